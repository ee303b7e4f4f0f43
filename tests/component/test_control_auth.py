"""The control plane's guarded routes over real HTTP: refused without the token, and nothing
changes when they are; the probes and the scrape stay open."""

from __future__ import annotations

import aiohttp
import pytest

from router import auth, siblings
from tests.support.fake_worker import fake_worker_in_process
from tests.support.metrics import Scrape
from tests.support.router import RouterHandle, router_in_process

TOKEN = "component-test-token-0123456789"


async def call(
    rt: RouterHandle, method: str, path: str, headers: dict[str, str] | None = None, **kw
) -> tuple[int, dict, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as session,  # no default headers at all
        session.request(method, rt.url + path, headers=headers or {}, **kw) as resp,
    ):
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


def guarded_calls(worker_url: str) -> list[tuple[str, str, dict]]:
    return [
        ("GET", "/workers", {}),
        ("POST", "/workers", {"json": {"url": "http://127.0.0.1:9"}}),
        ("DELETE", f"/workers?url={worker_url}", {}),
        ("GET", "/internal/kv_snapshot", {}),
        ("GET", "/internal/kv_snapshot?cursors_only=true", {}),
    ]


async def test_without_a_configured_token_every_guarded_route_is_refused_naming_the_flag() -> None:
    async with (
        fake_worker_in_process() as fw,
        router_in_process(workers=[fw.url], internal_token=None) as rt,
    ):
        for method, path, kw in guarded_calls(fw.url):
            for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer x"}):
                status, body, _ = await call(rt, method, path, headers, **kw)
                assert status == 403, (method, path, body)
                assert "--internal-token" in body["error"]["message"]
                assert auth.TOKEN_ENV in body["error"]["message"]
        # nothing changed: the worker is still the only one, and routable
        assert [w.url for w in rt.replica.workers.workers()] == [fw.url]
        assert rt.replica.workers.routable()


async def test_a_missing_or_wrong_token_is_a_401_challenge_and_changes_nothing() -> None:
    async with (
        fake_worker_in_process() as fw,
        router_in_process(workers=[fw.url], internal_token=TOKEN) as rt,
    ):
        for method, path, kw in guarded_calls(fw.url):
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": f"Basic {TOKEN}"},
                {"Authorization": f"Bearer {TOKEN}extra"},
            ):
                status, body, got = await call(rt, method, path, headers, **kw)
                assert status == 401, (method, path, headers, body)
                assert got["WWW-Authenticate"].startswith("Bearer")
        assert [w.url for w in rt.replica.workers.workers()] == [fw.url]
        assert rt.replica.workers.routable()
        assert rt.replica.producer is not None and rt.replica.producer.stats.builds == 0


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
async def test_the_right_token_passes_whatever_the_case_of_the_scheme(scheme: str) -> None:
    async with (
        fake_worker_in_process() as fw,
        router_in_process(workers=[fw.url], internal_token=TOKEN) as rt,
    ):
        headers = {"Authorization": f"{scheme} {TOKEN}"}
        status, body, _ = await call(rt, "GET", "/workers", headers)
        assert status == 200 and [w["url"] for w in body["workers"]] == [fw.url]
        status, body, _ = await call(rt, "DELETE", f"/workers?url={fw.url}", headers)
        assert status == 200 and rt.replica.workers.workers() == []


async def test_every_registered_route_under_a_guarded_path_is_guarded() -> None:
    """A route added later under /internal/ or /workers cannot forget the guard."""
    async with router_in_process(internal_token=TOKEN) as rt:
        routes = [
            (route.method, route.resource.canonical)
            for route in rt.serving.control.app.router.routes()
            if route.resource is not None and auth.guarded(route.resource.canonical)
        ]
        assert {path for _, path in routes} == {
            "/workers",
            "/internal/kv_snapshot",
            "/internal/decisions",
            "/internal/place",
        }
        for method, path in routes:
            if method == "HEAD":
                continue
            status, _, _ = await call(rt, method, path)
            assert status == 401, (method, path)
            assert auth.route_family(path) != "other"  # its refusals counted under its name


async def test_an_unregistered_path_or_method_under_internal_is_refused_for_its_token() -> None:
    """`/internal/<anything>` answered 404 (a wrong method 405) without the token and
    uncounted: an unauthenticated caller could tell which internal routes exist. Only with
    the token does it learn that a path is not served."""
    calls = [
        ("GET", "/internal/nope"),
        ("GET", "/internal/"),
        ("POST", "/internal/kv_snapshot"),
        ("PUT", "/workers"),
    ]
    async with router_in_process(internal_token=TOKEN) as rt:
        for method, path in calls:
            status, body, headers = await call(rt, method, path)
            assert status == 401, (method, path, body)
            assert headers["WWW-Authenticate"] == auth.CHALLENGE
        counts = rt.replica.metrics.auth_refusals.counts
        assert {route: n for route, n in counts.items() if n} == {
            "other": 2,
            "snapshot": 1,
            "workers": 1,
        }
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        answers = []
        for method, path in calls:
            async with rt.session.request(method, rt.url + path, headers=bearer) as resp:
                answers.append(resp.status)
        assert answers == [404, 404, 405, 405]


async def test_refused_tokens_are_counted_by_route_family_and_warned_once_per_family(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sibling with another token was refused without a trace on the refusing side."""
    async with router_in_process(internal_token=TOKEN) as rt:
        wrong = {"Authorization": "Bearer wrong"}
        for _ in range(50):
            assert (await call(rt, "GET", "/workers", wrong))[0] == 401
        for _ in range(2):
            assert (await call(rt, "POST", siblings.PATH, wrong, data=b"x"))[0] == 401
        async with aiohttp.ClientSession() as session, session.get(rt.url + "/metrics") as resp:
            scrape = Scrape.parse(await resp.text())
    assert scrape.by("kvrouter_auth_refusals_total", "route") == {
        "workers": 50,
        "decisions": 2,
    }
    assert scrape.value("kvrouter_auth_refusals_total", route="placement") == 0
    said = [r.getMessage() for r in caplog.records if r.name == "router.auth"]
    assert [line.split(" routes")[0] for line in said] == [
        "refused 1 request(s) to the workers",
        "refused 1 request(s) to the decisions",
    ]
    assert all("the latest from 127.0.0.1: 401" in line for line in said)
    assert all("is the same on both sides" in line for line in said)


async def test_a_replica_without_a_token_warns_that_it_has_none_not_that_tokens_differ(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its 403 says no token is configured, but its warning read "check that --internal-token
    is the same on both sides", as if it had one."""
    async with router_in_process(internal_token=None) as rt:
        status, body, _ = await call(
            rt, "GET", "/internal/kv_snapshot", {"Authorization": f"Bearer {TOKEN}"}
        )
        assert status == 403 and "none is configured" in body["error"]["message"]
    (said,) = [r.getMessage() for r in caplog.records if r.name == "router.auth"]
    assert "the latest from 127.0.0.1: 403" in said and "This replica has no token" in said
    assert "both sides" not in said


async def test_the_probes_the_scrape_and_the_model_list_stay_open() -> None:
    async with (
        fake_worker_in_process() as fw,
        router_in_process(workers=[fw.url], internal_token=TOKEN) as rt,
    ):
        assert (await call(rt, "GET", "/healthz"))[0] == 200
        assert (await call(rt, "GET", "/readyz"))[0] == 200
        assert (await call(rt, "GET", "/v1/models"))[0] == 200
        async with aiohttp.ClientSession() as session, session.get(rt.url + "/metrics") as resp:
            assert resp.status == 200 and "kvrouter_tree_nodes" in await resp.text()


async def test_a_decision_batch_over_the_bound_is_a_413_counted_refused() -> None:
    async with router_in_process(
        internal_token=TOKEN, peer=["http://127.0.0.1:9"], kv_bootstrap_timeout_ms=0
    ) as rt:
        sharing = rt.replica.sharing
        assert sharing is not None
        body = b"\x00" * (siblings.MAX_BODY_BYTES + 1)
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/msgpack"}
        status, _, _ = await call(rt, "POST", "/internal/decisions", headers, data=body)
        assert status == 413
        assert (sharing.stats.refused, sharing.stats.received) == (1, 0)
