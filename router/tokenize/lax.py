"""The engines' lax reading of JSON scalars: pydantic's lax mode, as plain rules. Pure.

vLLM's and SGLang's OpenAI request models are pydantic models validated in lax mode, so an
engine serves `"add_generation_prompt": "false"` (False) and `"prompt": [1.0, 2.0]` (ids 1, 2).
The router must read such a body as the engine does (a 400 the engine would not give turns a
served request away; a misread flag or id changes the prompt's blocks), and refuse what the
engine refuses. These are pydantic-core's rules (`src/input/shared.rs`: `str_as_bool`,
`int_as_bool`, `float_as_int`, `str_as_int`, `str_as_float`), written out;
tests/unit/test_lax.py holds them against pydantic itself. SGLang's `/generate` reads
`input_ids` with its own validator instead (`array("q", ids)`: ints and bools only), which is
`sglang_token_id`.

Each function returns the value the engine's model holds, or raises ValueError.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Final

_FALSE: Final = frozenset({"0", "f", "n", "no", "off", "false"})
_TRUE: Final = frozenset({"1", "t", "y", "on", "yes", "true"})
# What Rust's `str::trim` strips (Unicode White_Space), which differs from Python's `strip()`
# (that also strips U+001C..U+001F).
_WHITE_SPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_JSON_INT: Final = re.compile(r"-?(?:0|[1-9][0-9]*)")
# What Rust's `f64::from_str` parses (pydantic-core's float from a string): no white space, no
# `_`, ASCII digits only, `5.` and `.5` both taken, inf and nan in any case.
_RUST_FLOAT: Final = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE
)
_I64: Final = 2**63
_SHOWN: Final = 40  # characters of a refused value an error message repeats
_LONGEST_INT_TEXT: Final = 1024  # longer: padding no client sends, or past any id: refused


def lax_bool(value: Any) -> bool:
    """A pydantic `bool` field: true/false, 0/1 (int or float), or one of pydantic's words
    (`"true"`, `"off"`, `"y"`, ... in any ASCII case). Not null, not `"  true"`."""
    if value is True or value is False:
        return value
    kind = type(value)
    if (kind is int or kind is float) and value in (0, 1):
        return bool(value)
    if kind is str and value.isascii():
        lowered = value.lower()
        if lowered in _FALSE:
            return False
        if lowered in _TRUE:
            return True
    raise ValueError(f"{shown(value)} is not a boolean")


def lax_bool_field(
    body: dict[str, Any], key: str, default: bool, refused: Callable[[str, str], Exception]
) -> bool:
    """`body[key]` read as `lax_bool`; absent, `default`; null or anything else, the caller's
    400 naming the field (`refused(message, key)`)."""
    if key not in body:
        return default
    try:
        return lax_bool(body[key])
    except ValueError:
        raise refused(f"'{key}' must be a boolean", key) from None


def lax_int(value: Any) -> int:
    """A pydantic `int` field: an int, a bool (0/1), a float with no fraction (within i64), or
    a string of an integer (surrounding white space, a `+`, leading zeros, `_` between digits
    and a `.000` fraction allowed; no exponent, no hex)."""
    kind = type(value)
    if kind is int:
        return value  # type: ignore[no-any-return]
    if kind is bool:
        return int(value)
    if kind is float:
        if not math.isfinite(value) or not value.is_integer() or not -_I64 < value < _I64:
            raise ValueError(f"{shown(value)} is not an integer")
        return int(value)
    if kind is str:
        return _int_of_str(value)
    raise ValueError(f"{shown(value)} is not an integer")


def lax_float(value: Any) -> float:
    """A pydantic `float` field: a number (a bool is 0.0 or 1.0), or a string Rust parses as
    one after trimming white space, else once its `_` are dropped (none first, last or
    doubled). inf and nan are read as such: fields that refuse them check it themselves."""
    kind = type(value)
    if kind is float:
        return value  # type: ignore[no-any-return]
    if kind is int or kind is bool:
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{shown(value)} is not a float in range") from None
    if kind is str:
        text = value.strip(_WHITE_SPACE)
        if _RUST_FLOAT.fullmatch(text):
            return float(text)
        if not (value.startswith("_") or value.endswith("_") or "__" in value):
            joined = value.replace("_", "")
            if _RUST_FLOAT.fullmatch(joined):
                return float(joined)
    raise ValueError(f"{shown(value)} is not a float")


def sglang_token_id(value: Any) -> int:
    """An id of SGLang's `/generate` `input_ids`: an int64 or a bool, nothing else (its
    validator builds an `array("q")` of the list)."""
    if type(value) is bool:
        return int(value)
    if type(value) is not int or not -_I64 <= value < _I64:
        raise ValueError(f"{shown(value)} is not an int64")
    return value  # type: ignore[no-any-return]


def shown(value: Any) -> str:
    """A value as an error message names it: its repr, cut (a 4 MB string in a token list was
    echoed whole in the 400, 20 MB of it once escaped)."""
    text = repr(value) if type(value) is not str or len(value) <= _SHOWN else repr(value[:_SHOWN])
    return text if len(text) <= 2 * _SHOWN else text[: 2 * _SHOWN] + "..."


def _int_of_str(text: str) -> int:
    if len(text) > _LONGEST_INT_TEXT:  # Python's int() refuses past 4,300 digits, in its words
        raise ValueError(f"{shown(text)} is not an integer in range")
    if _JSON_INT.fullmatch(text):
        return int(text)
    cleaned = _cleaned_int_str(text)
    if cleaned is None or not _JSON_INT.fullmatch(cleaned):
        raise ValueError(f"{shown(text)} is not an integer")
    return int(cleaned)


def _cleaned_int_str(text: str) -> str | None:
    """pydantic-core's `clean_int_str`: the text made a JSON integer, or None."""
    s = text.strip(_WHITE_SPACE)
    if s.startswith("+"):
        if s[1:2] == "-":
            return None
        s = s[1:]
    sign = ""
    if s.startswith("-"):
        if s[1:2] in ("-", "+"):
            return None
        sign, s = "-", s[1:]
    digits = _without_leading_zeros(s)
    if digits is None:
        return None
    s = digits
    point = s.find(".")
    if point >= 0 and point + 1 < len(s) and set(s[point + 1 :]) == {"0"}:
        s = s[:point]
    if "_" in s and not (s.startswith("_") or s.endswith("_") or "__" in s):
        return sign + s.replace("_", "")
    if len(text) == len(s):
        return None  # nothing was cleaned: the first parse's verdict stands
    return sign + s


def _without_leading_zeros(s: str) -> str | None:
    """pydantic-core's `strip_leading_zeros` (one zero kept before a `.`, or when all zeros)."""
    if not s:
        return None
    if s[0] in "123456789-":
        return s
    if s[0] != "0":
        return None
    for i, c in enumerate(s[1:], 1):
        if c in "123456789-":
            return s[i:]
        if c == ".":
            return s[i - 1 :]
        if c not in "0_":
            return None
    return s[-1]
