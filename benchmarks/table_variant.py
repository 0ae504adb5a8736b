"""Writes a variant of a launch table, to measure it anywhere the table is read (LORA_CORE_TABLE).

    PYTHONPATH=. python benchmarks/table_variant.py /tmp/narrow.json --classes t16/r16,t64/r16 \
        --fused '{"BLOCK_N": 128, "BLOCK_K": 256}' --use-fused on
    LORA_CORE_TABLE=/tmp/narrow.json PYTHONPATH=. python benchmarks/e2e_decode.py ...
    PYTHONPATH=. python benchmarks/table_variant.py /tmp/no_spread.json --policy '{"spread_pdl_max_tokens": 1}'

The chosen classes' configs (and the configs of the same kind in their slot/slice variants) are
updated with the given keys; `--use-fused on|off` sets whether those classes take the fused
kernel (in the class entry and in every variant of it); `--policy` sets fields of the table's
launch policy (lora_core/kernels/policy.py, checked). The base is the tuned table of a device
(`--device`, default the H200's) or any table file (`--base`). Nothing else changes, so the
variant's measurements differ from the base's by exactly the edit.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lora_core.kernels import configs
from lora_core.kernels.policy import LaunchPolicy

KINDS = ("shrink", "expand", "fused")


def variant(data: dict, classes, edits: dict, use_fused, policy: dict | None = None) -> dict:
    """A copy of table `data` with `edits` ({kind: {key: value}}) merged into the configs of
    `classes` (None: every class) and their variants, use_fused set where it is not None, and the
    fields of `policy` set in its launch policy (checked as LaunchPolicy fields)."""
    out = copy.deepcopy(data)
    if policy:
        out["policy"] = {**out.get("policy", {}), **policy}
        LaunchPolicy.from_table(out["policy"], "--policy")
    names = list(out["classes"]) if classes is None else list(classes)
    unknown = [n for n in names if n not in out["classes"]]
    if unknown:
        raise ValueError(f"classes {unknown} are not in the table (it has {sorted(out['classes'])})")
    for name in names:
        entry = out["classes"][name]
        for kind, keys in edits.items():
            if keys:
                # (a class without a fused entry runs the generic one: the edit starts from it)
                start = entry.get(kind) or dict(configs.GENERIC_FUSED.get(tuple(name.split("/")),
                                                                          configs._FUSED_FALLBACK))
                entry[kind] = {**start, **keys}
                for v in entry.get("variants", ()):
                    if kind in v:
                        v[kind] = {**v[kind], **keys}
        if use_fused is not None:
            entry["use_fused"] = bool(use_fused)
            for v in entry.get("variants", ()):
                v["use_fused"] = bool(use_fused)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the table file to write")
    p.add_argument("--device", default="NVIDIA H200", help="whose tuned table is the base")
    p.add_argument("--base", default=None, help="a table file as the base instead")
    p.add_argument("--classes", default=None, help="comma list of classes, e.g. t16/r16,t64/r16 (default all)")
    for kind in KINDS:
        p.add_argument(f"--{kind}", default=None, help=f"JSON: keys merged into the {kind} configs")
    p.add_argument("--use-fused", choices=("on", "off"), default=None)
    p.add_argument("--policy", default=None, help='JSON: launch policy fields to set, e.g. {"small_t_max": 16}')
    args = p.parse_args(argv)
    base = args.base or configs._table_file(args.device)
    with open(base) as f:
        data = json.load(f)
    edits = {kind: json.loads(getattr(args, kind)) if getattr(args, kind) else {} for kind in KINDS}
    classes = args.classes.split(",") if args.classes else None
    use_fused = None if args.use_fused is None else args.use_fused == "on"
    policy = json.loads(args.policy) if args.policy else None
    out = variant(data, classes, edits, use_fused, policy)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{args.out}: {os.path.basename(base)} with {json.dumps(edits)} on {classes or 'every class'}"
          + ("" if use_fused is None else f", use_fused {args.use_fused}")
          + ("" if policy is None else f", policy {json.dumps(policy)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
