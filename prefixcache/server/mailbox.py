"""Mailbox: a request's updates from the engine thread that its handler has not read yet, on the asyncio side.

Updates wait in arrival order, one per engine step of a sample, so a handler that keeps up streams a chunk a token
whatever the load. Past MERGE_AFTER waiting, a new update merges into its sample's latest waiting one (text deltas
and logprobs appended, the latest counts kept), so a handler that stops reading (a client that stops draining its
stream, or a slow one) costs the memory of its text and MERGE_AFTER entries, never a copy of the text per step.
`stalled` tells when updates have waited longer than a time: the worker then aborts the request.
"""
import asyncio
import time
from collections import deque

from prefixcache.server.update import Update

MERGE_AFTER = 256  # waiting updates: a handler this far behind the engine is not reading


class Mailbox:
    def __init__(self):
        self.waiting: deque[Update] = deque()
        self.latest: dict[int, Update] = {}  # each sample's latest waiting update
        self.error: Update | None = None  # once set, the request's last update, after those waiting
        self.ready = asyncio.Event()
        self.read_at = time.monotonic()  # when the handler last took an update (or the request began)

    def put(self, update: Update) -> None:
        if self.error is not None:
            return
        if update.error is not None:
            self.error = update
        elif len(self.waiting) >= MERGE_AFTER and (w := self.latest.get(update.index)) is not None:
            w.merge(update)
        else:
            self.waiting.append(update)
            self.latest[update.index] = update
        self.ready.set()

    async def get(self) -> Update:
        while self.error is None and not self.waiting:
            self.ready.clear()
            await self.ready.wait()
        self.read_at = time.monotonic()
        if not self.waiting:
            return self.error
        u = self.waiting.popleft()
        if self.latest.get(u.index) is u:
            del self.latest[u.index]
        return u

    def stalled(self, now: float, seconds: float) -> bool:
        """Updates have waited unread for more than `seconds`."""
        return bool(self.waiting) and now - self.read_at > seconds
