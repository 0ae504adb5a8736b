"""Regular expressions from adapter configs, compiled under a guard so that matching stays fast.

PEFT reads a string `target_modules` / `exclude_modules` as a regex (full match of the module
name) and rank_pattern / alpha_pattern keys as regexes matching the end of a name; `layers_pattern`
is spliced into a regex too. A config is untrusted input: Python's backtracking matcher takes
exponential time on patterns such as `(.|.)*x` or `(a+)+b` (minutes against one module name). So
every pattern is checked before it is compiled:

1. At most MAX_PATTERN_CHARS characters.
2. Parsed by Python's own regex parser, then refused when it holds
   - a nested or ambiguous quantifier: a repeated part (`*`, `+`, `{m,n}` with n > 1) that holds
     another quantifier or an alternation `|` (`(a+)+`, `(.|.)*`, `(x*y)*`); these backtrack
     exponentially;
   - a backreference or a conditional group (`\\1`, `(?(1)..)`): matching them is NP-hard in general;
   - more than MAX_LOOPS unbounded quantifiers (`*`, `+`, `{m,}`, `{m,n}` with n > MAX_BOUNDED)
     in all: k of them after one another cost up to n**k steps on a name of n characters.
   rank_pattern / alpha_pattern keys may hold MAX_KEY_LOOPS: PEFT matches them at the end of a
   name, i.e. against each of its dotted suffixes, one more factor n; layers_pattern entries one
   (the regex they are spliced into adds two).
3. Names matched are at most MAX_NAME_CHARS long (the reader refuses longer tensor names), so one
   match costs at most about MAX_NAME_CHARS ** 3 / 6 steps (a few hundredths of a second); the
   reader also stops once matching an adapter's names has taken MATCH_BUDGET_S seconds.

What is accepted: literal names, `|` alternation outside repeats, `.` `.*` `.+` `\\d+` `[02]` and
other character classes with any quantifier, anchors `^ $`, groups and lookarounds such as
`^(?!.*lm_head).*`. The common PEFT patterns (`.*\\.(q_proj|v_proj)`,
`model\\.layers\\.\\d+\\.self_attn\\.(q|k|v)_proj`, `.*\\.layers\\.[02]\\.self_attn\\.(q|v)_proj`) pass.
A refused pattern is an AdapterError naming the file, the field and the pattern.
"""

from __future__ import annotations

import re

from ..errors import AdapterError

try:
    import re._parser as _sre_parse  # Python >= 3.11
    from re import _constants as _sre
except ImportError:                      # pragma: no cover  (Python 3.10)
    import sre_constants as _sre
    import sre_parse as _sre_parse

__all__ = ["MATCH_BUDGET_S", "MAX_BOUNDED", "MAX_KEY_LOOPS", "MAX_LOOPS", "MAX_NAME_CHARS", "MAX_PATTERN_CHARS",
           "compile_guarded"]

MAX_PATTERN_CHARS = 512
MAX_NAME_CHARS = 256
MAX_LOOPS = 3
MAX_KEY_LOOPS = 2        # rank_pattern / alpha_pattern keys: matched against each dotted suffix of a name
MATCH_BUDGET_S = 4.0
MAX_BOUNDED = 64          # a repeat of at most this many is bounded: {1,64} costs like 64 literals

_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT} | {getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)}
_REFERENCES = {_sre.GROUPREF, _sre.GROUPREF_EXISTS}


def _items(pattern) -> list:
    """The (op, argument) items of a parsed (sub)pattern."""
    return list(pattern.data if hasattr(pattern, "data") else pattern)


def _children(op, av) -> list:
    """The sub-patterns nested in one parsed item."""
    if op in _REPEATS:
        return [av[2]]
    if op == _sre.SUBPATTERN:
        return [av[-1]]
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if op == _sre.BRANCH:
        return list(av[1])
    if hasattr(_sre, "ATOMIC_GROUP") and op == _sre.ATOMIC_GROUP:
        return [av]
    return []


def _has(pattern, ops) -> bool:
    """Whether the parsed pattern holds an item of `ops` at any depth."""
    return any(op in ops or any(_has(child, ops) for child in _children(op, av)) for op, av in _items(pattern))


def _problem(pattern, loops: list) -> str | None:
    """Why the parsed pattern is refused (None: accepted); counts unbounded repeats into loops[0]."""
    for op, av in _items(pattern):
        if op in _REFERENCES:
            return "a backreference or conditional group"
        if op in _REPEATS:
            hi = av[1]
            if hi == _sre.MAXREPEAT or hi > MAX_BOUNDED:
                loops[0] += 1
            if hi > 1 and _has(av[2], _REPEATS | {_sre.BRANCH}):
                return ("a nested or ambiguous quantifier (a repeated group holding another quantifier or an "
                        "alternation '|'), which backtracks exponentially")
        for child in _children(op, av):
            why = _problem(child, loops)
            if why:
                return why
    return None


def compile_guarded(pattern: str, where: str, field: str, *, max_loops: int = MAX_LOOPS,
                    is_key: bool = False) -> re.Pattern:
    """`re.compile(pattern)` once the pattern is known to match fast (see the module docstring);
    AdapterError naming `where` (the file), `field` and the pattern otherwise (is_key: the pattern
    is a key of the field's object, as in rank_pattern)."""
    shown = pattern if len(pattern) <= 80 else pattern[:76] + " ..."
    subject = f"{where}: field {field!r}: {'key' if is_key else 'the regular expression'} {shown!r}"
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{subject} has {len(pattern)} characters, more than {MAX_PATTERN_CHARS}")
    try:
        compiled = re.compile(pattern)
        parsed = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise AdapterError(f"{subject} is not a valid regular expression ({e})") from None
    loops = [0]
    why = _problem(parsed, loops)
    if why is None and loops[0] > max_loops:
        why = f"{loops[0]} unbounded quantifiers (* + {{m,}}), more than {max_loops}"
    if why:
        raise AdapterError(f"{subject} is refused: it holds {why}. "
                           "Accepted: literal names, '|' outside repeats, '.', '.*', '\\d+', character classes, "
                           "anchors and lookarounds, without nested quantifiers (see lora_core.peft.patterns)")
    return compiled
