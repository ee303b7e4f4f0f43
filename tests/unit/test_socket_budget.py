"""`router.socket_budget.plan`: how many ranks a replica subscribes to under given limits."""

from __future__ import annotations

import pytest

from router.socket_budget import FDS_PER_RANK, NOFILE_CAP, SOCKETS_PER_RANK, plan

ZMQ_LIMIT = 65535  # libzmq's SOCKET_LIMIT with epoll


@pytest.mark.parametrize(
    "soft,hard,nofile,max_ranks",
    [
        (1024, 1024, 1024, 170),  # nothing to raise: half the descriptors are kept back
        (1024, 65536, 65536, 20480),  # the soft limit is raised to the hard one
        (1024, -1, NOFILE_CAP, (ZMQ_LIMIT - 16) // SOCKETS_PER_RANK),  # ZMQ's limit binds
        (256, 256, 256, 42),
        (16, 16, 16, 2),
        (2, 2, 2, 0),  # nothing fits: every worker is refused, none half-subscribed
        (4096, 2048, 4096, 682),  # a soft limit above the hard one is never lowered
    ],
)
def test_the_plan(soft: int, hard: int, nofile: int, max_ranks: int) -> None:
    got_nofile, budget = plan(soft, hard, ZMQ_LIMIT)
    assert (got_nofile, budget.nofile, budget.max_ranks) == (nofile, nofile, max_ranks)
    # the ranks' descriptors fit beside the reserve, their sockets in the context's limit
    assert budget.max_ranks * FDS_PER_RANK <= nofile - min(4096, nofile // 2)
    assert budget.max_ranks * SOCKETS_PER_RANK < budget.max_sockets <= ZMQ_LIMIT
