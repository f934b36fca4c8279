"""The rungs of `fastddpm bench ladder` (seed 000's DDPM ladder, then past it). Each rung adds one change.

Rungs 0-6 are "the user's loop": a torch Dataset / DataLoader, `.to(device)`, and fastddpm's plain step
(fastddpm.trainer.step.train_step, with torch.amp.GradScaler for fp16), a plain (non-fused, per-tensor) AdamW
and a per-tensor EMA loop, as a user writes them. Rungs 7-9 are fastddpm's own machinery (build_model /
Optimization: TrainStep, fused AdamW, foreach EMA, CUDA graph capture; find_batch_size).

A rung's switches are the previous rung's plus its own change. A rung that cannot run here (no CUDA; bf16 on a
GPU that would emulate it) is skipped and its change is not carried forward; a rung with `branch=True` (bf16)
is shown but not carried. Every rung's precision goes through fastddpm.device.resolve_precision, the
trainer's own owner of that choice.
Every builder returns a Prepared: a `step(i)` closure (one optimizer step, drawing its batch) plus notes.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from fastddpm.config import RunConfig, apply_overrides
from fastddpm.device import Precision, cpu_native_bf16, cuda_native_bf16, resolve_precision
from fastddpm.measure import Peaks
from fastddpm.trainer.batches import Batch, ResidentBatches
from fastddpm.trainer.build import Optimization, build_model
from fastddpm.trainer.fast_path import FastPath
from fastddpm.trainer.step import train_step


@dataclass(frozen=True)
class Switches:
    """Everything that differs between rungs. Rung 0 is the defaults."""

    source: str = "png"  # png = decode one PNG per item (the seed's baseline); ram = decoded once at start
    workers: int = 0  # DataLoader worker processes
    pin_memory: bool = False  # DataLoader(pin_memory=...) (CUDA only; a no-op on the CPU)
    non_blocking: bool = False  # .to(device, non_blocking=...)
    precision: str = "fp32"  # fp32 | fp16 (autocast + GradScaler) | bf16 (autocast, no scaler)
    batch_size: int = 64
    compile: bool = False  # torch.compile(model)
    drop_last: bool = False  # DataLoader(drop_last=...): static shapes for compile
    resident: bool = False  # uint8 data on the device, batches gathered there (ResidentBatches); no .item()/step
    fused: bool = False  # fastddpm TrainStep: fused AdamW + foreach EMA
    cuda_graphs: bool = False  # fastddpm TrainStep: the whole step captured in one CUDA graph
    auto_batch: bool = False  # batch size = the throughput knee (find_batch_size)
    layout: bool = False  # channels_last, Inductor's layout forced, heads padded: where fastddpm's auto picks them


@dataclass(frozen=True)
class Rung:
    key: str  # "0".."10", "3b"
    title: str  # short name for tables and the chart
    change: str  # the one change this rung makes, in words
    delta: dict  # the Switches fields it changes
    needs_cuda: str | None = None  # why it needs CUDA, or None
    branch: bool = False  # shown, but its change is not carried to the next rung
    cpu_quick_skip: str | None = None  # why --quick on a CPU skips it, or None


DDPM_RUNGS: list[Rung] = [
    Rung("0", "baseline", "PNG files decoded per item, num_workers=0, fp32, eager, batch 64", {}),
    Rung("1", "workers+pin", "DataLoader workers + pin_memory + non_blocking copies",
         {"workers": -1, "pin_memory": True, "non_blocking": True}),  # -1: the --workers value
    Rung("2", "RAM preload", "decode every PNG once at start into tensors in RAM", {"source": "ram"}),
    Rung("3", "AMP fp16", "fp16 autocast + GradScaler", {"precision": "fp16"},
         needs_cuda="fp16 autocast + GradScaler is the GPU recipe (on a CPU it runs slower than fp32)"),
    # on a GPU a branch beside fp16; on a CPU with native bf16 the CPU's fast precision, carried forward (plan())
    Rung("3b", "AMP bf16", "bf16 autocast instead of fp16 (no GradScaler); shown, not carried forward on a GPU",
         {"precision": "bf16"}, branch=True),
    Rung("4", "batch 192", "batch 192", {"batch_size": 192}),
    Rung("5", "compile+drop_last", "torch.compile(model) + DataLoader(drop_last=True): static shapes",
         {"compile": True, "drop_last": True},
         cpu_quick_skip="--quick on a CPU: torch.compile would spend minutes compiling for a few timed steps "
                        "(run without --quick to include it)"),
    Rung("6", "resident data", "uint8 data resident on the device; indices, timesteps and noise drawn there; "
         "no per-step host sync (no loss.item())", {"resident": True}),
    Rung("7", "fused AdamW+EMA", "fastddpm TrainStep: fused AdamW + foreach EMA", {"fused": True}),
    Rung("8", "CUDA graphs", "the whole step captured in one CUDA graph (needs bf16: the fp16 GradScaler's "
         "inf check is a host sync, so graphs switch the precision to bf16)", {"cuda_graphs": True},
         needs_cuda="CUDA graphs need a CUDA device"),
    Rung("9", "auto batch", "batch size = the throughput knee (fastddpm find_batch_size)", {"auto_batch": True}),
    Rung("10", "NHWC+heads", "channels_last weights, Inductor's layout optimization forced and attention heads "
         "padded to 8, each where --channels-last/--inductor-layout/--attention-head-pad auto picks it (one GPU, "
         "compiled, bf16)", {"layout": True},
         needs_cuda="auto picks none of them on a CPU (channels_last measured 0.77x there)"),
]


def skip_reason(rung: Rung, device: torch.device, quick: bool) -> str | None:
    cuda = device.type == "cuda"
    if rung.needs_cuda and not cuda:
        return f"skipped on {device.type}: {rung.needs_cuda}"
    if rung.key == "3b" and not cuda:
        native, why = cpu_native_bf16() if device.type == "cpu" else (False, f"no bf16 autocast on {device.type}")
        return None if native else f"skipped on {device.type}: {why}"
    if rung.key in ("3b", "8") and cuda:
        # Not torch.cuda.is_bf16_supported(): it also says True on a T4 (sm75), which emulates bf16 slowly.
        native, why = cuda_native_bf16(device)
        if not native and rung.key == "3b":
            return f"skipped: {why}; fp16 (rung 3) is this GPU's fast precision"
        if not native:
            return (f"skipped: capturing the step in a CUDA graph needs bf16 here (fp16's GradScaler checks for "
                    f"inf on the host), and {why}")
    if rung.cpu_quick_skip and quick and not cuda:
        return f"skipped: {rung.cpu_quick_skip}"
    return None


def apply_delta(base: Switches, rung: Rung, workers: int) -> Switches:
    delta = {k: (workers if (k == "workers" and v == -1) else v) for k, v in rung.delta.items()}
    if rung.key == "8" and base.precision == "fp16":
        delta["precision"] = "bf16"
    return dataclasses.replace(base, **delta)


def plan(device: torch.device, workers: int, quick: bool) -> list[tuple[Rung, Switches, str | None]]:
    """(rung, its switches, why it is skipped or None) for every rung, in order. A skipped rung's change is not
    carried to the next rung, nor is a branch's; a rung that fails when measured still carries."""
    out = []
    sw = Switches()
    for rung in DDPM_RUNGS:
        candidate = apply_delta(sw, rung, workers) if rung.key != "0" else sw
        skip = skip_reason(rung, device, quick)
        out.append((rung, candidate, skip))
        if carried(rung, device.type) and skip is None:
            sw = candidate
    return out


def carried(rung: Rung, device_type: str) -> bool:
    """Whether the rungs after `rung` build on its change: the main line's rungs do; a branch is measured beside it
    and dropped, except 3b (bf16) on a CPU, a CPU's fast precision."""
    return not rung.branch or (rung.key == "3b" and device_type == "cpu")


# ----------------------------------------------------------------------------------------------------------------
# The user's datasets (module level: DataLoader workers pickle them)


def list_pngs(root: Path) -> list[str]:
    """The seed's layout: ROOT/<label>/*.png, in (label, name) order as fastddpm's prepare reads it."""
    files = glob.glob(os.path.join(root, "*", "*.png")) + glob.glob(os.path.join(root, "*.png"))
    return sorted(files)


def decode_png(path: str) -> torch.Tensor:
    """Pillow -> (C, H, W) float32 in [-1, 1], as the seed's ToTensor() then 2x - 1."""
    arr = np.array(Image.open(path))
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr)).float().div_(127.5).sub_(1.0)


class PngDataset(torch.utils.data.Dataset):
    """Rung 0: every __getitem__ opens and decodes one PNG file."""

    def __init__(self, root: Path):
        self.files = list_pngs(root)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        return decode_png(self.files[index])


class RamDataset(torch.utils.data.Dataset):
    """Rung 2: the seed's "one-time hit": every PNG decoded once at construction, kept as tensors in RAM."""

    def __init__(self, root: Path):
        self.images = [decode_png(f) for f in list_pngs(root)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]


def endless(loader: torch.utils.data.DataLoader):
    """Epoch after epoch, as a training loop iterates (a new iterator, and new workers, per epoch)."""
    while True:
        yield from loader


# ----------------------------------------------------------------------------------------------------------------
# Building a rung


@dataclass
class Context:
    """What every rung shares: the data (as PNGs and as the uint8 array), the config, the device."""

    cfg: RunConfig  # the preset, model shape resolved
    device: torch.device
    png_root: Path | None  # None when no rung measured in this run decodes PNG files
    images_NCHW: np.ndarray  # uint8, the same images as the PNG folder, in the same order
    seed: int = 0
    quick: bool = False
    auto_batch_limit: int = 8192
    batch_divisor: int = 1  # --quick: every rung's batch / this (64 -> 16, 192 -> 48), ratios kept
    log: Callable[[str], None] = print
    peaks: Peaks | None = None  # MFU's peaks and the roofline's bandwidth, measured once for all rungs


@dataclass
class Prepared:
    step: Callable[[int], object]  # one optimizer step (draws its own batch); may return the device loss
    batch_size: int
    precision: str
    setup_s: float = 0.0  # work before the first step (RAM preload, batch-size search)
    notes: list[str] = field(default_factory=list)
    compiled: bool = False
    graph_failed: Callable[[], str | None] = lambda: None
    model: torch.nn.Module | None = None  # the U-Net it trains (uncompiled): its FLOPs and bytes, for the roofline
    autocast_dtype: torch.dtype | None = None
    # Images the steps have trained on so far, where a batch can be short (a DataLoader's ragged last batch
    # without drop_last); None: every step trains batch_size images.
    images_seen: Callable[[], int] | None = None


def precision_of(name: str, device: torch.device) -> Precision:
    """The rung's precision as the trainer resolves it (fp16 gets a GradScaler; bf16 on a GPU without native bf16
    is a ConfigError, though skip_reason keeps such rungs from running)."""
    return resolve_precision(name, device)


def prepare_rung(rung: Rung, sw: Switches, ctx: Context) -> Prepared:
    """Build the rung's model, optimizer and batch source; return its step. Raises on failure."""
    if ctx.batch_divisor != 1:
        sw = dataclasses.replace(sw, batch_size=max(1, sw.batch_size // ctx.batch_divisor))
    if sw.fused or sw.cuda_graphs or sw.auto_batch:
        return _fastddpm_rung(sw, ctx)
    return _user_rung(sw, ctx)


def _user_rung(sw: Switches, ctx: Context) -> Prepared:
    import time

    cfg, device = ctx.cfg, ctx.device
    cuda = device.type == "cuda"
    precision = precision_of(sw.precision, device)
    notes = []
    torch.manual_seed(ctx.seed)
    model, schedule = build_model(cfg, device=device,
                                  fast=FastPath(compile=False, cuda_graphs="off", channels_last=False,
                                                cudnn_benchmark=cuda, reasons={}))
    # The user's optimizer and EMA: one kernel per tensor, as torch.optim.AdamW(foreach=False) and a loop.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=cfg.train.adam_betas,
                                  weight_decay=cfg.train.weight_decay, foreach=False)
    ema_params = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
    net = torch.compile(model) if sw.compile else model  # the seed: compile after .to(device), before use
    ema_w = 1.0 - cfg.train.ema_decay
    T = cfg.diffusion.num_timesteps

    setup_s = 0.0
    if sw.resident:
        batches = ResidentBatches(ctx.images_NCHW, batch_size=sw.batch_size, num_timesteps=T, seed=ctx.seed,
                                  continuous=cfg.diffusion.objective != "ddpm",
                                  device=device)

        def next_batch(i: int) -> Batch:
            return batches.get(i)  # gather + t + noise on the device: no host work, no copy
    else:
        t0 = time.perf_counter()
        dataset = RamDataset(ctx.png_root) if sw.source == "ram" else PngDataset(ctx.png_root)
        setup_s = time.perf_counter() - t0
        if sw.source == "ram":
            notes.append(f"RAM preload: {setup_s:.1f} s to decode {len(dataset):,} PNGs (not in the steady state)")
        pin = sw.pin_memory and cuda
        if sw.pin_memory and not cuda:
            notes.append("pin_memory is a no-op without CUDA")
        loader = torch.utils.data.DataLoader(dataset, batch_size=sw.batch_size, shuffle=True,
                                             num_workers=sw.workers, pin_memory=pin, drop_last=sw.drop_last,
                                             generator=torch.Generator().manual_seed(ctx.seed))
        stream = endless(loader)
        seen = [0]

        def next_batch(i: int) -> Batch:
            x0 = next(stream).to(device, non_blocking=sw.non_blocking)
            seen[0] += x0.shape[0]
            # As the seed's DDPM loop: t drawn on the host and copied; noise drawn on the device.
            t = torch.randint(0, T, (x0.shape[0],)).to(device, non_blocking=sw.non_blocking)
            return Batch(x0=x0, t=t, noise=torch.randn_like(x0), indices=None)

    def step(i: int):
        loss = train_step(net, optimizer, scaler, schedule, cfg.diffusion.prediction, next_batch(i), precision,
                          cfg.train.grad_clip)
        with torch.no_grad():
            for e, p in zip(ema_params, model.parameters()):
                e.lerp_(p.detach(), ema_w)
        if not sw.resident:
            return loss.item()  # note: the user's per-step log value, a host sync every step
        return loss

    return Prepared(step=step, batch_size=sw.batch_size, precision=sw.precision, setup_s=setup_s, notes=notes,
                    compiled=sw.compile, model=model, autocast_dtype=precision.autocast_dtype,
                    images_seen=None if sw.resident else (lambda: seen[0]))


def _auto_layout(cfg: RunConfig, fast: FastPath, device: torch.device, precision: Precision) -> tuple[FastPath, str]:
    """The rung's fast path with the layout settings `auto` picks for this model, device and precision (as
    `fastddpm train` resolves them), and a note of what they are."""
    from fastddpm.trainer.fast_path import resolve_fast_path

    train = dataclasses.replace(cfg.train, compile="on" if fast.compile else "off", cuda_graphs=fast.cuda_graphs,
                                channels_last="auto", inductor_layout="auto", attention_head_pad="auto")
    auto = resolve_fast_path(train, device, precision, model_family=cfg.model.family)
    fast = dataclasses.replace(fast, channels_last=auto.channels_last, inductor_layout=auto.inductor_layout,
                               attention_head_pad=auto.attention_head_pad)
    return fast, (f"auto picks: channels_last {'on' if auto.channels_last else 'off'}, Inductor layout "
                  f"{auto.inductor_layout}, heads padded to {auto.attention_head_pad or 'none'}")


def _fastddpm_rung(sw: Switches, ctx: Context) -> Prepared:
    import time

    device = ctx.device
    cuda = device.type == "cuda"
    precision = precision_of(sw.precision, device)
    notes = []
    batch_size, setup_s = sw.batch_size, 0.0
    if sw.auto_batch:
        from fastddpm.trainer.batch_finder import find_batch_size, make_trial_fn

        t0 = time.perf_counter()
        probe, schedule = build_model(ctx.cfg, device=device,
                                      fast=FastPath(False, "off", False, cuda, {}))
        trial = make_trial_fn(probe, schedule, ctx.cfg.diffusion.prediction, precision,
                              image_shape=tuple(ctx.images_NCHW.shape[1:]), device=device)
        limit = min(ctx.auto_batch_limit, ctx.images_NCHW.shape[0])
        batch_size, trials = find_batch_size(trial, start=min(32, limit), limit=limit,
                                             log=lambda m: ctx.log(f"    {m.strip()}"))
        del probe
        setup_s = time.perf_counter() - t0
        notes.append(f"knee: batch {batch_size} (trials " + ", ".join(
            f"{t.batch_size}: {'OOM' if t.images_per_s is None else f'{t.images_per_s:,.0f}/s'}" for t in trials)
            + f"; search {setup_s:.1f} s, not in the steady state)")
    cfg = apply_overrides(ctx.cfg, {"train.batch_size": batch_size, "train.seed": ctx.seed},
                          source="bench ladder")
    graphs = "capture" if sw.cuda_graphs and cuda else "off"
    fast = FastPath(compile=sw.compile, cuda_graphs=graphs, channels_last=False, cudnn_benchmark=cuda, reasons={})
    if sw.layout:
        fast, picked = _auto_layout(cfg, fast, device, precision)
        notes.append(picked)
    model, schedule = build_model(cfg, device=device, fast=fast)
    step_fn = Optimization(cfg, model, schedule, device=device, precision=precision, fast=fast).build_step()
    batches = ResidentBatches(ctx.images_NCHW, batch_size=batch_size, num_timesteps=cfg.diffusion.num_timesteps,
                              continuous=cfg.diffusion.objective != "ddpm",
                              seed=ctx.seed, device=device)
    if not cuda and sw.fused:
        notes.append("CPU: AdamW fused (tensor lr) only with compile on, else foreach")

    def step(i: int):
        return step_fn([batches.get(i)], lr=cfg.train.lr, step=i)

    return Prepared(step=step, batch_size=batch_size, precision=sw.precision, setup_s=setup_s, notes=notes,
                    compiled=sw.compile, graph_failed=lambda: step_fn.graph_failed if graphs == "capture" else None,
                    model=model, autocast_dtype=precision.autocast_dtype)
