"""One `bench throughput` variant, built as the trainer builds it and timed: alone, or alternating with the other
choices of its preset and batch size (measure_alternating), so that the ratios between choices compare steps
that ran under the same conditions."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from fastddpm.config import RunConfig
from fastddpm.device import Precision
from fastddpm.measure import (Peaks, count_step_bytes, count_step_flops, free_device_memory, peak_memory_bytes,
                              reset_peak_memory, roofline, summarize, time_steps, time_wall_s)
from fastddpm.models import count_parameters
from fastddpm.trainer.batch_finder import is_oom
from fastddpm.trainer.batches import make_batches, step_batches
from fastddpm.trainer.build import Optimization, build_model
from fastddpm.trainer.compile_counters import CompileCounters
from fastddpm.trainer.fast_path import resolve_fast_path

if TYPE_CHECKING:
    from fastddpm.bench.throughput import ThroughputSettings


@dataclass
class Variant:
    preset: str
    batch_size: int
    cfg: RunConfig  # the preset with the benchmark's overrides, model shape resolved
    choice: str | None = None  # PRECISION-MODE[-cl], when the run compares choices
    precision: Precision | None = None  # resolved on the device, per variant
    fast_reasons: dict[str, str] = field(default_factory=dict)


def peak_dtype(precision: Precision) -> torch.dtype:
    """The dtype the step's matmuls and convolutions run in: autocast's, else fp32 (TF32 on CUDA, see
    matmul_dtype_name)."""
    return precision.autocast_dtype or torch.float32


def empty_row(v: Variant) -> dict:
    t = v.cfg.train
    return {
        "preset": v.preset, "batch_size": v.batch_size, "choice": v.choice, "accum_steps": t.accum_steps,
        "images_per_step": t.batch_size * t.accum_steps, "status": None, "error": None, "error_type": None,
        "parameters": None, "precision": None, "fast_path": v.fast_reasons, "data_placement": t.data_placement,
        "cuda_graphs_failed": None, "compile_s": None, "step_ms": None, "images_per_s": None,
        "images_per_s_range": None, "ratio_to_first": None, "flops_per_step": None, "gflops_per_image": None,
        "achieved_tflops": None, "mfu_pct": None, "mfu_dtype": None, "mfu_peak_tflops": None, "mfu_peak_label": None,
        "activation_bytes_per_image": None, "mb_per_image": None, "bandwidth_gbps": None, "bandwidth_label": None,
        "bound_us_per_image": None, "roofline_pct": None, "roofline_binds": None,
        "peak_memory_bytes": None, "peak_memory_gib": None,
        "compiled_graphs": None, "graph_breaks": None, "recompiles_after_warmup": None,
        "input_ms_per_step": None, "input_wait_pct": None, "final_loss": None, "timing": None,
        "alternated_with": None, "config": v.cfg.to_dict(),
    }


class VariantTimer:
    """One variant built as the trainer builds it and warmed up (`prepare`), then timed one repeat at a time
    (`time_repeat`), then summarised into its row (`finish`). measure_variant runs the three in a row; the choices
    of one preset and batch are timed alternating, a repeat of each in turn (`measure_alternating`)."""

    def __init__(self, v: Variant, images_NCHW: np.ndarray, *, device: torch.device, settings: ThroughputSettings,
                 peak: dict, bandwidth: dict):
        cfg, t, precision = v.cfg, v.cfg.train, v.precision
        self.v, self.device, self.settings, self.peak, self.bandwidth = v, device, settings, peak, bandwidth
        self.fast = fast = resolve_fast_path(t, device, precision, model_family=cfg.model.family)
        # what is already resident (the variants prepared before this one, when alternating) is not this one's
        self.resident_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        reset_peak_memory(device)

        # ---- the trainer's own set-up (fastddpm.trainer.setup), without data loading, logging and checkpoints
        self.model, schedule = build_model(cfg, device=device, fast=fast)
        self.step_fn = Optimization(cfg, self.model, schedule, device=device, precision=precision,
                                    fast=fast).build_step()
        self.batches = make_batches(images_NCHW, t.data_placement, batch_size=t.batch_size,
                                    num_timesteps=cfg.diffusion.num_timesteps, seed=t.seed, device=device,
                                    continuous=cfg.diffusion.objective != "ddpm", hflip=cfg.data.hflip,
                                    accum_steps=t.accum_steps)
        self.flops_per_step = count_step_flops(self.model, (t.batch_size, *settings.image_shape),
                                               accum_steps=t.accum_steps)
        self.moved = count_step_bytes(self.model, settings.image_shape, images_per_step=t.batch_size * t.accum_steps,
                                      device=device, autocast_dtype=precision.autocast_dtype)
        self.images_per_step = t.batch_size * t.accum_steps
        self.last_loss: list[torch.Tensor] = []
        self.step_ms_per_repeat: list[float] = []

        # ---- compile / warm-up: its own number, never part of the steady state
        counters = CompileCounters(enabled=fast.compile)
        self.compile_s = time_wall_s(lambda: [self.one_step(s) for s in range(settings.warmup_steps)], device)
        self.compile_report = counters.report()  # this variant's own graphs and breaks, before any other runs
        peak_bytes = peak_memory_bytes(device)  # the warm-up's steps reach the steady state's peak (same shapes)
        self.peak_bytes = None if peak_bytes is None else peak_bytes - self.resident_before
        counters.mark_warm()
        self.counters = counters

    def one_step(self, step: int) -> None:
        # As the training loop: draw the micro-batches for this step, then the step (no host sync inside).
        t = self.v.cfg.train
        self.last_loss[:] = [self.step_fn(step_batches(self.batches, step, t.accum_steps), lr=t.lr, step=step)]

    def time_repeat(self) -> None:
        """One more timed repeat; the step counter runs on, so epochs turn over as in training."""
        s = self.settings
        first = s.warmup_steps + len(self.step_ms_per_repeat) * s.steps
        elapsed_ms = time_steps(lambda i: self.one_step(first + i), s.steps, self.device)
        self.step_ms_per_repeat.append(elapsed_ms / s.steps)

    def finish(self, recompiles_after_warmup: int | None = None) -> dict:
        """The row. `recompiles_after_warmup`: counted over the timed repeats by the caller when alternating
        (dynamo's counters are global); else this variant's own count."""
        s, t, v, device = self.settings, self.v.cfg.train, self.v, self.device
        if recompiles_after_warmup is None:  # timed alone: every graph since its warm-up is its own
            recompiles_after_warmup = self.counters.report().get("recompiles_after_warmup")
        # ---- the batch source alone, on the steps that follow
        first = s.warmup_steps + len(self.step_ms_per_repeat) * s.steps
        input_ms = time_steps(lambda i: step_batches(self.batches, first + i, t.accum_steps), s.steps,
                              device) / s.steps

        step_ms = summarize(self.step_ms_per_repeat)
        step_ms["per_repeat"] = self.step_ms_per_repeat
        median_s = step_ms["median"] / 1000
        achieved_flops = self.flops_per_step / median_s
        final_loss = float(self.last_loss[0])  # note: sync, once, after all timing
        peak, ips = self.peak, self.images_per_step
        roof = roofline(flops_per_image=self.flops_per_step / ips, bytes_per_image=self.moved["bytes_per_image"],
                        peak_tflops=peak["tflops"], bandwidth_gbps=self.bandwidth["gbps"],
                        images_per_s=ips / median_s)
        row = empty_row(v)
        row.update({
            "status": "ok",
            "parameters": count_parameters(self.model),
            "precision": v.precision.name,
            "fast_path": self.fast.reasons,
            "data_placement": self.batches.placement,
            "cuda_graphs_failed": self.step_fn.graph_failed,
            "compile_s": self.compile_s,
            "step_ms": step_ms,
            "images_per_s": ips / median_s,
            "images_per_s_range": [ips / (step_ms["max"] / 1000), ips / (step_ms["min"] / 1000)],
            "flops_per_step": self.flops_per_step,
            "gflops_per_image": self.flops_per_step / ips / 1e9,
            "achieved_tflops": achieved_flops / 1e12,
            "mfu_pct": 100 * achieved_flops / (peak["tflops"] * 1e12),
            "mfu_dtype": peak["dtype"],
            "mfu_peak_tflops": peak["tflops"],
            "mfu_peak_label": peak["label"],
            "activation_bytes_per_image": self.moved["activation_bytes_per_image"],
            "mb_per_image": self.moved["bytes_per_image"] / 1e6, "bandwidth_gbps": self.bandwidth["gbps"],
            "bandwidth_label": self.bandwidth["label"], "bound_us_per_image": roof["bound_us_per_image"],
            "roofline_pct": roof["roofline_pct"], "roofline_binds": roof["binds"],
            "peak_memory_bytes": self.peak_bytes,
            "peak_memory_gib": None if self.peak_bytes is None else self.peak_bytes / 2**30,
            "compiled_graphs": self.compile_report.get("compiled_graphs"),
            "graph_breaks": self.compile_report.get("graph_breaks"),
            "recompiles_after_warmup": recompiles_after_warmup if self.fast.compile else None,
            "input_ms_per_step": input_ms,
            "input_wait_pct": 100 * input_ms / step_ms["median"],
            "final_loss": final_loss,
            "timing": "sequential",
        })
        return row


def failed_row(v: Variant, e: BaseException) -> dict:
    row = empty_row(v)
    row.update({"status": "failed", "error_type": "out of memory" if is_oom(e) else type(e).__name__,
                "error": f"{type(e).__name__}: {e}".strip()})
    return row

def _room_for_another(timers: list[VariantTimer], device: torch.device) -> bool:
    """On CUDA: does the largest footprint prepared so far fit again (with a fifth to spare)? The variants of an
    alternating group are all resident at once; the CPU's memory is not the limit at these sizes."""
    if device.type != "cuda" or not timers:
        return True
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached > 1.2 * max(t.peak_bytes or 0 for t in timers)


def _recompile_limit() -> int:
    import torch._dynamo.config as dc

    return int(getattr(dc, "recompile_limit", getattr(dc, "cache_size_limit", 8)))


def measure_alternating(group: list[Variant], images_NCHW: np.ndarray, *, device: torch.device,
                        settings: ThroughputSettings, peaks: Peaks) -> tuple[dict[int, dict], list[int]]:
    """The choices of one preset and batch timed side by side: each built and warmed up (its own compile time),
    then one repeat of each in turn, the order rotated every round, so that drift (clocks, heat, a noisy
    neighbour) falls on every variant alike and the ratios compare like with like. Returns {position in group:
    row} of the variants timed so (failed ones included) and the positions left over: variants that did not fit
    in the GPU's memory beside the others, or past dynamo's recompile limit; the caller times those one by one."""
    compiled = {i for i, v in enumerate(group) if resolve_fast_path(v.cfg.train, device, v.precision).compile}
    if compiled:
        import torch._dynamo as dynamo

        dynamo.reset()  # once for the group: every variant's compiled step must stay in dynamo's cache
    free_device_memory(device)
    timers: dict[int, VariantTimer] = {}  # position in group -> its timer, warmed up
    rows: dict[int, dict] = {}
    left: list[int] = []
    for i, v in enumerate(group):
        past_limit = i in compiled and len(compiled & set(timers)) + 1 >= _recompile_limit()
        if left or past_limit or not _room_for_another(list(timers.values()), device):
            left.append(i)
            continue
        try:
            timers[i] = VariantTimer(v, images_NCHW, device=device, settings=settings,
                                     peak=peaks.matmul(peak_dtype(v.precision)), bandwidth=peaks.bandwidth())
        except Exception as e:  # noqa: BLE001 - as run_variant: the others still run
            rows[i] = failed_row(v, e)
            gc.collect()
            free_device_memory(device)
    counters = CompileCounters(enabled=bool(compiled))
    counters.mark_warm()
    live = list(timers)
    for r in range(settings.repeats):
        for i in live[r % len(live):] + live[:r % len(live)] if live else []:
            try:
                timers[i].time_repeat()
            except Exception as e:  # noqa: BLE001
                rows[i] = failed_row(group[i], e)
                live.remove(i)
    recompiles = counters.report().get("recompiles_after_warmup")
    for i in live:
        try:
            rows[i] = timers[i].finish(recompiles)
            rows[i].update(timing="alternating" if len(live) > 1 else "sequential",
                           alternated_with=[group[k].choice for k in live if k != i])
        except Exception as e:  # noqa: BLE001
            rows[i] = failed_row(group[i], e)
    del timers
    gc.collect()
    free_device_memory(device)
    return rows, left
