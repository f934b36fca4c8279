"""--batch-size auto: find the throughput knee, not the out-of-memory edge.

Past a point a bigger batch buys no more images per second, only memory and fewer optimizer steps per epoch.
The finder doubles the batch on a throw-away copy of the model (uncompiled, so no compile per trial), times a
few steps of each, backs off at the first out-of-memory, and picks the smallest batch within `tolerance` of
the best images/s it saw. The training model, optimizer and EMA are never touched by a trial.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fastddpm.diffusion.objective import diffusion_loss
from fastddpm.diffusion.schedule import draw_t


@dataclass
class Trial:
    batch_size: int
    images_per_s: float | None  # None: out of memory
    step_ms: float | None
    error: str | None = None


def is_oom(e: BaseException) -> bool:
    """Out of memory, including the library allocations that fail near the limit (cuBLAS / cuDNN workspaces)."""
    text = str(e)
    return (isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower()
            or "STATUS_ALLOC_FAILED" in text)


def choose_knee(trials: list[Trial], tolerance: float) -> int:
    ok = [t for t in trials if t.images_per_s is not None]
    if not ok:
        raise RuntimeError("every batch-size trial ran out of memory, even the smallest: lower --batch-size by hand "
                           "or turn on --grad-checkpointing")
    best = max(t.images_per_s for t in ok)
    return min(t.batch_size for t in ok if t.images_per_s >= (1 - tolerance) * best)


def find_batch_size(trial_fn: Callable[[int], float], *, start: int = 32, limit: int = 8192,
                    tolerance: float = 0.05, stop_gain: float = 0.03, log=print) -> tuple[int, list[Trial]]:
    """Double from `start` until OOM, `limit`, or two doublings that each gain less than `stop_gain`.
    `trial_fn(batch)` returns images/s or raises an out-of-memory error. A `limit` below `start` (a small
    dataset) is tried itself: the search never proposes a batch the data cannot fill."""
    if limit < 1:
        raise ValueError(f"find_batch_size: limit={limit}, the largest batch to try, must be at least 1")
    trials: list[Trial] = []
    bs, flat = min(start, limit), 0
    while bs <= limit:
        try:
            ips = trial_fn(bs)
        except Exception as e:  # noqa: BLE001 - only OOM is expected; anything else propagates below
            if not is_oom(e):
                raise
            trials.append(Trial(bs, None, None, "out of memory"))
            log(f"  batch {bs:>6}: out of memory, backing off")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            break
        trials.append(Trial(bs, ips, 1000 * bs / ips))
        log(f"  batch {bs:>6}: {ips:,.0f} img/s")
        prev = [t for t in trials[:-1] if t.images_per_s is not None]
        if prev:
            flat = flat + 1 if ips < (1 + stop_gain) * prev[-1].images_per_s else 0
            if flat >= 2:
                break
        bs *= 2
    return choose_knee(trials, tolerance), trials


def make_trial_fn(model: torch.nn.Module, schedule, prediction: str, precision, *, image_shape, device,
                  warmup_steps: int = 2, timed_steps: int = 5) -> Callable[[int], float]:
    """A trial that trains a copy of `model` on random data at a given batch and returns images/s."""

    def trial(batch_size: int) -> float:
        # The trial's draws (its data, noise, timesteps and dropout) come from a forked global RNG, which is put
        # back afterwards: how many trials run depends on measured speed, and the run's dropout draws from the
        # global RNG, so the trials must leave it as they found it.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return _timed(batch_size)

    def _timed(batch_size: int) -> float:
        trial_model = copy.deepcopy(model).train()
        opt = torch.optim.AdamW(trial_model.parameters(), lr=1e-4)
        x0 = torch.rand(batch_size, *image_shape, device=device) * 2 - 1
        t = draw_t(schedule, batch_size, generator=None, device=device)
        noise = torch.randn_like(x0)

        def step():
            with precision.autocast(device):
                loss = diffusion_loss(trial_model, schedule, prediction, x0, t, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(warmup_steps):
            step()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(timed_steps):
                step()
            end.record()
            end.synchronize()  # note: sync, trials only
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            for _ in range(timed_steps):
                step()
            seconds = time.perf_counter() - t0
        # The trial's model and optimizer go out of scope here; an OOM's traceback is dropped by the caller.
        return batch_size * timed_steps / seconds

    return trial
