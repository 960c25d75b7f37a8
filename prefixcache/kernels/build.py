"""Build the kernel library (`make setup` runs this, and the engine on first use where no build is found): C++ in
csrc/, through torch's extension toolchain, into the user cache (kernels/__init__.py says where). Processes that
build at once take turns on a lock; each build runs in a folder of its own, renamed into place when complete."""
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile

from prefixcache.kernels import LIBRARY, SOURCES, build_folder, compiler, find, folder


def build() -> str:
    from torch.utils.cpp_extension import load

    cc = compiler()
    if not cc:
        raise SystemExit("prefixcache kernels: no C++ compiler ($CXX or c++): install g++")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # pip's ninja
    os.makedirs(folder(), exist_ok=True)
    with open(os.path.join(folder(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if find(cc):
            return find(cc)  # built while this process waited
        work = tempfile.mkdtemp(prefix=".build-", dir=folder())
        try:
            # no -ffast-math and no fused a*b+c beyond the kernels' own fma: the bits must not depend on the compiler's
            # choices; -fno-math-errno lets sqrtf be the instruction. OpenMP for at::parallel_for: the library then
            # needs libgomp.so.1, which resolves to the one torch has already loaded
            load(name=LIBRARY, sources=SOURCES, build_directory=work, is_python_module=False, verbose=False,
                 extra_cflags=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"])
            with open(os.path.join(work, "compiler"), "w") as f:
                f.write(cc + "\n")
            with open(os.path.join(work, f"{LIBRARY}.so"), "rb") as f, \
                    open(os.path.join(work, f"{LIBRARY}.so.sha256"), "w") as pin:
                pin.write(hashlib.sha256(f.read()).hexdigest())  # checked before each load (kernels/__init__.py)
            shutil.rmtree(build_folder(cc), ignore_errors=True)  # a build that lost its library
            os.rename(work, build_folder(cc))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return find(cc)


if __name__ == "__main__":
    print(f"prefixcache kernels: built {build()}")
