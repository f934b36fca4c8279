"""Rules 1-3 of docs/DOCTOR.md, the input pipeline: does the loop wait for data, is the loader's CPU the limit,
does the first step of each epoch stall. Each rule: the measurements in, its Finding or None out."""

from __future__ import annotations

import statistics

from fastddpm.doctor.findings import Finding, Fix, pct, watched_time
from fastddpm.doctor.measurements import Measurements, StepRecord
from fastddpm.doctor.system import usable_cores
from fastddpm.doctor.thresholds import (DATA_WAIT_SHARE, EPOCH_SPIKE_X, HEALTHY_FLOOR, IN_PROCESS_CPU_SHARE,
                                        LOADER_MARGIN)


def data_bound(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rules 1 and 3: the loop waits for data (> 10% of steady step time), or the loader alone is barely faster
    than training (a note). Rule 3 (the loader's CPU load) then tells a CPU-bound pipeline from latency."""
    steady = [s for s in m.steps if not s.epoch_start and not s.recompiles] or m.steps
    steady_ms = sum(s.host_ms for s in steady) or 1e-9
    wait_share = sum(s.data_wait_ms for s in steady) / steady_ms
    probe = m.loader_probe
    slow_loader = probe is not None and probe.ratio is not None and probe.ratio < LOADER_MARGIN
    if not (wait_share > DATA_WAIT_SHARE or slow_loader):
        return None
    wait_ms = statistics.median(s.data_wait_ms for s in steady)
    ev = [f"the loop waits {wait_ms:.1f} ms for data in a median step of "
          f"{statistics.median(s.host_ms for s in steady):.1f} ms "
          f"({pct(wait_share)} of step time, threshold {pct(DATA_WAIT_SHARE)})"]
    if probe is not None and probe.batches_per_s:
        k, steps = probe.batches_per_step or 1, probe.train_steps_per_s
        ev.append(f"the loader alone gives {probe.batches_per_s:.1f} batches/s; training could take "
                  f"{_or_nan(steps and steps * k):.1f}/s ("
                  + (f"{_or_nan(steps):.1f} optimizer steps/s, each accumulating gradients over {k:g} batches; "
                     if k != 1 else "")
                  + f"{_or_nan(probe.ratio):.2f}x, want >= {LOADER_MARGIN}x)")
    cpu_bound, workers, cpu_ev = _loader_cpu(m, steady)
    ev += cpu_ev
    if cpu_bound:
        cause = ("CPU-bound data pipeline: decoding/augmentation saturates the CPU " +
                 ("workers" if workers else "in the training process") +
                 (" while the GPU waits" if m.cuda else ", taking cores and time from the training step"))
        rules = (1, 3)
        fixes = [
            Fix("--data-placement device (the default on a GPU: uint8 data resident on the device, "
                "flips on the GPU)",
                "decode once into a uint8 tensor (e.g. `fastddpm data prepare`), keep it in RAM or on the GPU, "
                "and do normalisation/augmentation on the GPU on whole batches"),
            Fix(None, "move per-sample work out of __getitem__: precompute deterministic transforms; do "
                      "random flips/crops batched on the GPU"),
            Fix(None, f"more loader processes: DataLoader(..., num_workers={loader_workers(m, cpu_bound=True)}, "
                      "persistent_workers=True, prefetch_factor=4, pin_memory=True)",
                trial=f"loader-workers:{loader_workers(m, cpu_bound=True)}",
                gain=_workers_gain(m, steady, loader_workers(m, cpu_bound=True))),
        ]
    else:
        cause = ("data-starved: the loader delivers batches slower than the step consumes them, and the CPU is "
                 "not the limit (latency: file I/O, sleeps, locks, too few workers or too little prefetch)")
        rules = (1,)
        fixes = [
            Fix("--data-placement device (whole dataset on the GPU as uint8: no loader at all)",
                "preload the dataset into RAM (or onto the GPU) once, instead of reading per sample"),
            Fix(None, f"overlap the waits: DataLoader(..., num_workers={loader_workers(m, cpu_bound=False)}, "
                      "persistent_workers=True, prefetch_factor=4, pin_memory=True)",
                trial=f"loader-workers:{loader_workers(m, cpu_bound=False)}",
                gain=_workers_gain(m, steady, loader_workers(m, cpu_bound=False))),
            Fix("fastddpm data prepare SOURCE (a uint8 memory-mapped cache)",
                "read from a memory-mapped uint8 array (np.load(..., mmap_mode='r')) instead of files"),
        ]
    bound = wait_share > DATA_WAIT_SHARE  # else only the slow loader fired it: a note, costed under the floor
    cost = wait_share if bound else min(wait_share, HEALTHY_FLOOR / 2)
    return Finding("data-bound", rules, "DATA-BOUND: the step waits for the loader", cost, ev, cause, fixes,
                   kind="bottleneck" if bound else "note")


def _workers_gain(m: Measurements, steady: list[StepRecord], workers: int) -> float | None:
    """The most `workers` loader processes can speed the step up: each delivers batches at most as fast as one
    loading process did in the loader-alone probe, and the step takes at least its own compute. The data wait's
    share is what a loader that keeps up gives back; with 0 workers and a loader at 36 batches/s under a 29 ms
    step, one worker gives 1.07x at most, not the 15x that share promises. None without a probe."""
    probe = m.loader_probe
    if probe is None or not probe.batches_per_s or not probe.train_steps_per_s:
        return None
    now = m.loader_workers or 0
    if workers <= now:
        return 1.0  # the loader has as many already: the fix changes nothing
    step_ms = statistics.median(s.host_ms for s in steady)
    rate = probe.batches_per_s * workers / max(1, now)
    # a step that accumulates gradients over several batches waits for each of them
    return max(1.0, step_ms / max(1000 / probe.train_steps_per_s, (probe.batches_per_step or 1) * 1000 / rate))


# the most loader workers prescribed for a wait that is latency, not CPU: enough to overlap I/O waits
LATENCY_WORKERS = 8


def loader_workers(m: Measurements, *, cpu_bound: bool) -> int:
    """The workers to prescribe on the run's machine (the cores its process may use, as measured): a CPU-bound
    pipeline gets all but the training process's core; a latency-bound one up to LATENCY_WORKERS, never more
    than the cores (each worker still decodes what it read)."""
    cores = (m.cpu_load.cpu_count if m.cpu_load is not None else None) or usable_cores()
    return max(1, cores - 1) if cpu_bound else max(1, min(LATENCY_WORKERS, cores))


def _loader_cpu(m: Measurements, steady: list[StepRecord]) -> tuple[bool, int, list[str]]:
    """Rule 3: (is the data pipeline CPU-bound, the loader's worker count, the evidence)."""
    cpu = m.cpu_load
    workers = m.loader_workers
    if workers is None:
        workers = cpu.workers_seen if cpu is not None else 0
    wait_ms = sum(s.data_wait_ms for s in steady)
    # of the wait, the share this thread computed, out of the time it was not merely queued for a core
    not_queued_ms = wait_ms - sum(s.data_queued_ms for s in steady)
    in_process_cpu_share = sum(s.data_cpu_ms for s in steady) / not_queued_ms if not_queued_ms > 0 else 0.0
    busy_workers = (cpu is not None and workers > 0
                    and cpu.workers_cores >= 0.8 * min(workers, cpu.cpu_count or workers))
    # 0.4, not ~1: where the kernel has no schedstats, queued time cannot be taken out, and a crowded
    # machine gives a CPU-bound thread a fraction of a core; blocking waits (sleep, I/O) measure ~0.05
    cpu_bound = busy_workers or (workers == 0 and in_process_cpu_share >= IN_PROCESS_CPU_SHARE)
    ev = []
    if cpu is not None:
        ev.append(f"CPU: main process {cpu.main_cores:.2f} cores, {workers} loader worker process(es) "
                  f"{cpu.workers_cores:.2f} cores of {cpu.cpu_count}")
    if workers == 0 and wait_ms > 0:
        ev.append(f"loading runs in the training process (num_workers=0): for {pct(min(in_process_cpu_share, 1.0))} "
                  "of the wait this thread is computing (or queued for a core); the rest it is blocked (I/O, "
                  "sleep, locks)")
    return cpu_bound, workers, ev


def epoch_spikes(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 2: an epoch-start step over 3x the median step, its time spent waiting for data."""
    starts = [s for s in m.steps if s.epoch_start]
    watched_ms, median_ms = watched_time(m.steps)
    # an epoch-start stall is spent fetching the first batch; a slow epoch-start step whose time went to
    # compute is noise from elsewhere (another process, a GC pause), not this rule
    spikes = [s for s in starts if s.host_ms > EPOCH_SPIKE_X * median_ms
              and s.data_wait_ms > 0.5 * (s.host_ms - median_ms)]
    if not spikes:
        return None
    excess_ms = sum(s.host_ms - median_ms for s in spikes)
    worst = max(spikes, key=lambda s: s.host_ms)
    return Finding(
        "epoch-spikes", (2,), "EPOCH SPIKES: the first step of each epoch stalls", excess_ms / watched_ms,
        [f"{len(spikes)} of {len(starts)} epoch-start steps exceed {EPOCH_SPIKE_X:g}x the median step "
         f"({median_ms:.1f} ms); the worst, step {worst.index}, took {worst.host_ms:.0f} ms "
         f"({worst.host_ms / median_ms:.0f}x), {worst.data_wait_ms:.0f} ms of it waiting for data",
         f"these stalls are {pct(excess_ms / watched_ms)} of the watched time; with longer epochs the share "
         f"shrinks but each stall stays"],
        ("the loop builds a new DataLoader every epoch (`for x in DataLoader(...)`), whose workers start with it: "
         if m.loader_per_epoch else "DataLoader workers are started again at each epoch (persistent_workers=False): ")
        + "process start-up, dataset pickling and the first prefetch, every epoch",
        [Fix("--data-placement device (no workers to start)",
             "build the DataLoader once, before the epoch loop, with persistent_workers=True: its workers then "
             "live across epochs (persistent_workers on a loader built each epoch changes nothing)"
             if m.loader_per_epoch else
             "DataLoader(..., persistent_workers=True) keeps the workers alive across epochs"),
         Fix(None, "or hold the dataset on the GPU and index it per epoch (no DataLoader)")])


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x
