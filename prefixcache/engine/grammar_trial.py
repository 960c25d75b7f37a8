"""A guide new to its scope is compiled first in a worker process, under limits of CPU time, of wall time and of memory
(COMPILE_SECONDS, COMPILE_WALL, COMPILE_BYTES): a compile past any is stopped with its process, and the request
refused (a 400), where a compile on the grammar thread could be neither stopped nor bounded. Only a guide that passed
is compiled again on the grammar thread (engine/grammar.py): xgrammar's compile is deterministic, so it takes as long
there, or less with the scope's cache. Handing the trial's grammar back would cost more than compiling it twice: a
300-field schema compiles in 0.12 s, and its grammar serializes to 30 MB in 1.3 s and reads back in 0.45 s."""
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import BinaryIO

import xgrammar as xgr

from prefixcache.engine.guide import Guide

COMPILE_SECONDS = 30.0  # CPU seconds a guide may take to compile (a 300-field schema: about 0.1)
COMPILE_WALL = 60.0  # seconds the grammar thread waits for a trial's answer: at nice 10 on a busy machine the CPU
# limit alone let one guide hold the thread, and every tenant's guides behind it, for minutes
COMPILE_BYTES = 1 << 30  # memory a compile may take over the worker's own (the 300-field schema's grammar: 22 MB)
WATCH = 0.01  # seconds between the worker's looks at its own CPU time and memory
NICE = 10  # the worker's niceness: it compiles on the cycles the engine leaves, as the grammar thread does


class Trial:
    """The worker process (`python -m` this module, so it imports nothing of the caller's), started on the first
    guide and again after one past the limits stopped it. Called from the grammar thread only, one guide at a time."""

    def __init__(self, info: xgr.TokenizerInfo, seconds: float = COMPILE_SECONDS, memory: int = COMPILE_BYTES,
                 wall: float = COMPILE_WALL):
        self.info = info.serialize_json().encode()
        self.seconds, self.memory, self.wall = seconds, memory, wall
        self.worker: subprocess.Popen | None = None

    def check(self, guide: Guide) -> None:
        """Compile the guide in the worker; raises ValueError if it does not compile or takes more than the limits."""
        if self.worker is None:
            self.worker = subprocess.Popen([sys.executable, "-m", __name__, str(self.seconds), str(self.memory)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            _send(self.worker.stdin, self.info)
        try:
            _send(self.worker.stdin, f"{guide.kind}\n{guide.spec}".encode())
            if not select.select([self.worker.stdout], [], [], self.wall)[0]:
                raise EOFError  # no answer in time: stopped like a compile past a limit
            error = _receive(self.worker.stdout)
        except (BrokenPipeError, EOFError):  # the worker stopped itself (or was killed): the next guide gets a new one
            self.close()
            raise ValueError(f"the {guide.kind} guide takes more than {self.seconds:g} CPU seconds, "
                             f"{self.wall:g} seconds or {self.memory >> 20} MiB to compile") from None
        if error:
            raise ValueError(error.decode())

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker.wait()
            self.worker.stdin.close()
            self.worker.stdout.close()
            self.worker = None


def _send(pipe: BinaryIO, data: bytes) -> None:
    pipe.write(struct.pack("<I", len(data)) + data)
    pipe.flush()


def _receive(pipe: BinaryIO) -> bytes:
    head = pipe.read(4)
    if len(head) < 4:
        raise EOFError
    (size,) = struct.unpack("<I", head)
    data = pipe.read(size)
    if len(data) < size:
        raise EOFError
    return data


def _serve(seconds: float, memory: int) -> None:
    """The worker: guides in on stdin, for each the reason it does not compile (empty if it does) out on what was
    stdout (now stderr's, so that nothing else writes into the replies)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    os.nice(NICE)
    # with its cache, as the grammar thread's: a schema that repeats a sub-schema compiles 9x faster (3.2 s against
    # 0.36 for the bench's wide schema); emptied after each guide, so nothing of one carries to the next
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(_receive(sys.stdin.buffer).decode()),
                                   max_threads=1)
    job: list[float] = []  # the CPU time at the start of the compile under way, if one is
    threading.Thread(target=_watch, args=(job, seconds, _resident() + memory), daemon=True).start()
    while True:
        try:
            kind, spec = _receive(sys.stdin.buffer).decode().split("\n", 1)
        except EOFError:
            return
        job.append(time.process_time())
        try:
            Guide(kind, spec).compile(compiler)
            error = ""
        except ValueError as e:
            error = str(e)
        compiler.clear_cache()
        job.clear()
        _send(replies, error.encode())


def _watch(job: list[float], seconds: float, memory: int) -> None:
    """Stop the process when a compile has taken more than `seconds` of CPU time or the process more than `memory`
    bytes (xgrammar compiles without the GIL, so this thread runs beside it)."""
    while True:
        time.sleep(WATCH)
        start = job[0] if job else None
        if (start is not None and time.process_time() - start > seconds) or _resident() > memory:
            os._exit(1)


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    _serve(float(sys.argv[1]), int(sys.argv[2]))
