"""A replica served over HTTP: the replica's parts, the control app and the data plane.

`start_serving` starts the replica (`router.replica`), sets up the control app
(`router.control`) without a listener of its own, and listens with the data plane
(`router.dataplane`), which answers the generation routes and hands every other path to the
control app (see `router.dataplane.control_link`). With `control_port` the data plane also
listens on that port and hands every path to the control app (for peer and admin traffic a
NetworkPolicy can single out), with the same head, body and idle timeouts and its own bound
on connections.
`stop_serving` stops them in the reverse order. A SIGTERM drain (`router.cli.serve`) sits
between the two: `begin_drain`, then wait for in-flight requests; at its timeout, those never
sent (waiting for a connection to a worker, a placer's answer or a long prompt's encode) are
answered 503 with `Retry-After`, and the rest are cut.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from peer.origin import http_origin
from router.control import build_control_app, liveness, readiness
from router.dataplane.cors import CorsPolicy
from router.dataplane.routing import RequestRouter
from router.dataplane.server import DataPlane, Limits
from router.placement import PlacementAsker, Placer, election_url
from router.replica import Replica, ServeConfig, start_replica, stop_replica

log = logging.getLogger(__name__)

# After the drain, what control handlers are still running get this long before they are
# cancelled (aiohttp's own default is 60 s).
SHUTDOWN_GRACE_S: Final = 1.0
# File descriptors a replica needs besides its client connections: worker connections, ZMQ
# sockets, the control session, logs. Only for the warning below; not a limit.
_FD_RESERVE: Final = 256
# What the relay adds to a head it hands the control app (Host, Content-Length, ...).
_RELAY_HEAD_FIELDS: Final = 8
_RELAY_HEAD_SLACK: Final = 1024


class StartError(Exception):
    """The server could not start (e.g. its port is taken); the message is one line."""


@dataclass(slots=True)
class Serving:
    replica: Replica
    plane: DataPlane
    control: web.AppRunner
    url: str
    control_url: str | None = None

    def begin_drain(self) -> None:
        """`/readyz` turns 503; answers close their connections; idle connections close."""
        self.replica.draining = True
        self.plane.begin_drain()

    async def drain(self, timeout_s: float) -> bool:
        """Drain, and wait up to `timeout_s` for in-flight requests; False if some are left.

        A request waiting for its routing slice is not in flight yet, but will be within a
        turn of the loop: it is waited for too; so are a long prompt being encoded in a worker
        thread and a new prefix's question to its placer, in flight once answered.
        """
        self.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        plane = self.plane
        while True:
            idle = await self.replica.inflight.wait_idle(max(0.0, deadline - loop.time()))
            pending = next((p for p in (plane.encodes.held, plane.asking) if p.count), None)
            if idle and pending is not None:
                if not await pending.wait_idle(max(0.0, deadline - loop.time())):
                    return False
                continue  # what they routed is in flight now
            if not idle or not self.plane.routing_backlog:
                return idle
            await asyncio.sleep(0)  # the backlog is routed in the next turns


def limits_of(config: ServeConfig) -> Limits:
    return Limits(
        max_body_bytes=config.max_request_bytes,
        max_header_count=config.max_header_count,
        max_head_bytes=config.max_head_bytes,
        max_connections=config.max_connections,
        header_timeout_s=config.client_header_timeout_s,
        body_timeout_s=config.client_body_timeout_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
        connect_timeout_s=config.upstream_connect_timeout_s,
        head_timeout_s=config.upstream_head_timeout_s,
        stream_idle_timeout_s=config.stream_idle_timeout_s,
        client_write_timeout_s=config.client_write_timeout_s,
        upstream_idle_expiry_s=config.upstream_idle_expiry_s,
        upstream_connections_per_worker=config.upstream_connections_per_worker,
        max_attempts=config.max_attempts,
    )


def check_file_limit(max_connections: int) -> None:
    """Warn when --max-connections cannot be reached under the process's file limit: past
    it, accepting fails (and asyncio logs it) instead of the clean 503 the limit gives."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections + _FD_RESERVE > soft:
        log.warning(
            "--max-connections %d does not fit the file limit of %d (ulimit -n) with about %d "
            "kept for workers and events: raise the limit or lower --max-connections",
            max_connections,
            soft,
            _FD_RESERVE,
        )


async def start_serving(config: ServeConfig) -> Serving:
    check_file_limit(config.max_connections)
    replica = await start_replica(config)
    # The data plane already bounded every head it hands over (`--max-head-bytes`,
    # `--max-header-count`): aiohttp's own, smaller bounds (8190-byte lines) would refuse a
    # head the documented limits allow, with a plain-text 400 echoing it and an ERROR
    # traceback per request. Its limits sit above the data plane's, with room for the
    # fields the relay adds.
    head_room = config.max_head_bytes + _RELAY_HEAD_SLACK
    control = web.AppRunner(
        build_control_app(replica),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        max_line_size=head_room,
        max_field_size=head_room,
        max_headers=config.max_header_count + _RELAY_HEAD_FIELDS,
    )
    plane: DataPlane | None = None
    try:
        await control.setup()
        assert control.server is not None
        router = RequestRouter(
            replica.tokenizer,
            replica.policy,
            replica.workers,
            replica.loads,
            replica.inflight,
            replica.pump.rules,
            replica.metrics,
            offload_chars=config.tokenize_offload_chars,
        )
        placement = replica.placement
        if placement is not None:
            rules = replica.pump.rules
            replica.placer = Placer(
                placement.policy,
                lambda: rules.tree,
                router.candidates,
                router.servers,
                placement.counts,
            )
            if config.placement_timeout_ms and config.internal_token:
                router.placement = placement
                router.asker = PlacementAsker(
                    replica.sessions[0],
                    config.internal_token,
                    placement,
                    config.placement_timeout_ms / 1000,
                )
        plane = DataPlane(
            router,
            replica.workers,
            replica.inflight,
            replica.metrics,
            control.server,
            limits_of(config),
            expose_route_headers=config.expose_route_headers,
            internal_token=config.internal_token,
            cors=CorsPolicy.parse(config.cors_allow_origin),
            probes={
                b"/healthz": lambda: liveness(replica),
                b"/readyz": lambda: readiness(replica),
            },
        )
        replica.workers.on_unhealthy = plane.worker_down
        replica.workers.on_removed = plane.forget_worker
        replica.metrics.watch_dataplane(plane)
        try:
            addresses = await plane.listen(config.host, config.port)
        except OSError as exc:
            raise StartError(
                f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
            ) from None
        serving = Serving(replica, plane, control, listening_url(config.host, addresses[0][1]))
        if placement is not None:
            ports = [addresses[0][1], config.control_port]
            placement.own = election_url(
                config.self_url,
                config.host,
                [port for port in ports if port],
                os.environ.get("POD_IP"),
                config.peer,
            )
            if router.placement is not None and placement.own is None:
                log.warning(
                    "placement: this replica does not know its own URL, so it cannot tell "
                    "which replica places new prefixes and places them itself; set --self-url "
                    "(or POD_IP from the downward API)"
                )
        if config.control_port:
            try:
                await plane.listen(config.host, config.control_port, control_only=True)
            except OSError as exc:
                raise StartError(
                    f"cannot listen on {config.host}:{config.control_port} (--control-port): "
                    f"{exc.strerror or exc}"
                ) from None
            serving.control_url = listening_url(config.host, config.control_port)
        return serving
    except BaseException:
        if plane is not None:
            await plane.close()
        await control.cleanup()
        await stop_replica(replica)
        raise


def listening_url(host: str, port: int) -> str:
    """The URL a replica listening on `host` is reached at: the loopback address for ""
    (every address), where `http://:PORT` names nothing."""
    return http_origin(host or "127.0.0.1", port)


async def stop_serving(serving: Serving) -> None:
    await serving.plane.close()
    await serving.control.cleanup()
    await stop_replica(serving.replica)


async def serve_until(serving: Serving, stop: asyncio.Event, drain_timeout_s: float) -> None:
    """Serve until `stop` is set, then drain (in-flight requests get `drain_timeout_s`)."""
    await stop.wait()
    log.info(
        "draining: /readyz is 503; waiting up to %.0fs for in-flight requests", drain_timeout_s
    )
    if not await serving.drain(drain_timeout_s):
        turned = serving.plane.turn_away_waiting()
        if turned:
            log.warning(
                "drain timeout: %d request(s) never sent (waiting for a connection to a "
                "worker, a placer's answer or a long prompt's encode) are answered 503 with "
                "Retry-After, for their clients to retry on another replica",
                turned,
            )
        if serving.replica.inflight.total:
            log.warning(
                "drain timeout: %d request(s) still in flight are cut",
                serving.replica.inflight.total,
            )
