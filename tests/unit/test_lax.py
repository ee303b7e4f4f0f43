"""The engines' lax reading of JSON scalars: the router's rules and the engine mirror's, each
held against pydantic itself (what vLLM's and SGLang's request models run)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fake_kv_worker import protocol as mirror
from router.tokenize.lax import lax_bool, lax_float, lax_int, sglang_token_id

pydantic = pytest.importorskip("pydantic")

INT = pydantic.TypeAdapter(int)
BOOL = pydantic.TypeAdapter(bool)
FLOAT = pydantic.TypeAdapter(float)

# Every string of up to four of these pieces: signs, zeros, underscores, points, exponents,
# the white space Rust trims and Python's strip() also takes (\x1c), in every order.
PIECES = ("0", "1", "9", "_", ".", "+", "-", " ", "\t", "e", "\x1c", "\u3000", "00", "0.0")
TEXTS = sorted({"".join(p) for n in range(1, 5) for p in itertools.product(PIECES, repeat=n)})
SCALARS: list[Any] = [
    0, 1, 2, -1, 2**70, True, False, None, [], {},
    0.0, -0.0, 1.0, 1.5, 2.0**62, 2.0**63, -(2.0**63), 1e300, float("inf"), float("nan"),
    "true", "TRUE", "t", "Y", "yes", "On", "1", "0", "false", "off", "No", "n", "F",
    "", " true", "true ", "tru", "01", "1.0", "\uff54rue", "2",
]  # fmt: skip


def verdict(read: Callable[[Any], Any], value: Any) -> tuple[Any, ...]:
    try:
        return ("ok", read(value))
    except (ValueError, pydantic.ValidationError, mirror.RequestError):
        return ("refused",)


def mirror_int(value: Any) -> int:
    got = mirror.lax_int(value)
    if got is None:
        raise ValueError(value)
    return got


def mirror_bool(value: Any) -> bool:
    return mirror.lax_bool(value, "field")


@pytest.mark.parametrize(("ours", "theirs"), [(lax_int, INT), (mirror_int, INT)])
def test_integers_are_read_as_pydantic_lax_mode_reads_them(ours: Any, theirs: Any) -> None:
    wrong = [
        (v, verdict(ours, v), verdict(theirs.validate_python, v))
        for v in [*SCALARS, *TEXTS]
        if verdict(ours, v) != verdict(theirs.validate_python, v)
    ]
    assert wrong == []


@pytest.mark.parametrize(("ours", "theirs"), [(lax_bool, BOOL), (mirror_bool, BOOL)])
def test_booleans_are_read_as_pydantic_lax_mode_reads_them(ours: Any, theirs: Any) -> None:
    words = [w.upper() for w in SCALARS if isinstance(w, str)]
    wrong = [
        v for v in [*SCALARS, *words] if verdict(ours, v) != verdict(theirs.validate_python, v)
    ]
    assert wrong == []


@given(st.text(alphabet="0123456789_.+- \te", max_size=12) | st.floats() | st.integers())
def test_any_integer_text_or_number_is_read_as_pydantic_reads_it(value: Any) -> None:
    expected = verdict(INT.validate_python, value)
    assert verdict(lax_int, value) == expected
    assert verdict(mirror_int, value) == expected


def float_verdict(read: Callable[[Any], Any], value: Any) -> tuple[Any, ...]:
    got = verdict(read, value)
    return ("ok", "nan") if got[0] == "ok" and got[1] != got[1] else got


FLOAT_PIECES = (*PIECES, "E", "inf", "nan", "x", "5")


def test_floats_are_read_as_pydantic_lax_mode_reads_them() -> None:
    texts = ["".join(p) for n in range(1, 4) for p in itertools.product(FLOAT_PIECES, repeat=n)]
    wrong = [
        v
        for v in [*SCALARS, 2**2000, "1e400", "0.5_0", "5._0", "INFINITY", *texts]
        if float_verdict(lax_float, v) != float_verdict(FLOAT.validate_python, v)
    ]
    assert wrong == []


@given(st.text(alphabet="0123456789_.+- \teEinfa", max_size=12) | st.floats() | st.integers())
def test_any_float_text_or_number_is_read_as_pydantic_reads_it(value: Any) -> None:
    assert float_verdict(lax_float, value) == float_verdict(FLOAT.validate_python, value)


def test_sglang_generate_ids_are_int64s_or_bools_and_nothing_else() -> None:
    assert [sglang_token_id(v) for v in (5, True, False, 2**63 - 1)] == [5, 1, 0, 2**63 - 1]
    for refused in (2.0, "2", None, 2**63, [1]):
        with pytest.raises(ValueError):
            sglang_token_id(refused)


def test_a_refused_value_is_named_cut_short_and_never_in_pythons_words() -> None:
    """A 4 MB string in a token list was echoed whole in the 400 (20 MB once its characters
    were escaped), and a 5,000-digit one got Python's own `sys.set_int_max_str_digits` text."""
    from router.tokenize.lax import lax_bool, lax_int, sglang_token_id

    for bad, read in (
        ("x" * 4_000_000, lax_int),
        ("\u0085" * 4_000_000, lax_int),
        ("1" * 5_000, lax_int),
        ("y" * 4_000_000, sglang_token_id),
        ("z" * 4_000_000, lax_bool),
    ):
        with pytest.raises(ValueError) as caught:
            read(bad)
        message = str(caught.value)
        assert len(message) < 200 and "set_int_max_str_digits" not in message
