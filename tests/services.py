"""Real service processes for the tests, each on a free loopback port and owned by the test that starts it."""
import shutil
import socket
import subprocess
import time

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A redis-server subprocess that keeps nothing on disk. stop() and start() again on the same port: a test kills
    Redis mid-run and brings it back."""

    def __init__(self):
        binary = shutil.which("redis-server")
        assert binary, "redis-server not found: `apt-get install redis-server` (the README's setup section)"
        self.binary, self.port, self.proc = binary, free_port(), None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)
