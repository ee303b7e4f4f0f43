"""Issue 13, rows 2, 2a, 2b and 11: the admin and peer APIs under attack, on a real replica.

Before: with default flags anyone could read `/internal/kv_snapshot` (whether a prompt is
cached), delete every worker or add one; `POST /workers` took a URL with a path (SSRF, the
answer relayed to the client) or a rogue worker that then attracted victims' prompts; the
token was compared with `!=` and `bearer` in lower case was refused.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from router.auth import TOKEN_ENV
from tests.support.adversary import stub_server, stub_worker_routes
from tests.support.cluster import Cluster, RouterProcess
from tests.support.router import TEST_TOKEN

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"prompt": "You are a helpful assistant. Say hello.", "max_tokens": 2}


async def raw(
    rt: RouterProcess, method: str, path: str, headers: dict[str, str] | None = None, **kw
) -> tuple[int, dict]:
    """A request with exactly `headers` (no token added)."""
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, rt.url + path, headers=headers or {}, **kw) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def completion_served_by(rt: RouterProcess) -> str:
    status, body, headers = await rt.post("/v1/completions", COMPLETION)
    assert status == 200, body
    return headers["X-Kvrouter-Worker"]


async def test_with_default_flags_the_admin_and_peer_api_refuse_everyone(
    cluster: Cluster,
) -> None:
    w = await cluster.worker("w")
    rt = await cluster.router("open", workers=[w], env={TOKEN_ENV: ""})  # no token at all
    await rt.wait_ready()
    attempts = [
        ("GET", "/internal/kv_snapshot", {}),
        ("GET", "/internal/kv_snapshot?cursors_only=true", {}),
        ("GET", "/workers", {}),
        ("DELETE", f"/workers?url={w.url}", {}),
        ("POST", "/workers", {"json": {"url": "http://127.0.0.1:9"}}),
    ]
    for method, path, kw in attempts:
        for headers in ({}, {"Authorization": f"Bearer {TEST_TOKEN}"}, {"Authorization": "x"}):
            status, body = await raw(rt, method, path, headers, **kw)
            assert status == 403 and "--internal-token" in body["error"]["message"], (path, body)
    # Nothing changed: the one worker still serves every completion.
    assert [await completion_served_by(rt) for _ in range(3)] == [w.url] * 3
    assert (await rt.readyz())[0] == 200


async def test_a_worker_url_with_a_path_is_refused_and_nothing_is_fetched_from_it(
    cluster: Cluster,
) -> None:
    asked: list[str] = []

    async def metadata(request: web.Request) -> web.Response:
        asked.append(request.path_qs)
        return web.json_response({"AccessKeyId": "leaked"})

    w = await cluster.worker("w")
    rt = await cluster.router("a", workers=[w])
    await rt.wait_ready()
    async with stub_server({("*", "/{tail:.*}"): metadata}) as target:
        for url in (f"{target}/latest/meta-data/iam#", f"{target}/x?", f"{target}#"):
            status, body, _ = await rt.post("/workers", {"url": url})
            assert status == 400 and "origin" in body["error"]["message"], body
        # the completions still go to the real worker, and the target heard nothing
        assert [await completion_served_by(rt) for _ in range(3)] == [w.url] * 3
    assert asked == []
    _, listing = await rt.get("/workers")
    assert [x["url"] for x in listing["workers"]] == [w.url]


async def test_a_rogue_worker_outside_the_allow_list_is_refused_and_never_asked(
    cluster: Cluster,
) -> None:
    asked: list[str] = []

    def recording(handler):
        async def wrapped(request: web.Request) -> web.StreamResponse:
            asked.append(request.path)
            return await handler(request)

        return wrapped

    w = await cluster.worker("w")
    rt = await cluster.router("a", "--worker-allow-cidr", "10.0.0.0/8", workers=[w])
    await rt.wait_ready()
    routes = {key: recording(h) for key, h in stub_worker_routes().items()}
    async with stub_server(routes) as rogue:
        status, body, _ = await rt.post("/workers", {"url": rogue})
        assert status == 403 and "--worker-allow-cidr" in body["error"]["message"], body
        assert [await completion_served_by(rt) for _ in range(5)] == [w.url] * 5
    assert asked == []  # not even its /server_info


async def test_the_token_scheme_is_case_insensitive_and_a_wrong_token_changes_nothing(
    cluster: Cluster,
) -> None:
    w = await cluster.worker("w")
    rt = await cluster.router("a", workers=[w])
    await rt.wait_ready()
    for headers in (
        {"Authorization": f"Bearer {TEST_TOKEN[:-1]}"},
        {"Authorization": f"Bearer {TEST_TOKEN}0"},
        {"Authorization": TEST_TOKEN},
    ):
        status, _ = await raw(rt, "DELETE", f"/workers?url={w.url}", headers)
        assert status == 401
    assert (await rt.readyz())[0] == 200
    status, body = await raw(rt, "GET", "/workers", {"Authorization": f"bearer {TEST_TOKEN}"})
    assert status == 200 and [x["url"] for x in body["workers"]] == [w.url]
