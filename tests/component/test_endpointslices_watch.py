"""The EndpointSlice list+watch loop, driving the real kubernetes-asyncio client through the
fake API server: what it publishes, and what it asks the server, in every case."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration, DiscoveryV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from peer import endpointslices
from peer.endpointslices import EndpointSliceWatch, WatchSettings
from peer.kubeconfig import KubeConfigError, kube_api_client
from peer.slices import Extraction, Family, SelfIdentity
from tests.support.fake_apiserver import FakeApiServer, endpoint, endpoint_slice
from tests.support.waiting import eventually

SELECTOR = "kubernetes.io/service-name=kvrouter"
ME = SelfIdentity(pod_name="router-a", namespace="default", pod_ip="10.0.0.1")
RULES = Extraction(Family.IPV4, 8080, ME)
# A watch cut here backs off as any failure, however long it ran (`cut_min_run_s`), unless
# a test says otherwise: a reset a test makes must not turn into a cut on a slow host.
FAST = WatchSettings(watch_timeout_s=30, request_grace_s=5, min_watch_s=0, cut_min_run_s=600)
# The bound of every wait on the watch: generous, because a loaded CI host can take seconds
# for the several API round trips a backoff test needs, and a met condition returns at once.
WAIT_S = 20.0


def url(ip: str, port: int = 8080) -> str:
    return f"http://{ip}:{port}"


def router_slice(name: str, *ips: str, service: str = "kvrouter", **kw) -> dict:
    return endpoint_slice(name, service, [endpoint(ip, f"pod-{ip}") for ip in ips], **kw)


class Sleeper:
    """The loop's injected sleep: records each backoff and returns only while open."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await self._open.wait()


@dataclass
class Harness:
    fake: FakeApiServer
    watch: EndpointSliceWatch
    sleeper: Sleeper
    published: list[tuple[str, ...]] = field(default_factory=list)

    async def published_is(self, *urls: str) -> None:
        await eventually(lambda: self.published and self.published[-1] == urls, WAIT_S)

    async def watching(self, count: int = 1) -> None:
        """Until `count` watch requests were made and one is open."""
        await eventually(
            lambda: self.fake.verbs().count("watch") >= count and self.fake.open_watches, WAIT_S
        )


@contextlib.asynccontextmanager
async def watching(
    fake: FakeApiServer,
    *,
    namespace: str = "default",
    rules: Extraction = RULES,
    settings: WatchSettings = FAST,
) -> AsyncIterator[Harness]:
    sleeper = Sleeper()
    async with ApiClient(Configuration(host=fake.url)) as client:
        harness = Harness(fake, None, sleeper)  # type: ignore[arg-type]
        harness.watch = EndpointSliceWatch(
            DiscoveryV1Api(client),
            what="test",
            namespace=namespace,
            selector=SELECTOR,
            rules=rules,
            publish=lambda listing: harness.published.append(listing.urls),
            settings=settings,
            sleep=sleeper,
            rng=random.Random(3),
        )
        task = asyncio.create_task(harness.watch.run())
        try:
            yield harness
        finally:
            sleeper.release()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def synced(*slices: dict, **kw) -> AsyncIterator[Harness]:
    """A fake API server holding `slices`, and a loop that listed them and is watching."""
    async with FakeApiServer() as fake:
        for item in slices:
            fake.put(item)
        async with watching(fake, **kw) as h:
            await h.watching()
            yield h


async def test_the_initial_list_publishes_every_ready_sibling_but_self_once() -> None:
    async with synced(
        router_slice("kvrouter-a", "10.0.0.1", "10.0.0.2"),
        router_slice("kvrouter-b", "10.0.0.3"),
        router_slice("other-x", "10.0.0.9", service="other"),
        endpoint_slice("kvrouter-empty", "kvrouter", None),
    ) as h:
        fake = h.fake
        assert h.published == [(url("10.0.0.2"), url("10.0.0.3"))]
        first = fake.requests[0]
        assert first.verb == "list" and first.query["labelSelector"] == SELECTOR
        assert first.path.endswith("/namespaces/default/endpointslices")
        watch = fake.requests[1]
        assert watch.query["watch"] == "True"  # true for the server, as any non-"false"
        assert watch.query["allowWatchBookmarks"] == "True"
        assert watch.resource_version == "1004"  # the list's, not a fresh read


async def test_events_update_the_set_incrementally_in_order() -> None:
    async with synced(router_slice("kvrouter-a", "10.0.0.2")) as h:
        fake = h.fake
        fake.put(router_slice("kvrouter-b", "10.0.0.3"))
        await h.published_is(url("10.0.0.2"), url("10.0.0.3"))
        terminating = endpoint("10.0.0.2", "pod-10.0.0.2", ready=False, terminating=True)
        fake.put(endpoint_slice("kvrouter-a", "kvrouter", [terminating]))
        await h.published_is(url("10.0.0.3"))
        fake.delete("kvrouter-b")
        await h.published_is()
        assert h.published == [
            (url("10.0.0.2"),),
            (url("10.0.0.2"), url("10.0.0.3")),
            (url("10.0.0.3"),),
            (),
        ]
        assert h.watch.view.resource_version == fake.resource_version
        assert fake.verbs() == ["list", "watch"]


async def test_a_label_change_out_of_the_selector_removes_the_slice() -> None:
    async with synced(
        router_slice("kvrouter-a", "10.0.0.2"), router_slice("kvrouter-b", "10.0.0.3")
    ) as h:
        fake = h.fake
        fake.put(router_slice("kvrouter-a", "10.0.0.2", service="renamed"))
        await h.published_is(url("10.0.0.3"))
        assert h.watch.view.slices == 1


async def test_a_burst_of_a_hundred_modifications_ends_at_the_last_state() -> None:
    async with synced(router_slice("kvrouter-a", "10.0.0.2")) as h:
        fake = h.fake
        for i in range(100):
            fake.put(router_slice("kvrouter-a", f"10.0.1.{i}"))
        await h.published_is(url("10.0.1.99"))
        assert len(h.published) == 101
        assert h.watch.view.resource_version == fake.resource_version


async def test_an_expired_watch_relists_and_the_relist_replaces_rather_than_merges() -> None:
    async with synced(
        router_slice("kvrouter-a", "10.0.0.2"), router_slice("kvrouter-b", "10.0.0.3")
    ) as h:
        fake = h.fake
        h.sleeper.hold()
        # While the client is cut off: one slice goes, one comes, history is compacted.
        assert fake.reset_watches() == 1
        fake.delete("kvrouter-a")
        fake.put(router_slice("kvrouter-c", "10.0.0.4"))
        fake.compact()
        await eventually(lambda: h.sleeper.delays, WAIT_S)  # the reset backs off, once
        h.sleeper.release()
        await h.published_is(url("10.0.0.3"), url("10.0.0.4"))
        await h.watching(count=3)
        # list, watch (reset), watch (ERROR 410: too old), list, watch
        assert fake.verbs() == ["list", "watch", "watch", "list", "watch"]
        assert h.published == [
            (url("10.0.0.2"), url("10.0.0.3")),
            (url("10.0.0.3"), url("10.0.0.4")),
        ]
        assert len(h.sleeper.delays) == 1  # a 410 relists at once
        stats = h.watch.stats
        assert stats.relists == 2 and stats.failures == {"transport": 1, "expired": 1}
        assert stats.events["DELETED"] == 0  # the deletion was learned by the relist


async def test_a_relist_cut_off_between_pages_publishes_nothing_partial() -> None:
    async with FakeApiServer() as fake:
        for i in range(5):
            fake.put(router_slice(f"kvrouter-{i}", f"10.0.0.{10 + i}"))
        everyone = tuple(url(f"10.0.0.{10 + i}") for i in range(5))
        fake.fail("continue", 410, times=1)  # the first page's continue token expired
        async with watching(fake, settings=replace(FAST, page_size=2)) as h:
            await h.watching()
            assert h.published == [everyone]
            assert fake.verbs() == ["list", "continue", "list", "continue", "continue", "watch"]


async def test_a_forbidden_list_backs_off_until_granted_then_syncs() -> None:
    async with FakeApiServer() as fake:
        fake.put(router_slice("kvrouter-a", "10.0.0.2"))
        fake.fail("list", 403)
        async with watching(fake) as h:
            h.sleeper.hold()
            await eventually(lambda: h.sleeper.delays, WAIT_S)
            assert h.published == []  # never synced: not even an empty set
            assert h.watch.stats.relists == 0 and h.watch.stats.failures["http_403"] >= 1
            fake.fail("list", None)
            h.sleeper.release()
            await h.published_is(url("10.0.0.2"))
            assert h.watch.stats.relists == 1


async def test_watch_errors_keep_the_view_and_the_backoff_grows_until_recovery() -> None:
    async with synced(router_slice("kvrouter-a", "10.0.0.2")) as h:
        fake = h.fake
        fake.fail("watch", 403)
        fake.fail("list", 500)
        fake.reset_watches()
        await eventually(lambda: len(h.sleeper.delays) >= 4, WAIT_S)
        fake.fail("watch", None)
        fake.fail("list", None)
        await h.watching(count=5)
        assert h.published == [(url("10.0.0.2"),)]  # errors never cleared it
        d = h.sleeper.delays
        assert d[1] > d[0] and d[2] > d[1]  # 0.5 s doubling, with jitter in [d/2, d]
        assert all(v <= FAST.backoff_max_s for v in d)
        # A watch error keeps the resourceVersion: no relist was needed.
        assert fake.verbs().count("list") == 1
        fake.put(router_slice("kvrouter-b", "10.0.0.3"))
        await h.published_is(url("10.0.0.2"), url("10.0.0.3"))


async def test_a_reset_connection_resumes_from_the_last_resource_version() -> None:
    async with synced(router_slice("kvrouter-a", "10.0.0.2")) as h:
        fake = h.fake
        fake.put(router_slice("kvrouter-b", "10.0.0.3"))
        await h.published_is(url("10.0.0.2"), url("10.0.0.3"))
        seen = fake.resource_version
        h.sleeper.hold()
        fake.reset_watches()
        fake.put(router_slice("kvrouter-c", "10.0.0.4"))  # happens while cut off
        await eventually(lambda: h.sleeper.delays, WAIT_S)
        h.sleeper.release()
        await h.published_is(url("10.0.0.2"), url("10.0.0.3"), url("10.0.0.4"))
        assert fake.requests[-1].resource_version == seen  # replayed, not relisted
        assert fake.verbs() == ["list", "watch", "watch"]


async def test_watches_cut_mid_stream_after_they_ran_resume_at_once_and_are_no_failure() -> None:
    """A proxy whose idle timeout is shorter than the API server's bookmark interval cuts
    every idle watch (a FIN or an RST mid-stream): each re-watches at once from where it was,
    so a slice change reaches the replica as fast after ten cuts as after none. Backed off as
    failures, the re-watches grew to the 30-s cap and stayed there, and every cut counted as
    a transport failure (the failing alert)."""
    settings = replace(FAST, cut_min_run_s=0)  # any established watch ran long enough
    async with synced(router_slice("kvrouter-a", "10.0.0.2"), settings=settings) as h:
        fake = h.fake
        for i in range(1, 11):
            await h.watching(count=i)
            # An event seen proves the client has the stream (its HTTP 200): a bookmark at
            # the same resourceVersion, which moves nothing on (an idle watch).
            fake.bookmark()
            await eventually(lambda i=i: h.watch.stats.events["BOOKMARK"] >= i, WAIT_S)
            cut = fake.close_watches if i % 2 else fake.reset_watches
            assert cut() == 1
        await h.watching(count=11)
        fake.put(router_slice("kvrouter-b", "10.0.0.3"))
        await h.published_is(url("10.0.0.2"), url("10.0.0.3"))
        assert h.sleeper.delays == []  # not one backoff
        assert h.watch.stats.failures == {"cut": 10}
        assert fake.verbs() == ["list"] + ["watch"] * 11  # resumed each time, never relisted
        assert {r.resource_version for r in fake.requests[1:]} == {
            fake.requests[1].resource_version
        }


async def test_a_watch_that_breaks_before_its_minimum_run_still_backs_off() -> None:
    """Cuts of watches that had not run `cut_min_run_s` (a server or a path that fails every
    watch at once) are failures: backed off, growing, and counted."""
    async with synced(router_slice("kvrouter-a", "10.0.0.2")) as h:
        fake = h.fake
        for i in range(1, 4):
            await h.watching(count=i)
            fake.bookmark()
            await eventually(lambda i=i: h.watch.stats.events["BOOKMARK"] >= i, WAIT_S)
            assert fake.close_watches() == 1
            await eventually(lambda i=i: len(h.sleeper.delays) == i, WAIT_S)
        d = h.sleeper.delays
        assert d[2] > d[1] > d[0]
        assert h.watch.stats.failures == {"transport": 3}


@pytest.mark.parametrize(
    ("opened_at", "broke_at", "cut"),
    [
        (None, 100.0, False),  # never established: a failure to start
        (100.0, 100.5, False),  # broke at once
        (100.0, 101.99, False),
        (100.0, 102.0, True),  # ran the minimum run
        (100.0, 400.0, True),
    ],
)
def test_a_broken_watch_is_a_cut_only_once_established_and_after_its_minimum_run(
    opened_at: float | None, broke_at: float, cut: bool
) -> None:
    assert endpointslices.is_cut(opened_at, broke_at, 2.0) is cut


async def test_a_bookmark_carries_the_watch_past_writes_the_selector_hides() -> None:
    async with synced(router_slice("kvrouter-a", "10.0.0.2")) as h:
        fake = h.fake
        for i in range(3):
            fake.put(router_slice(f"noise-{i}", "10.9.0.1", service="other"))
        fake.bookmark()
        await eventually(lambda: h.watch.view.resource_version == fake.resource_version, WAIT_S)
        # History before the bookmark is compacted away: resuming from it needs no relist.
        fake.compact()
        fake.reset_watches()
        await h.watching(count=2)
        assert fake.verbs() == ["list", "watch", "watch"]
        assert h.published == [(url("10.0.0.2"),)]


async def test_a_server_timeout_ends_the_watch_cleanly_and_it_resumes_without_backoff() -> None:
    async with FakeApiServer() as fake:
        fake.put(router_slice("kvrouter-a", "10.0.0.2"))
        async with watching(fake, settings=replace(FAST, watch_timeout_s=1)) as h:
            await h.watching(count=2)
            assert fake.requests[2].resource_version == fake.requests[1].resource_version
            assert h.sleeper.delays == []


async def test_a_watch_that_hangs_past_its_deadline_is_cut_by_the_client_timeout() -> None:
    async with FakeApiServer() as fake:
        fake.put(router_slice("kvrouter-a", "10.0.0.2"))
        fake.hang_watches = True  # a half-open connection: no event, no end
        settings = replace(FAST, watch_timeout_s=1, request_grace_s=0.2)
        async with watching(fake, settings=settings) as h:
            h.sleeper.hold()
            await eventually(lambda: h.sleeper.delays, WAIT_S)
            assert fake.verbs() == ["list", "watch"]
            fake.hang_watches = False
            h.sleeper.release()
            await h.watching(count=2)
            assert h.published == [(url("10.0.0.2"),)]


async def test_a_watch_that_ends_at_once_and_empty_is_backed_off() -> None:
    async with FakeApiServer() as fake:
        fake.put(router_slice("kvrouter-a", "10.0.0.2"))
        fake.end_watches_at_once = True
        async with watching(fake, settings=replace(FAST, min_watch_s=5)) as h:
            h.sleeper.hold()
            await eventually(lambda: h.sleeper.delays, WAIT_S)
            assert fake.verbs() == ["list", "watch"]


async def test_a_slice_the_clients_models_would_refuse_costs_only_itself_in_a_list() -> None:
    """An endpoint without addresses (a non-conforming server): the client's typed list
    refused the whole page, so every relist failed and nothing was ever published."""
    broken = router_slice("kvrouter-b", "10.0.0.3")
    del broken["endpoints"][0]["addresses"]
    async with synced(router_slice("kvrouter-a", "10.0.0.2"), broken) as h:
        await h.published_is(url("10.0.0.2"))
        assert h.watch.stats.failures.total() == 0
        assert h.sleeper.delays == []


async def test_a_list_that_never_ends_is_a_failure_backed_off_not_a_busy_loop() -> None:
    async with FakeApiServer() as fake:
        fake.put(router_slice("kvrouter-a", "10.0.0.2"))
        fake.endless_list = True
        async with watching(fake) as h:
            h.sleeper.hold()
            await eventually(lambda: h.sleeper.delays, WAIT_S)
            assert fake.verbs() == ["list", "continue"]  # the token came back: no third page
            assert h.watch.stats.failures["transport"] == 1
            assert h.published == []


async def test_only_an_event_that_moves_the_watch_on_ends_its_backoff() -> None:
    """A server that sends a stale bookmark or an event of an unknown type and closes is
    backed off as one that sends nothing; unknown types count under one label."""
    async with synced(router_slice("kvrouter-a", "10.0.0.2")) as h:
        watch = h.watch
        here = {"metadata": {"resourceVersion": watch.view.resource_version}}
        assert watch._on_event({"type": "BOOKMARK", "raw_object": here}) is False
        for kind in ("WEIRD", "ALSO_WEIRD", None):
            assert watch._on_event({"type": kind, "raw_object": {}}) is False
        assert watch.stats.events["other"] == 3
        assert set(watch.stats.events) <= {"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "other"}
        further = {"metadata": {"resourceVersion": "99999"}}
        assert watch._on_event({"type": "BOOKMARK", "raw_object": further}) is True


@pytest.mark.parametrize(
    ("status", "label"),
    [(403, "http_403"), (503, "http_503"), (599, "http_other"), ("410", "http_other")],
)
def test_a_failures_status_label_is_one_of_a_few(status: object, label: str) -> None:
    assert endpointslices._status_label(status) == label


async def test_all_namespaces_lists_and_watches_cluster_wide() -> None:
    async with synced(
        router_slice("kvrouter-a", "10.0.0.2", namespace="team-a"),
        router_slice("kvrouter-a", "10.0.0.3", namespace="team-b"),
        namespace="",
    ) as h:
        fake = h.fake
        assert h.published == [(url("10.0.0.2"), url("10.0.0.3"))]
        assert fake.requests[0].path == "/apis/discovery.k8s.io/v1/endpointslices"
        fake.delete("kvrouter-a", namespace="team-a")
        await h.published_is(url("10.0.0.3"))


async def test_ipv6_siblings_on_a_slice_port_other_than_ours() -> None:
    async with FakeApiServer() as fake:
        fake.put(router_slice("v4", "10.0.0.2", ports=[9000]))
        fake.put(router_slice("v6", "fd00::2", address_type="IPv6", ports=[9000]))
        rules = Extraction(Family.IPV6, 8080, ME)
        async with watching(fake, rules=rules) as h:
            await h.watching()
            assert h.published == [("http://[fd00::2]:9000",)]


async def test_kubeconfig_points_the_client_at_the_api_server(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        fake.put(router_slice("kvrouter-a", "10.0.0.2"))
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
            f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
            "users: [{name: u, user: {token: kube-token}}]\n"
            "contexts: [{name: test, context: {cluster: fake, user: u}}]\n"
        )
        async with await kube_api_client(None, {"KUBECONFIG": str(kubeconfig)}) as client:
            page = await DiscoveryV1Api(client).list_namespaced_endpoint_slice("default")
        assert [i.metadata.name for i in page.items] == ["kvrouter-a"]


async def test_in_cluster_config_uses_the_service_account_over_tls(tmp_path: Path) -> None:
    tls = await self_signed(tmp_path)
    if tls is None:
        pytest.skip("openssl is not installed: no certificate for the TLS API server")
    server_ctx = tls
    (tmp_path / "token").write_text("s3cr3t-token")
    async with FakeApiServer(token="s3cr3t-token", ssl_context=server_ctx) as fake:
        fake.put(router_slice("kvrouter-a", "10.0.0.2"))
        port = fake.url.rsplit(":", 1)[1]
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
        client = await kube_api_client(None, environ, service_account=tmp_path)
        async with client:
            page = await DiscoveryV1Api(client).list_namespaced_endpoint_slice("default")
        assert [i.metadata.name for i in page.items] == ["kvrouter-a"]
        assert fake.requests[-1].verb == "list"


async def test_no_way_to_reach_an_api_server_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match=r"KUBECONFIG.*--kube-api-server"):
        await kube_api_client(None, {"KUBECONFIG": str(tmp_path / "missing")})


KUBECONFIG_WITH_CA = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", certificate-authority-data: %s}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.parametrize(
    "text",
    [
        "clusters: [unclosed",  # not YAML
        "",  # empty
        "- a list\n- not a mapping\n",
        KUBECONFIG_WITH_CA % "'not base64!'",
        KUBECONFIG_WITH_CA % "bm90IGEgY2VydGlmaWNhdGU=",  # base64 of no certificate
    ],
)
async def test_a_malformed_kubeconfig_is_one_clear_error_not_a_traceback(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(KubeConfigError, match=r"cannot reach the Kubernetes API: .*KUBECONFIG"):
        await kube_api_client(None, {"KUBECONFIG": str(path)})
    with pytest.raises(KubeConfigError) as caught:
        await kube_api_client(None, {"KUBECONFIG": str(path)})
    assert "\n" not in str(caught.value)  # one line


async def self_signed(tmp_path: Path):
    """A server TLS context with a self-signed certificate for IP 127.0.0.1 (in ca.crt)."""
    if shutil.which("openssl") is None:
        return None
    cert, key = tmp_path / "ca.crt", tmp_path / "key.pem"
    proc = await asyncio.create_subprocess_exec(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=127.0.0.1",
        "-addext",
        "subjectAltName=IP:127.0.0.1",
        "-keyout",
        str(key),
        "-out",
        str(cert),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert await proc.wait() == 0
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


def test_a_401_blames_the_credentials_and_a_403_the_service_accounts_rights() -> None:
    unauthorized = endpointslices._api_problem(ApiException(401, "Unauthorized"), "ns")
    forbidden = endpointslices._api_problem(ApiException(403, "Forbidden"), "ns")
    assert "refused the credentials" in unauthorized and "needs get/list" not in unauthorized
    assert "needs get/list/watch on endpointslices.discovery.k8s.io in namespace ns" in forbidden
