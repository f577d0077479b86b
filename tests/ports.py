"""Local TCP ports for the tests that start servers or process groups: `free_ports` chooses them, `port_open` asks
whether something answers on one."""

from __future__ import annotations

import socket


def free_ports(n: int = 1, exclude: frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free when chosen (held open together while choosing, so they
    differ), none of them in `exclude`."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            if (p := s.getsockname()[1]) not in exclude:
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
