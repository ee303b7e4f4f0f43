"""`kvrouter view --watch` against in-process replicas fed by in-process fake workers.

The watch loop runs as a task drawing into a list at a short, injected interval; the test
waits (bounded) for the frame that shows what it caused, never for a fixed time. The
command itself runs as a subprocess with `--count`, which is its contract for scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from cachetree.ranks import RankId
from peer.fetch import SnapshotFetcher
from router.auth import TOKEN_ENV
from router.tools import view, watch
from tests.component.test_view import FIRST, TOK, fleet, quiesce, run_view
from tests.support.adversary import stub_server
from tests.support.fake_worker import fake_worker_in_process
from tests.support.processes import kvrouter_argv
from tests.support.router import TEST_TOKEN, RouterHandle, router_in_process
from tests.support.waiting import eventually

INTERVAL_S = 0.02


@contextlib.asynccontextmanager
async def watching(
    replicas: list[RouterHandle], **kw: object
) -> AsyncIterator[Callable[[Callable[[list[str]], bool]], asyncio.Future]]:
    """Run the watch loop; yields `frame_where(check)`, the first frame drawn after the call
    for which `check(lines)` holds (bounded)."""
    frames: list[list[str]] = []
    kw.setdefault("token", TEST_TOKEN)
    task = asyncio.create_task(
        watch.watch([r.url for r in replicas], frames.append, interval_s=INTERVAL_S, **kw)  # type: ignore[arg-type]
    )

    async def frame_where(check: Callable[[list[str]], bool]) -> list[str]:
        start = len(frames)

        def found() -> list[str] | None:
            if task.done():
                task.result()  # a loop that died says why
            return next((f for f in frames[start:] if check(f)), None)

        return await eventually(found, 10.0)

    try:
        yield frame_where  # type: ignore[misc]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def row(lines: list[str], rank: RankId) -> list[str]:
    """The rank's cells, one per replica, as drawn (without the rank column)."""
    line = next(line for line in lines if line.startswith(str(rank) + " "))
    return [cell.strip() for cell in line.split(" | ")[1:]]


async def test_agreeing_replicas_show_each_ranks_cursor_blocks_and_no_mark() -> None:
    async with fleet() as ([a, b], [w1, _]), watching([a, b]) as frame_where:
        seq = (await w1.state(0))["last_seq"]
        lines = await frame_where(lambda f: "agree" in f[-1])
        assert lines[-1] == "the 2 replicas agree on cursors and blocks of 3 ranks"
        assert f"A {a.url}  ready" in lines[1] and f"B {b.url}  ready" in lines[2]
        blocks = len(TOK.encode(FIRST)) // 16 + 1  # the conversation and the gate's probe
        for cell in row(lines, RankId(w1.url, 0)):
            assert cell.split() == [str(seq), str(blocks), "-"]  # no lag, no bootstrap
        assert not any(watch.MARK in line for line in lines[3:-1])

        # A batch on w1: the next frames follow both replicas' cursors and blocks. Cursors
        # (the cursor table) and blocks (`/metrics`) are two reads of a replica, so a frame
        # may show the new cursor beside the blocks before the batch; the view catches up.
        more = TOK.encode(FIRST + " And a second question about the same thing.")
        new_seq = await w1.store([more[: len(more) // 16 * 16]])

        def caught_up(f: list[str]) -> bool:
            cells = row(f, RankId(w1.url, 0))
            return "agree" in f[-1] and all(
                c.split()[0] == str(new_seq) and int(c.split()[1]) > blocks for c in cells
            )

        lines = await frame_where(caught_up)
        assert [c.split()[0] for c in row(lines, RankId(w1.url, 0))] == [str(new_seq)] * 2
        assert int(row(lines, RankId(w1.url, 0))[1].split()[1]) > blocks


async def test_a_block_on_two_tiers_counts_once_as_view_counts_it() -> None:
    async with fleet() as ([a, b], [w1, w2]):
        rank = RankId(w1.url, 0)
        chain = list(range(1000, 1048))  # 3 blocks, of bytes no prompt of the fleet has
        await w1.store([chain], medium="CPU")
        await w1.store([chain[:16]], medium="GPU")  # the first of them on device too
        await quiesce([a, b], [w1, w2])
        (one_shot,) = await view.collect([a.url], token=TEST_TOKEN)
        tree = a.replica.pump.rules.tree
        assert tree is not None
        per_tier = sum(n for (r, _), n in tree.block_counts().items() if r == rank)
        assert per_tier == tree.block_count(rank) + 1  # the premise: one block on two tiers
        state = await watch_state(a.url, TEST_TOKEN)
        assert state.blocks[rank] == one_shot.blocks(rank) == tree.block_count(rank)


async def test_a_rank_one_replica_lacks_is_marked_absent_on_that_replica() -> None:
    async with fleet(b_workers=1) as ([a, b], [w1, w2]), watching([a, b]) as frame_where:
        lines = await frame_where(lambda f: "differ" in f[-1])
        assert lines[-1] == "2 of 3 ranks differ between replicas (marked)"
        for dp_rank in (0, 1):
            held, absent = row(lines, RankId(w2.url, dp_rank))
            assert not held.endswith(watch.MARK)  # A is the reference: it has the rank
            assert absent.split() == ["absent", watch.MARK]
        assert not any(c.endswith(watch.MARK) for c in row(lines, RankId(w1.url, 0)))


def test_a_cursor_behind_the_replica_furthest_ahead_shows_its_lag_and_is_marked() -> None:
    rank = RankId("http://w1:8000", 0)
    ahead = watch.ReplicaState("http://a", ready=True, cursors={rank: 12}, blocks={rank: 40})
    behind = watch.ReplicaState("http://b", ready=True, cursors={rank: 9}, blocks={rank: 40})
    joining = watch.ReplicaState(
        "http://c", ready=False, ready_detail="bootstrap", cursors={rank: 12}, blocks={rank: 40}
    )
    joining.bootstrap[rank] = "pending"
    lines = watch.frame([behind, ahead, joining], color=False)
    assert lines[2] == "C http://c  not ready (bootstrap)"
    cells = row(lines, rank)
    assert cells[0].split() == ["9", "-3", "40", "-", watch.MARK]  # 3 batches behind A
    assert cells[1].split() == ["12", "40", "-"]
    assert cells[2].split() == ["12", "40", "pending"]  # same cursor and blocks: no mark
    assert lines[-1] == "1 of 1 ranks differ between replicas (marked)"
    # Same cursor, other blocks: marked too.
    behind.cursors[rank], behind.blocks[rank] = 12, 39
    assert row(watch.frame([ahead, behind], color=False), rank)[1].endswith(watch.MARK)


def test_a_rank_registered_without_a_cursor_is_a_row_and_the_verdict_follows_the_marks() -> None:
    # B registered w2#dp0 and its bootstrap found no sibling's view: no batch yet, so no cursor
    # and no blocks, only its bootstrap state (`kvrouter view` lists the rank). A says nothing
    # of it: no replica holds anything of it, so they agree.
    held, cold = RankId("http://w1:8000", 0), RankId("http://w2:8000", 0)
    a = watch.ReplicaState("http://a", ready=True, cursors={held: 5}, blocks={held: 3})
    b = watch.ReplicaState("http://b", ready=True, cursors={held: 5}, blocks={held: 3})
    b.bootstrap = {held: "recovered", cold: "unseeded"}
    lines = watch.frame([a, b], color=False)
    assert [c.split() for c in row(lines, cold)] == [["-", "0", "-"], ["-", "0", "unseeded"]]
    assert lines[-1] == "the 2 replicas agree on cursors and blocks of 2 ranks"
    assert watch.verdict([a, b]) == 0
    # Its first batch reaches B: A lacks what B holds.
    b.cursors[cold], b.blocks[cold] = 0, 2
    lines = watch.frame([a, b], color=False)
    assert row(lines, cold)[0].split() == ["absent", watch.MARK]
    assert lines[-1] == "1 of 2 ranks differ between replicas (marked)"
    assert watch.verdict([a, b]) == 1
    assert watch.verdict([a, watch.ReplicaState("http://c", error="refused")]) == 2


def test_a_rank_that_ran_cold_with_no_batch_yet_is_cold_not_absent() -> None:
    """A replica whose bootstrap of an idle rank ran cold holds nothing of it: it misses what
    the warm replica holds, which is `cold`, not a rank it lacks (`absent`)."""
    rank = RankId("http://w1:8000", 0)
    a = watch.ReplicaState("http://a", ready=True, cursors={rank: 5}, blocks={rank: 3})
    b = watch.ReplicaState("http://b", ready=True)
    b.bootstrap, b.cold = {rank: "unseeded"}, {rank}
    cells = row(watch.frame([a, b], color=False), rank)
    assert cells[1].split() == ["-", "0", "unseeded", f"cold{watch.MARK}"]


async def test_a_rank_registered_with_no_batch_yet_is_a_row_on_a_replica_without_bootstrap() -> (
    None
):
    # No cursor, no blocks and (no bootstrap) no bootstrap state: the watch named it nowhere
    # and drew "no ranks yet", while `kvrouter view` listed it from the export.
    async with (
        fake_worker_in_process(dp_size=2) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        ranks = [RankId(fw.url, 0), RankId(fw.url, 1)]
        assert rt.replica.bootstrap is None
        await eventually(lambda: rt.replica.pump.rules.live >= set(ranks), 10)
        async with watching([rt]) as frame_where:
            lines = await frame_where(lambda f: any(line.startswith(str(ranks[0])) for line in f))
        for rank in ranks:
            assert row(lines, rank)[0].split() == ["-", "0", "-"]  # no cursor, 0 blocks
        assert watch.verdict([await watch_state(rt.url, TEST_TOKEN)]) == 0
        (one_shot,) = await view.collect([rt.url], token=TEST_TOKEN)
        assert one_shot.ranks == set(ranks) and not one_shot.cursors  # what view lists
        assert rt.replica.pump.rules.cursors == {}  # still no batch: the premise held


async def test_a_failed_bootstrap_is_unseeded_and_only_a_rank_held_cold_is_marked_cold() -> None:
    # Its only sibling down, the replica's bootstrap gives up (gauge 2), yet it reads the
    # rank's stream from seq 0: its view is whole, not README's "cold" (which the watch said).
    async with (
        fake_worker_in_process() as fw,
        router_in_process(
            workers=[fw.url], peer=["http://127.0.0.1:9"], kv_bootstrap_timeout_ms=500
        ) as rt,
        watching([rt]) as frame_where,
    ):
        rank = RankId(fw.url, 0)
        seq = await fw.store([list(range(1000, 1032))])
        lines = await frame_where(
            lambda f: row(f, rank)[0].split()[:3] == [str(seq), "2", "unseeded"]
        )
        assert row(lines, rank)[0].split() == [str(seq), "2", "unseeded"]  # not cold
        assert rt.replica.pump.rules.cold == set()  # the premise: a whole view
        rt.replica.pump.rules.cold.add(rank)  # as a lost batch leaves it until a re-pull
        lines = await frame_where(lambda f: "cold" in row(f, rank)[0])
        assert row(lines, rank)[0].split() == [str(seq), "2", "unseeded", "cold"]


async def test_an_unreachable_replica_is_shown_as_an_error_and_the_others_still_drawn() -> None:
    async with fleet() as ([a, _], [w1, _]):
        states = await asyncio.gather(
            *(
                watch_state(url)
                for url in (a.url, "http://127.0.0.1:9")  # port 9: discard, nobody listens
            )
        )
        lines = watch.frame(states, color=True)
        assert lines[1].startswith("B http://127.0.0.1:9  error: ")
        assert row(lines, RankId(w1.url, 0))[1] == "error"
        # Color: a differing cell is reverse video, not a star.
        lacking = watch.ReplicaState("http://x", ready=True)
        colored = watch.frame([states[0], lacking], color=True)
        cell = row(colored, RankId(w1.url, 0))[1]
        assert cell.startswith(f"{watch.HIGHLIGHT[0]}absent ") and cell.endswith(watch.HIGHLIGHT[1])


async def test_a_replica_that_does_not_answer_or_sends_no_metrics_is_named_with_the_url() -> None:
    # Was "/readyz: TimeoutError: " (a timeout's message is empty) and a bare "ValueError:
    # Invalid labels" that did not say the body came from /metrics.
    async def hang(request: web.Request) -> web.Response:
        await asyncio.Event().wait()  # cancelled when the client gives up
        raise AssertionError("unreachable")

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text="kvrouter_tree_nodes{oops 1\n")

    async with (
        stub_server({("GET", "/readyz"): hang}) as silent,
        stub_server({("GET", "/readyz"): ready, ("GET", "/metrics"): garbage}) as bad,
        aiohttp.ClientSession() as session,
        SnapshotFetcher(per_fetch_s=0.2) as fetcher,
    ):
        state = await watch.fetch_state(fetcher, session, silent, 0.2)
        assert state.error == f"{silent}/readyz: no answer within 0.2 s"
        (one_shot,) = await view.collect([silent], timeout_s=0.2)
        assert one_shot.error == state.error
        state = await watch.fetch_state(fetcher, session, bad, 0.2)
        assert state.error is not None
        assert state.error.startswith(f"{bad}/metrics: the body does not parse: "), state.error


async def watch_state(url: str, token: str | None = None) -> watch.ReplicaState:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        SnapshotFetcher(token=token, per_fetch_s=2.0) as fetcher,
        aiohttp.ClientSession(headers=headers) as session,
    ):
        return await watch.fetch_state(fetcher, session, url, 2.0)


async def test_the_command_draws_count_frames_and_exits() -> None:
    async with fleet() as ([a, b], [w1, _]):
        status, out, err = await run_view(
            "--watch", "--count", "2", "--interval-s", "0.05", a.url, b.url
        )
        assert status == 0, out + err
        frames = [f for f in out.split("\n\n") if f.strip()]
        assert len(frames) == 2, out
        assert all(f.startswith("kvrouter view --watch: every 0.05 s") for f in frames)
        assert all(str(RankId(w1.url, 0)) in f for f in frames)
        status, _, err = await run_view("--watch", "--interval-s", "0", a.url)
        assert status == 2 and "--interval-s must be > 0" in err


async def test_the_command_exits_as_view_does_after_count_frames_1_when_they_differ() -> None:
    async with fleet(b_workers=1) as ([a, b], _):
        status, out, err = await run_view("--watch", "--count", "1", a.url, b.url)
        assert "2 of 3 ranks differ" in out, out + err
        assert status == 1, out + err
        assert (await run_view(a.url, b.url))[0] == 1  # plain `view`: the same verdict
        status, out, err = await run_view("--watch", "--count", "1", a.url, "http://127.0.0.1:9")
        assert status == 2 and "B http://127.0.0.1:9  error: " in out, out + err


async def test_the_command_waits_for_a_replica_as_long_as_timeout_s_says() -> None:
    """`--watch --timeout-s 30` gave up on a replica after 1 s (the interval or 1 s bounded
    it, silently): a replica answering in 2 s was reported as no answer within 1 s."""

    async def hang(request: web.Request) -> web.Response:
        await asyncio.Event().wait()  # cancelled when the client gives up
        raise AssertionError("unreachable")

    async with stub_server({("GET", "/readyz"): hang}) as silent:
        watched = ("--watch", "--count", "1", "--interval-s", "0.05")
        _, out, err = await run_view(*watched, "--timeout-s", "2.5", silent)
        assert f"{silent}/readyz: no answer within 2.5 s" in out, out + err
        _, out, err = await run_view(*watched, silent)  # the default: the interval or 1 s
        assert f"{silent}/readyz: no answer within 1 s" in out, out + err


async def test_a_wrong_token_is_an_error_that_says_to_pass_one() -> None:
    async with fleet() as ([a, _], _):
        state = await watch_state(a.url)  # no token
        assert state.error is not None and "HTTP 401" in state.error, state.error
        assert "pass --token" in state.error
        line = watch.frame([state], color=False)[0]
        assert line.startswith(f"A {a.url}  error: cursor table: HTTP 401") and "--token" in line


async def test_a_watch_whose_reader_leaves_ends_quietly() -> None:
    """`kvrouter view --watch URL | head -2` ended with a BrokenPipeError traceback."""
    async with fleet() as ([a, _], _):
        proc = await asyncio.create_subprocess_exec(
            *kvrouter_argv("view", "--watch", "--interval-s", "0.05", a.url),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, TOKEN_ENV: TEST_TOKEN},
        )
        assert proc.stdout is not None and proc.stderr is not None
        async with asyncio.timeout(30):
            assert (await proc.stdout.readline()).startswith(b"kvrouter view --watch")
            proc.stdout._transport.close()  # type: ignore[attr-defined]  # the reader leaves
            err = await proc.stderr.read()
            status = await proc.wait()
        assert status == 0 and b"Traceback" not in err, err.decode()
