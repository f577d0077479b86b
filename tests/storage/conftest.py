"""A local HTTP server for the fetch and source tests (the network is never used)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Route:
    body: bytes
    fail_first: int = 0  # answer this many requests with `fail_status` first
    fail_status: int = 503
    declared_length: int | None = None  # a Content-Length other than the body's: the connection drops short


@dataclass
class FileServer:
    base: str
    routes: dict[str, Route] = field(default_factory=dict)
    hits: Counter = field(default_factory=Counter)

    def serve(self, path: str, body: bytes, **kw) -> str:
        """Serve `body` at `path`; returns its URL."""
        self.routes[path] = Route(body, **kw)
        return self.base + path


def _handler(server: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name
            server.hits[self.path] += 1
            route = server.routes.get(self.path)
            if route is None:
                self.send_error(404)
                return
            if server.hits[self.path] <= route.fail_first:
                self.send_error(route.fail_status)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(route.declared_length or len(route.body)))
            self.end_headers()
            self.wfile.write(route.body)
            self.close_connection = True

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def http_server(monkeypatch) -> FileServer:
    """A `FileServer` on 127.0.0.1 (a free port), stopped after the test; proxies are bypassed for it."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    files = FileServer(base="")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(files))
    files.base = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield files
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
