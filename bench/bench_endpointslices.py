"""EndpointSlice discovery figures: the pure view, and the real client through the fake server.

Run: .venv/bin/python -m bench.bench_endpointslices [--slices 100] [--endpoints 100]
Prints figures; asserts only that every path ends at the expected URL count.

- decode: one slice dict -> `EndpointSlice` struct (msgspec.convert);
- relist: `SliceView` begin/page/finish over every slice (extraction and merge);
- event: one MODIFIED applied to a full view (extraction of the slice, incremental merge);
- client list: the whole paged list through kubernetes-asyncio and the fake API server, as a
  replica's relist does it (typed deserialization included);
- client events: MODIFIED events per second through a live watch into the view.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client import ApiClient, Configuration, DiscoveryV1Api

from peer.endpointslices import EndpointSliceWatch, WatchSettings
from peer.slice_view import MODIFIED, Listing, SliceView
from peer.slices import Extraction, Family, SelfIdentity, decode_slice
from tests.support.fake_apiserver import FakeApiServer, endpoint, endpoint_slice
from tests.support.waiting import eventually

RULES = Extraction(Family.IPV4, 8080, SelfIdentity(pod_name="me", pod_ip="10.255.255.255"))
SELECTOR = "kubernetes.io/service-name=kvrouter"


def fleet(slices: int, per_slice: int) -> list[dict[str, Any]]:
    return [
        endpoint_slice(
            f"kvrouter-{s}",
            "kvrouter",
            [endpoint(f"10.{s // 250}.{s % 250}.{e}", f"pod-{s}-{e}") for e in range(per_slice)],
        )
        for s in range(slices)
    ]


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def pure(raw: list[dict[str, Any]]) -> None:
    total = sum(len(r["endpoints"]) for r in raw)
    decode_s = best_of(lambda: [decode_slice(r) for r in raw])
    slices = [decode_slice(r) for r in raw]
    view = SliceView(RULES)

    def relist() -> None:
        view.begin_relist()
        view.relist_page(slices)
        done = view.finish_relist("1")
        assert done is not None and len(done.listing.urls) == total

    relist_s = best_of(relist)
    changed = decode_slice({**raw[0], "metadata": {**raw[0]["metadata"], "resourceVersion": "2"}})
    per_event = []
    for _ in range(50):
        start = time.perf_counter()
        view.apply(MODIFIED, changed)
        per_event.append(time.perf_counter() - start)
    print(f"decode   {len(raw)} slices ({total} endpoints): {decode_s * 1e3:8.2f} ms")
    print(f"relist   {len(raw)} slices ({total} endpoints): {relist_s * 1e3:8.2f} ms")
    event_ms = statistics.median(per_event) * 1e3
    print(f"event    one MODIFIED in a {total}-endpoint view: {event_ms:8.3f} ms")


async def through_the_client(raw: list[dict[str, Any]], events: int) -> None:
    total = sum(len(r["endpoints"]) for r in raw)
    async with FakeApiServer() as fake:
        for item in raw:
            fake.put(item)
        published: list[tuple[str, ...]] = []
        wanted = 1  # publishes to wait for: the list, then one per (URL-changing) event
        arrived = asyncio.Event()

        def publish(listing: Listing) -> None:
            published.append(listing.urls)
            if len(published) >= wanted:
                arrived.set()

        async with ApiClient(Configuration(host=fake.url)) as client:
            watch = EndpointSliceWatch(
                DiscoveryV1Api(client),
                what="bench",
                namespace="default",
                selector=SELECTOR,
                rules=RULES,
                publish=publish,
                settings=WatchSettings(watch_timeout_s=600),
            )
            start = time.perf_counter()
            task = asyncio.create_task(watch.run())
            await arrived.wait()
            list_s = time.perf_counter() - start
            assert len(published[0]) == total
            await eventually(lambda: fake.open_watches, 10.0)
            target = raw[0]
            wanted, arrived = 1 + events, asyncio.Event()
            start = time.perf_counter()
            for i in range(events):
                moved = [endpoint(f"10.254.{i // 250}.{i % 250}", f"moved-{i}")]
                fake.put({**target, "endpoints": moved + target["endpoints"][1:]})
            await arrived.wait()
            events_s = time.perf_counter() - start
            task.cancel()
    print(
        f"client   list {len(raw)} slices ({total} endpoints), pages of 500: {list_s * 1e3:8.1f} ms"
    )
    print(f"client   {events} MODIFIED through the watch: {events / events_s:8.0f} events/s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slices", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--events", type=int, default=500)
    args = parser.parse_args()
    raw = fleet(args.slices, args.endpoints)
    pure(raw)
    asyncio.run(through_the_client(raw, args.events))


if __name__ == "__main__":
    main()
