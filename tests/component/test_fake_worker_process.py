"""`fake-kv-worker` as a real process: port 0, discovery, and a clean SIGTERM shutdown."""

from __future__ import annotations

import signal

import pytest

from tests.support.cluster import Cluster
from tests.support.fake_worker import cli_args, wait_healthy, worker_config
from tests.support.kv_stream import KvTap, replay
from tests.support.processes import fake_worker_argv, run_to_end

pytestmark = pytest.mark.timeout(30)


async def test_the_process_serves_publishes_and_ends_its_stream_on_sigterm(
    cluster: Cluster,
) -> None:
    fw = await cluster.worker("w", replay=True, wire="sglang", dp_size=2)
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
        assert fw.child is not None
        fw.child.send(signal.SIGTERM)
        end = await tap.recv()
        assert (end.is_end, end.payload) == (True, b"")
        assert await fw.child.wait_exit(10) == 0


async def test_a_taken_kv_port_makes_the_process_exit_with_an_error(cluster: Cluster) -> None:
    fw = await cluster.worker("w")
    clash = worker_config(kv_port_base=fw.config.kv_port_base)
    done = await run_to_end(fake_worker_argv(*cli_args(clash)), within_s=15)
    assert done.status == 1
    assert "cannot start" in done.stderr
