"""Measuring a step: timing, memory, FLOP counting, the device's measured peak, and the environment record, for
`fastddpm bench`, the doctor and `fastddpm eval` alike. Ground floor: it imports no other part of fastddpm.

The discipline (airbench / modded-nanogpt): warm up before timing; time the GPU with CUDA events between two
synchronisations, not with the host clock around asynchronous launches; repeat and report the median and the
spread; measure the peak that MFU is divided by in the same process, on the same device, in the dtype the
step computes in; and write the code version, library versions and device next to every number.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastddpm.device import cpu_native_bf16


# ----------------------------------------------------------------------------------------------------------------
# Clocks


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on `device` (a no-op on the CPU, whose ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn: Callable[[int], object], steps: int, device: torch.device | str) -> float:
    """Milliseconds for `fn(0), fn(1), ..., fn(steps - 1)`, from a drained queue to the last kernel's end.

    On CUDA: events recorded on the current stream (GPU timestamps, so the time a step spends waiting for the
    host to launch it counts, and the host racing ahead does not hide GPU work). On the CPU: perf_counter.
    """
    device = torch.device(device)
    if steps < 1:
        raise ValueError(f"time_steps: steps={steps} must be >= 1")
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # note: sync, so the timed window starts on an empty queue
        start.record()
        for i in range(steps):
            fn(i)
        end.record()
        end.synchronize()  # note: sync, the window ends when the last step's kernels have run
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    for i in range(steps):
        fn(i)
    return 1000.0 * (time.perf_counter() - t0)


def time_wall_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of wall time for one call of `fn`, synchronised on both sides (for compile / warm-up time,
    which is mostly host work: tracing, Inductor codegen, autotuning, graph capture)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def summarize(values: list[float]) -> dict[str, float]:
    """Median and spread of repeated measurements: min, q1, median, q3, max (and the count)."""
    a = np.asarray(values, dtype=np.float64)
    q1, median, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(median), "min": float(a.min()), "max": float(a.max()), "q1": float(q1),
            "q3": float(q3), "n": int(a.size)}


# ----------------------------------------------------------------------------------------------------------------
# Memory


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """torch.cuda.max_memory_allocated since the last reset; None where there is no such counter (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def free_device_memory(device: torch.device) -> None:
    """Drop cached blocks so the next variant starts from what it allocates itself (after gc.collect())."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# FLOPs: counted, and the peak measured


def count_step_flops(model: torch.nn.Module, batch_shape: tuple[int, ...], *, accum_steps: int = 1) -> int:
    """FLOPs of one training step: one forward + backward of `model` per micro-batch of shape `batch_shape`
    (B, C, H, W), times `accum_steps`, as torch.utils.flop_counter.FlopCounterMode counts them (2 per
    multiply-add of matmuls and convolutions; norms, activations and the optimizer are not counted).

    Counted on an uncompiled copy of the model on the meta device: exact shapes, no memory, no compute, the
    same number whichever device the step runs on. Attention is counted through SDPA's math backend (two
    bmm forward, four backward: the model's FLOPs), because the fused kernels are counted unevenly: the CPU
    flash kernel has no FLOP formula (it counts zero) and the CUDA flash backward also counts its recompute of
    Q K^T (hardware FLOPs, not model FLOPs). Gradient checkpointing's recompute is likewise left out, and so
    are the zeros of attention heads padded to a wider head dimension (`head_pad`: the same model).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    meta_model = copy.deepcopy(model).to("meta").train()
    if hasattr(meta_model, "grad_checkpointing"):
        meta_model.grad_checkpointing = False
    for module in meta_model.modules():  # the model's FLOPs: padded heads multiply zeros
        if hasattr(module, "head_pad"):
            module.head_pad = 0
    x_BCHW = torch.empty(batch_shape, device="meta")
    t_B = torch.zeros(batch_shape[0], dtype=torch.long, device="meta")  # values never change the count
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        out = meta_model(x_BCHW, t_B)
        out.float().square().mean().backward()  # the MSE itself is elementwise: it counts zero, like the real loss
    return int(counter.get_total_flops()) * accum_steps


def matmul_dtype_name(dtype: torch.dtype, device: torch.device) -> str:
    """bf16 / fp16 / fp32, or tf32 for an fp32 matmul on CUDA while TF32 is allowed (cuBLAS then runs it on the
    tensor cores with 10-bit mantissas, at 7-8x the datasheet fp32 rate of an A100 or H100)."""
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def measure_matmul_peak(device: torch.device | str, *, n: int | None = None, dtype: torch.dtype | None = None,
                        trials: int = 5, iters: int | None = None, emulated: bool = False) -> dict:
    """The achievable dense-matmul rate on `device` in `dtype`, measured now: an MFU denominator.

    CUDA: an n x n x n matmul (n = 8192: 1.1 TFLOP each), warmed, timed with CUDA events, best of `trials`
    trials of `iters` matmuls (an H100 80GB measures ~790-800 TFLOP/s in bf16; the datasheet's 989 is not
    reached by any real kernel). An fp32 matmul runs as TF32 when torch.backends.cuda.matmul.allow_tf32 is on
    (as in training), and is then labelled tf32. Default dtype: bf16 on CUDA, fp32 on the CPU.

    CPU: on all of torch's threads, the faster of two kernels: an n x n x n torch.matmul (n = 1024) and a 3x3
    convolution in channels_last (CONV_PEAK_SHAPE), the oneDNN kernel the U-Nets' own convolutions use. A dtype
    the CPU emulates runs its matmuls 50-100x below fp32 (1.4 GFLOP/s for bf16 and fp16 on a 2-core AMD EPYC with
    AVX2 only, against 65-90 for fp32): at n = 1024 the measurement alone took 25 s there. fp16 (which most CPUs
    emulate), and a dtype the caller says is `emulated` (bf16 where device.cpu_native_bf16 finds no flag for it),
    are measured at n = 256 and a convolution of 2 images, where the rate is about the same.
    The two kernels differ: torch.matmul is MKL's sgemm in fp32, which on an AMD CPU runs AVX2 code: 0.21 TFLOP/s
    on a 2-core Zen 5 whose oneDNN convolutions reach 0.50 (AVX-512), while bf16 goes to oneDNN either way (1.0).
    A peak read off MKL alone put the fp32 U-Net at "114% MFU" and bf16 at 4.2x fp32's rate; the hardware's ratio
    (avx512_bf16's dot products against fp32 FMAs) is 2x.
    Returns {"tflops", "label", "device", "dtype", "n", "iters", "trials", "per_trial_tflops", "path"}.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    small = not cuda and (emulated or dtype == torch.float16)
    n = n or (8192 if cuda else 256 if small else 1024)
    iters = iters or (10 if cuda else 3)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    paths = {f"matmul {n}^3": (lambda i: torch.matmul(a, b, out=c), 2 * n**3)}
    if not cuda:
        paths["conv3x3 (oneDNN)"] = conv3x3_peak_case(dtype, device, gen, batch=2 if small else None)
    rates: dict[str, list[float]] = {}
    for path, (fn, flops) in paths.items():
        for _ in range(3):  # warm-up: cuBLAS heuristics and workspace, clocks up, CPU threads spun up, primitives
            fn(0)
        rates[path] = [flops * iters / (time_steps(fn, iters, device) / 1000) / 1e12 for _ in range(trials)]
    del a, b, c, paths
    free_device_memory(device)
    best = max(rates, key=lambda k: max(rates[k]))
    name = matmul_dtype_name(dtype, device)
    if cuda:
        what = f"{name} matmul {n}x{n}x{n} on {device_name(device)}"
    else:
        others = "".join(f"; {k} {max(v):.3f}" for k, v in rates.items() if k != best)
        what = f"{name} {best} on {device_name(device)}, {torch.get_num_threads()} threads{others}"
    return {
        "tflops": max(rates[best]),
        "label": f"measured {what}, best of {trials}",
        "device": str(device), "dtype": name, "n": n, "iters": iters, "trials": trials,
        "per_trial_tflops": rates[best], "path": best,
    }


# ----------------------------------------------------------------------------------------------------------------
# The roofline: the least time a step needs, on the compute side or the memory side


# What the update moves per fp32 parameter, in parameter-sized tensors: the forward and the backward read the
# weights (2), the backward writes the gradient (1), AdamW reads weight, gradient and both moments and writes
# weight and moments (7); fastddpm's EMA reads its copy and the weight and writes its copy (3).
ADAMW_UPDATE_TENSORS = 2 + 1 + 7
UPDATE_TENSORS = ADAMW_UPDATE_TENSORS + 3


def _storage_of(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of a tensor's storage (a DTensor's: its local shard's), or None for a tensor without
    one readable storage (sparse, nested, a wrapper subclass such as float8)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        t = local
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def optimizer_passes(optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    """Parameter-sized tensors an optimizer step reads and writes, and its name: Adam's family reads weight,
    gradient and two moments and writes weight and moments (7); SGD with momentum reads weight, gradient and
    buffer and writes weight and buffer (5), without it 3. Others are taken as Adam's, and said to be."""
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return 7, name
    if name == "SGD":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return (5, "SGD with momentum") if momentum else (3, "SGD")
    return 7, f"{name} (taken as Adam's 7 passes)"


class SavedTensors:
    """While active (a context manager, entered and left on the training thread): the storages autograd saves for
    the backward, each once (a tensor saved by several ops, or views of one storage, move through memory once;
    an address reused after the earlier storage was freed, as between micro-batches, is a new storage), and the
    parameters that any torch.optim optimizer steps (a process-wide pre-hook while active).
    Parameters are saved too (a convolution keeps its weight); they are no activation: `activation_bytes(params)`
    leaves out the storages of `params`, of the parameters an optimizer stepped, of leaf tensors that require
    grad or views of them (an eager step's weights; a compiled graph's weights are neither), and of casts of
    such leaves (autocast's low-precision weight copies: `cast_bytes()`).
    Activation checkpointing installs hooks of its own, under which these see nothing: what it recomputes is
    not counted. `on_pack`, when given, sees each saved tensor too (the only saved-tensor hooks in effect are the
    innermost ones, so a second observer rides on these)."""

    def __init__(self, on_pack: Callable[[torch.Tensor], None] | None = None):
        self.on_pack = on_pack
        self.saved: list[tuple[int, int]] = []  # (data pointer, bytes), one a storage
        self._alive: dict[int, tuple[weakref.ref, ...]] = {}  # data pointer -> tensors saved on it, while they live
        self.leaf_numel: dict[int, int] = {}  # of those, leaf tensors that require grad -> elements
        self.casts: dict[int, int] = {}  # of those, dtype casts of such leaves (autocast's weight copies) -> bytes
        self.stepped: dict[int, tuple[int, int, int]] = {}  # stepped parameters: pointer -> (numel, bytes/elt, passes)
        self.optimizers: set[str] = set()
        self._hooks = None
        self._optimizer_hook = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.on_pack is not None:
            self.on_pack(t)
        # Autograd keeps what the pack hook returns. Returning `t` itself ties a saved output to its own grad_fn
        # (tensor -> grad_fn -> saved tensor -> tensor): a cycle no collector frees, so a forward observed without
        # its backward (count_step_bytes' probes) stayed alive, and with it the parameters' AccumulateGrad nodes; a
        # whole-step CUDA graph capture after such a probe failed on an H100 (torch 2.11). A detached alias keeps
        # the storage and no graph; autograd re-attaches the graph when it unpacks.
        packed = t.detach()
        key = _storage_of(t)
        if key is None:
            return packed
        ptr, nbytes = key
        seen = self._alive.get(ptr)
        if seen is None or all(ref() is None for ref in seen):
            self.saved.append((ptr, nbytes))
            # the storage is alive while either is: `t` (the caller's tensor, e.g. a batch read by every
            # micro-batch) or `packed` (what autograd holds; `t` may be an op's temporary view, gone at once)
            self._alive[ptr] = (weakref.ref(t), weakref.ref(packed))
        base = t._base if t._base is not None else t  # a linear layer saves its weight as weight.t(), a view
        if base.is_leaf and base.requires_grad:
            self.leaf_numel[ptr] = base.numel()
        elif _is_cast_of_leaf(base):
            self.casts[ptr] = nbytes
        return packed

    def _stepped(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        passes, name = optimizer_passes(optimizer)
        self.optimizers.add(name)
        for group in optimizer.param_groups:
            for p in group["params"]:
                key = _storage_of(p)
                if key is not None:
                    self.stepped[key[0]] = (p.numel(), p.element_size(), passes)

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed)
        self._hooks.__enter__()
        # a pre-hook: the doctor ends its steps in a post-hook, and this one is removed then (a hook removed from
        # the dict being iterated would break the optimizer's loop over it)
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._optimizer_hook = register_optimizer_step_pre_hook(self._stepped)
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._optimizer_hook.remove()
            hooks, self._hooks, self._optimizer_hook = self._hooks, None, None
            hooks.__exit__(*exc)

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def total_bytes(self) -> int:
        return sum(n for _, n in self.saved)

    def activation_bytes(self, params: list[torch.Tensor] | tuple = ()) -> int:
        given = {key[0] for key in map(_storage_of, params) if key is not None}
        skip = set(self.leaf_numel) | set(self.stepped) | set(self.casts) | given
        return sum(n for ptr, n in self.saved if ptr not in skip)

    def cast_bytes(self) -> int:
        """The saved casts of the weights (autocast's bf16/fp16 copies): a cost of the weights, whatever the batch,
        written by the forward and read by the backward, once a step."""
        return sum(self.casts.values())


def _is_cast_of_leaf(t: torch.Tensor) -> bool:
    """Whether `t` is a dtype/device copy of a leaf that requires grad (autocast's cast of a weight): its grad_fn is
    a ToCopyBackward whose input is that leaf's AccumulateGrad."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return False
    source = fn.next_functions[0][0]
    return source is not None and hasattr(source, "variable")  # AccumulateGrad holds the leaf as .variable


def count_step_bytes(model: torch.nn.Module, image_shape: tuple[int, ...], *, images_per_step: int,
                     device: torch.device | str, autocast_dtype: torch.dtype | None) -> dict:
    """The bytes one training step must move through memory at the least, per image.

    Activations: what autograd saves for the backward in the run's dtype (SavedTensors), written by the forward
    and read by the backward: twice its size. Counted on the device from two probe forwards of 1 and 2 images
    under the run's autocast; their difference is one image's, so that the weights (and autocast's cached casts
    of them), saved whatever the batch, are not counted as activations. Eager autograd's saved set:
    torch.compile may save less (it recomputes cheap ops), never more by much.
    Update: UPDATE_TENSORS fp32 passes over the parameters (weights, gradients, AdamW moments, the EMA), once a
    step: per image, divided by `images_per_step`.
    Returns {"activation_bytes_per_image", "update_bytes_per_step", "bytes_per_image"}."""
    device = torch.device(device)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = []
    for probe in (1, 2):
        gen = torch.Generator(device=device).manual_seed(0)
        x_BCHW = torch.randn(probe, *image_shape, device=device, generator=gen)
        t_B = torch.zeros(probe, dtype=torch.long, device=device)
        ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        # dropout draws from the global RNG: forked, so that the run being measured draws what it would have
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with rng, SavedTensors() as counted, ctx:
            loss = model(x_BCHW, t_B).float().square().mean()
        del loss  # the graph and what it saved go with it
        saved.append(counted.total_bytes())
    activation = max(0, saved[1] - saved[0])
    update = UPDATE_TENSORS * sum(p.numel() for p in params) * 4
    return {"activation_bytes_per_image": activation, "update_bytes_per_step": update,
            "bytes_per_image": 2 * activation + update / images_per_step}


def measure_memory_bandwidth(device: torch.device | str, *, nbytes: int | None = None, trials: int = 5) -> dict:
    """The device's memory bandwidth, measured now: one large device-to-device copy (read and written: twice its
    size moved), best of `trials`. 1 GiB on a GPU; 256 MiB on a CPU, well past its caches.
    Returns {"gbps", "label", "nbytes"}."""
    device = torch.device(device)
    n = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    iters = 5 if device.type == "cuda" else 2
    for _ in range(2):  # warm-up: pages touched, clocks up
        dst.copy_(src)
    rates = [2 * n * iters / (time_steps(lambda i: dst.copy_(src), iters, device) / 1000) / 1e9 for _ in range(trials)]
    del src, dst
    free_device_memory(device)
    return {"gbps": max(rates), "nbytes": n,
            "label": f"measured {n / 2**20:,.0f} MiB copy on {device_name(device)}, best of {trials}"}


def roofline(*, flops_per_image: float, bytes_per_image: float, peak_tflops: float, bandwidth_gbps: float,
             images_per_s: float | None = None) -> dict:
    """The least time an image's step needs: max(FLOPs / peak FLOP/s, bytes / bandwidth), the side that binds,
    and images/s as a share of what that bound allows ("% of roofline")."""
    compute_s = flops_per_image / (peak_tflops * 1e12)
    memory_s = bytes_per_image / (bandwidth_gbps * 1e9)
    bound_s = max(compute_s, memory_s)
    return {"bound_us_per_image": 1e6 * bound_s, "compute_us_per_image": 1e6 * compute_s,
            "memory_us_per_image": 1e6 * memory_s, "binds": "compute" if compute_s >= memory_s else "memory",
            "roofline_pct": 100 * images_per_s * bound_s if images_per_s else None}


def share_warning(mfu_pct: float | None, roofline_pct: float | None, binds: str | None) -> str | None:
    """Why an MFU or a share of the roofline over 100% cannot be read as it stands, or None.

    MFU over 100% (and the roofline's compute side, which is MFU when compute binds) means the step ran faster
    than the matmul peak measured in the same run: the peak was measured low, most often while another process
    used the device, and every share of that run then reads high. Over 100% of a memory-bound roofline means
    the step moved fewer bytes than eager autograd saves (torch.compile recomputes cheap ops instead of saving
    them) or the bandwidth was measured low under load."""
    if mfu_pct is not None and mfu_pct > 100:
        return (f"MFU {mfu_pct:.0f}% is over 100%: the matmul peak measured in this run is below what the step "
                "reached (likely measured while another process used the device), so this run's MFU and roofline "
                "shares read high; rerun on an idle device")
    if roofline_pct is not None and roofline_pct > 100 and binds == "memory":
        return (f"{roofline_pct:.0f}% of a memory-bound roofline: the step moved fewer bytes than eager autograd "
                "saves (torch.compile recomputes instead of saving), or the bandwidth was measured low under load")
    return None


class Peaks:
    """A run's denominators, each measured the first time it is needed and then shared: the matmul peak per dtype
    (MFU's), and the memory bandwidth (the roofline's memory side). A run that reuses every result measures none."""

    def __init__(self, device: torch.device, log: Callable[[str], None] = print):
        self.device, self.log = torch.device(device), log
        self.measured: dict[str, dict] = {}  # dtype name (bf16, fp16, tf32, fp32) -> measure_matmul_peak's dict
        self._bandwidth: dict | None = None

    def matmul(self, dtype: torch.dtype) -> dict:
        name = matmul_dtype_name(dtype, self.device)
        if name not in self.measured:
            # bf16 on a CPU without native bf16 runs emulated: measured small (seconds, not 25), at about its rate
            emulated = self.device.type == "cpu" and dtype == torch.bfloat16 and not cpu_native_bf16()[0]
            self.measured[name] = measure_matmul_peak(self.device, dtype=dtype, emulated=emulated)
            peak = self.measured[name]
            self.log(f"peak for MFU ({name}): {peak['tflops']:,.3f} TFLOP/s ({peak['label']})")
        return self.measured[name]

    def bandwidth(self) -> dict:
        if self._bandwidth is None:
            self._bandwidth = measure_memory_bandwidth(self.device)
            self.log(f"memory bandwidth for the roofline: {self._bandwidth['gbps']:,.1f} GB/s "
                     f"({self._bandwidth['label']})")
        return self._bandwidth


def model_roofline(model: torch.nn.Module, image_shape: tuple[int, ...], *, images_per_step: int,
                   device: torch.device | str, autocast_dtype: torch.dtype | None, images_per_s: float,
                   peaks: Peaks) -> dict:
    """MFU and the roofline of a U-Net's training step measured at `images_per_s`: FLOPs and bytes counted on the
    model (count_step_flops, count_step_bytes), against the peak in the step's own dtype and the bandwidth."""
    peak = peaks.matmul(autocast_dtype or torch.float32)
    bandwidth = peaks.bandwidth()
    flops = count_step_flops(model, (images_per_step, *image_shape)) / images_per_step
    moved = count_step_bytes(model, image_shape, images_per_step=images_per_step, device=device,
                             autocast_dtype=autocast_dtype)
    roof = roofline(flops_per_image=flops, bytes_per_image=moved["bytes_per_image"], peak_tflops=peak["tflops"],
                    bandwidth_gbps=bandwidth["gbps"], images_per_s=images_per_s)
    return {"gflops_per_image": flops / 1e9, "mfu_pct": 100 * flops * images_per_s / (peak["tflops"] * 1e12),
            "mfu_dtype": peak["dtype"], "activation_bytes_per_image": moved["activation_bytes_per_image"],
            "mb_per_image": moved["bytes_per_image"] / 1e6, "bandwidth_gbps": bandwidth["gbps"],
            "bound_us_per_image": roof["bound_us_per_image"], "roofline_pct": roof["roofline_pct"],
            "roofline_binds": roof["binds"]}


CONV_PEAK_SHAPE = (16, 128, 28, 28)  # (B, C, H, W), C -> C channels: a U-Net level's convolution at MNIST's size


def conv3x3_peak_case(dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                      batch: int | None = None) -> tuple[Callable[[int], torch.Tensor], int]:
    """(a callable running one 3x3 convolution of CONV_PEAK_SHAPE (`batch` images in place of its 16) in
    channels_last, its FLOPs: 2 per multiply-add, as FlopCounterMode counts them)."""
    b, ch, h, w = CONV_PEAK_SHAPE
    b = batch or b
    x = torch.randn((b, ch, h, w), device=device, generator=gen).to(dtype)
    weight = torch.randn(ch, ch, 3, 3, device=device, generator=gen).to(dtype)
    x, weight = (t.contiguous(memory_format=torch.channels_last) for t in (x, weight))
    return (lambda i: torch.nn.functional.conv2d(x, weight, padding=1)), 2 * b * h * w * ch * ch * 9


# ----------------------------------------------------------------------------------------------------------------
# Where the numbers came from


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state(path: Path | None = None) -> dict[str, object]:
    """The commit of the fastddpm source tree (not of the current directory), and whether the package's files
    (changed or new) differ from it. Read-only: GIT_OPTIONAL_LOCKS=0 keeps `git status` from refreshing the index.

    FASTDDPM_COMMIT, when set, is the commit: a copy of the tree sent to another machine can carry a stale .git
    (seen on the device machine: the session's first commit, every file then "uncommitted changes")."""
    given = os.environ.get("FASTDDPM_COMMIT")
    if given:
        return {"git_commit": given, "git_dirty": None, "git_commit_source": "FASTDDPM_COMMIT"}
    path = path or Path(__file__).resolve().parent.parent  # src/fastddpm
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=path, env=env)
    if commit is None:
        return {"git_commit": "unknown", "git_dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=all", "--", "."], cwd=path, env=env)
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def _cuda_driver_version() -> str | None:
    try:
        import pynvml  # optional: nvidia-ml-py

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - absent or broken NVML: fall back to nvidia-smi
        pass
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def environment_record(device: torch.device | str, argv: list[str] | None = None) -> dict[str, object]:
    """Everything needed to know what produced a number: device, driver, library versions, code version,
    the UTC date and the exact command line."""
    import fastddpm

    device = torch.device(device)
    argv = list(sys.argv if argv is None else argv)
    env: dict[str, object] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run_id": uuid.uuid4().hex[:12],  # two runs of one command within a second are still two runs
        "command": argv,
        "command_line": shlex.join(argv),
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "fastddpm": fastddpm.__version__,
        **git_state(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_runtime": torch.version.cuda,
        "cuda_driver": None,
        "cudnn": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update({
            "cuda_driver": _cuda_driver_version(),
            "cudnn": torch.backends.cudnn.version(),
            "compute_capability": f"{props.major}.{props.minor}",
            "device_memory_gib": round(props.total_memory / 2**30, 2),
            "multiprocessors": props.multi_processor_count,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        })
    return env
