"""The data plane: the request path on asyncio Protocols and httptools.

One listening port. Every request is parsed here; a POST to a generation route
(`/v1/completions`, `/v1/chat/completions`, `/generate`) is routed synchronously when its
body is complete and relayed to the chosen worker; every other path goes to the aiohttp
control app in process (`control_link`). The two health probes are answered off the event
loop by the accept thread (`door`) on a new connection, and in the parser callback on one the
loop already serves (`server.DataPlane.probes`).

    exchange.py      the HTTP exchange rules, socket-free: admission, framing, headers,
                     which failures fail over, what a cut stream sends (table-tested)
    cors.py          which web pages may read the browser routes' answers (--cors-allow-origin):
                     a preflight's answer, an answer's fields (table-tested)
    routing.py       what the router reads of a request, and the routing decision
    door.py          the accept thread: owns the listening sockets, answers health probes,
                     hands every other connection to the loop
    server.py        the client Protocol (httptools' request parser), the limits, the
                     per-turn routing slice
    relay.py         one request answered from upstream: failover, breaker, backpressure
    upstream.py      the keep-alive connection pool per worker (httptools' response parser)
    control_link.py  the in-process hand-off to the control app
    polling.py       GETs for the replica's own polling (engine loads) on the same pools
    flow.py          flow control (reasons to pause reading) and lazy deadlines
    inflight.py      requests in flight per rank (policies, /workers, the SIGTERM drain)
"""
