"""Where the kernels' builds live (prefixcache/kernels): found by their sources, torch and compiler, and built by
one process at a time into a folder that appears whole."""
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

from prefixcache import kernels
from prefixcache.kernels import build


def test_a_build_is_found_by_sources_torch_and_compiler_or_any_compiler_without_one(monkeypatch, tmp_path):
    """No compiler and no build: the torch path, saying why. With no compiler (an image that ships the library), a
    build by any compiler serves; with one, only its own build."""
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "compiler", lambda: "")
    assert kernels._load().problem.startswith("not built: no C++ compiler ($CXX or c++) to build them")
    built = tmp_path / "kernels" / os.path.basename(kernels.folder()) / "0123"
    built.mkdir(parents=True)
    (built / f"{kernels.LIBRARY}.so").touch()
    assert kernels.find("") == ""  # no hash written by its build beside it: not a build of ours
    (built / f"{kernels.LIBRARY}.so.sha256").write_text(hashlib.sha256(b"").hexdigest())
    assert kernels.find("") == str(built / f"{kernels.LIBRARY}.so") and kernels.find("g++ (other) 1.0") == ""
    monkeypatch.setattr(torch, "__version__", "2.0.0")  # another torch: another folder
    assert kernels.find("") == ""


def test_builds_at_once_take_turns_and_the_library_appears_whole(monkeypatch, tmp_path):
    """Four processes' first uses at once (threads here: each opens the lock file itself, so flock excludes them as
    it would processes): one compiles, in a folder of its own renamed into place; the others wait and find it."""
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "compiler", lambda: "g++ (test) 1.0")
    compiled = []

    def load(name, sources, build_directory, **kwargs):
        assert not kernels.find("g++ (test) 1.0")  # nothing at the final path while the build runs
        compiled.append(build_directory)
        time.sleep(0.3)
        (Path(build_directory) / f"{name}.so").write_bytes(b"library")
    monkeypatch.setattr(cpp_extension, "load", load)
    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(lambda _: build.build(), range(4)))
    assert len(compiled) == 1 and paths == {kernels.find("g++ (test) 1.0")}
    left = sorted(p.name for p in Path(kernels.folder()).iterdir())
    assert left == [".lock", os.path.basename(kernels.build_folder("g++ (test) 1.0"))]
    assert (Path(paths.pop()).parent / "compiler").read_text() == "g++ (test) 1.0\n"
