"""Wait until every address answers: `python docker/wait_for.py tcp://postgres:5432 http://prefect-server:4200/api/health`.

The compose stack starts its services in order (depends_on) and each waits here for the ones it needs, so no
healthcheck support is required from the container engine. CSE_WAIT_TIMEOUT seconds (default 300) per address.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request
from urllib.parse import urlsplit


def ready(address: str) -> bool:
    u = urlsplit(address)
    try:
        if u.scheme == "tcp":
            with socket.create_connection((u.hostname, u.port), timeout=5):
                return True
        with urllib.request.urlopen(address, timeout=5) as r:  # http(s) only, from the compose file
            return 200 <= r.status < 300
    except OSError:
        return False


def main(addresses: list[str]) -> int:
    timeout = float(os.environ.get("CSE_WAIT_TIMEOUT", "300"))
    for address in addresses:
        if urlsplit(address).scheme not in ("tcp", "http", "https"):
            print(f"wait_for: not tcp:// or http(s)://: {address}", file=sys.stderr)
            return 2
        deadline = time.monotonic() + timeout
        while not ready(address):
            if time.monotonic() > deadline:
                print(f"wait_for: {address} did not answer within {timeout:.0f}s", file=sys.stderr)
                return 1
            time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
