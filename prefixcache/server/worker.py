"""EngineWorker: the one thread that owns the Engine. HTTP handlers talk to it only through its inbox.

The engine is not thread-safe, so every engine call (add_request, step, abort, purge, stats) runs on this
thread. Handlers put closures into a thread-safe inbox; the thread drains it between steps, steps while work
exists, blocks on the inbox when idle, and hands each request's updates to the asyncio side with
`loop.call_soon_threadsafe` into that request's asyncio.Queue. New requests also wait in `arrivals`, which the
thread drains before each layer of a step too, so that a short request can run inside a long step
(Engine.lane_step) rather than after it.
"""
import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from prefixcache.cache.policy import Breakpoint
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.engine import Engine, StepFailed
from prefixcache.engine.grammar import Busy
from prefixcache.engine.sequence import Fault, SamplingParams, Sequence
from prefixcache.server.mailbox import Mailbox
from prefixcache.server.update import Report, Update

log = logging.getLogger("prefixcache.engine")


@dataclass
class Handle:
    """One request as the asyncio side sees it."""

    tenant: str
    updates: Mailbox = field(default_factory=Mailbox)
    seqs: list[Sequence] = field(default_factory=list)  # the request's samples; the engine thread's only
    shown: dict[int, int] = field(default_factory=dict)  # characters of each sample's text sent; engine thread only
    done: bool = False


class EngineWorker:
    """Builds the engine on its own thread and runs it there. The engine must be built where it runs: torch's
    OpenMP threads serve the thread that used them first, and another thread's parallel ops then ran up to 5x
    slower (an engine step on a fresh thread: 92 ms when the main thread had built the engine, 70 ms otherwise)."""

    def __init__(self, build: Callable[[], Engine], stall_seconds: float = 30.0):
        self.stall_seconds = stall_seconds  # a request whose updates wait unread this long is aborted
        self.engine: Engine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start(), before the first request
        self.inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.arrivals: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # submitted requests' adds
        self.live: dict[int, Handle] = {}  # seq id -> handle, engine thread only
        self.held: Counter[str] = Counter()  # requests submitted and not yet finished, by tenant; asyncio side only
        built: queue.SimpleQueue[Engine | BaseException] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(build, built), name="engine", daemon=True)
        self.thread.start()
        result = built.get()  # the engine (then also self.engine), or what stopped its build
        if isinstance(result, BaseException):
            raise result

    @property
    def in_flight(self) -> int:
        return sum(self.held.values())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join()

    # ---- asyncio side -------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, scope: CacheScope,
               breakpoints: list[Breakpoint], adapter: str = "") -> Handle:
        handle = Handle(scope.tenant)
        self.held[scope.tenant] += 1

        def add():
            try:
                handle.seqs = self.engine.add_request(prompt, params, scope, breakpoints, adapter=adapter).samples
            except ValueError as e:
                self._deliver(handle, Update("", [time.monotonic()], error=str(e), status=429 if isinstance(e, Busy)
                                             else 400))
                return
            except Exception:
                log.exception("add_request failed")
                self._deliver(handle, Update("", [time.monotonic()], error="internal engine error", status=500))
                return
            for seq in handle.seqs:
                self.live[seq.id] = handle

        self.arrivals.put(add)
        self.inbox.put(self._add_arrivals)  # in order with the inbox's other work (an abort comes after it)
        return handle

    def finished(self, handle: Handle) -> None:
        """The handler is done with this request; abort it in the engine if it still runs (a disconnect)."""
        if handle.done:
            return
        handle.done = True
        self.held[handle.tenant] -= 1
        if not self.held[handle.tenant]:
            del self.held[handle.tenant]
        self._abort(handle)

    def _abort(self, handle: Handle) -> None:
        def abort():
            for seq in handle.seqs:
                if self.live.pop(seq.id, None):
                    self.engine.abort(seq)

        self.inbox.put(abort)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread and await its result."""
        fut = self.loop.create_future()

        def run():
            try:
                result = fn(self.engine)
            except Exception as e:  # handed to the awaiting handler, which decides what it means
                self.loop.call_soon_threadsafe(fut.set_exception, e)
            else:
                self.loop.call_soon_threadsafe(fut.set_result, result)

        self.inbox.put(run)
        return await fut

    # ---- engine thread ------------------------------------------------------------------------------------
    def _run(self, build: Callable[[], Engine], built: queue.SimpleQueue) -> None:
        try:
            self.engine = build()
        except BaseException as e:  # noqa: BLE001 -- handed to the constructor, which raises it
            built.put(e)
            return
        built.put(self.engine)
        while True:
            block = not self.engine.has_unfinished()
            while True:
                try:
                    op = self.inbox.get(block=block)
                except queue.Empty:
                    break
                if op is None:
                    self.engine.close()
                    return
                op()
                block = False
            try:
                touched = self.engine.step(self._between_layers)
            except Exception as e:  # an engine bug: fail the requests of that step (all, if unknown), keep serving
                log.exception("engine step failed")
                self._fail(e.seqs if isinstance(e, StepFailed) else [s for h in self.live.values() for s in h.seqs])
                continue
            self._publish(touched)

    def _add_arrivals(self) -> None:
        while not self.arrivals.empty():
            self.arrivals.get()()

    def _between_layers(self) -> None:
        """Called by the engine before each layer of a step: add the requests that arrived meanwhile, and let
        the engine run those it can in a lane step now, and those the step left waiting (a running prompt's chunk
        can take its whole token budget: a short request that came just before it waited for it, and the next), and
        the next tokens of those it ran so (else they wait for the step's end: 1.3 s beside a 512-token chunk).
        A failed lane step fails its own requests only."""
        if self.arrivals.empty() and not self.engine.scheduler.lane_due:
            return
        self._add_arrivals()
        try:
            touched = self.engine.lane_step()
        except StepFailed as e:
            log.exception("engine lane step failed")
            self._fail(e.seqs)
            return
        self._publish(touched)

    def _fail(self, seqs: list[Sequence]) -> None:
        """Abort these sequences' requests (all of each request's samples) and tell their handlers: with the
        sequence's own fault if it has one, else as an internal error."""
        for seq in seqs:
            handle = self.live.get(seq.id)
            if handle is None:
                continue
            for s in handle.seqs:
                self.engine.abort(s)
                self.live.pop(s.id, None)
            fault = seq.fault or Fault("internal engine error", internal=True)
            status = 500 if fault.internal else 400
            self._deliver(handle, Update("", [time.monotonic()], error=fault.message, status=status))

    def _publish(self, touched: list[Sequence]) -> None:
        """Hand the sequences' new tokens (and, when done, their outputs) to their handlers; a request that failed
        alone (Sequence.fault), or whose update cannot be built, gets its error."""
        now = time.monotonic()
        for seq in touched:
            handle = self.live.get(seq.id)
            if handle is None:
                continue
            if seq.fault:
                self._fail([seq])
                continue
            try:
                update = self._update(handle, seq, now)
            except Exception:
                log.exception("a request's update failed; it fails alone")
                self._fail([seq])
                continue
            if update.output is not None:
                del self.live[seq.id]
            self._deliver(handle, update)

    def _update(self, handle: Handle, seq: Sequence, now: float) -> Update:
        out = seq.output() if seq.finish_reason is not None else None
        # one token per step: the last logprob is this update's
        first = seq.prompt_logprobs is not None and len(seq.output_ids) == 1
        return Update(self._new_text(handle, seq, out is None), [now], Report.of(seq), out, index=seq.index,
                      logprobs=seq.logprobs[-1:] if seq.logprobs else [],
                      prompt_logprobs=tuple(seq.prompt_logprobs) if first else None)

    @staticmethod
    def _new_text(handle: Handle, seq: Sequence, running: bool) -> str:
        """The sample's text not yet sent; while it runs, less what may still become a stop string (cut from
        the output) or an incomplete character."""
        shown = handle.shown.get(seq.index, 0)
        end = len(seq.text) - (max(map(len, seq.params.stop), default=1) - 1 if running else 0)
        new = seq.text[shown:end].rstrip("\ufffd") if running else seq.text[shown:]
        handle.shown[seq.index] = shown + len(new)
        return new

    def _deliver(self, handle: Handle, update: Update) -> None:
        self.loop.call_soon_threadsafe(self._receive, handle, update)

    # ---- asyncio side, from the engine thread --------------------------------------------------------------
    def _receive(self, handle: Handle, update: Update) -> None:
        """Hand an update to the request's mailbox; a request whose handler left its updates unread for
        stall_seconds (a stream its client does not read) is aborted, and its handler finds a 408."""
        if handle.done:
            return
        if handle.updates.stalled(time.monotonic(), self.stall_seconds):
            self._abort(handle)
            update = Update("", [time.monotonic()], error=f"the client read nothing of this stream for "
                            f"{self.stall_seconds:g} s: the request was aborted", status=408)
        handle.updates.put(update)

