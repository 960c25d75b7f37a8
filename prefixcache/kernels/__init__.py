"""Our CPU kernels (C++ in csrc/, registered as torch ops prefixcache::*), and whether this process can use them.

Each kernel computes every output in an order fixed by the problem's own sizes (K for a GEMM element, the key
blocks for an attention row), never by the batch, the thread count or the ISA: the AVX-512 and AVX2 builds give
the same bits. `choose` says which build to run, or why none can run; then the model runs its torch path.

The sources ship in the package; the library is built from them once (build.py: `make setup`, or on first use
where a compiler is) into the user cache, $PREFIXCACHE_HOME/kernels/<sources and torch>/<compiler>/. A process
without a compiler (an image that ships the library, not the compiler that built it) loads a build by any compiler.
"""
import functools
import glob
import hashlib
import logging
import os
import platform
import subprocess
import sys
from dataclasses import dataclass

import torch

from prefixcache.config import ISAS
from prefixcache.files import cache_home

log = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = "prefixcache_kernels"
SOURCES = sorted(glob.glob(os.path.join(HERE, "csrc", "*.cpp")))


@dataclass
class Choice:
    isa: str  # "" for the torch path
    status: str  # what runs, and why


@dataclass
class Library:
    path: str  # the library this process loaded; "" when none
    sha256: str  # its bytes' hash: what the probe's cache is keyed by
    problem: str  # why none is loaded, or ""


def source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(HERE, "csrc", "*"))):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()


def compiler() -> str:
    """The first line of `--version` of the C++ compiler torch's toolchain runs ($CXX, else c++); "" when none."""
    try:
        run = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return run.stdout.partition("\n")[0] if run.returncode == 0 else ""


def folder() -> str:
    """Where the builds of these sources for this torch live, one subfolder per compiler."""
    key = f"{source_hash()} torch {torch.__version__} {platform.machine()}"
    return os.path.join(cache_home(), "kernels", hashlib.sha256(key.encode()).hexdigest()[:16])


def build_folder(cc: str) -> str:
    """The build of these sources for this torch by compiler `cc` (compiler())."""
    return os.path.join(folder(), hashlib.sha256(cc.encode()).hexdigest()[:16])


def find(cc: str) -> str:
    """The library built by `cc`, or with no compiler by any; "" when there is none (a library without the hash
    its build wrote beside it is none)."""
    builds = [build_folder(cc)] if cc else sorted(glob.glob(os.path.join(folder(), "*")))  # not .lock, .build-*
    return next((p for p in (os.path.join(b, f"{LIBRARY}.so") for b in builds) if os.path.exists(f"{p}.sha256")), "")


def supported() -> list[str]:
    """The builds this process may run, best first: those this CPU can run, less those that $PREFIXCACHE_KERNELS
    (a comma-separated list of ISAS, e.g. "avx2") leaves out, so that one machine can run as a CPU without
    AVX-512 does. Empty when the library is not loaded."""
    if loaded().problem:
        return []
    allowed = os.environ.get("PREFIXCACHE_KERNELS")
    names = list(torch.ops.prefixcache.supported())
    return [n for n in names if allowed is None or n in allowed.split(",")]


def choose(want: str = "auto") -> Choice:
    """The build to run for `want` ("auto" or one of ISAS) on this CPU. Logs a warning when the torch path must run
    though kernels were asked for."""
    assert want in ("auto", *ISAS), want
    lib = loaded()
    problem = lib.problem
    if not problem:
        builds = supported()
        isa = next((i for i in ISAS if want in ("auto", i) and i in builds), "")
        if isa:
            with open(os.path.join(os.path.dirname(lib.path), "compiler")) as f:
                return Choice(isa, f"{isa} (built from the current sources for torch {torch.__version__} by "
                              f"{f.read().strip()}; builds this process may run: {', '.join(builds)})")
        allowed = os.environ.get("PREFIXCACHE_KERNELS")
        problem = f"this CPU lacks {want if want != 'auto' else 'AVX2 and FMA'}" + (
            f" (PREFIXCACHE_KERNELS={allowed})" if allowed is not None else "")
    log.warning("prefixcache kernels: %s; running the torch path", problem)
    return Choice("", f"off: {problem}")


@functools.cache
def loaded() -> Library:
    """The library, loaded once per process: found in the user cache, else built there first."""
    return _load()


def _load() -> Library:
    cc = compiler()
    path = find(cc)
    if not path and not cc:
        return Library("", "", f"not built: no C++ compiler ($CXX or c++) to build them, and no build for these "
                       f"sources and torch {torch.__version__} in {folder()}")
    if not path:
        log.warning("prefixcache kernels: compiling them into %s (once for these sources, compiler and torch; a few "
                    "minutes)", folder())
        root = os.path.dirname(os.path.dirname(HERE))  # this package's, whatever the working directory
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        run = subprocess.run([sys.executable, "-m", "prefixcache.kernels.build"], capture_output=True, text=True,
                             env=env)
        path = find(cc)
        if run.returncode or not path:
            return Library("", "", f"failed to build ({(run.stderr.strip() or 'no library').splitlines()[-1]})")
    with open(path, "rb") as f, open(f"{path}.sha256") as pin:
        sha256, pinned = hashlib.sha256(f.read()).hexdigest(), pin.read().strip()
    if sha256 != pinned:
        return Library("", "", f"refused to load {path}: its bytes are not those its build wrote (sha256 {sha256}, "
                       f"built {pinned}); delete {os.path.dirname(path)} to build it again")
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        return Library("", "", f"failed to load {path} ({e})")
    return Library(path, sha256, "")
