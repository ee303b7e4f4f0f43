"""A fleet of real processes on loopback: `fake-kv-worker`s and `kvrouter serve` replicas.

    async def test_something(cluster: Cluster) -> None:   # the fixture in tests/conftest.py
        w = await cluster.worker("w1", dp_size=2)
        a = await cluster.router("a", workers=[w])
        await a.wait_ready()
        await gate_fleet([a], [w])
        await w.store([chain])
        await quiesce([a], [w])

Every process is started through `Processes` (a process group of its own, output to a file
under the test's tmp_path, stopped when the test ends however it ends; a failed test's report
carries each child's command line and the end of its output). Nothing here sleeps to
synchronize: a worker is up when it prints its ready line, a replica when it prints its own
and then answers `/readyz` 200; a replica has applied a batch when its `/workers` cursor for
the rank reached the batch's seq.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import aiohttp

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from fake_kv_worker.__main__ import READY_LINE_PREFIX as WORKER_READY
from router.auth import TOKEN_ENV
from router.tokenize import BytesTokenizer
from router.tools import view
from tests.support.fake_worker import PROBE_TOKEN, FakeWorkerHandle, cli_args, worker_config
from tests.support.ports import free_tcp_port
from tests.support.processes import Child, Processes, fake_worker_argv, kvrouter_argv
from tests.support.router import TEST_TOKEN, RouterClient, gate_fleet, quiesce, ranks_of
from tests.support.waiting import eventually

ROUTER_READY: Final = "kvrouter listening on "
BLOCK_SIZE: Final = 16
TOKENIZER: Final = BytesTokenizer()  # what the workers and the replicas tokenize with
START_WITHIN_S: Final = 20.0  # a Python start-up on a busy 2-core machine, with room
READY_WITHIN_S: Final = 20.0

# What every fleet replica runs with unless a test says otherwise: health and load polled
# often (a dead worker is noticed in a fraction of a second), route headers on (tests count
# which worker served), and the fleet block size given, as a real deployment would.
FLEET_FLAGS: Final = (
    "--block-size",
    str(BLOCK_SIZE),
    "--health-interval-s",
    "0.2",
    "--load-interval-ms",
    "100",
    "--expose-route-headers",
    "true",
    "--drain-timeout-s",
    "10",
)


@dataclass
class RouterProcess(RouterClient):
    """A `kvrouter serve` process and a client for it."""

    child: Child = field(kw_only=True)

    async def wait_ready(self, within_s: float = READY_WITHIN_S) -> None:
        """Until `/readyz` answers 200 (bootstrap settled, a worker routable)."""

        async def ready() -> bool:
            if self.child.returncode is not None:
                raise AssertionError(
                    f"{self.child.name} exited with status {self.child.returncode} before it "
                    f"was ready:\n{self.child.tail()}"
                )
            try:
                status, _ = await self.readyz()
            except aiohttp.ClientConnectionError:
                return False
            return status == 200

        await eventually(ready, within_s, poll_s=0.02)


Peer = str | RouterClient


class Cluster:
    """Starts fleet processes for one test; `close` stops them all (the fixture calls it)."""

    def __init__(self, log_dir: Path) -> None:
        self.processes = Processes(log_dir)
        self.session = aiohttp.ClientSession()

    async def close(self) -> None:
        try:
            await self.processes.stop_all()
        finally:
            await self.session.close()

    async def worker(self, name: str, *, replay: bool = True, **overrides: Any) -> FakeWorkerHandle:
        """A `fake-kv-worker` process on free loopback ports; any `WorkerConfig` field.

        Replay is on by default: a replica that joins a stream late, or loses a batch, heals
        the gap from the worker's buffer, as against a vLLM with replay configured.
        """
        config = worker_config(replay=replay, **overrides)
        child = await self.processes.spawn(f"worker-{name}", fake_worker_argv(*cli_args(config)))
        url = await child.wait_line(WORKER_READY, START_WITHIN_S)
        port = int(url.rsplit(":", 1)[1])
        return FakeWorkerHandle(replace(config, port=port), url, self.session, child=child)

    async def router(
        self,
        name: str,
        *flags: str,
        workers: Sequence[FakeWorkerHandle | str] = (),
        peers: Sequence[Peer] = (),
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        fleet_flags: bool = True,
        wait_listening: bool = True,
        under: Sequence[str] = (),
    ) -> RouterProcess:
        """`kvrouter serve --host 127.0.0.1 --port PORT` with the fleet's flags, then `flags`.

        `port` None picks a free one; 0 passes no `--port` (the test sets it through `env`).
        The replica gets `TEST_TOKEN` through KVROUTER_INTERNAL_TOKEN unless `env` sets it
        (to "" for a replica without a token); the client sends the same.
        `fleet_flags=False` leaves out `FLEET_FLAGS` (a test of the command line itself).
        With `wait_listening` it returns once the ready line is printed; otherwise at once.
        `under` is a command to run it under (`prlimit --nofile=128:128`).
        """
        port = free_tcp_port() if port is None else port
        if not port and not wait_listening:
            raise ValueError("without --port, only its ready line tells where it listens")
        argv = ["serve", "--host", "127.0.0.1", *(["--port", str(port)] if port else [])]
        if fleet_flags:
            argv += FLEET_FLAGS
        for w in workers:
            argv += ["--worker", w if isinstance(w, str) else w.url]
        for p in peers:
            argv += ["--peer", p if isinstance(p, str) else p.url]
        argv += flags
        env = {TOKEN_ENV: TEST_TOKEN, **(env or {})}
        argv = [*under, *kvrouter_argv(*argv)]
        child = await self.processes.spawn(f"router-{name}", argv, env=env)
        url = f"http://127.0.0.1:{port}"
        if wait_listening:
            url = await child.wait_line(ROUTER_READY, START_WITHIN_S)
        return RouterProcess(url, self.session, child=child, token=env[TOKEN_ENV] or None)


async def wait_all_ready(replicas: Sequence[RouterProcess]) -> None:
    await asyncio.gather(*(r.wait_ready() for r in replicas))


async def agreed_view(replicas: Sequence[RouterClient]) -> view.ReplicaView:
    """The replicas' common view (the first one's), fetched and restored by `kvrouter view`'s
    own code, after asserting that every replica answered and all of them agree.

    Call it after `quiesce`, or views differ by the batches in flight.
    """
    got = await view.collect([r.url for r in replicas], token=TEST_TOKEN)
    errors = {v.url: v.error for v in got if v.error is not None}
    assert errors == {}, errors
    comparison = view.compare(got)
    assert comparison.agree, "\n".join(view.render(got, comparison))
    return got[0]


# -- what a fleet holds ---------------------------------------------------------------------


def whole_blocks(text: str) -> list[int]:
    """`text`'s tokens cut to whole blocks, as an engine announces them."""
    tokens = TOKENIZER.encode(text)
    return tokens[: len(tokens) // BLOCK_SIZE * BLOCK_SIZE]


PROBE_KEY: Final = block_keys([PROBE_TOKEN] * BLOCK_SIZE, BLOCK_SIZE)[0]


class Ledger:
    """Every block the test had the workers store, per rank: what each view must hold.

    Every rank starts with the probe block, since every test gates every rank before it
    stores anything (`gate_fleet`).
    """

    def __init__(self, workers: Sequence[FakeWorkerHandle]) -> None:
        self.keys: dict[RankId, set[int]] = {
            RankId(fw.url, dp_rank): {PROBE_KEY} for fw, dp_rank in ranks_of(workers)
        }

    async def store(self, fw: FakeWorkerHandle, dp_rank: int, *texts: str) -> list[list[int]]:
        """One BlockStored batch per text on that rank; returns the chains (token ids)."""
        chains = [whole_blocks(t) for t in texts]
        await fw.store(chains, dp_rank)
        for chain in chains:
            self.keys[RankId(fw.url, dp_rank)].update(block_keys(chain, BLOCK_SIZE))
        return chains

    def forget(self, fw: FakeWorkerHandle, dp_rank: int) -> None:
        """The rank's cache was emptied (a publisher restart): it holds nothing any more."""
        self.keys[RankId(fw.url, dp_rank)] = set()

    @property
    def nodes(self) -> int:
        return len(set().union(*self.keys.values()))

    def assert_held_by(self, got: view.ReplicaView) -> None:
        """The replica's view holds exactly the stored blocks on each rank, no more, no less."""
        assert got.canonical is not None
        held = {rank: set(keys) for rank, keys in view.rank_blocks(got.canonical).items()}
        expected = {rank: keys for rank, keys in self.keys.items() if keys}
        assert held == expected, {
            str(rank): (len(held.get(rank, ())), len(keys)) for rank, keys in expected.items()
        }
        assert got.nodes == self.nodes


@dataclass
class Fleet:
    workers: list[FakeWorkerHandle]
    replicas: list[RouterProcess]
    ledger: Ledger
    view: view.ReplicaView  # what every replica held once warm


SYSTEM_PROMPTS: Final = (
    "You are the booking assistant of a railway company. Answer in two sentences at most. ",
    "You review Python patches for a team that ships small web services every week. ",
)


async def warm_fleet(cluster: Cluster, size: int = 2) -> Fleet:
    """Workers w1 (one rank) and w2 (two ranks), and `size` replicas, all ready, gated, and
    holding the same conversations once quiesced (asserted: `Fleet.view` is their view).

    Conversations on different ranks share a system prompt, so nodes carry several ranks. These
    replicas list no peers: they subscribe before anything is published, so there is nothing
    to bootstrap and they are ready as soon as they listen (the live gate's probes, which
    re-announce the same block, are all a late subscription can miss).
    """
    w1, w2 = await asyncio.gather(cluster.worker("w1"), cluster.worker("w2", dp_size=2))
    workers = [w1, w2]
    replicas = await asyncio.gather(
        *(cluster.router(f"warm-{i}", workers=workers) for i in range(size))
    )
    await wait_all_ready(replicas)
    await gate_fleet(replicas, workers)
    ledger = Ledger(workers)
    railway, review = SYSTEM_PROMPTS
    await ledger.store(
        w1,
        0,
        railway + "Is there a night train from Vienna to Venice on Fridays?",
        railway + "Is there a night train from Vienna to Venice on Fridays? Yes, at 21:28. "
        "Can I take a bicycle on it, and what does that cost?",
    )
    await ledger.store(w2, 0, railway + "My train was cancelled; how do I claim a refund?")
    await ledger.store(w2, 1, review + "Please review this change to the retry loop.")
    await quiesce(replicas, workers)
    warm = await agreed_view(replicas)
    ledger.assert_held_by(warm)
    return Fleet(workers, list(replicas), ledger, warm)
