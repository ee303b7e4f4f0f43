"""`fake-kv-worker` as a real process: port 0, discovery, and a clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from tests.support.fake_worker import cli_args, fake_worker_subprocess, wait_healthy, worker_config
from tests.support.kv_stream import KvTap, replay

pytestmark = pytest.mark.timeout(30)


async def test_the_process_serves_publishes_and_ends_its_stream_on_sigterm() -> None:
    async with fake_worker_subprocess(replay=True, wire="sglang", dp_size=2) as fw:
        assert fw.config.port != 0  # learned from the ready line
        await wait_healthy(fw)
        info = await fw.get("/server_info")
        assert info["kv_events"]["endpoint_port_base"] == fw.config.kv_port_base
        assert info["kv_events"]["dp_size"] == 2
        async with KvTap(fw.kv_endpoint(1)) as tap:
            gate = await tap.gate(fw.probe_for(1))
            seq = await fw.store([list(range(1, 33))], dp_rank=1)
            frame = (await tap.recv_through(seq))[-1]
            assert frame.batch()[1][0]["block_hashes"] == [
                8635429971592222890,
                1256577331724852459,
            ]
            assert (await replay(fw.replay_endpoint(1), gate)).seqs == [gate, seq]
            assert fw.process is not None
            fw.process.send_signal(signal.SIGTERM)
            end = await tap.recv()
            assert (end.is_end, end.payload) == (True, b"")
            assert await asyncio.wait_for(fw.process.wait(), 10) == 0


async def test_a_taken_kv_port_makes_the_process_exit_with_an_error() -> None:
    async with fake_worker_subprocess() as fw:
        clash = worker_config(kv_port_base=fw.config.kv_port_base)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fake_kv_worker",
            *cli_args(clash),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 15)
        assert proc.returncode == 1
        assert b"cannot start" in err
