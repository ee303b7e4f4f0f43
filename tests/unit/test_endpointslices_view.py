"""SliceView: relists replace and publish once, events update, errors never clear the view."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from peer.endpointslices import Backoff
from peer.kubeconfig import resolve_namespace
from peer.slice_view import ADDED, DELETED, MODIFIED, Listing, SliceView, ViewError
from peer.slices import (
    Backend,
    EndpointSlice,
    Extraction,
    Family,
    SelfIdentity,
    backends,
    decode_slice,
)
from tests.support.fake_apiserver import endpoint, endpoint_slice

RULES = Extraction(Family.IPV4, 8080, SelfIdentity(pod_name="me", pod_ip="10.0.0.1"))


def sl(name: str, *ips: str, rv: str = "1") -> EndpointSlice:
    raw = endpoint_slice(name, "kvrouter", [endpoint(ip, f"pod-{ip}") for ip in ips])
    raw["metadata"]["resourceVersion"] = rv
    return decode_slice(raw)


def url(ip: str) -> str:
    return f"http://{ip}:8080"


def listed(view: SliceView, *slices: EndpointSlice, rv: str = "10") -> tuple[str, ...] | None:
    view.begin_relist()
    view.relist_page(slices)
    done = view.finish_relist(rv)
    return done.listing.urls if done is not None else None


def test_a_relist_publishes_once_when_complete_even_an_empty_one() -> None:
    view = SliceView(RULES)
    assert view.needs_list
    view.begin_relist()
    view.relist_page([sl("a", "10.0.0.2")])
    view.relist_page([sl("b", "10.0.0.3")])
    done = view.finish_relist("10")
    assert done is not None and done.listing == Listing((url("10.0.0.2"), url("10.0.0.3")))
    assert done.slices == 2 and view.resource_version == "10" and not view.needs_list
    empty = listed(SliceView(RULES))
    assert empty == ()


def test_a_relist_with_only_self_publishes_an_empty_set() -> None:
    assert listed(SliceView(RULES), sl("a", "10.0.0.1")) == ()


def test_a_relist_abandoned_part_way_publishes_nothing_and_keeps_the_view() -> None:
    view = SliceView(RULES)
    listed(view, sl("a", "10.0.0.2"), sl("b", "10.0.0.3"))
    view.begin_relist()
    view.relist_page([sl("a", "10.0.0.2")])  # page 2 never comes
    view.abandon_relist()
    assert view.urls == (url("10.0.0.2"), url("10.0.0.3")) and view.slices == 2
    assert view.finish_relist("11") is None  # a stray end after the abandon
    assert view.resource_version == "10"


def test_a_stray_relist_end_publishes_nothing() -> None:
    view = SliceView(RULES)
    assert view.finish_relist("5") is None
    assert view.needs_list and view.urls == ()


def test_a_relist_replaces_rather_than_merges() -> None:
    view = SliceView(RULES)
    listed(view, sl("a", "10.0.0.2"), sl("b", "10.0.0.3"))
    assert listed(view, sl("c", "10.0.0.4"), rv="20") == (url("10.0.0.4"),)
    assert view.slices == 1


def test_events_upsert_and_delete_by_namespace_and_name_publishing_only_changes() -> None:
    view = SliceView(RULES)
    listed(view, sl("a", "10.0.0.2"))
    assert view.apply(ADDED, sl("b", "10.0.0.3", rv="11")) == Listing(
        (url("10.0.0.2"), url("10.0.0.3"))
    )
    assert view.resource_version == "11"
    # A MODIFIED that changes nothing we route by (e.g. a label) publishes nothing.
    assert view.apply(MODIFIED, sl("b", "10.0.0.3", rv="12")) is None
    assert view.resource_version == "12"
    assert view.apply(MODIFIED, sl("a", "10.0.0.5", rv="13")) == Listing(
        (url("10.0.0.3"), url("10.0.0.5"))
    )
    assert view.apply(DELETED, sl("b", "10.0.0.3", rv="14")) == Listing((url("10.0.0.5"),))
    other_ns = endpoint_slice("a", "kvrouter", [endpoint("10.0.0.6", "x")], namespace="other")
    assert view.apply(ADDED, decode_slice(other_ns)) == Listing((url("10.0.0.5"), url("10.0.0.6")))
    assert view.slices == 2


def test_unready_workers_are_listed_apart_and_ready_wins_a_url_offered_both_ways() -> None:
    rules = Extraction(Family.ANY, 8080, keep_unready=True)
    view = SliceView(rules)

    def worker(name: str, ip: str, rv: str, **conditions: bool) -> EndpointSlice:
        raw = endpoint_slice(name, "w", [endpoint(ip, f"pod-{ip}", **conditions)])
        raw["metadata"]["resourceVersion"] = rv
        return decode_slice(raw)

    listed(view, worker("a", "10.0.0.2", "1"), worker("b", "10.0.0.3", "1"))
    both = (url("10.0.0.2"), url("10.0.0.3"))
    assert view.listing == Listing(both)
    flap = view.apply(MODIFIED, worker("a", "10.0.0.2", "2", ready=False))
    assert flap == Listing((url("10.0.0.3"),), (url("10.0.0.2"),))
    # The same pod listed ready in another slice (controller churn): ready.
    assert view.apply(ADDED, worker("c", "10.0.0.2", "3")) == Listing(both)
    assert view.apply(DELETED, worker("c", "10.0.0.2", "4")) == flap
    assert view.apply(MODIFIED, worker("a", "10.0.0.2", "5", ready=True)) == Listing(both)
    terminating = worker("a", "10.0.0.2", "6", ready=False, terminating=True)
    assert view.apply(MODIFIED, terminating) == Listing((url("10.0.0.3"),))
    # Siblings' rules drop an unready endpoint as before.
    assert listed(SliceView(RULES), worker("a", "10.0.0.2", "1", ready=False)) == ()


def test_deleting_an_unknown_slice_changes_nothing() -> None:
    view = SliceView(RULES)
    listed(view, sl("a", "10.0.0.2"))
    assert view.apply(DELETED, sl("zzz", "10.0.0.9", rv="11")) is None
    assert view.urls == (url("10.0.0.2"),)


def test_expiry_forgets_the_resource_version_but_keeps_the_view_until_the_relist() -> None:
    view = SliceView(RULES)
    listed(view, sl("a", "10.0.0.2"))
    view.expire()
    assert view.needs_list and view.urls == (url("10.0.0.2"),)


def test_a_bookmark_moves_the_resource_version_only() -> None:
    view = SliceView(RULES)
    listed(view, sl("a", "10.0.0.2"))
    view.bookmark("99")
    assert view.resource_version == "99" and view.urls == (url("10.0.0.2"),)


def test_events_out_of_order_are_refused() -> None:
    view = SliceView(RULES)
    with pytest.raises(ViewError):
        view.relist_page([])
    view.begin_relist()
    with pytest.raises(ViewError):
        view.apply(ADDED, sl("a", "10.0.0.2"))
    with pytest.raises(ViewError):
        view.bookmark("3")
    view.abandon_relist()
    with pytest.raises(ViewError, match="unknown event type"):
        view.apply("ERROR", sl("a", "10.0.0.2"))


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets() -> None:
    backoff = Backoff(0.5, 4.0, random.Random(1))
    delays = [backoff.next_delay() for _ in range(6)]
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    backoff.reset()
    assert backoff.next_delay() <= 0.5


def test_namespace_comes_from_the_flag_then_pod_namespace_then_the_file(tmp_path: Path) -> None:
    assert resolve_namespace("", {"POD_NAMESPACE": "p"}, tmp_path) == ("", "--namespace")
    assert resolve_namespace(None, {"POD_NAMESPACE": "p"}, tmp_path)[0] == "p"
    assert resolve_namespace(None, {}, tmp_path)[0] == "default"
    (tmp_path / "namespace").write_text("from-file\n")
    assert resolve_namespace(None, {"POD_NAMESPACE": ""}, tmp_path) == (
        "from-file",
        str(tmp_path / "namespace"),
    )


def play_random_slices(
    rules: Extraction,
    rng: random.Random,
    endpoints: Callable[[random.Random], tuple[list[dict[str, Any]], list[int]]],
) -> Iterator[tuple[int, SliceView, list[Backend]]]:
    """400 random upserts and deletes of six slices, `endpoints` drawing each upsert's
    endpoints and ports; after each, the step, the view, and every backend of the slices it
    holds (for a brute-force merge to check the view against)."""
    view = SliceView(rules)
    listed(view)
    held: dict[str, EndpointSlice] = {}
    for step in range(400):
        name = f"s{rng.randrange(6)}"
        if rng.random() < 0.25:
            view.apply(DELETED, sl(name, rv=str(step)))
            held.pop(name, None)
        else:
            eps, ports = endpoints(rng)
            raw = endpoint_slice(name, "kvrouter", eps, ports=ports)
            raw["metadata"]["resourceVersion"] = str(step)
            held[name] = decode_slice(raw)
            view.apply(MODIFIED, held[name])
        yield step, view, [b for s in held.values() for b in backends(s, rules)]


def test_incremental_events_agree_with_merging_everything_afresh() -> None:
    """Random upserts and deletes of slices sharing pods (and a dual-stack one): after each,
    the view's URLs equal a brute-force merge of the slices it holds."""

    def pods(rng: random.Random) -> tuple[list[dict[str, Any]], list[int]]:
        eps = [
            endpoint(f"fd00::{p}" if p == 7 and rng.random() < 0.5 else f"10.0.0.{p}", f"pod-{p}")
            for p in rng.sample(range(8), rng.randrange(4))
        ]
        return eps, [8080]

    rules = Extraction(Family.ANY, 8080, SelfIdentity(pod_ip="10.0.0.1"))
    for step, view, found in play_random_slices(rules, random.Random(7), pods):
        best: dict[str, str] = {}
        for b in found:
            best[b.key] = min(best.get(b.key, b.url), b.url)
        assert view.urls == tuple(sorted(set(best.values()))), step


def test_incremental_events_agree_with_a_fresh_merge_one_backend_per_pod() -> None:
    """The same, for siblings: slices on different ports (two Services), one URL per pod, the
    preferred port winning as slices come and go."""

    def pods(rng: random.Random) -> tuple[list[dict[str, Any]], list[int]]:
        eps = [endpoint(f"10.0.0.{p}", f"pod-{p}") for p in rng.sample(range(8), 3)]
        return eps, [rng.choice([7070, 8080, 9090])]

    rules = Extraction(
        Family.ANY, 8080, SelfIdentity(pod_ip="10.0.0.1"), one_per_pod=True, control_port=9090
    )
    for step, view, found in play_random_slices(rules, random.Random(8), pods):
        best: dict[str, tuple[tuple[int, int], str]] = {}
        for b in found:
            best[b.key] = min(best.get(b.key, (b.choice, b.url)), (b.choice, b.url))
        assert view.urls == tuple(sorted({url for _, url in best.values()})), step
        assert len(view.urls) == len({url.rsplit(":", 1)[0] for url in view.urls}), step
