"""Device and precision choices, each with the reason it was made (printed and recorded in run.json)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fastddpm import amp
from fastddpm.config import ConfigError


@dataclass
class Precision:
    name: str                          # "fp32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None  # None = no autocast
    use_grad_scaler: bool              # fp16 only: bf16 has fp32's exponent range, so nothing underflows
    reason: str

    def autocast(self, device: torch.device, cache: bool = True):
        return amp.autocast(device.type, self.autocast_dtype, cache)


def resolve_device(spec: str) -> tuple[torch.device, str]:
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), f"auto: CUDA is available ({torch.cuda.get_device_name(0)})"
        return torch.device("cpu"), "auto: no CUDA device, using the CPU"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"train.device={spec!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={spec!r} but CUDA is not available here: use --device cpu or auto")
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
    recipe (the seed's T4 ran fp16), so "native" is read off the compute capability alone."""
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
    return _proc_cpu_flags()


@functools.lru_cache(maxsize=1)
def _proc_cpu_flags() -> frozenset[str] | None:
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
            # issue 18's measurement on a 2-core CPU with amx_bf16: the cpu-demo U-Net trains 1.6x faster under bf16
            # autocast than in fp32; without the flags oneDNN emulates bf16 and it runs slower (0.23x fp32 matmuls)
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


@dataclass
class FastPath:
    """What the fast path turned on, and why: printed at start and written to run.json."""

    compile: bool
    cuda_graphs: str  # "off" | "capture" | "reduce-overhead"
    channels_last: bool
    cudnn_benchmark: bool
    reasons: dict[str, str]

    def lines(self) -> list[str]:
        return [f"{k}: {self.reasons[k]}" for k in ("compile", "cuda_graphs", "channels_last", "cudnn_benchmark")]


@dataclass(frozen=True)
class CpuCompileMeasurement:
    """torch.compile against eager on one CPU: the cpu-demo U-Net's training step, batch 64, 2 cores, bf16."""

    cpu: str
    eager_images_per_s: float
    compiled_images_per_s: float
    compile_s: float  # a cold compile (an empty Inductor cache); a warm cache takes ~6 s

    @property
    def speedup(self) -> float:
        return self.compiled_images_per_s / self.eager_images_per_s

    @property
    def payback_images(self) -> float:
        """Images after which the time compiling cost is saved: compile_s / seconds saved per image."""
        return self.compile_s / (1 / self.eager_images_per_s - 1 / self.compiled_images_per_s)


# fp32 compiled measured no faster than eager on both (222 vs 231 images/s; 312 vs 288 and 328 vs 352), so auto
# compiles only under bf16, and only runs long enough to pay back on the CPU where it gained least, twice over.
CPU_COMPILE_MEASURED = (
    CpuCompileMeasurement("a 2-core Xeon with amx_bf16 (issue 18)", 371.0, 435.0, 45.0),
    # AMD EPYC (Zen 5) with avx512_bf16, 2026-11-25: the median of five side-by-side runs (1.02-1.13x), the
    # median eager rate, the cold compile of the first run (benchmarks/RESULTS.md, issue 18)
    CpuCompileMeasurement("a 2-core AMD EPYC (Zen 5) with avx512_bf16", 493.0, 524.0, 44.0),
)
CPU_COMPILE_MARGIN = 2.0


def cpu_compile_min_images() -> int:
    """The planned run length (images) from which `--compile auto` compiles on a CPU under bf16."""
    return int(CPU_COMPILE_MARGIN * max(m.payback_images for m in CPU_COMPILE_MEASURED))


def _cpu_compile_auto(precision: Precision, planned_images: int | None) -> tuple[bool, str]:
    if precision.autocast_dtype != torch.bfloat16:
        return False, ("auto: off on CPU in fp32, where compiling measured no faster than eager (cpu-demo, two "
                       "CPUs); it pays only under bf16")
    if planned_images is None:
        return False, "auto: off on CPU, the run's length is not known here (--compile on to compile)"
    need = cpu_compile_min_images()
    slow = max(CPU_COMPILE_MEASURED, key=lambda m: m.payback_images)
    measured = (f"compiling (~{slow.compile_s:.0f} s cold) pays back at {slow.speedup:.2f}x under bf16 after "
                f"~{int(slow.payback_images):,} images on {slow.cpu}, the CPU it gained least on")
    if planned_images < need:
        return False, (f"auto: off on CPU, this run plans {planned_images:,} images; {measured}, and auto asks "
                       f"for {need:,}")
    return True, f"auto: on, this run plans {planned_images:,} images, more than twice what it takes: {measured}"


def resolve_fast_path(train_cfg, device: torch.device, precision: Precision, world_size: int = 0,
                      parallel: str = "ddp", planned_images: int | None = None) -> FastPath:
    """`world_size`: ranks under torchrun (DDP or FSDP, per `parallel`), 0 for a plain single process.
    `planned_images`: the run's length, which decides `--compile auto` on a CPU."""
    cuda = device.type == "cuda"
    reasons = {}
    c = train_cfg.compile
    fsdp = bool(world_size) and parallel == "fsdp"
    if c != "auto":
        compile_on, why = c == "on", "requested"
    elif fsdp:
        compile_on, why = False, ("auto: off under FSDP, whose per-block all-gather hooks split the compiled loss "
                                  "into pieces; not yet measured faster (--compile on to try)")
    elif cuda:
        compile_on, why = True, "auto: CUDA"
    else:
        compile_on, why = _cpu_compile_auto(precision, planned_images)
    reasons["compile"] = f"{'on' if compile_on else 'off'} ({why})"
    g = train_cfg.cuda_graphs
    if g == "auto":
        if not cuda:
            graphs, why = "off", "auto: no CUDA"
        elif precision.use_grad_scaler:
            graphs, why = "off", "auto: fp16's GradScaler is not captured; use bf16 for graphs"
        elif train_cfg.ema_every != 1:
            graphs, why = "off", "auto: ema_every > 1 runs the EMA outside the step"
        elif fsdp:
            graphs, why = "off", (f"auto: FSDP over {world_size} rank(s); its all-gathers and reduce-scatters are not "
                                  "captured")
        elif world_size:
            # Not suggested: reduce-overhead (cudagraph trees) under DDP + compile has an open PyTorch bug
            # (pytorch#113809) and is unmeasured here.
            graphs, why = "off", (f"auto: DDP over {world_size} rank(s); the gradient all-reduce is not captured "
                                  "into the step's graph (compile stays on)")
        else:
            graphs, why = "capture", "auto: the whole step captured in one CUDA graph"
    else:
        graphs, why = g, "requested"
        if g != "off" and not cuda:
            raise ConfigError(f"train.cuda_graphs={g} needs a CUDA device (device is {device}); use off")
        if g == "reduce-overhead" and not compile_on:
            raise ConfigError("train.cuda_graphs=reduce-overhead is torch.compile's mode: turn --compile on")
        if g == "capture" and train_cfg.ema_every != 1:
            raise ConfigError("train.cuda_graphs=capture records the EMA inside the step: use --ema-every 1, or "
                              "--cuda-graphs reduce-overhead/off with --ema-every > 1")
        if g == "reduce-overhead" and fsdp:
            raise ConfigError("train.cuda_graphs=reduce-overhead does not capture FSDP's all-gathers and "
                              "reduce-scatters: use --cuda-graphs off with --parallel fsdp")
        if g == "capture" and world_size:
            raise ConfigError(f"train.cuda_graphs=capture records the whole step in one graph, which does not "
                              f"include DDP's all-reduce ({world_size} rank(s)): use "
                              f"--cuda-graphs off")
        if g == "capture" and precision.use_grad_scaler:
            raise ConfigError("train.cuda_graphs=capture does not capture fp16's GradScaler: use --precision bf16 "
                              "(or fp32), or --cuda-graphs off")
    reasons["cuda_graphs"] = f"{graphs} ({why})"
    cl = train_cfg.channels_last
    channels_last = cl == "on"
    if channels_last and fsdp:
        raise ConfigError("train.channels_last=on: FSDP shards contiguous parameters only, and channels_last "
                          "weights are not: use --channels-last off (or auto) with --parallel fsdp")
    reasons["channels_last"] = f"{'on' if channels_last else 'off'} (" + (
        "requested" if cl != "auto" else "auto: off until measured faster for this U-Net; GroupNorm has no "
        "NHWC kernel in eager") + ")"
    cb = train_cfg.cudnn_benchmark
    bench = (cuda if cb == "auto" else cb == "on")
    reasons["cudnn_benchmark"] = f"{'on' if bench else 'off'} (" + (
        "requested" if cb != "auto" else "auto: static shapes, so one search per shape pays off" if cuda
        else "auto: CPU") + ")"
    return FastPath(compile=compile_on, cuda_graphs=graphs, channels_last=channels_last, cudnn_benchmark=bench,
                    reasons=reasons)
