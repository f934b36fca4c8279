"""The trainer's fast path (torch.compile, CUDA graphs, channels_last, cuDNN autotuning): what `auto` turns on
for this device, precision, world size and run length, each with its reason (printed and written to run.json)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastddpm.config import ConfigError
from fastddpm.device import Precision


@dataclass
class FastPath:
    """What the fast path turned on, and why: printed at start and written to run.json."""

    compile: bool
    cuda_graphs: str  # "off" | "capture" | "reduce-overhead"
    channels_last: bool
    cudnn_benchmark: bool
    reasons: dict[str, str]
    compile_mode: str = "default"  # "default" | "max-autotune" (Inductor's)
    inductor_layout: str = "heuristic"  # "heuristic" (Inductor's own) | "channels-last" (layout optimization forced)
    attention_head_pad: int = 0  # attention heads narrower than this zero-padded to it (0: off)

    def lines(self) -> list[str]:
        return [f"{k}: {self.reasons[k]}" for k in ("compile", "cuda_graphs", "channels_last", "cudnn_benchmark",
                                                    "inductor_layout", "attention_head_pad") if k in self.reasons]


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
    CpuCompileMeasurement("a 2-core Xeon with amx_bf16", 371.0, 435.0, 45.0),
    # AMD EPYC (Zen 5) with avx512_bf16, 2026-11-25: the median of five side-by-side runs (1.02-1.13x), the
    # median eager rate, the cold compile of the first run (benchmarks/RESULTS.md, "The CPU fast path")
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


def _no_cpu_compiler() -> str | None:
    """Why Inductor finds no C++ compiler here (its own search: $CXX, then g++ and clang++), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except ImportError:  # another torch's layout: leave the decision to torch.compile itself
        return None
    except Exception as e:  # noqa: BLE001 - torch raises its own InvalidCxxCompiler (a RuntimeError) or OSError
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'none found'}"
    return None


def _channels_last_auto(cuda: bool, compiled: bool, world_size: int, model_family: str | None,
                        precision: str) -> tuple[bool, str]:
    """`--channels-last auto`: on where it was measured faster than NCHW, against NCHW in the same call (cuDNN's
    bf16 convolutions run in NHWC and convert every NCHW tensor they meet); off everywhere else."""
    if not cuda:
        return False, "auto: off on a CPU (the DDPM U-Net measured 0.77x NCHW's step there)"
    if not compiled:
        return False, "auto: off in eager, where GroupNorm has no NHWC kernel and converts back"
    if world_size:
        return False, "auto: off under DDP/FSDP (measured on one process only)"
    if precision != "bf16":
        return False, f"auto: off under {precision} (measured faster under bf16 only)"
    if model_family == "seed":
        # benchmarks/RESULTS.md, "GPU session 2026-11-27": seed-1layer at batch 1024, bf16, compiled, captured
        return True, ("auto: the seed U-Net compiled on CUDA; measured 1.09x the NCHW step on an H200 (seed-1layer, "
                      "batch 1024)")
    return False, ("auto: off for this U-Net; the DDPM family compiled measured 0.94x the NCHW step on an H200 "
                   "(ddpm-cifar10, batch 128)")


def _inductor_layout_auto(cuda: bool, compiled: bool, world_size: int, precision: str) -> tuple[str, str]:
    """`--inductor-layout auto`: Inductor's layout optimization forced where it was measured faster than Inductor's
    heuristic in the same call; the heuristic everywhere else."""
    if not compiled:
        return "heuristic", "auto: unused, not compiling"
    if not cuda:
        return "heuristic", "auto: Inductor's heuristic on a CPU (forcing it is unmeasured there)"
    if world_size:
        return "heuristic", "auto: Inductor's heuristic under DDP/FSDP (forcing it was measured on one process only)"
    if precision != "bf16":
        return "heuristic", f"auto: Inductor's heuristic under {precision} (forcing it was measured under bf16 only)"
    # benchmarks/RESULTS.md, "GPU session 2026-11-28": compiled, captured, bf16, each against the previous default
    return "channels-last", ("auto: forced on CUDA under compile, where its heuristic skips a U-Net; measured 1.18x "
                             "the heuristic's step on ddpm-cifar10 (batch 128, NCHW weights) and 1.02x on "
                             "seed-1layer (batch 1024, channels_last) on an H200")


def _attention_head_pad_auto(cuda: bool, compiled: bool, precision: str) -> tuple[int, str]:
    """`--attention-head-pad auto`: heads narrower than 8 padded to 8 where that was measured faster than the
    unpadded heads; off everywhere else. Only the seed U-Net has such heads (4 heads at 16 channels)."""
    if not cuda:
        return 0, "auto: off on a CPU (unmeasured there; the padded heads do twice the attention arithmetic)"
    if not compiled:
        return 0, "auto: off in eager (measured under compile only)"
    if precision != "bf16":
        return 0, f"auto: off under {precision} (measured under bf16 only)"
    # benchmarks/RESULTS.md, "GPU session 2026-11-28" (on top of channels_last) and "GPU session 2026-11-27" (NCHW)
    return 8, ("auto: 8 on CUDA under compile, where cuDNN's attention needs a head dimension that is a multiple of "
               "8; seed-1layer at batch 1024 measured 1.05x the unpadded step on an H200, NCHW and channels_last")


def resolve_fast_path(train_cfg, device: torch.device, precision: Precision, world_size: int = 0,
                      parallel: str = "ddp", planned_images: int | None = None,
                      model_family: str | None = None) -> FastPath:
    """`world_size`: ranks under torchrun (DDP or FSDP, per `parallel`), 0 for a plain single process.
    `planned_images`: the run's length, which decides `--compile auto` on a CPU. `model_family`: the U-Net's
    (model.family), which decides `--channels-last auto` on a GPU."""
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
    if compile_on and not cuda and (missing := _no_cpu_compiler()):
        # Inductor's CPU backend builds C++: without a compiler the first step fails, after the data and model set-up
        if c == "on":
            raise ConfigError(f"train.compile=on on a CPU needs a C++ compiler, which Inductor builds its kernels "
                              f"with ({missing}): install one (apt-get install g++), or --compile off")
        compile_on, why = False, f"auto: off, no C++ compiler for Inductor's CPU kernels ({missing}); install g++"
    if train_cfg.compile_mode != "default":
        if c == "off":
            raise ConfigError(f"train.compile_mode={train_cfg.compile_mode} is a mode of torch.compile: turn "
                              f"--compile on (or auto), or leave --compile-mode default")
        why += f"; mode {train_cfg.compile_mode}" if compile_on else f"; mode {train_cfg.compile_mode} unused"
    reasons["compile"] = f"{'on' if compile_on else 'off'} ({why})"
    il = train_cfg.inductor_layout
    if il == "auto":
        layout, why = _inductor_layout_auto(cuda, compile_on, world_size, precision.name)
    elif c == "off" and il == "channels-last":  # the heuristic asks for nothing: uncompiled, nothing differs
        raise ConfigError(f"train.inductor_layout={il} sets the layout of torch.compile's own tensors: turn "
                          f"--compile on (or auto), or leave --inductor-layout auto")
    else:
        layout, why = (il, "requested") if compile_on else ("heuristic", f"{il} unused, not compiling")
    reasons["inductor_layout"] = f"{layout} ({why})"
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
    if cl == "on" and fsdp:
        raise ConfigError("train.channels_last=on: FSDP shards contiguous parameters only, and channels_last "
                          "weights are not: use --channels-last off (or auto) with --parallel fsdp")
    if cl == "auto":
        channels_last, why = _channels_last_auto(cuda, compile_on, world_size, model_family, precision.name)
    else:
        channels_last, why = cl == "on", "requested"
    reasons["channels_last"] = f"{'on' if channels_last else 'off'} ({why})"
    pad = train_cfg.attention_head_pad
    if pad == "auto":
        pad, why = _attention_head_pad_auto(cuda, compile_on, precision.name)
    else:
        why = "requested"
    reasons["attention_head_pad"] = f"{pad or 'off'} ({why})"
    cb = train_cfg.cudnn_benchmark
    bench = (cuda if cb == "auto" else cb == "on")
    reasons["cudnn_benchmark"] = f"{'on' if bench else 'off'} (" + (
        "requested" if cb != "auto" else "auto: static shapes, so one search per shape pays off" if cuda
        else "auto: CPU") + ")"
    return FastPath(compile=compile_on, cuda_graphs=graphs, channels_last=channels_last, cudnn_benchmark=bench,
                    reasons=reasons, compile_mode=train_cfg.compile_mode if compile_on else "default",
                    inductor_layout=layout, attention_head_pad=pad)
