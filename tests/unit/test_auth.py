"""The bearer-token rule (`router.auth`) as a table: what is let through, what is refused, why."""

from __future__ import annotations

import pytest

from router import auth
from tests.support.clock import ManualClock

TOKEN = "a-long-enough-token-0123456789"


@pytest.mark.parametrize(
    "configured,headers,expected",
    [
        # secure by default: nothing configured refuses every caller, a correct-looking one too
        (None, [], auth.NOT_CONFIGURED),
        ("", [f"Bearer {TOKEN}"], auth.NOT_CONFIGURED),
        (None, ["Bearer "], auth.NOT_CONFIGURED),
        # configured
        (TOKEN, [], auth.MISSING),
        (TOKEN, [f"Bearer {TOKEN}"], None),
        (TOKEN, [f"bearer {TOKEN}"], None),  # the scheme is case-insensitive
        (TOKEN, [f"BEARER {TOKEN}"], None),
        (TOKEN, [f"  Bearer   {TOKEN}  "], None),  # optional whitespace around the token
        (TOKEN, [f"Bearer {TOKEN.upper()}"], auth.WRONG),  # the token itself is not
        (TOKEN, [f"Bearer {TOKEN}x"], auth.WRONG),
        (TOKEN, [f"Bearer {TOKEN[:-1]}"], auth.WRONG),  # a prefix is not the token
        (TOKEN, ["Bearer "], auth.WRONG),
        (TOKEN, ["Bearer"], auth.WRONG),
        (TOKEN, [TOKEN], auth.NOT_BEARER),
        (TOKEN, [f"Basic {TOKEN}"], auth.NOT_BEARER),
        (TOKEN, [f"Token {TOKEN}"], auth.NOT_BEARER),
        (TOKEN, ["Bearer caf\u00e9"], auth.WRONG),  # non-ASCII: compared, not a crash
        (TOKEN, [f"Bearer {TOKEN}", f"Bearer {TOKEN}"], auth.TWO_HEADERS),
        (TOKEN, ["Bearer wrong", f"Bearer {TOKEN}"], auth.TWO_HEADERS),
    ],
)
def test_the_rule(configured: str | None, headers: list[str], expected: auth.Denial | None) -> None:
    assert auth.check(configured, headers) == expected


def test_only_a_configured_but_wrong_credential_is_a_challenge() -> None:
    assert auth.NOT_CONFIGURED.status == 403 and not auth.NOT_CONFIGURED.challenge
    for denial in (auth.MISSING, auth.WRONG, auth.NOT_BEARER, auth.TWO_HEADERS):
        assert denial.status == 401 and denial.challenge


def test_the_refusal_without_a_token_names_the_flag_and_the_variable() -> None:
    assert "--internal-token" in auth.NOT_CONFIGURED.message
    assert "KVROUTER_INTERNAL_TOKEN" in auth.NOT_CONFIGURED.message


def test_the_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bytes, bytes]] = []

    def compare_digest(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", compare_digest)
    assert auth.check(TOKEN, [f"Bearer {TOKEN}"]) is None
    assert seen == [(TOKEN.encode(), TOKEN.encode())]


@pytest.mark.parametrize(
    "path,guarded",
    [
        ("/workers", True),
        ("/internal/kv_snapshot", True),
        ("/internal/anything-added-later", True),
        ("/healthz", False),
        ("/readyz", False),
        ("/metrics", False),
        ("/v1/models", False),
        ("/v1/completions", False),
        ("/workersx", False),
        ("/internal", False),
    ],
)
def test_which_paths_are_guarded(path: str, guarded: bool) -> None:
    assert auth.guarded(path) is guarded


@pytest.mark.parametrize(
    "token,refused_because",
    [
        (TOKEN, None),
        (auth.PLACEHOLDER_TOKEN, "placeholder"),
        ("replace-me", "placeholder"),
        ("two words", "whitespace"),
        (" padded", "whitespace"),
    ],
)
def test_which_tokens_a_replica_refuses_to_start_with(
    token: str, refused_because: str | None
) -> None:
    problem = auth.token_problem(token)
    if refused_because is None:
        assert problem is None
    else:
        assert problem is not None and refused_because in problem


def test_refusals_are_counted_by_family_and_warned_once_an_interval_per_family(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    refusals = auth.Refusals(clock)
    for path in ["/workers"] * 5 + ["/internal/place", "/internal/x%2F..", "/internal/abc"]:
        refusals.refused(path, "10.0.0.7", 401, auth.WRONG.message)
    assert refusals.counts == {
        "workers": 5, "snapshot": 0, "decisions": 0, "placement": 1, "other": 2,
    }  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3  # the first of each family; the rest wait for the interval
    assert said[0].startswith("refused 1 request(s) to the workers routes")
    assert "10.0.0.7: 401, bearer token refused" in said[0] and auth.TOKEN_FLAG in said[0]
    clock.advance(auth.REFUSAL_LOG_EVERY_S)
    refusals.refused("/workers", "10.0.0.8", 401, auth.MISSING.message)
    assert caplog.records[-1].getMessage().startswith("refused 5 request(s) to the workers")
    assert "the latest from 10.0.0.8" in caplog.records[-1].getMessage()
