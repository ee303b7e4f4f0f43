"""The fake API server answers like kube-apiserver where clients can tell: raw HTTP checks
of its semantics, and kubectl (client-go) watching through it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.fake_apiserver import (
    FakeApiServer,
    endpoint,
    endpoint_slice,
    label_selector,
    labels_match,
    query_bool,
)

BASE = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
KUBECTL = shutil.which("kubectl")


async def get(fake: FakeApiServer, path: str, **query: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(fake.url + path, params=query) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def watch_lines(fake: FakeApiServer, count: int, **query: str) -> list[dict]:
    """The first `count` events of a watch (HTTP 200 expected)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(fake.url + BASE, params={"watch": "1", **query}) as resp,
    ):
        assert resp.status == 200
        lines = [await asyncio.wait_for(resp.content.readline(), 5) for _ in range(count)]

    return [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    "raw,value",
    [
        (None, False),
        ("0", False),
        ("false", False),
        ("False", False),
        ("", True),
        ("True", True),
        ("1", True),
        ("yes", True),
    ],
)
def test_boolean_query_parameters_are_false_only_when_absent_zero_or_false(
    raw: str | None, value: bool
) -> None:
    assert query_bool(raw) is value


def test_label_selector_grammar() -> None:
    labels = {"app": "kv", "tier": "gpu"}
    cases = {
        "app=kv": True,
        "app==kv": True,
        "app!=kv": False,
        "app in (kv, other)": True,
        "app notin (kv)": False,
        "tier": True,
        "!tier": False,
        "!zone": True,
        "app=kv,tier in (gpu,cpu),!zone": True,
        "app=kv,zone": False,
    }
    for text, expected in cases.items():
        assert labels_match(label_selector(text), labels) is expected, text


async def test_a_list_has_items_without_kind_and_the_resource_version_to_watch_from() -> None:
    async with FakeApiServer() as fake:
        fake.put(endpoint_slice("a", "kvrouter", [endpoint("10.0.0.2", "b")]))
        status, body = await get(fake, BASE)
        assert status == 200 and body["kind"] == "EndpointSliceList"
        assert body["metadata"]["resourceVersion"] == fake.resource_version
        assert "kind" not in body["items"][0] and "apiVersion" not in body["items"][0]
        status, body = await get(fake, BASE, watch="false")
        assert body["kind"] == "EndpointSliceList"  # watch=false is a list


async def test_a_watch_without_resource_version_starts_with_synthetic_added() -> None:
    async with FakeApiServer() as fake:
        fake.put(endpoint_slice("a", "kvrouter", [endpoint("10.0.0.2", "b")]))
        fake.put(endpoint_slice("b", "kvrouter", None))
        events = await watch_lines(fake, 2, watch="True")
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("ADDED", "a"),
            ("ADDED", "b"),
        ]
        assert events[0]["object"]["kind"] == "EndpointSlice"
        assert events[1]["object"]["endpoints"] is None


async def test_a_too_old_resource_version_is_http_200_then_one_error_event() -> None:
    async with FakeApiServer(first_rv=1000) as fake:
        fake.put(endpoint_slice("a", "kvrouter", None))
        fake.compact()
        async with (
            aiohttp.ClientSession() as session,
            session.get(fake.url + BASE, params={"watch": "1", "resourceVersion": "1000"}) as resp,
        ):
            assert resp.status == 200
            body = await resp.read()
        lines = body.splitlines()
        assert len(lines) == 1
        import json

        event = json.loads(lines[0])
        assert event["type"] == "ERROR"
        assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"
        assert event["object"]["message"].startswith("too old resource version: 1000")


async def test_label_transitions_are_delivered_as_deleted_with_the_old_content_and_added() -> None:
    async with FakeApiServer() as fake:
        fake.put(endpoint_slice("a", "kvrouter", [endpoint("10.0.0.2", "b")]))
        fake.put(endpoint_slice("c", "other", [endpoint("10.0.0.3", "c")]))
        since = fake.resource_version
        fake.put(endpoint_slice("a", "renamed", [endpoint("10.0.0.9", "z")]))
        left_at = fake.resource_version
        fake.put(endpoint_slice("c", "kvrouter", [endpoint("10.0.0.3", "c")]))
        left, joined = await watch_lines(
            fake, 2, resourceVersion=since, labelSelector="kubernetes.io/service-name=kvrouter"
        )
        assert left["type"] == "DELETED"
        assert left["object"]["endpoints"][0]["addresses"] == ["10.0.0.2"]  # the old content
        assert left["object"]["metadata"]["resourceVersion"] == left_at
        assert joined["type"] == "ADDED" and joined["object"]["metadata"]["name"] == "c"


async def test_errors_are_status_objects() -> None:
    async with FakeApiServer() as fake:
        status, body = await get(fake, BASE, fieldSelector="spec.nodeName=x")
        assert status == 400 and body["kind"] == "Status" and "not supported" in body["message"]
        status, body = await get(fake, BASE, labelSelector="app in (")
        assert status == 400 and body["reason"] == "BadRequest"
        fake.fail("watch", 403)
        status, body = await get(fake, BASE, watch="true")
        assert status == 403 and body["reason"] == "Forbidden"
        assert "cannot watch resource" in body["message"]
        assert body["details"] == {"group": "discovery.k8s.io", "kind": "endpointslices"}
        status, body = await get(fake, BASE + "/missing")
        assert status == 404 and body["code"] == 404


async def test_pages_share_one_resource_version_and_an_expired_token_is_http_410() -> None:
    async with FakeApiServer() as fake:
        for i in range(3):
            fake.put(endpoint_slice(f"s{i}", "kvrouter", None))
        _, first = await get(fake, BASE, limit="2")
        assert [i["metadata"]["name"] for i in first["items"]] == ["s0", "s1"]
        assert first["metadata"]["remainingItemCount"] == 1
        fake.put(endpoint_slice("s9", "kvrouter", None))  # after the snapshot: not in page 2
        _, second = await get(fake, BASE, limit="2", **{"continue": first["metadata"]["continue"]})
        assert [i["metadata"]["name"] for i in second["items"]] == ["s2"]
        assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        _, third = await get(fake, BASE, limit="2")
        fake.put(endpoint_slice("s10", "kvrouter", None))
        fake.compact()
        status, body = await get(fake, BASE, **{"continue": third["metadata"]["continue"]})
        assert status == 410 and body["reason"] == "Expired"


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_watches_the_fake_like_a_real_api_server(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        fake.put(endpoint_slice("kvrouter-a", "kvrouter", [endpoint("10.0.0.2", "a")]))
        env = dict(os.environ, KUBECONFIG=str(tmp_path / "none"), HOME=str(tmp_path))
        assert KUBECTL is not None
        proc = await asyncio.create_subprocess_exec(
            KUBECTL,
            "--server",
            fake.url,
            "--cache-dir",
            str(tmp_path),
            "get",
            "endpointslices",
            "-l",
            "kubernetes.io/service-name=kvrouter",
            "--watch",
            "--output-watch-events",
            "-o",
            'jsonpath={.type} {.object.metadata.name} {.object.metadata.resourceVersion}{"\\n"}',
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None

        async def line() -> str:
            return (await asyncio.wait_for(proc.stdout.readline(), 15)).decode().strip()

        try:
            assert await line() == "ADDED kvrouter-a 1001"
            while fake.open_watches == 0:  # noqa: ASYNC110 - kubectl's watch is not an event
                await asyncio.sleep(0.01)
            fake.put(endpoint_slice("kvrouter-b", "kvrouter", [endpoint("10.0.0.3", "b")]))
            assert await line() == "ADDED kvrouter-b 1002"
            fake.put(endpoint_slice("kvrouter-b", "kvrouter", None))
            assert await line() == "MODIFIED kvrouter-b 1003"
            fake.put(endpoint_slice("kvrouter-a", "other", [endpoint("10.0.0.2", "a")]))
            assert await line() == "DELETED kvrouter-a 1004"
            fake.delete("kvrouter-b")
            assert await line() == "DELETED kvrouter-b 1005"
        finally:
            proc.terminate()
            await proc.communicate()
        verbs = fake.verbs()
        assert verbs == ["list", "watch"]
        listing, watching = (r for r in fake.requests if r.verb != "discovery")
        assert listing.query["limit"] == "500"
        assert watching.query["watch"] == "true"
        assert watching.resource_version == "1001"
