"""Our CPU kernels (C++ in csrc/, registered as torch ops prefixcache::*), and whether this process can use them.

Each kernel computes every output in an order fixed by the problem's own sizes (K for a GEMM element, the key
blocks for an attention row), never by the batch, the thread count or the ISA: the AVX-512 and AVX2 builds give
the same bits. `choose` says which build to run, or why none can run; then the model runs its torch path.
"""
import glob
import hashlib
import logging
import os
from dataclasses import dataclass

import torch

from prefixcache.config import ISAS

log = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(HERE, "build")
LIBRARY = "prefixcache_kernels"
SOURCES = sorted(glob.glob(os.path.join(HERE, "csrc", "*.cpp")))

_loaded: list[str] = []  # the reason the library is not loaded, or "" once it is


@dataclass
class Choice:
    isa: str  # "" for the torch path
    status: str  # what runs, and why


def source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(HERE, "csrc", "*"))):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()


def choose(want: str = "auto") -> Choice:
    """The build to run for `want` ("auto" or one of ISAS) on this CPU. Logs a warning when the torch path must run
    though kernels were asked for."""
    assert want in ("auto", *ISAS), want
    problem = _load()
    if not problem:
        supported = torch.ops.prefixcache.supported()
        isa = next((i for i in ISAS if want in ("auto", i) and i in supported), "")
        if isa:
            return Choice(isa, f"{isa} (built from the current sources; this CPU has {', '.join(supported)})")
        problem = f"this CPU lacks {want if want != 'auto' else 'AVX2 and FMA'}"
    log.warning("prefixcache kernels: %s; running the torch path", problem)
    return Choice("", f"off: {problem}")


def _load() -> str:
    """Load the library once: "" when loaded, else why not."""
    if not _loaded:
        _loaded.append(_try_load())
    return _loaded[0]


def _try_load() -> str:
    try:
        with open(os.path.join(BUILD, "sources.sha256")) as f:
            built = f.read().strip()
    except OSError:
        return "not built (make setup builds it)"
    if built != source_hash():
        return "built from other sources (make setup rebuilds it)"
    try:
        torch.ops.load_library(os.path.join(BUILD, f"{LIBRARY}.so"))
    except (OSError, RuntimeError) as e:
        return f"failed to load ({e})"
    return ""
