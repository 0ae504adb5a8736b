"""Text in and out of the demo: the checkpoint's dtype and tokenizer, and a byte-level tokenizer for
the built-in random model (UTF-8 bytes are token ids 0-255; higher ids print as `<id>`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

DTYPES = ("float32", "bfloat16", "float16")


class DemoError(Exception):
    """A problem with the demo's input (a bad directory, adapter, prompt or option): `main` prints
    `jax-lora demo: error: <message>` (the form argparse uses for bad options) and exits with
    status 2, without a traceback."""


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype config.json records (`torch_dtype`, or `dtype` in newer transformers) when it is
    one the demo serves in, else None."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None                               # load_llama reports the problem
    if not isinstance(cfg, dict):
        return None                               # (load_llama again)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return dtype if dtype in DTYPES else None


# ----------------------------------------------------------------------------- tokenizers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ByteTokenizer:
    """The built-in random model's tokenizer: UTF-8 bytes are token ids 0-255.

    The demo model is random, so its output is not language; ids 256 and above (the demo model's
    vocabulary has 512) have no byte and are shown as `<id>`.
    """

    name = "byte-level (UTF-8 bytes = ids 0-255; the built-in model is random: expect gibberish)"
    eos_token_id = None

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            out.append(f"<{i}>")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


class _HFTokenizer:
    """A checkpoint's tokenizer through transformers.AutoTokenizer, or the tokenizers package."""

    def __init__(self, model_dir: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        if AutoTokenizer is not None:
            tok = AutoTokenizer.from_pretrained(model_dir)
            self.name = f"{type(tok).__name__} from {model_dir}"
            self.eos_token_id = tok.eos_token_id
            self._encode = lambda text: list(tok(text)["input_ids"])
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
            return
        path = os.path.join(model_dir, "tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None
        if Tokenizer is None or not os.path.isfile(path):
            raise DemoError(f"{model_dir} has a tokenizer, but reading it needs transformers "
                            "(pip install transformers)")
        tok = Tokenizer.from_file(path)
        self.name = f"tokenizers.Tokenizer from {path}"
        self.eos_token_id = None
        self._encode = lambda text: list(tok.encode(text).ids)
        self._decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list:
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(ids)


def load_tokenizer(model_dir: str, built_in: bool):
    """The tokenizer --prompt uses: the checkpoint's, or ByteTokenizer for the built-in model."""
    if built_in:
        return ByteTokenizer()
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        raise DemoError(f"--prompt needs a tokenizer, and {model_dir} has none ({', '.join(TOKENIZER_FILES)}); "
                        "without --prompt the demo serves random token ids")
    try:
        return _HFTokenizer(model_dir)
    except DemoError:
        raise
    except (ImportError, OSError, ValueError, KeyError) as e:
        raise DemoError(f"cannot load the tokenizer of {model_dir}: {e}") from e


# ----------------------------------------------------------------------------- demo
