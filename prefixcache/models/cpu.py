"""The CPU at hand: its model, SIMD flags and threads (from /proc/cpuinfo), torch's build, and what it can run.

The exactness probe caches its plans per CPU (models/probe.py); the engine refuses bfloat16 weights on a CPU
without native bf16 (check_dtype).
"""
import platform
import re
from dataclasses import dataclass

import torch

SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass
class CPU:
    model: str
    flags: list[str]  # every flag; `simd` picks the relevant ones
    threads: int
    torch: str
    blas: str

    @property
    def simd(self) -> list[str]:
        return [f for f in SIMD_FLAGS if f in self.flags]

    @property
    def has_bf16(self) -> bool:
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def __str__(self) -> str:
        return f"{self.model} ({' '.join(self.simd)}; {self.threads} threads; torch {self.torch}, {self.blas})"


def cpu_info() -> CPU:
    """From /proc/cpuinfo (elsewhere: no flags, so bfloat16 weights are refused) and torch's build."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    model, flags = (re.search(rf"^{key}\s*:\s*(.*)$", text, re.M) for key in ("model name", "flags"))
    config = torch.__config__.show()
    mkl, blas, onednn = (re.search(p, config) for p in (r"Math Kernel Library Version (\S+)", r"BLAS_INFO=(\w+)",
                                                        r"MKL-DNN (v\S+)"))
    libs = f"MKL {mkl.group(1)}" if mkl else f"BLAS {blas.group(1) if blas else 'unknown'}"
    libs += f", oneDNN {onednn.group(1)}" if onednn else ""
    return CPU(model.group(1) if model else platform.processor() or platform.machine(),
               flags.group(1).split() if flags else [], torch.get_num_threads(), torch.__version__, libs)


def check_dtype(dtype: str) -> None:
    """Raise ValueError if this CPU cannot run weights of `dtype` (Config.dtype) natively."""
    if dtype == "bfloat16" and not (cpu := cpu_info()).has_bf16:
        raise ValueError(f"dtype='bfloat16' needs a CPU with avx512_bf16 or AMX, which {cpu.model} lacks: "
                         "use float32")
