"""Free TCP ports on the loopback interface, for tests that need explicit port numbers.

A port found free can be taken by someone else before the test binds it. Two things keep
that window harmless:
- ports are drawn below the kernel's ephemeral range (`ip_local_port_range`), which is where
  every outgoing connection on the machine takes its local port: a replica's health checks,
  a ZMQ SUB connecting, another test run. A port picked there can be taken by any of them
  in the second a child process needs to start up and bind it; below it, only an explicit
  bind can;
- each number is handed out at most once per test process, so our own tests never collide.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path
from typing import Final

_handed_out: set[int] = set()
# Its own source of randomness: a test that seeds `random` (hypothesis does) must not make
# concurrent test runs on the machine draw the same ports.
_rng = random.SystemRandom()
_LOWEST: Final = 10_000  # below: well-known and registered services
_DEFAULT_EPHEMERAL_LOW: Final = 32768  # Linux's default, when /proc says nothing


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def _all_bindable(host: str, base: int, count: int) -> bool:
    held: list[socket.socket] = []
    try:
        for port in range(base, base + count):
            sock = _bindable(host, port)
            if sock is None:
                return False
            held.append(sock)
        return True
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()


def free_port_range(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of `count` consecutive free ports (e.g. a kv-port-base for `count` ranks)."""
    high = _ephemeral_low() - count
    if high <= _LOWEST:
        raise RuntimeError(f"no room for {count} ports below the ephemeral port range")
    for _ in range(attempts):
        base = _rng.randrange(_LOWEST, high)
        if _handed_out.intersection(range(base, base + count)):
            continue
        if _all_bindable(host, base, count):
            _handed_out.update(range(base, base + count))
            return base
    raise RuntimeError(f"no {count} consecutive free ports found on {host}")


def free_tcp_port(host: str = "127.0.0.1") -> int:
    return free_port_range(1, host)


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on the port (a process we started, say)."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0
