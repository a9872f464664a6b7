"""`gasloc status --serve PORT`: the status view as a live web page, with the JSON behind it.

  GET /           the page (cli/status_page.html): the table, loss over time per peer, and a graph of who exchanged
                  with whom in the last edge_window_s; it polls /api/swarm
  GET /api/swarm  {"snapshot": <gasloc status --json>, "history": {"curves", "edges"}, "error": null | "..."}

The standard library's ThreadingHTTPServer is enough here: two read-only routes, a handful of viewers, no
templates, no websockets (the page polls), and it adds no dependency to every peer's install. The DHT is only read
by the main thread, every interval_s; requests are served from the last snapshot, so a burst of viewers never
reaches the DHT.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from gasloc.cli.statusview import History, StatusError

log = logging.getLogger(__name__)


class State:
    """The latest snapshot and history as JSON bytes, swapped whole under a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._body = json.dumps({"snapshot": None, "history": None, "error": "no listing yet"}).encode()

    def set(self, body: dict) -> None:
        data = json.dumps(body).encode()
        with self._lock:
            self._body = data

    def get(self) -> bytes:
        with self._lock:
            return self._body


def make_server(host: str, port: int, state: State) -> ThreadingHTTPServer:
    page = resources.files("gasloc.cli").joinpath("status_page.html").read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/swarm":
                self._send(200, "application/json", state.get())
            else:
                self._send(404, "text/plain; charset=utf-8", f"no such page: {path} (try / or /api/swarm)\n".encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args) -> None:
            log.debug("http %s", fmt % args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(cfg, obs, stop: threading.Event) -> int:
    """Serve until `stop`: cfg is gasloc.cli.status.StatusConfig, obs its Observer (the DHT reader)."""
    from gasloc.runtime.procs import emit_ready

    state, history = State(), History(edge_window_s=cfg.edge_window_s)
    try:
        server = make_server(cfg.host, cfg.serve_port or 0, state)
    except OSError as e:
        raise StatusError(f"cannot serve on {cfg.host}:{cfg.serve_port}: {e.strerror or e}") from None
    url = f"http://{cfg.host}:{server.server_port}/"
    thread = threading.Thread(target=server.serve_forever, name="status-http", daemon=True)
    thread.start()
    try:
        first = True
        while not stop.is_set():
            try:
                snap = obs.snapshot()
                history.add(snap)
                state.set({"snapshot": snap, "history": history.to_json(), "error": None})
            except StatusError as e:  # keep serving the last listing and say why it is old
                state.set({**json.loads(state.get()), "error": str(e)})
            if first:  # ready once the page has something to show
                first = False
                print(f"status page: {url} (JSON: {url}api/swarm)", flush=True)
                emit_ready("status", str(obs.dht.peer_id), [], url=url)
            stop.wait(cfg.interval_s)
    finally:
        server.shutdown()
        server.server_close()
    return 0
