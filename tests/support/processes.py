"""Real child processes for tests: each in its own process group, its output in a file, and
every one stopped when the test ends, however it ends.

    procs = Processes(tmp_path)                 # or the `cluster` fixture, which owns one
    child = await procs.spawn("router-a", [sys.executable, "-m", "router.launch", "serve", ...])
    url = await child.wait_line("kvrouter listening on ", within_s=15)
    await child.kill()                          # SIGKILL, the whole group
    ...
    await procs.stop_all()                      # SIGTERM, then SIGKILL whatever is left

Why each piece:
- A session (process group) of its own: a SIGKILL reaches the child and anything it started,
  and a Ctrl-C in the terminal reaches pytest only, which then stops its children itself.
- PR_SET_PDEATHSIG (Linux): if pytest dies (SIGKILL, a thread-method timeout's `os._exit`),
  the children get SIGTERM instead of living on and holding ports. `atexit` SIGKILLs any
  group still alive when the interpreter exits normally without `stop_all` having run.
- stdout and stderr go to one file, never a pipe: nobody has to read a pipe to keep the
  child from blocking on it, and the file outlives the test for the failure report
  (`Processes.report`, which `tests/conftest.py` attaches to a failed test).
- Readiness is the child's own ready line, polled from that file with a bound; the process
  exiting first is reported with the end of its output.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from router.tools.demo import pdeathsig_preexec

REPO: Final = Path(__file__).resolve().parents[2]
POLL_S: Final = 0.01
TAIL_LINES: Final = 40
_TCP_ESTABLISHED: Final = "01"  # the `st` column of /proc/net/tcp

# Every child started here, by pid, until it is reaped.
_children: dict[int, asyncio.subprocess.Process] = {}


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the child's process group, only while the child is not reaped.

    Once reaped, its pid (the group id) may belong to someone else's process.
    """
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_children.values()):
        _kill_group(proc)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any KVROUTER_ variable, plus `extra`.

    A variable in the developer's shell (a token, a policy) must not change what a test runs.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env.update(extra or {})
    return env


@dataclass(slots=True)
class Child:
    """One running (or exited) child process and the file its output goes to."""

    name: str
    argv: list[str]
    log_path: Path
    proc: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def output(self) -> str:
        """Everything it wrote so far, stdout and stderr interleaved."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = TAIL_LINES) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    async def wait_line(self, prefix: str, within_s: float) -> str:
        """The rest of the first output line that starts with `prefix` (a ready line)."""
        deadline = time.monotonic() + within_s
        while True:
            for line in self.output().splitlines():
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
            if self.returncode is not None:
                raise AssertionError(
                    f"{self.name} exited with status {self.returncode} before printing "
                    f"{prefix!r}; its output ({self.log_path}) ends:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name} printed no {prefix!r} within {within_s:g} s; its output "
                    f"({self.log_path}) ends:\n{self.tail()}"
                )
            await asyncio.sleep(POLL_S)

    def send(self, sig: signal.Signals) -> None:
        """Send `sig` to the child itself (SIGTERM, SIGINT: what it handles)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP: it keeps its sockets (the kernel still accepts connections) but runs nothing."""
        self.send(signal.SIGSTOP)

    def thaw(self) -> None:
        self.send(signal.SIGCONT)

    def frozen(self) -> bool:
        """Whether the kernel reports the process stopped (state T in /proc/PID/stat)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def connected_ports(self) -> set[int]:
        """The remote ports of its established TCP connections (from /proc: Linux only).

        A connection to a SIGSTOPped server is established all the same (the kernel accepts
        it into the listen backlog), so this shows whom a child is waiting on.
        """
        inodes = set()
        for fd in Path(f"/proc/{self.pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(table).read_text().splitlines()[1:]:
                    cols = line.split()
                    if cols[3] == _TCP_ESTABLISHED and cols[9] in inodes:
                        ports.add(int(cols[2].rsplit(":", 1)[1], 16))
        return ports

    async def wait_exit(self, within_s: float) -> int:
        """Its exit status; TimeoutError if it is still running after `within_s`."""
        status = await asyncio.wait_for(self.proc.wait(), within_s)
        _children.pop(self.pid, None)
        return status

    async def terminate(self, within_s: float = 10.0) -> int:
        """SIGTERM and wait for the exit status (SIGKILL and an error past `within_s`)."""
        self.send(signal.SIGTERM)
        try:
            return await self.wait_exit(within_s)
        except TimeoutError:
            await self.kill()
            raise AssertionError(
                f"{self.name} did not exit within {within_s:g} s of SIGTERM and was killed; "
                f"its output ({self.log_path}) ends:\n{self.tail()}"
            ) from None

    async def kill(self) -> int:
        """SIGKILL its whole process group and reap it."""
        _kill_group(self.proc)
        status = await self.proc.wait()
        _children.pop(self.pid, None)
        return status

    async def stop(self, within_s: float) -> None:
        """Whatever state it is in: thawed, SIGTERMed, SIGKILLed after `within_s`."""
        if self.returncode is None:
            self.thaw()  # a stopped process keeps a SIGTERM pending until it runs again
            self.send(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await self.wait_exit(within_s)
        await self.kill()

    def describe(self) -> str:
        status = "running" if self.returncode is None else f"exit status {self.returncode}"
        return (
            f"--- {self.name} (pid {self.pid}, {status}): {' '.join(self.argv)}\n"
            f"--- output: {self.log_path}\n{self.tail()}"
        )


class Processes:
    """Every child a test started; `stop_all` may be called any number of times."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    async def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
    ) -> Child:
        """Start `argv` in the repository with a clean environment (plus `env`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        if any(c.name == name for c in self.children):
            raise ValueError(f"a child named {name!r} was started already in this test")
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=REPO,
                env=clean_env(env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(),
            )
        finally:
            os.close(log)  # the child has its own copy
        _children[proc.pid] = proc
        child = Child(name, list(argv), log_path, proc)
        self.children.append(child)
        return child

    async def stop_all(self, within_s: float = 10.0) -> None:
        """Every child, at once: SIGTERM, and SIGKILL for whatever has not exited by then."""
        await asyncio.gather(*(c.stop(within_s) for c in self.children))

    def report(self) -> str:
        """Each child's command line, status and the end of its output, for a failed test."""
        return "\n\n".join(c.describe() for c in self.children) or "(no child processes)"


class Finished(NamedTuple):
    status: int | None  # None: still running at the bound, and killed
    stdout: str
    stderr: str


async def run_to_end(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, within_s: float = 20.0
) -> Finished:
    """Run a short-lived command to completion, its stdout and stderr kept apart.

    It runs in a session of its own too, so a command still running after `within_s` is
    SIGKILLed with everything it started, and reported with status None.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=REPO,
        env=clean_env(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        preexec_fn=pdeathsig_preexec(),
    )
    _children[proc.pid] = proc
    status: int | None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), within_s)
        status = proc.returncode
    except TimeoutError:
        # The whole group, even when the command itself has exited: a shell script that
        # stopped early (`set -e`) leaves its background jobs holding the pipes. Its pid
        # cannot have been reused while they live: it is still their process group's id.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = await proc.communicate()
        status = None
    finally:
        _kill_group(proc)  # cancelled (the caller's own timeout, say): nothing may outlive it
    _children.pop(proc.pid, None)
    return Finished(status, out.decode(errors="replace"), err.decode(errors="replace"))


def kvrouter_argv(*args: str) -> list[str]:
    """`kvrouter ARGS` as this interpreter runs it (no installed console script needed)."""
    return [sys.executable, "-m", "router.launch", *args]


def fake_worker_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "fake_kv_worker", *args]
