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


async def test_a_taken_http_port_is_named_in_the_error(cluster: Cluster) -> None:
    # It said only "[Errno 98] Address already in use", naming neither port nor which one.
    fw = await cluster.worker("w")
    clash = worker_config(port=fw.config.port)
    done = await run_to_end(fake_worker_argv(*cli_args(clash)), within_s=15)
    assert done.status == 1
    assert f"HTTP port 127.0.0.1:{fw.config.port}: Address already in use" in done.stderr
    await wait_healthy(fw)  # the first worker is untouched


async def test_a_kv_port_base_whose_last_rank_is_past_65535_names_that_rank_and_port() -> None:
    # It said "kv_port_base 65535 must be an explicit port 1..65535", which 65535 is.
    done = await run_to_end(
        fake_worker_argv("--port", "0", "--kv-port-base", "65535", "--dp-size", "2"), within_s=15
    )
    assert done.status == 2
    assert "kv_port_base 65535 puts rank 1 of dp_size 2 on port 65536, past 65535" in done.stderr
