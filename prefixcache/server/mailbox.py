"""Mailbox: a request's updates from the engine thread that its handler has not read yet, on the asyncio side.

It holds at most one update per sample: a new update merges into the one still waiting (text deltas and logprobs
appended, the latest counts kept), so a handler that stops reading (a client that stops draining its stream, or a
slow one) costs the memory of its text, never a copy per step, and a bounded number of entries. `stalled` tells
when updates have waited longer than a time: the worker then aborts the request.
"""
import asyncio
import time

from prefixcache.server.update import Update


class Mailbox:
    def __init__(self):
        self.waiting: dict[int, Update] = {}  # by sample index, in arrival order
        self.error: Update | None = None  # once set, the request's only remaining update
        self.ready = asyncio.Event()
        self.read_at = time.monotonic()  # when the handler last took an update (or the request began)

    def put(self, update: Update) -> None:
        if self.error is not None:
            return
        if update.error is not None:
            self.error, self.waiting = update, {}
        elif (w := self.waiting.get(update.index)) is None:
            self.waiting[update.index] = update
        else:
            w.merge(update)
        self.ready.set()

    async def get(self) -> Update:
        while self.error is None and not self.waiting:
            self.ready.clear()
            await self.ready.wait()
        self.read_at = time.monotonic()
        if self.error is not None:
            return self.error
        return self.waiting.pop(next(iter(self.waiting)))

    def stalled(self, now: float, seconds: float) -> bool:
        """Updates have waited unread for more than `seconds`."""
        return bool(self.waiting) and now - self.read_at > seconds
