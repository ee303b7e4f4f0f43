"""Who may call the control plane's guarded routes: the bearer-token rule.

Rules of this file: no I/O but the refusals' warning. `check` takes the configured token and
the request's `Authorization` header values and returns None (let it through) or a `Denial`
(status and a message that says what to do); `guarded` says which paths need it. The aiohttp
side is one wrapper in `router.control`; the data plane applies it too, to a request that asks
before sending its body (`Expect: 100-continue`), so that no client without the token is
invited to upload (`router.dataplane.exchange.uninvited`).

Guarded, and why:
    /workers (GET)          reads the index's per-rank state: which worker holds how much
    /workers (POST, DELETE) changes where prompts go (a rogue worker, or none at all)
    /internal/*             the sibling snapshot: the whole index, a prompt-cache side channel
                            (whether a given prompt was cached), and what a booting sibling
                            grafts
Open: /healthz, /readyz (kubelet probes carry no token), /metrics (scrapers; aggregate counts,
no keys) and /v1/models (what clients ask before a completion). README's threat model.

A refusal is counted by route family (`Refusals`: the guarded routes above, and `other` for
any other path under /internal/, so the label set stays bounded whatever paths callers send)
and warned about at most once a minute per family, with how many since and who asked last: a
sibling with another token otherwise failed its bootstraps, decisions and placement questions
without a trace on the refusing side.

Secure by default: with no token configured the guarded routes are refused outright (403,
naming the flag), never open. The scheme is case-insensitive (RFC 9110 11.1), the token is
compared in constant time, and a request carrying two Authorization headers is refused (a
proxy and a client disagreeing about who is asking is not a question to settle by order).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from router.log_tally import LogTally

log = logging.getLogger(__name__)

TOKEN_FLAG: Final = "--internal-token"
TOKEN_ENV: Final = "KVROUTER_INTERNAL_TOKEN"
GUARDED_PREFIXES: Final = ("/internal/",)
GUARDED_PATHS: Final = frozenset({"/workers"})
# The route families refusals are counted by (`route_family`), every one exported from the start.
ROUTES: Final = ("workers", "snapshot", "decisions", "placement", "other")
_FAMILIES: Final = {
    "/workers": "workers",
    "/internal/kv_snapshot": "snapshot",
    "/internal/decisions": "decisions",
    "/internal/place": "placement",
}
REFUSAL_LOG_EVERY_S: Final = 60.0
# What manifests/internal-token.env.example holds: a pod given it must not start.
PLACEHOLDER_TOKEN: Final = "REPLACE-ME-run-scripts-gen-internal-token"


@dataclass(frozen=True, slots=True)
class Denial:
    status: int  # 401: no or a wrong credential; 403: the route is off (no token configured)
    message: str

    @property
    def challenge(self) -> bool:
        """Whether the answer carries `WWW-Authenticate: Bearer` (a 401 does)."""
        return self.status == 401


NOT_CONFIGURED: Final = Denial(
    403,
    f"this route needs a bearer token and none is configured: start the replica with "
    f"{TOKEN_FLAG} (or {TOKEN_ENV}) and send 'Authorization: Bearer <token>'",
)
# What a 401 carries in `WWW-Authenticate`.
CHALLENGE: Final = 'Bearer realm="kvrouter"'
MISSING: Final = Denial(401, "bearer token required: send 'Authorization: Bearer <token>'")
TWO_HEADERS: Final = Denial(401, "more than one Authorization header")
NOT_BEARER: Final = Denial(401, "the Authorization scheme must be Bearer")
WRONG: Final = Denial(401, "bearer token refused")
# What a refusal's warning tells the operator, by the status it answered.
_ANOTHER_TOKEN: Final = (
    f"A sibling or an admin tool calls with another token than this replica's, or none: "
    f"check that {TOKEN_FLAG} ({TOKEN_ENV}) is the same on both sides"
)
_NO_TOKEN_HERE: Final = (
    f"This replica has no token, so it serves these routes to no one (its siblings "
    f"included): start it with {TOKEN_FLAG} ({TOKEN_ENV}), the same as its siblings'"
)


def guarded(path: str) -> bool:
    return path in GUARDED_PATHS or path.startswith(GUARDED_PREFIXES)


def check(configured: str | None, headers: Sequence[str]) -> Denial | None:
    """None when `headers` (every Authorization value of the request) present `configured`."""
    if not configured:
        return NOT_CONFIGURED
    if not headers:
        return MISSING
    if len(headers) > 1:
        return TWO_HEADERS
    scheme, _, presented = headers[0].strip().partition(" ")
    if scheme.lower() != "bearer":
        return NOT_BEARER
    # Both sides as bytes: compare_digest refuses non-ASCII str, and a header may hold any.
    if not hmac.compare_digest(
        presented.strip().encode("utf-8", "surrogateescape"),
        configured.encode("utf-8", "surrogateescape"),
    ):
        return WRONG
    return None


def route_family(path: str) -> str:
    """The family of a guarded `path` a refusal is counted under (one of `ROUTES`)."""
    return _FAMILIES.get(path, "other")


class Refusals:
    """Guarded requests refused, counted by route family, and a warning per family at most
    once a `REFUSAL_LOG_EVERY_S` with how many since and the last caller's address."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: Counter[str] = Counter(dict.fromkeys(ROUTES, 0))
        self._tallies = {route: LogTally(REFUSAL_LOG_EVERY_S) for route in ROUTES}
        self._clock = clock

    def refused(self, path: str, peer: str, status: int, message: str) -> None:
        route = route_family(path)
        self.counts[route] += 1
        said = self._tallies[route].count(self._clock())
        if said:
            log.warning(
                "refused %d request(s) to the %s routes since the last warning (the latest "
                "from %s: %d, %s). %s",
                said,
                route,
                peer,
                status,
                message,
                _NO_TOKEN_HERE if status == NOT_CONFIGURED.status else _ANOTHER_TOKEN,
            )


def token_problem(token: str) -> str | None:
    """Why `token` cannot be this replica's token (checked before it listens), or None."""
    if token.strip() != token or any(c.isspace() for c in token):
        return "it contains whitespace, which no Authorization header can carry intact"
    if token == PLACEHOLDER_TOKEN or "REPLACE-ME" in token.upper():
        return (
            "it is the manifests' placeholder; generate a token at deploy time "
            "(scripts/gen-internal-token, see manifests/README.md)"
        )
    return None
