"""The replicas behind a router, and the health checker that takes them out of rotation and puts them back.

A replica is routable while its `GET /health` answers 200 with status "ok" or "degraded" (it still serves, with
a tier missing). A connection refused on a forwarded request takes it out at once; the next check puts it back.
A replica with API keys tells its id and load only to an admin key: the checks send the router's (RouterConfig
admin_key), and without it the router knows no cached prefixes there and counts only its own requests as the
replica's load.
"""
import asyncio
import logging
from dataclasses import dataclass

import httpx

from prefixcache.router.index import PrefixIndex

UP = ("ok", "degraded")
HEALTH_TIMEOUT = 2.0  # seconds; a replica's /health does not wait on its engine, so this is generous

log = logging.getLogger("prefixcache.router")


@dataclass
class Replica:
    url: str
    healthy: bool = False  # until the first check says otherwise
    status: str = "unchecked"  # the replica's last reported status, or why it is out
    replica_id: str | None = None  # the name its KV events carry
    running: int = 0  # from its last health check
    waiting: int = 0
    in_flight: int = 0  # this router's requests there now, counted as they are sent

    @property
    def load(self) -> int:
        """Requests there: the replica's own count (every router's, as of its last check) already holds this
        router's requests sent before that check, so the two are not added."""
        return max(self.in_flight, self.running + self.waiting)

    def up(self, health: dict) -> None:
        """In rotation, with the figures of a /health answer when it has them (KeyError, ValueError: some are
        missing); an answer of its status alone leaves the replica's id unknown and its own load at 0."""
        replica_id, running, waiting = None, 0, 0
        if health.keys() != {"status"}:
            replica_id, running, waiting = str(health["replica_id"]), int(health["running"]), int(health["waiting"])
        if not self.healthy:
            log.info("replica %s (%s) in rotation, status %s", self.url, replica_id, health["status"])
            if replica_id is None:
                log.warning("replica %s tells its id and load only to an admin key (route --admin-key-file): "
                            "routing there by this router's own requests, with no cached prefix known", self.url)
        self.healthy, self.status = True, health["status"]
        self.replica_id, self.running, self.waiting = replica_id, running, waiting

    def down(self, why: str) -> None:
        if self.healthy:
            log.warning("replica %s out of rotation: %s", self.url, why)
        self.healthy, self.status = False, why

    def describe(self) -> dict:
        return {"url": self.url, "replica_id": self.replica_id, "healthy": self.healthy, "status": self.status,
                "running": self.running, "waiting": self.waiting, "in_flight": self.in_flight}


class HealthChecker:
    def __init__(self, replicas: list[Replica], client: httpx.AsyncClient, interval: float, key: str | None,
                 index: PrefixIndex | None = None):
        """`key`: an admin key of the replicas, sent with each check to read their ids and load; None: none sent.
        Once every replica's id is known, `index` forgets every other id after each round."""
        self.replicas, self.client, self.interval, self.index = replicas, client, interval, index
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def check(self, replica: Replica) -> None:
        try:
            r = await self.client.get(f"{replica.url}/health", headers=self.headers, timeout=HEALTH_TIMEOUT)
            health = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as e:
            return replica.down(type(e).__name__)
        if not isinstance(health, dict) or health.get("status") not in UP:
            return replica.down(f"health answered {r.status_code}")
        try:
            replica.up(health)
        except (KeyError, TypeError, ValueError):
            replica.down("health answer lacks replica_id, running or waiting")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))
        if self.index and all(r.replica_id for r in self.replicas):
            self.index.retain({r.replica_id for r in self.replicas})

    async def run(self) -> None:
        """Check every replica every `interval` seconds, forever (run it as a task; cancel it to stop)."""
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()
