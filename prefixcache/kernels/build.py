"""Build the kernel library (`make setup` runs this): C++ in csrc/, through torch's extension toolchain, into
build/. The engine loads the result only if it was built from the sources as they are now (kernels/__init__.py)."""
import os
import sys

from prefixcache.kernels import BUILD, LIBRARY, SOURCES, source_hash


def build() -> str:
    from torch.utils.cpp_extension import load

    os.makedirs(BUILD, exist_ok=True)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # pip's ninja
    # no -ffast-math and no fused a*b+c beyond the kernels' own fma: the bits must not depend on the compiler's
    # choices; -fno-math-errno lets sqrtf be the instruction. OpenMP for at::parallel_for: the library then needs
    # libgomp.so.1, which resolves to the one torch has already loaded
    load(name=LIBRARY, sources=SOURCES, build_directory=BUILD, is_python_module=False, verbose=False,
         extra_cflags=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"])
    with open(os.path.join(BUILD, "sources.sha256"), "w") as f:
        f.write(source_hash())
    return os.path.join(BUILD, f"{LIBRARY}.so")


if __name__ == "__main__":
    print(f"prefixcache kernels: built {build()}")
