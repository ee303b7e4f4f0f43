"""`router.control.SharedListing`: the replica's own /v1/models answer, fetched once for every
caller while it is fetched or fresh, anew when it is stale (the last answer served meanwhile,
up to an age), its workers changed, or it failed."""

from __future__ import annotations

import asyncio

import pytest

from router.control import SharedListing
from tests.support.clock import ManualClock


class Fetcher:
    def __init__(self) -> None:
        self.calls = 0
        self.fail = False
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self) -> int:
        self.calls += 1
        await self.release.wait()
        if self.fail:
            raise OSError("worker gone")
        return self.calls


async def ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_callers_share_a_fetch_in_flight_and_a_fresh_answer_other_keys_fetch_at_once() -> (
    None
):
    clock = ManualClock()
    shared, fetch = SharedListing(fresh_s=1.0, clock=clock), Fetcher()
    assert await asyncio.gather(*(shared.get("w", fetch) for _ in range(5))) == [1] * 5
    clock.advance(0.9)
    assert await shared.get("w", fetch) == 1  # fresh
    assert await shared.get("w+x", fetch) == 2  # other workers: fetched anew at once
    assert fetch.calls == shared.fetches == 2


async def test_a_stale_answer_is_served_while_one_fetch_renews_it_until_it_is_too_old() -> None:
    """A stale answer was fetched anew with its callers waiting: behind a slow worker (or
    other fetches' turns) every caller waited, though an answer a second old was kept."""
    clock = ManualClock()
    shared, fetch = SharedListing(fresh_s=1.0, stale_s=10.0, clock=clock), Fetcher()
    assert await shared.get("w", fetch) == 1
    fetch.release.clear()
    clock.advance(1.0)
    assert [await shared.get("w", fetch) for _ in range(3)] == [1] * 3  # stale, served
    await ticks()
    assert fetch.calls == shared.fetches == 2  # one fetch renews it
    fetch.release.set()
    await ticks()
    assert await shared.get("w", fetch) == 2 and fetch.calls == 2
    fetch.release.clear()
    clock.advance(10.0)  # past `stale_s` since its fetch began: callers await the next
    waiting = asyncio.ensure_future(shared.get("w", fetch))
    await ticks()
    assert not waiting.done() and fetch.calls == 3
    fetch.release.set()
    assert await waiting == 3


async def test_a_failed_fetch_keeps_the_last_answer_and_is_not_kept() -> None:
    clock = ManualClock()
    shared, fetch = SharedListing(fresh_s=1.0, stale_s=10.0, clock=clock), Fetcher()
    fetch.fail = True
    with pytest.raises(OSError):
        await shared.get("w", fetch)
    fetch.fail = False
    assert await shared.get("w", fetch) == 2
    fetch.fail = True
    clock.advance(1.0)
    assert await shared.get("w", fetch) == 2  # stale: served while a fetch fails
    await ticks()
    fetch.fail = False
    assert await shared.get("w", fetch) == 2  # the failure kept nothing: fetched anew
    await ticks()
    assert await shared.get("w", fetch) == 4


async def test_a_caller_that_leaves_does_not_cancel_the_fetch_the_others_wait_for() -> None:
    shared, fetch = SharedListing(fresh_s=60.0, clock=ManualClock()), Fetcher()
    first = asyncio.ensure_future(shared.get("w", fetch))
    second = asyncio.ensure_future(shared.get("w", fetch))
    await asyncio.sleep(0)
    first.cancel()
    assert await second == 1
    assert fetch.calls == 1


async def test_answers_of_several_keys_are_kept_the_least_recently_asked_going_first() -> None:
    """One answer was kept: callers alternating two keys had every call fetched anew."""
    shared, fetch = SharedListing(fresh_s=60.0, clock=ManualClock(), most_keys=2), Fetcher()
    assert [await shared.get(k, fetch) for k in ("a", "b", "a", "b")] == [1, 2, 1, 2]
    assert await shared.get("c", fetch) == 3  # past two keys: "a", asked least lately, goes
    assert await shared.get("b", fetch) == 2
    assert await shared.get("a", fetch) == 4
    assert fetch.calls == shared.fetches == 4


async def test_at_most_most_fetches_run_at_once_the_others_waiting_their_turn() -> None:
    running, most = 0, 0
    release = asyncio.Event()

    async def slow() -> str:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        return "listing"

    shared = SharedListing(fresh_s=60.0, clock=ManualClock(), most_fetches=2)
    callers = [asyncio.ensure_future(shared.get(k, slow)) for k in range(6)]
    await ticks()
    assert (running, most) == (2, 2)
    release.set()
    assert await asyncio.gather(*callers) == ["listing"] * 6
    assert most == 2 and shared.fetches == 6
