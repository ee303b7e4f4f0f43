"""Cross-origin requests from browser apps (CORS, the Fetch standard): rules over parsed heads.

A page on another origin (a web UI, openai-node with `dangerouslyAllowBrowser`) asks before
each POST with a JSON body or an `Authorization` header: a preflight, an `OPTIONS` request with
`Origin` and `Access-Control-Request-Method`, and it reads an answer only if that answer names
its origin in `Access-Control-Allow-Origin`. vLLM (`--allowed-origins`, any by default) and
SGLang (any, always) answer through Starlette's CORSMiddleware; the router answers for the
origins `--cors-allow-origin` names (repeatable, `*` for any), and for none by default: no page
reads answers through the router unless its operator says which may.

`CorsPolicy.preflight`: a preflight of a browser route from an allowed origin is answered 204
with `Access-Control-Allow-Origin` (the origin, or `*`), `-Allow-Methods` (the route's),
`-Allow-Headers` (those the preflight asks for), `-Max-Age` (600 s, Starlette's) and, when the
answer depends on the origin, `Vary: Origin`. Any other `OPTIONS` is answered as before (a 405
on a generation route), so a page from another origin learns nothing more.
`CorsPolicy.fields`: what the answer to a request from an allowed origin on a browser route
carries, the worker's or the router's own (a 400, a 502): `Access-Control-Allow-Origin`, and
`Vary: Origin` when not `*`.

Browser routes: the generation routes and `GET /v1/models`. Never `/internal/*`, `/workers`,
`/metrics` or the probes: nothing there is for a page to read. No
`Access-Control-Allow-Credentials`: an API key travels in `Authorization`, which needs none
(a preflight allows the header by name), and the router sets no cookies.

The client's `Origin` is not passed on to a worker (`exchange.upstream_request`): an engine's
own CORS answer (vLLM's and SGLang's allow any origin) would reach the page beside the
router's, a second `Access-Control-Allow-Origin` that fails the request, or alone when the
router allows none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from peer.origin import origin_problem
from peer.spellings import DEFAULT_PORTS
from router.dataplane.exchange import GENERATION_ROUTES, RequestHead

ANY: Final = b"*"
MAX_AGE_S: Final = 600
# The routes a page may call, with the method each serves.
BROWSER_ROUTES: Final = {**dict.fromkeys(GENERATION_ROUTES, b"POST"), b"/v1/models": b"GET"}

Fields = tuple[tuple[bytes, bytes], ...]


def serialized_origin(value: str) -> str:
    """An allowed origin as a browser's `Origin` field spells it (scheme and host in lower case,
    the scheme's default port left out); ValueError saying why `value` is none."""
    if (problem := origin_problem(value)) is not None:
        raise ValueError(f"{value!r} is not an origin (scheme://host[:port]): {problem}")
    parts = urlsplit(value)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    if port is None or port == DEFAULT_PORTS[parts.scheme]:
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """The origins whose pages may call the browser routes (`ANY` among them: every one)."""

    origins: frozenset[bytes]

    @classmethod
    def parse(cls, values: Sequence[str]) -> CorsPolicy | None:
        """The policy `--cors-allow-origin` values make (None for none: no CORS at all);
        ValueError naming a value that is neither `*` nor an origin."""
        if not values:
            return None
        return cls(
            frozenset(
                ANY if value == "*" else serialized_origin(value).encode("ascii")
                for value in values
            )
        )

    def allowed(self, head: RequestHead) -> bytes | None:
        """The `Access-Control-Allow-Origin` value for a request on a browser route from an
        allowed origin (`*` when any is), or None."""
        if head.path not in BROWSER_ROUTES:
            return None
        origin = head.header(b"origin")
        if origin is None:
            return None
        if ANY in self.origins:
            return ANY
        return origin if origin.lower() in self.origins else None

    def fields(self, head: RequestHead) -> Fields:
        """The fields an answer to `head` carries for its page: on a browser route, its
        `Access-Control-Allow-Origin` when its origin is allowed, and `Vary: Origin` whenever
        the answer depends on the origin (not `*`), allowed or not: a shared cache that stored
        the answer to a request without an allowed origin served it, without the field, to the
        allowed page. None for any other request."""
        allow = self.allowed(head)
        if allow is not None:
            return _origin_fields(allow)
        if head.path in BROWSER_ROUTES and ANY not in self.origins:
            return _VARY_ORIGIN
        return ()

    def preflight(self, head: RequestHead) -> Fields | None:
        """The fields of the 204 answering `head` when it is a preflight of a browser route
        from an allowed origin; None for any other request."""
        if head.method != b"OPTIONS" or head.header(b"access-control-request-method") is None:
            return None
        allow = self.allowed(head)
        if allow is None:
            return None
        fields = [
            *_origin_fields(allow),
            (b"Access-Control-Allow-Methods", BROWSER_ROUTES[head.path]),
            (b"Access-Control-Max-Age", b"%d" % MAX_AGE_S),
        ]
        asked = head.header(b"access-control-request-headers")
        if asked:
            # Echoed: any header the page names may come (an `Authorization` with its key,
            # a `Content-Type` of JSON), as the engines' `allow_headers=["*"]` lets it.
            fields.append((b"Access-Control-Allow-Headers", asked))
        return tuple(fields)


def lines(fields: Fields) -> bytes:
    """`fields` as field lines, each ending with a CRLF."""
    return b"".join(b"%s: %s\r\n" % field for field in fields)


_VARY_ORIGIN: Final[Fields] = ((b"Vary", b"Origin"),)


def _origin_fields(allow: bytes) -> Fields:
    if allow == ANY:
        return ((b"Access-Control-Allow-Origin", ANY),)
    # The answer names one origin of several: a cache must not serve it to another.
    return ((b"Access-Control-Allow-Origin", allow), (b"Vary", b"Origin"))
