"""`router.control.SharedListing`: the replica's own /v1/models answer, fetched once for every
caller while it is fetched or fresh, anew when it is stale, its workers changed, or it failed."""

from __future__ import annotations

import asyncio

import pytest

from router.control import SharedListing
from tests.support.clock import ManualClock


class Fetcher:
    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    async def __call__(self) -> int:
        self.calls += 1
        await asyncio.sleep(0)
        if self.fail:
            raise OSError("worker gone")
        return self.calls


async def test_callers_share_a_fetch_in_flight_and_a_fresh_answer_then_fetch_anew() -> None:
    clock = ManualClock()
    shared, fetch = SharedListing(fresh_s=1.0, clock=clock), Fetcher()
    assert await asyncio.gather(*(shared.get("w", fetch) for _ in range(5))) == [1] * 5
    clock.advance(0.9)
    assert await shared.get("w", fetch) == 1  # fresh
    clock.advance(0.1)
    assert await shared.get("w", fetch) == 2  # stale: fetched anew
    assert await shared.get("w+x", fetch) == 3  # other workers: fetched anew at once
    assert fetch.calls == shared.fetches == 3


async def test_a_failed_fetch_is_not_kept() -> None:
    shared, fetch = SharedListing(fresh_s=60.0, clock=ManualClock()), Fetcher()
    fetch.fail = True
    with pytest.raises(OSError):
        await shared.get("w", fetch)
    fetch.fail = False
    assert await shared.get("w", fetch) == 2


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
    for _ in range(5):
        await asyncio.sleep(0)
    assert (running, most) == (2, 2)
    release.set()
    assert await asyncio.gather(*callers) == ["listing"] * 6
    assert most == 2 and shared.fetches == 6
