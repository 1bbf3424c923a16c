"""A local HTTP receiver for the automations' webhook calls."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """A local HTTP server that keeps the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.cond:
                    receiver.bodies.append(json.loads(body))
                    receiver.cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def wait_for(self, pred, timeout: float = 90) -> dict:
        """The first body `pred` accepts, waiting (on the arrivals, not a sleep) up to `timeout`."""
        deadline = time.time() + timeout
        with self.cond:
            while True:
                found = next((b for b in self.bodies if pred(b)), None)
                if found is not None:
                    return found
                left = deadline - time.time()
                assert left > 0, f"no matching webhook call within {timeout} s; received: {self.bodies}"
                self.cond.wait(left)

    def close(self) -> None:
        self.server.shutdown()
