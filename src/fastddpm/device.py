"""The device a run computes on and the precision it computes in, each chosen with the reason (printed and
recorded in run.json), and autocast entered one way by the trainer's step and the samplers.

Ground floor: imports nothing of fastddpm but the config's error type, so every package may import it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fastddpm.config import ConfigError


def autocast(device_type: str, dtype: torch.dtype | None, cache: bool = True):
    """torch.autocast to `dtype` on `device_type`, or no autocast at all for None (fp32). `cache=False` turns the
    weight-cast cache off, as CUDA graph capture needs (a cached cast would be freed under the graph)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)


@dataclass
class Precision:
    name: str                          # "fp32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None  # None = no autocast
    use_grad_scaler: bool              # fp16 only: bf16 has fp32's exponent range, so nothing underflows
    reason: str

    def autocast(self, device: torch.device, cache: bool = True):
        return autocast(device.type, self.autocast_dtype, cache)


def resolve_device(spec: str, *, setting: str = "train.device") -> tuple[torch.device, str]:
    """The torch.device `spec` names (auto: CUDA when present), and why. `setting` is what gave it, as the error
    names it: a config field (train.device), a flag (--device) or a keyword (device)."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), f"auto: CUDA is available ({torch.cuda.get_device_name(0)})"
        return torch.device("cpu"), "auto: no CUDA device, using the CPU"
    named = f"{setting} {spec}" if setting.startswith("--") else f"{setting}={spec!r}"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"{named} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):  # mps, xpu, meta...: torch parses them; fastddpm runs on neither
        raise ConfigError(f"{named}: fastddpm runs on CUDA GPUs and on the CPU, not on {device.type} devices: use "
                          "auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{named}, but CUDA is not available here: use cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{named}, but this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device, "requested"


def fix_cpu_threads(requested: int | None) -> tuple[int, int]:
    """Set the intra-op thread count for a CPU run; returns (count now, count before) so a library caller's
    count can be restored afterwards.

    Called even when the count does not change: torch.set_num_threads also switches MKL's dynamic threading off
    (mkl_set_dynamic(false), aten/src/ATen/ParallelOpenMP.cpp), and MKL in dynamic mode runs some GEMMs on fewer
    threads, summing them in another order. A fresh process and one that has called set_num_threads before (a
    notebook, a test, the doctor's self-test) would then differ in the 8th digit. After this call a CPU run's
    summation order is a function of the thread count alone, which is what exact resume needs."""
    before = torch.get_num_threads()
    torch.set_num_threads(requested or before)
    return torch.get_num_threads(), before


def cuda_native_bf16(device: torch.device | int | None = None) -> tuple[bool, str]:
    """Whether a CUDA device computes bf16 natively (compute capability >= 8.0: Ampere and later), and why.

    `torch.cuda.is_bf16_supported()` also answers True on a T4 or V100 (sm75 / sm70), where bf16 is emulated:
    no bf16 tensor cores, no bf16 cuDNN convolutions, no flash attention. There fp16 + GradScaler is the fast
    recipe (the seed notebook trained on a T4 in fp16), so "native" is read off the compute capability alone."""
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major >= 8:
        return True, f"{name} is sm{major}{minor}: native bf16"
    return False, f"{name} is sm{major}{minor}: bf16 would be emulated (native from sm80, Ampere)"


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (x86 "flags", Arm "Features"); None where there is no such
    file (macOS, Windows): callers then assume the least. FASTDDPM_CPU_FLAGS (space-separated), when set, is
    the flag set instead: the test suite sets it so that every machine makes the same choices."""
    given = os.environ.get("FASTDDPM_CPU_FLAGS")
    if given is not None:
        return frozenset(given.split())
    return hardware_cpu_flags()


@functools.lru_cache(maxsize=1)
def hardware_cpu_flags() -> frozenset[str] | None:
    """/proc/cpuinfo's flags whatever FASTDDPM_CPU_FLAGS says: what the hardware computes, which is what a
    measurement finds (the doctor's rule 12 measures bf16 against fp32 before it calls bf16 emulated)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


# x86: AMX tiles (Sapphire Rapids and later) or AVX512-BF16 dot products (Cooper Lake, Zen 4); Arm: FEAT_BF16
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def cpu_native_bf16(flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether this CPU computes bf16 matmuls in hardware, and why (the flag it has, or the ones it lacks).
    Without them oneDNN emulates bf16 by converting to fp32, which is slower than fp32 itself."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return False, "the CPU's flags are unknown (no /proc/cpuinfo): assuming no native bf16"
    have = [f for f in CPU_BF16_FLAGS if f in flags]
    if have:
        return True, f"the CPU has {' and '.join(have)}: native bf16 matmuls"
    return False, "the CPU has none of amx_bf16, avx512_bf16 (x86) or bf16 (Arm): bf16 would be emulated"


def resolve_precision(spec: str, device: torch.device) -> Precision:
    if device.type != "cuda":
        if spec == "auto" and device.type == "cpu":
            # Measured on 2-core CPUs (benchmarks/RESULTS.md): with amx_bf16 or avx512_bf16 the cpu-demo U-Net trains
            # 1.4-1.6x faster under bf16 autocast than in fp32; without them oneDNN emulates bf16, 0.23x fp32 matmuls
            native, why = cpu_native_bf16()
            if native:
                return Precision("bf16", torch.bfloat16, False, f"auto: {why}; bf16 autocast (fp32 range, no loss "
                                 "scaling)")
            return Precision("fp32", None, False, f"auto: fp32, because {why}")
        if spec in ("auto", "fp32"):
            return Precision("fp32", None, False, f"{spec}: fp32 on {device.type}")
        if spec == "bf16":
            return Precision("bf16", torch.bfloat16, False, f"requested bf16 autocast on {device.type}")
        # fp16 + GradScaler runs on a CPU too (torch's CPU autocast has fp16 kernels): slower than fp32 there, but
        # it lets the loss-scaling path (skips on overflow, scale state across resume) be tested without a GPU.
        return Precision("fp16", torch.float16, True, f"requested fp16 autocast with GradScaler on {device.type} "
                         "(slower than fp32 on most CPUs: meant for testing the GPU recipe)")
    bf16_ok, why = cuda_native_bf16(device)
    if spec == "auto":
        if bf16_ok:
            return Precision("bf16", torch.bfloat16, False, f"auto: {why} (fp32 range, no loss scaling)")
        return Precision("fp16", torch.float16, True, f"auto: {why}; fp16 with GradScaler")
    if spec == "bf16":
        if not bf16_ok:
            raise ConfigError(f"train.precision=bf16 but {why}, slowly: use --precision fp16 (with GradScaler) "
                              "or auto")
        return Precision("bf16", torch.bfloat16, False, "requested")
    if spec == "fp16":
        return Precision("fp16", torch.float16, True, "requested (with GradScaler)")
    return Precision("fp32", None, False, "requested")
