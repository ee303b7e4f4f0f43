"""`router.dataplane.cors`: which pages' requests get which CORS answer, as tables."""

from __future__ import annotations

import pytest

from router.dataplane.cors import CorsPolicy
from router.dataplane.exchange import RequestHead, read_request_head

APP = b"https://app.example"
PREFLIGHT = ((b"Access-Control-Request-Method", b"POST"),)


def head(method: bytes, path: bytes, *fields: tuple[bytes, bytes]) -> RequestHead:
    return read_request_head(method, path, True, [(b"Host", b"router"), *fields], True)


@pytest.mark.parametrize(
    ("values", "origins"),
    [
        (["https://app.example"], {APP}),
        (["HTTPS://App.Example:443/"], {APP}),  # as a browser serializes it
        (["http://localhost:3000", "*"], {b"http://localhost:3000", b"*"}),
        (["http://[::1]:8080"], {b"http://[::1]:8080"}),
    ],
)
def test_allowed_origins_are_kept_as_browsers_send_them(
    values: list[str], origins: set[bytes]
) -> None:
    policy = CorsPolicy.parse(values)
    assert policy is not None and policy.origins == origins


def test_no_allowed_origin_is_no_policy() -> None:
    assert CorsPolicy.parse([]) is None


@pytest.mark.parametrize(
    "value", ["app.example", "https://app.example/ui", "https://app.example?x", "null", "ftp://a"]
)
def test_a_value_that_is_no_origin_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match="is not an origin"):
        CorsPolicy.parse([value])


ONE = CorsPolicy(frozenset({APP}))
ANY = CorsPolicy(frozenset({b"*"}))
OTHER = b"https://evil.example"


@pytest.mark.parametrize(
    ("policy", "method", "path", "fields", "expected"),
    [
        # A page's preflight of a browser route from an allowed origin.
        (
            ONE,
            b"OPTIONS",
            b"/v1/chat/completions",
            ((b"Origin", APP), *PREFLIGHT, (b"Access-Control-Request-Headers", b"authorization")),
            (
                (b"Access-Control-Allow-Origin", APP),
                (b"Vary", b"Origin"),
                (b"Access-Control-Allow-Methods", b"POST"),
                (b"Access-Control-Max-Age", b"600"),
                (b"Access-Control-Allow-Headers", b"authorization"),
            ),
        ),
        (
            ANY,
            b"OPTIONS",
            b"/v1/models",
            ((b"Origin", OTHER), (b"Access-Control-Request-Method", b"GET")),
            (
                (b"Access-Control-Allow-Origin", b"*"),  # the same for every page: no Vary
                (b"Access-Control-Allow-Methods", b"GET"),
                (b"Access-Control-Max-Age", b"600"),
            ),
        ),
        (ONE, b"OPTIONS", b"/generate", ((b"Origin", b"HTTPS://APP.example"), *PREFLIGHT), "ok"),
        # Not answered: another origin, no preflight, a route not for pages.
        (ONE, b"OPTIONS", b"/v1/completions", ((b"Origin", OTHER), *PREFLIGHT), None),
        (ONE, b"OPTIONS", b"/v1/completions", PREFLIGHT, None),  # no Origin
        (ONE, b"OPTIONS", b"/v1/completions", ((b"Origin", APP),), None),  # no method asked
        (ONE, b"POST", b"/v1/completions", ((b"Origin", APP), *PREFLIGHT), None),
        (ANY, b"OPTIONS", b"/workers", ((b"Origin", APP), *PREFLIGHT), None),
        (ANY, b"OPTIONS", b"/internal/kv_snapshot", ((b"Origin", APP), *PREFLIGHT), None),
        (ANY, b"OPTIONS", b"/metrics", ((b"Origin", APP), *PREFLIGHT), None),
        (ANY, b"OPTIONS", b"/healthz", ((b"Origin", APP), *PREFLIGHT), None),
    ],
)
def test_which_preflights_are_answered_and_with_what(
    policy: CorsPolicy,
    method: bytes,
    path: bytes,
    fields: tuple[tuple[bytes, bytes], ...],
    expected: object,
) -> None:
    answer = policy.preflight(head(method, path, *fields))
    if expected == "ok":
        assert answer is not None and answer[0] == (
            b"Access-Control-Allow-Origin",
            b"HTTPS://APP.example",
        )
    else:
        assert answer == expected


@pytest.mark.parametrize(
    ("policy", "method", "path", "origin", "expected"),
    [
        (
            ONE,
            b"POST",
            b"/v1/completions",
            APP,
            ((b"Access-Control-Allow-Origin", APP), (b"Vary", b"Origin")),
        ),
        (
            ONE,
            b"GET",
            b"/v1/models",
            APP,
            ((b"Access-Control-Allow-Origin", APP), (b"Vary", b"Origin")),
        ),
        (ANY, b"POST", b"/v1/chat/completions", OTHER, ((b"Access-Control-Allow-Origin", b"*"),)),
        # Not allowed, or no page's request: no origin, but the answer depends on it.
        (ONE, b"POST", b"/v1/completions", OTHER, ((b"Vary", b"Origin"),)),
        (ONE, b"GET", b"/v1/models", None, ((b"Vary", b"Origin"),)),
        (ANY, b"GET", b"/v1/models", None, ()),  # every page's: it depends on no origin
        (ONE, b"GET", b"/workers", None, ()),
        (ANY, b"GET", b"/workers", APP, ()),
        (ANY, b"GET", b"/internal/kv_snapshot", APP, ()),
        (ANY, b"GET", b"/metrics", APP, ()),
        (ANY, b"GET", b"/readyz", APP, ()),
    ],
)
def test_which_answers_carry_the_allowed_origin(
    policy: CorsPolicy, method: bytes, path: bytes, origin: bytes | None, expected: object
) -> None:
    fields = [(b"Origin", origin)] if origin is not None else []
    assert policy.fields(head(method, path, *fields)) == expected
