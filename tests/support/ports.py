"""Free TCP ports on the loopback interface, for tests that need explicit port numbers.

A port found free can be taken by someone else before the test binds it; handing out each
number at most once per test process at least keeps our own tests from colliding.
"""

from __future__ import annotations

import contextlib
import socket

_handed_out: set[int] = set()


def _bindable(host: str, port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def free_port_range(count: int, host: str = "127.0.0.1", attempts: int = 100) -> int:
    """The first of `count` consecutive free ports (e.g. a kv-port-base for `count` ranks)."""
    for _ in range(attempts):
        held: list[socket.socket] = []
        try:
            first = _bindable(host, 0)
            if first is None:
                continue
            held.append(first)
            base = first.getsockname()[1]
            if base + count - 1 > 65535 or any(p in _handed_out for p in range(base, base + count)):
                continue
            for port in range(base + 1, base + count):
                sock = _bindable(host, port)
                if sock is None:
                    break
                held.append(sock)
            else:
                _handed_out.update(range(base, base + count))
                return base
        finally:
            for sock in held:
                with contextlib.suppress(OSError):
                    sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found on {host}")


def free_tcp_port(host: str = "127.0.0.1") -> int:
    return free_port_range(1, host)
