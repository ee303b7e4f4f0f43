"""The dashboard and the alerts against a real Prometheus scraping a real local fleet.

One fleet for the module (real processes on loopback): three fake workers (w1 vLLM-style with
replay, w2 SGLang-style with two dp ranks, w3 without replay), replica a with static workers
and b as its peer, replica b finding its workers and a through the fake Kubernetes API server,
replica d on its own with a model tokenizer, an ingest process and an index cap far too small
for the fleet, and replica c joining later to bootstrap from a and b (and refusing w4, whose
block size is not the fleet's). A real Prometheus (Debian's binary)
scrapes the replicas (job `kvrouter`) and the workers (job `engines`) every second and
evaluates manifests/observability/alerts.yaml. Then traffic, and the faults the panels and
alerts are for: a worker failing requests, a stream gap replay repairs, a stream gap nothing
repairs, a publisher restart, a bad request, a malformed one, chats d cannot tokenize as the
engine would, d's index over its cap, and discovery refused with 403.

Every query of every dashboard panel must then return data, the panels must show those
faults (who failed, which rank lost batches, how c bootstrapped), every series and label a
panel or a rule names must be exported by a running replica or worker, and the rules for the
faults must fire in the real Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cachetree import accel
from tests.support.cluster import Cluster, RouterProcess, whole_blocks
from tests.support.fake_apiserver import FakeApiServer, endpoint, endpoint_slice
from tests.support.fake_worker import FakeWorkerHandle
from tests.support.manifests import MANIFESTS
from tests.support.model_dirs import build_fixture_model
from tests.support.ports import free_tcp_port
from tests.support.prometheus import Prometheus, binary, running_prometheus
from tests.support.router import gate_fleet, quiesce
from tests.support.waiting import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

DASHBOARD: Final = MANIFESTS / "observability" / "dashboard.json"
RULES: Final = MANIFESTS / "observability" / "alerts.yaml"
DATA_WITHIN_S: Final = 45.0
# Labels Prometheus adds to every scraped series (the target's), and histograms' `le`.
TARGET_LABELS: Final = frozenset({"namespace", "job", "instance", "le"})
PROMPT: Final = (
    "You are the operations assistant of a cluster of inference servers. Answer briefly. "
)


# A long prefix only w1 holds: cache_aware sends its requests there first.
W1_PROMPT: Final = "Summarise the incident report of the night shift for the morning team. " * 6
# Replica d's cap: W1_PROMPT alone is 27 blocks, the traffic stores several dozen more.
D_INDEX_MAX_BLOCKS: Final = 48
IMAGE_CHATS: Final = 2
IMAGE_PART: Final = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@dataclass
class Fleet:
    prom: Prometheus
    replicas: dict[str, RouterProcess]
    workers: dict[str, FakeWorkerHandle]


def panels() -> list[dict[str, Any]]:
    board = json.loads(DASHBOARD.read_text())
    return [p for p in board["panels"] if p["type"] != "row"]


def panel(title: str) -> dict[str, Any]:
    return next(p for p in panels() if p["title"] == title)


def rule_exprs() -> list[str]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return [r["expr"] for g in spec["groups"] for r in g["rules"]]


def worker_slice(fw: FakeWorkerHandle) -> dict[str, Any]:
    port = urlsplit(fw.url).port
    assert port is not None
    pod = endpoint("127.0.0.1", f"fake-kv-worker-{port}")
    return endpoint_slice(f"fake-kv-worker-{port}", "fake-kv-worker", [pod], ports=[port])


async def traffic(replicas: list[RouterProcess], requests: int, prefix: str = PROMPT) -> None:
    """Completions with a shared prefix, spread over the replicas."""
    for i in range(requests):
        rt = replicas[i % len(replicas)]
        body = {"prompt": prefix + f"Question {i % 5}: what is the state?", "max_tokens": 2}
        status, payload, _ = await rt.post("/v1/completions", body)
        assert status == 200, payload


async def repeat_on_each_rank(fw: FakeWorkerHandle) -> None:
    """One prompt twice on each of `fw`'s ranks, straight to the engine: whichever ranks the
    routers chose, every rank has a cache hit to report (the SGLang ratio panel needs one)."""
    body = {"prompt": PROMPT + "Asked twice on every rank.", "max_tokens": 1}
    for dp_rank in range(fw.config.dp_size):
        for _ in range(2):
            await fw.post("/v1/completions", body, headers={"X-Data-Parallel-Rank": str(dp_rank)})


async def failed_over(replicas: list[RouterProcess]) -> float:
    """Upstream attempts the replicas failed over, in all."""
    total = 0.0
    for rt in replicas:
        scrape = await rt.scrape()
        total += sum(scrape.series("kvrouter_upstream_failures_total").values())
    return total


async def fail_over(fw: FakeWorkerHandle, replicas: list[RouterProcess]) -> None:
    """`fw`, the only holder of W1_PROMPT, answers its next request 503: cache_aware tries it
    first, and the attempt fails over to the next ranked rank."""
    await fw.post("/control/fail", {"count": 1, "status": 503})
    await traffic(replicas[:1], 1, W1_PROMPT)
    assert await failed_over(replicas) == 1
    assert (await fw.get("/control/state"))["failed_requests"] == 1


async def chats(rt: RouterProcess, requests: int) -> None:
    """Chats d renders with its model tokenizer (the segment cache), then chats with an image
    part it cannot render as the engine would: routed by load, counted as tokenize failures."""
    for i in range(requests):
        messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": f"Q{i}?"}]
        status, payload, _ = await rt.post("/v1/chat/completions", {"messages": messages})
        assert status == 200, payload
    for _ in range(IMAGE_CHATS):
        content = [{"type": "text", "text": "What is on this graph?"}, IMAGE_PART]
        status, payload, _ = await rt.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}
        )
        assert status == 200, payload


async def malformed_request(rt: RouterProcess) -> None:
    """Bytes that are not HTTP: answered 400, and the router closes the connection."""
    url = urlsplit(rt.url)
    assert url.hostname is not None and url.port is not None
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]


async def stream_faults(
    replicas: list[RouterProcess], workers: dict[str, FakeWorkerHandle]
) -> None:
    """A gap replay repairs (w1), a gap nothing repairs (w3), a publisher restart (w2)."""
    w1, w2, w3 = workers["w1"], workers["w2"], workers["w3"]
    await w1.post("/control/drop-next", {"count": 1})
    await w1.store([whole_blocks(PROMPT + "dropped")])
    await w1.store([whole_blocks(PROMPT + "after the drop")])
    await w3.post("/control/skip-seq", {"count": 2})
    await w3.store([whole_blocks(PROMPT + "after the skip")])
    await w2.post("/control/restart-publisher", {"dp_rank": 1})
    await w2.store([whole_blocks(PROMPT + "after the restart")], dp_rank=1)
    await quiesce(replicas, list(workers.values()))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    binary("prometheus")
    workdir = tmp_path_factory.mktemp("observability")
    rules = workdir / "rules.yaml"
    rules.write_text(yaml.safe_dump(yaml.safe_load(RULES.read_text())["spec"]))
    cluster = Cluster(workdir / "processes")
    try:
        async with FakeApiServer() as api:
            workers = dict(
                zip(
                    ("w1", "w2", "w3"),
                    await asyncio.gather(
                        cluster.worker("w1"),
                        cluster.worker("w2", wire="sglang", dp_size=2),
                        cluster.worker("w3", replay=False),
                    ),
                    strict=True,
                )
            )
            odd = await cluster.worker("w4", block_size=32)
            for fw in workers.values():
                api.put(worker_slice(fw))
            a_port, b_port = free_tcp_port(), free_tcp_port()
            api.put(
                endpoint_slice(
                    "kvrouter-a", "kvrouter", [endpoint("127.0.0.1", "kvrouter-a")], ports=[a_port]
                )
            )
            model = build_fixture_model(workdir / "model", "qwen3.jinja")
            a, b, d = await asyncio.gather(
                cluster.router(
                    "a",
                    workers=list(workers.values()),
                    peers=[f"http://127.0.0.1:{b_port}"],
                    port=a_port,
                ),
                cluster.router(
                    "b",
                    "--kube-api-server",
                    api.url,
                    "--namespace",
                    "default",
                    "--worker-selector",
                    "kubernetes.io/service-name=fake-kv-worker",
                    "--kv-peer-selector",
                    "kubernetes.io/service-name=kvrouter",
                    port=b_port,
                ),
                cluster.router(
                    "d",
                    "--tokenizer",
                    str(model),
                    # A mixed fleet: the rules would be the first worker's to register, and
                    # SGLang's render the image chats (no tokenize failure to count).
                    "--chat-rules",
                    "vllm",
                    "--kv-ingest-processes",
                    "1",
                    "--kv-index-max-blocks",
                    str(D_INDEX_MAX_BLOCKS),
                    workers=list(workers.values()),
                ),
            )
            await asyncio.gather(a.wait_ready(), b.wait_ready(), d.wait_ready())
            async with running_prometheus(
                cluster.processes, workdir, ["kvrouter", "engines"], rules=rules
            ) as prom:
                prom.set_targets("kvrouter", [a.url, b.url, d.url])
                prom.set_targets("engines", [fw.url for fw in workers.values()])
                await gate_fleet([a, b, d], list(workers.values()))
                await traffic([a, b], 20)
                await chats(d, 4)
                await malformed_request(a)
                await workers["w1"].store([whole_blocks(W1_PROMPT)])
                await quiesce([a, b, d], list(workers.values()))
                await fail_over(workers["w1"], [a, b])
                await traffic([a, b], 6, W1_PROMPT)
                status, _, _ = await a.post("/v1/completions", {"max_tokens": 1})
                assert status == 400  # no prompt: the client's error, counted as such
                await stream_faults([a, b, d], workers)
                # b's watches are cut and may not come back for a while: RBAC taken away.
                api.fail("watch", 403, times=3)
                api.fail("list", 403, times=3)
                api.reset_watches()
                # c also lists w4, whose block size is not the fleet's: refused.
                c = await cluster.router(
                    "c", workers=[*workers.values(), odd], peers=[a.url, b.url]
                )
                await c.wait_ready()
                prom.set_targets("kvrouter", [a.url, b.url, c.url, d.url])
                await traffic([a, b, c, d], 16)
                await repeat_on_each_rank(workers["w2"])
                await prom.wait_scraped("kvrouter", 4)
                await prom.wait_scraped("engines", 3)
                yield Fleet(prom, {"a": a, "b": b, "c": c, "d": d}, workers)
    finally:
        await cluster.close()


async def returns_data(prom: Prometheus, expr: str) -> list[dict[str, Any]]:
    """The query's samples once it returns any (bounded)."""

    async def samples() -> list[dict[str, Any]]:
        return await prom.query_templated(expr)

    try:
        return await eventually(samples, DATA_WITHIN_S, poll_s=0.25)
    except TimeoutError:
        raise AssertionError(f"no data within {DATA_WITHIN_S} s: {expr}") from None


async def test_every_dashboard_panel_query_returns_data_from_the_fleet(fleet: Fleet) -> None:
    empty = []
    for p in panels():
        for target in p["targets"]:
            try:
                await returns_data(fleet.prom, target["expr"])
            except AssertionError:
                empty.append(f"{p['title']} [{target['refId']}]: {target['expr']}")
    assert empty == [], "\n".join(empty)


def instance(fleet: Fleet, replica: str) -> str:
    return urlsplit(fleet.replicas[replica].url).netloc


async def shows(
    prom: Prometheus, title: str, target: int, check: Callable[[list[dict[str, Any]]], bool]
) -> None:
    """Until the panel's `target`-th query shows what `check` looks for (bounded)."""
    expr = panel(title)["targets"][target]["expr"]
    last: list[dict[str, Any]] = []

    async def shown() -> bool:
        nonlocal last
        last = await prom.query_templated(expr)
        return check(last)

    try:
        await eventually(shown, DATA_WITHIN_S, poll_s=0.25)
    except TimeoutError:
        raise AssertionError(f"{title} [{target}] shows {last}") from None


def labels(samples: list[dict[str, Any]], *names: str) -> set[tuple[str, ...]]:
    return {tuple(s["metric"].get(n, "") for n in names) for s in samples}


async def test_the_panels_show_who_served_what_failed_and_how_c_bootstrapped(fleet: Fleet) -> None:
    prom, w = fleet.prom, fleet.workers
    urls = {(fw.url,) for fw in w.values()}
    await shows(prom, "Requests by worker", 0, lambda s: bool(s) and labels(s, "worker") <= urls)
    await shows(prom, "Failed-over attempts", 0, lambda s: labels(s, "worker") == {(w["w1"].url,)})
    await shows(prom, "Answers that were not 2xx", 0, lambda s: ("400",) in labels(s, "status"))
    # Every replica subscribed when w3 skipped its seqs lost them; no other rank lost any.
    await shows(
        prom,
        "Lost batches per rank",
        0,
        lambda s: (
            labels(s, "worker_url", "dp_rank") == {(w["w3"].url, "0")}
            and labels(s, "instance") >= {(instance(fleet, "a"),), (instance(fleet, "b"),)}
        ),
    )
    await shows(prom, "Replay outcomes", 0, lambda s: bool(labels(s, "outcome")))
    c = instance(fleet, "c")
    await shows(
        prom,
        "Bootstrap: rank outcomes",
        0,
        lambda s: (c, "warm") in labels(s, "instance", "outcome"),
    )
    await shows(
        prom,
        "Sibling snapshot fetches",
        0,
        lambda s: (c, "accepted") in labels(s, "instance", "outcome"),
    )
    await shows(prom, "Discovery", 1, lambda s: ("http_403",) in labels(s, "reason"))
    # SGLang's ranks found cached prefixes (the requests share a system prompt).
    await shows(
        prom,
        "Fleet cached-token ratio, as the engines report it",
        1,
        lambda s: bool(s) and 0 < float(s[0]["value"][1]) <= 1,
    )


def value_of(samples: list[dict[str, Any]], **match: str) -> float | None:
    """The value of the one sample whose labels include `match`, None when there is none."""
    found = [s for s in samples if all(s["metric"].get(k) == v for k, v in match.items())]
    assert len(found) <= 1, found
    return float(found[0]["value"][1]) if found else None


async def test_the_new_panels_show_the_faults_that_made_their_series(fleet: Fleet) -> None:
    prom, w = fleet.prom, fleet.workers
    d = instance(fleet, "d")
    every = {(instance(fleet, r),) for r in fleet.replicas}
    ranks = {(fw.url, str(r)) for fw in w.values() for r in range(fw.config.dp_size)}
    await shows(
        prom,
        "Cursor lag per rank",
        0,
        lambda s: (
            labels(s, "instance") == every
            and labels(s, "worker_url", "dp_rank") == ranks
            and all(float(x["value"][1]) >= 0 for x in s)
        ),
    )
    await shows(
        prom, "Cap clears", 0, lambda s: {x[0] for x in labels(s, "instance", "worker_url")} == {d}
    )
    await shows(prom, "Cap clears", 1, lambda s: (value_of(s, instance=d) or 0) > 0)
    await shows(
        prom,
        "Client connections the router closed",
        0,
        lambda s: (instance(fleet, "a"), "malformed") in labels(s, "instance", "reason"),
    )
    # d's one ingest process subscribes to every rank of the fleet.
    await shows(
        prom, "Ingest processes", 0, lambda s: value_of(s, instance=d, process="0") == len(ranks)
    )
    await shows(prom, "Memory beside the index", 1, lambda s: (value_of(s, instance=d) or 0) > 0)
    await shows(prom, "Tokenization cache hit ratio", 0, lambda s: labels(s, "instance") == {(d,)})
    await shows(prom, "Background tasks", 0, lambda s: ("health",) in labels(s, "task"))
    await shows(
        prom,
        "Ingest accelerator",
        0,
        lambda s: (
            labels(s, "instance", "implementation") == {(i, accel.IMPLEMENTATION) for (i,) in every}
        ),
    )
    failures = 'kvrouter_tokenize_failures_total{reason="content"}'
    assert value_of(await prom.query(failures), instance=d) == IMAGE_CHATS
    # Each routed request is timed once, the failed-over one too; the 400 and the malformed
    # request never reached a worker.
    routed = 20 + 4 + IMAGE_CHATS + 1 + 6 + 16
    timed = await prom.query("sum(kvrouter_request_added_seconds_count)")
    assert float(timed[0]["value"][1]) == routed


_METRIC: Final = re.compile(r"\b((?:kvrouter|process|python)_\w+|(?:vllm|sglang):\w+)")
_SELECTOR: Final = re.compile(r"((?:kvrouter|process|python)_\w+|(?:vllm|sglang):\w+)\{([^}]*)\}")
_MATCHER: Final = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_BY: Final = re.compile(r"\bby\s*\(([^)]*)\)")


async def exported(fleet: Fleet) -> dict[str, set[str]]:
    """Every sample name the replicas and workers export, with the label names it carries.

    A family with no sample yet (a counter labelled per outcome that never counted) is there
    by its sample names, without labels.
    """
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names: dict[str, set[str]] = {}
    for target in [*fleet.replicas.values(), *fleet.workers.values()]:
        async with fleet.prom.session.get(target.url + "/metrics") as resp:
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            for suffix in suffixes.get(family.type, ("",)):
                names.setdefault(family.name + suffix, set())
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


async def test_every_series_and_label_a_panel_or_rule_names_is_exported(fleet: Fleet) -> None:
    names = await exported(fleet)
    exprs = [t["expr"] for p in panels() for t in p["targets"]] + rule_exprs()
    missing = []
    for expr in exprs:
        used = set(_METRIC.findall(expr))
        assert used, f"the check sees no series in {expr!r}"
        missing += [f"{name} (in {expr!r})" for name in sorted(used - names.keys())]
        for name, matchers in _SELECTOR.findall(expr):
            for label in set(_MATCHER.findall(matchers)) - TARGET_LABELS:
                if label not in names.get(name, set()):
                    missing.append(f"label {label} of {name} (in {expr!r})")
        carried = set().union(*(names.get(n, set()) for n in used)) | TARGET_LABELS
        for group in _BY.findall(expr):
            for label in {g.strip() for g in group.split(",")} - carried:
                missing.append(f"by label {label} (in {expr!r})")
    assert missing == []


async def test_the_rules_fire_on_the_real_faults(fleet: Fleet) -> None:
    wanted = {
        "KvrouterEventBatchesLost",
        "KvrouterDiscoveryForbidden",
        "KvrouterWorkerRefused",
        "KvrouterIndexCapClears",
    }

    async def fired() -> dict[str, list[dict[str, str]]]:
        by_name: dict[str, list[dict[str, str]]] = {}
        for name, labels in await fleet.prom.firing():
            by_name.setdefault(name, []).append(dict(labels))
        return by_name if wanted <= by_name.keys() else {}

    try:
        firing = await eventually(fired, DATA_WITHIN_S, poll_s=0.25)
    except TimeoutError:
        raise AssertionError(f"not firing: {wanted}; firing: {await fired()}") from None
    w3 = fleet.workers["w3"].url
    assert {a["worker_url"] for a in firing["KvrouterEventBatchesLost"]} == {w3}
    b = urlsplit(fleet.replicas["b"].url).netloc
    assert {a["instance"] for a in firing["KvrouterDiscoveryForbidden"]} == {b}
    c = urlsplit(fleet.replicas["c"].url).netloc
    assert {(a["instance"], a["reason"]) for a in firing["KvrouterWorkerRefused"]} == {
        (c, "block_size")
    }
    d = urlsplit(fleet.replicas["d"].url).netloc
    assert {a["instance"] for a in firing["KvrouterIndexCapClears"]} == {d}
    # What did not go wrong stays quiet: the workers' health, the bootstrap, the backlog, the
    # loops, the connection cap, the ingest process, the accelerator.
    quiet = {
        "KvrouterWorkerUnhealthy",
        "KvrouterBootstrapNotSettled",
        "KvrouterPumpBacklog",
        "KvrouterTaskFailing",
        "KvrouterConnectionsRefused",
        "KvrouterIngestRestarts",
        "KvrouterAcceleratorNotBuilt",
    }
    assert not quiet & firing.keys()
