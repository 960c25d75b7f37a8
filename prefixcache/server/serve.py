"""The server process: the app under uvicorn, with a draining shutdown.

SIGTERM (what `docker stop` and Kubernetes send) starts a drain. The listener stays open; new completion requests
get a 503 with Retry-After, which a router retries on another replica at once; /health answers 503 "draining", so
routers and load balancers take the replica out; running requests go on. Once none is left, or after
`grace_seconds`, uvicorn shuts down (cutting what still runs) and the process exits 0. A second SIGTERM, or SIGINT,
stops at once, as uvicorn does.
"""
import signal
import socket
import sys
import threading
import time

import uvicorn

from prefixcache.server.app import create_app
from prefixcache.server.config import ServeConfig
from prefixcache.server.state import Server

CUT_SECONDS = 1.0  # after the grace period: how long uvicorn waits for connections before cutting them
# how long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The engine thread gives
# the GIL up in every kernel call, about 200 a step, and waits this long for it whenever the event loop is busy
SWITCH_SECONDS = 5e-4


class Draining(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: Server, grace: float):
        super().__init__(config)
        self.server, self.grace = server, grace

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self.server.draining:
            return super().handle_exit(sig, frame)
        self.server.draining = True  # not handed to uvicorn, which would raise it again on exit: the exit is 0
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace
        while self.server.worker.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def serve(cfg: ServeConfig) -> None:
    """The app on its port, and on --metrics-port when given: one server, so both drain and stop together."""
    sockets = [listen(cfg.host, port) for port in (cfg.port, cfg.metrics_port) if port]
    sys.setswitchinterval(SWITCH_SECONDS)
    app = create_app(cfg)
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=CUT_SECONDS)
    Draining(config, app.state.server, cfg.grace_seconds).run(sockets=sockets)


def listen(host: str, port: int) -> socket.socket:
    """A bound listening socket; a port in use fails startup here, before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise SystemExit(f"prefixcache serve: cannot listen on {host}:{port}: {e.strerror}") from None
