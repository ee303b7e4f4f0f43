"""`kvrouter view` against in-process replicas fed by in-process fake workers, over real HTTP.

The command itself runs as a subprocess (its exit status is the contract); the replicas and
workers run in the test's loop, which keeps serving while the subprocess asks them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from cachetree.ranks import RankId
from router.auth import TOKEN_ENV
from router.replica import ServeConfig, snapshot_body_bound
from router.tokenize import BytesTokenizer
from router.tools import view
from tests.support.adversary import stub_server
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.processes import kvrouter_argv, run_to_end
from tests.support.router import TEST_TOKEN, RouterHandle, router_in_process

TOK = BytesTokenizer()
SYSTEM = "You are a careful assistant who answers in full sentences. " * 3  # 11 blocks
FIRST = SYSTEM + "First question, and a follow-up of some length."  # 14 blocks
OTHER = "Another conversation on rank one of the second worker."  # 3 blocks


async def run_view(
    *args: str, token: str = TEST_TOKEN, within_s: float = 30.0
) -> tuple[int, str, str]:
    """`kvrouter view ARGS` with `token` in KVROUTER_INTERNAL_TOKEN ("": none)."""
    env = {TOKEN_ENV: token} if token else {}
    status, out, err = await run_to_end(kvrouter_argv("view", *args), env=env, within_s=within_s)
    assert status is not None, f"kvrouter view still running after {within_s} s\n{err}"
    return status, out, err


async def gate_all(replicas: Sequence[RouterHandle], workers: Sequence[FakeWorkerHandle]) -> None:
    """Every replica's subscription to every rank it knows is live."""
    for rt in replicas:
        known = {w["url"] for w in (await rt.get("/workers"))[1]["workers"]}
        for fw in workers:
            if fw.url in known:
                for dp_rank in range(fw.config.dp_size):
                    await rt.gate(fw, dp_rank)


async def quiesce(replicas: Sequence[RouterHandle], workers: Sequence[FakeWorkerHandle]) -> None:
    """Every replica's cursor reached each rank's last seq, where it knows the worker."""
    for fw in workers:
        for dp_rank in range(fw.config.dp_size):
            last = (await fw.state(dp_rank))["last_seq"]
            for rt in replicas:
                if await rt.rank_view(fw.url, dp_rank) is not None:
                    await rt.wait_cursor(fw.url, dp_rank, last)


@contextlib.asynccontextmanager
async def fleet(
    *, b_workers: int = 2, **router_kw: Any
) -> AsyncIterator[tuple[list[RouterHandle], list[FakeWorkerHandle]]]:
    """Workers w1 (one rank) and w2 (two ranks); replica A knows both, B the first `b_workers`.

    Both hold the system prompt and a conversation on w1, and one chain on each of w2's ranks.
    """
    async with (
        fake_worker_in_process() as w1,
        fake_worker_in_process(dp_size=2) as w2,
        router_in_process(workers=[w1.url, w2.url], **router_kw) as a,
        router_in_process(workers=[w1.url, w2.url][:b_workers], **router_kw) as b,
    ):
        workers, replicas = [w1, w2], [a, b]
        await gate_all(replicas, workers)
        await w1.store([TOK.encode(FIRST)])
        await w2.store([TOK.encode(SYSTEM)], dp_rank=0)
        await w2.store([TOK.encode(OTHER)], 1)
        await quiesce(replicas, workers)
        yield replicas, workers


async def test_replicas_that_applied_the_same_stream_agree() -> None:
    async with fleet() as ([a, b], [w1, w2]):
        views = await view.collect([a.url, b.url], token=TEST_TOKEN)
        comparison = view.compare(views)
        assert comparison.agree and view.exit_status(views, comparison) == 0
        assert all(v.ready for v in views)
        rank = RankId(w1.url, 0)
        assert views[0].cursors[rank] == (await w1.state(0))["last_seq"]
        # The conversation's blocks and the live gate's probe block.
        assert views[0].blocks(rank) == len(TOK.encode(FIRST)) // 16 + 1
        # Nodes: the conversation (its first 11 shared with w2#dp0), the probe block (shared
        # by every rank), and the other conversation.
        nodes = len(TOK.encode(FIRST)) // 16 + 1 + len(TOK.encode(OTHER)) // 16
        assert views[0].canonical == views[1].canonical
        assert len(views[0].canonical or ()) == views[0].nodes == nodes

        status, out, err = await run_view(a.url, b.url)
        assert status == 0, out + err
        for fw in (w1, w2):
            for dp_rank in range(fw.config.dp_size):
                seq = (await fw.state(dp_rank))["last_seq"]
                # Each rank is listed per replica with its cursor.
                rows = [
                    line.split() for line in out.splitlines() if f"{fw.url}#dp{dp_rank}" in line
                ]
                assert len(rows) == 2, out
                assert all(row[1] == str(seq) for row in rows), out
        assert f"replica {a.url}: ready" in out and f"replica {b.url}: ready" in out
        assert "views: agree (2 replicas" in out


async def test_a_replica_not_subscribed_to_a_worker_differs_on_its_ranks() -> None:
    async with fleet(b_workers=1) as ([a, b], [_, w2]):
        status, out, err = await run_view(a.url, b.url)
        assert status == 1, out + err
        assert "views: differ" in out
        differing = [line for line in out.splitlines() if line.strip().startswith("rank http")]
        assert len(differing) == 2, out  # both ranks of w2, nothing of w1
        assert all(f"{w2.url}#dp" in line for line in differing), out
        # w2#dp0 holds the system prompt and the gate's probe block, all only in A.
        blocks = len(TOK.encode(SYSTEM)) // 16 + 1
        assert any(
            f"{w2.url}#dp0: 0 block(s) only in {b.url}, {blocks} only in {a.url}" in line
            for line in differing
        ), out


async def test_blocks_stored_into_one_replica_only_are_named_with_their_rank() -> None:
    async with fleet() as ([a, b], [_, w2]):
        extra = TOK.encode(SYSTEM + "A turn that only replica B believes is cached somewhere.")
        extra = extra[: len(extra) // 16 * 16]  # whole blocks, as an engine announces them
        rank = next(r for r in b.replica.pump.rules.tree.ranks() if r == RankId(w2.url, 0))

        def plant(rules: Any) -> int:
            # Engine hashes the real stream would never use: chained below nothing.
            n = len(extra) // 16
            return rules.tree.store(rank, None, list(range(1 << 40, (1 << 40) + n)), extra, 16)

        planted = await b.replica.pump.call(plant)
        assert planted > 0
        views = await view.collect([a.url, b.url], token=TEST_TOKEN)
        comparison = view.compare(views)
        assert not comparison.agree and view.exit_status(views, comparison) == 1
        [diff] = comparison.diffs
        [rank_diff] = diff.ranks
        assert rank_diff.rank == rank
        # The system prompt's blocks now carry other engine hashes on B; the rest are new.
        system_blocks = len(TOK.encode(SYSTEM)) // 16
        assert len(rank_diff.changed) == system_blocks
        assert len(rank_diff.only_other) == planted - system_blocks
        assert rank_diff.only_ref == []

        status, out, _ = await run_view(a.url, b.url)
        assert status == 1
        assert f"rank {rank}: {planted - system_blocks} block(s) only in {b.url}" in out, out


async def test_cursors_only_compares_cursor_tables() -> None:
    async with fleet() as ([a, b], _):
        views = await view.collect([a.url, b.url], token=TEST_TOKEN, cursors_only=True)
        assert all(v.snapshot is None and v.tree is None for v in views)
        comparison = view.compare(views, cursors_only=True)
        assert comparison.agree
        status, out, err = await run_view("--cursors-only", a.url, b.url)
        assert status == 0, out + err
        assert "cursor tables: agree (2 replicas, 3 ranks)" in out


async def test_replicas_that_learned_different_adapter_names_differ_naming_them() -> None:
    """Holding the same blocks, B keys a request naming "sql" in the adapter's namespace and
    A as the base model's (A's sibling sent a body without `adapters`, say): `view` said they
    agree."""
    async with fleet() as ([a, b], _):
        await b.replica.pump.call(lambda rules: rules.learn_adapters(["sql", "chat"]))
        await a.replica.pump.call(lambda rules: rules.learn_adapters(["chat"]))
        views = await view.collect([a.url, b.url], token=TEST_TOKEN)
        comparison = view.compare(views)
        assert not comparison.agree and view.exit_status(views, comparison) == 1
        assert [d.ranks for d in comparison.diffs] == [[]]  # the blocks are the same
        line = f"    adapter names differ: only in {b.url}: 'sql'"
        for args in ((), ("--cursors-only",)):
            status, out, err = await run_view(*args, a.url, b.url)
            assert status == 1, out + err
            assert line in out.splitlines(), out
        status, out, err = await run_view("--watch", "--count", "1", a.url, b.url)
        assert status == 1, out + err
        assert "adapter names differ, B vs A: only in B: 'sql'" in out, out


async def test_the_bearer_token_is_sent_and_required() -> None:
    async with (
        fake_worker_in_process() as w1,
        router_in_process(workers=[w1.url], internal_token="s3cret") as a,
        router_in_process(workers=[w1.url], internal_token="s3cret") as b,
    ):
        status, out, _ = await run_view(a.url, b.url, token="")
        assert status == 2 and "HTTP 401" in out and f"set {TOKEN_ENV}" in out, out
        status, out, _ = await run_view(a.url, b.url, token="wrong")
        assert status == 2 and "HTTP 401" in out, out
        status, out, err = await run_view("--token", "s3cret", a.url, b.url, token="")
        assert status == 0, out + err
        status, out, err = await run_view(a.url, b.url, token="s3cret")  # from the environment
        assert status == 0, out + err


async def test_an_unreachable_replica_is_an_error() -> None:
    async with fleet() as ([a, _b], _):
        status, out, _ = await run_view(a.url, "http://127.0.0.1:9")
        assert status == 2
        assert "replica http://127.0.0.1:9: readiness unknown" in out
        assert "error: http://127.0.0.1:9/readyz: " in out


async def test_a_timeout_or_interval_that_is_not_a_finite_positive_number_is_refused() -> None:
    """`--timeout-s nan` waited forever on a silent server, `inf` ended in aiohttp's
    OverflowError traceback, and `--watch --interval-s nan` redrew thousands of frames a
    second: each is one error line and exit 2 now, before any request."""
    for args in (
        ("--timeout-s", "nan"),
        ("--timeout-s", "inf"),
        ("--watch", "--interval-s", "nan"),
        ("--watch", "--interval-s", "inf"),
    ):
        status, _, err = await run_to_end(
            kvrouter_argv("view", *args, "http://127.0.0.1:9"), within_s=30
        )
        assert status == 2, (args, err)
        assert err.startswith("kvrouter: error: --") and "Traceback" not in err, (args, err)


async def test_count_without_watch_is_refused_before_any_request() -> None:
    # It was ignored: one report, as if --count had not been given.
    asked: list[str] = []

    async def count(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({})

    async with stub_server({("GET", "/{tail:.*}"): count}) as url:
        status, out, err = await run_view("--count", "3", url)
    assert status == 2 and out == ""
    assert err == "kvrouter: error: --count counts --watch frames: add --watch\n"
    assert asked == []


async def test_a_replica_whose_cursor_table_does_not_decode_is_an_error_on_its_own_line() -> None:
    """It crashed `view` (AttributeError, exit 1: "views differ") and lost the healthy
    replica's report with it."""

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * 20, content_type="application/msgpack")

    async with (
        fleet() as ([a, _b], _),
        stub_server({("GET", "/{tail:.*}"): garbage}) as bad,
    ):
        status, out, err = await run_view(a.url, bad)
        assert status == 2, out + err
        assert "Traceback" not in err, err
        assert f"replica {a.url}: ready, block size 16" in out, out
        lines = out.splitlines()
        at = lines.index(next(line for line in lines if line.startswith(f"replica {bad}")))
        assert lines[at + 1].startswith("  error: cursor table:"), out
        assert "--token" not in lines[at + 1]  # not a token problem


async def test_an_export_over_the_bound_names_the_flag_that_raises_it() -> None:
    """At the fetcher's 24 MiB default (12 MiB for msgpack) `view` refused any replica past
    ~550k blocks; the bound is now a flag, by default what a replica accepts of a sibling."""
    async with fleet() as ([a, _b], _), aiohttp.ClientSession() as session:

        async def relay_or_oversize(request: web.Request) -> web.Response:
            if request.path == "/internal/kv_snapshot" and "cursors_only" not in request.query:
                filler = bytes(range(256)) * (6 << 10)  # 1.5 MiB
                return web.Response(body=filler, content_type="application/msgpack")
            headers = {"Authorization": f"Bearer {TEST_TOKEN}"}
            async with session.get(a.url + request.path_qs, headers=headers) as resp:
                return web.Response(
                    status=resp.status, body=await resp.read(), content_type=resp.content_type
                )

        async with stub_server({("GET", "/{tail:.*}"): relay_or_oversize}) as big:
            status, out, err = await run_view("--max-body-mb", "1", big)
            assert status == 2, out + err
            assert "bound (raise --max-body-mb)" in out, out
            # Raised, the body is read (and found not to be a snapshot: a filler).
            status, out, err = await run_view("--max-body-mb", "4", big)
            assert status == 2, out + err
            assert "error: snapshot:" in out and "bound" not in out, out


def test_the_default_bound_reads_whatever_index_a_default_replica_may_hold() -> None:
    accepted = snapshot_body_bound(ServeConfig())
    assert accepted <= view.DEFAULT_MAX_BODY_MB << 20 < accepted + (1 << 20)
