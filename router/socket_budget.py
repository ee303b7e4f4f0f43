"""How many worker ranks one replica can subscribe to, and the limits raised at start for it.

Every rank costs a TCP connection for good (its live stream, read by the event loop:
`router.zmtp`) and a ZMQ DEALER socket while a gap is replayed, which holds a mailbox
descriptor and a TCP connection. Two limits bound that: the ZMQ context's socket count
(`zmq.MAX_SOCKETS`, 1,023 by default) and the process's open files (`RLIMIT_NOFILE`, often a
soft 1,024). Past either, `socket()` fails with "Too many open files": before this module, the
subscribers past the limit died without a word and the health loop died with them at the next
eviction (issue 13, row 1).

So at start the soft open-file limit is raised to the hard one (capped: some libraries walk
every descriptor number up to the limit), the context's socket limit is set to what that
many descriptors can serve, and the number of ranks that fits is the registry's bound: a
worker whose ranks would pass it is refused (listed `refused`, counted with reason
`socket_limit`) instead of half-subscribed. A share of the descriptors is kept for what
else the process opens: client and worker connections, files, the event loop. The worker
connections of the replica's own polling stay within it by bounds of their own rather than a
count here (they come and go with each check): at most `--max-workers` workers are
registered (`router.workers`), a ready one's health and load polls keep a keep-alive
connection each, down workers are checked 16 at a time, and a poll that times out closes its
connection.

`plan` is the arithmetic (pure); `apply` reads and sets the real limits.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Final

import zmq

log = logging.getLogger(__name__)

SOCKETS_PER_RANK: Final = 1  # the DEALER during a replay
FDS_PER_RANK: Final = 3  # the live stream; the DEALER's mailbox and TCP connection
NOFILE_CAP: Final = 1 << 20  # never raise the soft limit past this
RESERVED_FDS_MAX: Final = 4096  # kept for connections, files and the loop
CONTEXT_SOCKETS_MIN: Final = 16  # what a context must allow whatever the budget


@dataclass(frozen=True, slots=True)
class SocketBudget:
    nofile: int  # the soft RLIMIT_NOFILE in force
    max_sockets: int  # the ZMQ context's MAX_SOCKETS
    max_ranks: int  # ranks this replica may subscribe to

    def describe(self) -> str:
        return (
            f"{self.max_ranks} worker rank(s) (open files {self.nofile}, "
            f"ZMQ sockets {self.max_sockets})"
        )


def reserved_fds(nofile: int) -> int:
    return min(RESERVED_FDS_MAX, nofile // 2)


def plan(soft: int, hard: int, socket_limit: int) -> tuple[int, SocketBudget]:
    """(the soft limit to set, the budget it gives). `hard` may be RLIM_INFINITY (-1);
    `socket_limit` is the most libzmq allows (`zmq.SOCKET_LIMIT`)."""
    ceiling = NOFILE_CAP if hard < 0 else min(hard, NOFILE_CAP)
    nofile = max(soft, ceiling)
    by_fds = max(0, (nofile - reserved_fds(nofile)) // FDS_PER_RANK)
    by_sockets = max(0, (socket_limit - CONTEXT_SOCKETS_MIN) // SOCKETS_PER_RANK)
    max_ranks = min(by_fds, by_sockets)
    max_sockets = min(socket_limit, max_ranks * SOCKETS_PER_RANK + CONTEXT_SOCKETS_MIN)
    return nofile, SocketBudget(nofile, max_sockets, max_ranks)


def apply(context: zmq.Context) -> SocketBudget:
    """Raise the soft open-file limit and the context's socket limit; call before the
    context opens its first socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile, budget = plan(soft, hard, context.get(zmq.SOCKET_LIMIT))
    if nofile != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, nofile, exc)
            _, budget = plan(soft, soft, context.get(zmq.SOCKET_LIMIT))
    context.set(zmq.MAX_SOCKETS, budget.max_sockets)
    # Debug: this runs before the listen, whose failure must stay the only line on stderr.
    log.debug("socket budget: %s", budget.describe())
    return budget
