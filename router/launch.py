"""The `kvrouter` command's entry point: SIGTERM and SIGINT are caught before the command is
imported.

Python's imports of the command and the parsing of its flags take ~0.3 s (a tokenizer may
take seconds more); a SIGTERM in that window would end the process with the default action,
status 143, where a replica that has begun must drain and exit 0 (Kubernetes sends SIGTERM
whenever a pod goes, the moment it starts included). So this module, which imports nothing
of the router, holds both signals first (`hold`: each one that arrives is remembered), then
imports and runs the command. `kvrouter serve` takes them over from its event loop and
treats one held meanwhile as sent then (`router.cli.serve`); every other command gives them
back their default actions before it runs (`release`), acting on one held meanwhile as the
default would have. What remains unguarded is the interpreter's own start, before this
module runs (~20 ms).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from types import FrameType
from typing import Final

HELD: Final = (signal.SIGTERM, signal.SIGINT)
_arrived: list[int] = []  # the held signals that arrived, in order


def _remember(signum: int, frame: FrameType | None) -> None:
    _arrived.append(signum)


def hold() -> None:
    """Catch SIGTERM and SIGINT from now on, remembering them (`arrived`)."""
    for sig in HELD:
        signal.signal(sig, _remember)


def arrived() -> list[int]:
    """The held signals that arrived since `hold`, in order (empty when nothing held them)."""
    return list(_arrived)


def release() -> None:
    """The default actions back (SIGINT raises KeyboardInterrupt, SIGTERM ends the process),
    and each signal that arrived while held sent again, to act as it would have."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pending, _arrived[:] = list(_arrived), []
    for sig in pending:
        os.kill(os.getpid(), sig)


def main(argv: Sequence[str] | None = None) -> None:
    hold()
    from router.cli import main as command  # the ~0.3 s the signals are held for

    command(argv)


if __name__ == "__main__":  # `python -m router.launch`: run as the module `router.cli` reads
    from router.launch import main as entry

    entry()
