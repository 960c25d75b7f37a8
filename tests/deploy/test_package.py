"""The package as pip installs it (a wheel, not this source tree) carries our kernels: their C++ ships in it, and
`prefixcache doctor` in a fresh venv runs them, from the library built for those sources, this compiler and this
torch in the user cache ($PREFIXCACHE_HOME, as the suite's: `make setup` built it there)."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from prefixcache import kernels

ROOT = Path(__file__).resolve().parents[2]


def test_an_installed_wheel_runs_our_kernels(tmp_path):
    choice = kernels.choose()  # built into the user cache now if `make setup` has not
    if not choice.isa:
        pytest.skip(f"kernels: {choice.status}")
    src, venv = tmp_path / "src", tmp_path / "venv"  # a copy: building the wheel writes beside the sources
    shutil.copytree(ROOT / "prefixcache", src / "prefixcache", ignore=shutil.ignore_patterns("__pycache__", "build"))
    shutil.copy(ROOT / "pyproject.toml", src)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # the dependencies (and pip, setuptools) are this interpreter's, read-only: a path, so its .pth files (an
    # editable prefixcache) are not read
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    python = venv / "bin" / "python"
    pip = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--ignore-installed", "--no-cache-dir", "--disable-pip-version-check", str(src)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    where = subprocess.run([python, "-c", "import prefixcache; print(prefixcache.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where
    doctor = subprocess.run([venv / "bin" / "prefixcache", "doctor"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ""}, timeout=600)
    assert f"\nkernels  {choice.isa} (built from the current sources" in doctor.stdout, doctor.stdout + doctor.stderr
