"""Rules 10, 14, 15 and 24 of docs/DOCTOR.md, the run as a whole rather than one step: graphs compiled after
warm-up (10), device memory left unused (14), steps that slow down over the watch (15), other work on the cores
(24)."""

from __future__ import annotations

from fastddpm.doctor.findings import Finding, Fix, pct, watched_time
from fastddpm.doctor.measurements import CompileCounts, Measurements
from fastddpm.doctor.thresholds import (BUSY_OTHERS_MIN_CORES, BUSY_OTHERS_SHARE, DRIFT_FIFTH_STEPS, DRIFT_SHARE,
                                        HEALTHY_FLOOR, MEMORY_HEADROOM_SHARE)


def recompiles(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 10: graphs compiled, graph breaks or CUDA-graph skips after the warm-up."""
    c = m.compile or CompileCounts()
    if not (c.recompiles_after_warmup or c.graph_breaks_after_warmup or c.cudagraph_skips):
        return None
    watched_ms, median_ms = watched_time(m.steps)
    hit = [s for s in m.steps if s.recompiles]
    excess_ms = sum(max(0.0, s.host_ms - median_ms) for s in hit)
    ev = [f"{c.recompiles_after_warmup} graph(s) compiled after warm-up, {c.graph_breaks_after_warmup} graph "
          f"break(s) after warm-up, {c.cudagraph_skips} CUDA-graph skip(s)"]
    if hit:
        ev.append("compiling in step(s) " + ", ".join(f"{s.index} ({s.host_ms:.0f} ms vs median {median_ms:.1f})"
                                                      for s in hit[:4]))
    return Finding(
        "recompiles", (10,), "RECOMPILES: torch.compile compiles again after warm-up",
        max(excess_ms / watched_ms, HEALTHY_FLOOR if c.cudagraph_skips else 0.0), ev,
        "a guard failed: a new input shape (an uneven last batch), a Python float that changes (learning "
        "rate), or a graph break; each recompile costs seconds and may fall back to slower code",
        [Fix("fastddpm drops the ragged tail and keeps the learning rate in a tensor already",
             "DataLoader(..., drop_last=True) (or pad the last batch); torch.compile(..., dynamic=False)"),
         Fix(None, "pass the learning rate as a tensor (AdamW(lr=torch.tensor(lr), fused=True): a tensor LR "
                   "needs the fused or capturable implementation); run with TORCH_LOGS=recompiles,graph_breaks to "
                   "see the failing guard"),
         Fix(None, "with mode='reduce-overhead', call torch.compiler.cudagraph_mark_step_begin() each step")])


def memory_headroom(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 14: peak allocated < 50% of device memory: an opportunity, never the verdict."""
    mem = m.memory
    if mem is None:
        unavailable["14 (memory)"] = "no CUDA device" if not m.cuda else "not measured"
        return None
    if not mem.peak_share < MEMORY_HEADROOM_SHARE:
        return None
    return Finding(
        "memory-headroom", (14,), "HEADROOM: the batch can grow", 0.0,
        [f"peak allocated {mem.peak_allocated_bytes / 2**30:.1f} GiB of {mem.total_bytes / 2**30:.0f} GiB "
         f"({pct(mem.peak_share)})"],
        "memory is left unused; a larger batch usually raises throughput up to a knee",
        [Fix("--batch-size auto (searches the throughput knee)", "raise the batch toward the throughput knee "
                                                                  "(search before compiling)")],
        kind="opportunity")


def drift(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 15: the median step of the last fifth of the watch > 5% slower than the first fifth (a note);
    the SM clock at both ends tells throttling from state that grows."""
    ss = m.step_stats
    if ss is None or not ss.first_fifth_median_ms:
        return None
    if len(m.steps) < 5 * DRIFT_FIFTH_STEPS:  # a fifth of one step is that step's noise, not a trend
        unavailable["15 (drift)"] = (f"{len(m.steps)} watched steps: the first and last fifth of the watch need "
                                     f"{DRIFT_FIFTH_STEPS} steps each, {5 * DRIFT_FIFTH_STEPS} in all (--steps)")
        return None
    t0, t1 = m.telemetry_start, m.telemetry_end
    clocks = t0 is not None and t1 is not None
    if not clocks:  # the drift is still measured; what tells its cause is not
        unavailable["15 (GPU clocks: throttling or growth)"] = ("no CUDA device" if not m.cuda else
                                                                "NVML and nvidia-smi unavailable")
    drift_share = ss.last_fifth_median_ms / ss.first_fifth_median_ms - 1
    if not drift_share > DRIFT_SHARE:
        return None
    ev = [f"the median step grew {pct(drift_share)} from the first to the last fifth of the watch "
          f"({ss.first_fifth_median_ms:.1f} -> {ss.last_fifth_median_ms:.1f} ms"
          f"{', timed by CUDA events' if ss.fifths_basis != 'host' else ''})"]
    if clocks:
        ev.append(f"SM clock {t0.sm_clock_mhz:.0f} -> {t1.sm_clock_mhz:.0f} MHz, temperature "
                  f"{t0.temperature_c:.0f} -> {t1.temperature_c:.0f} C ({t1.source})")
        cause = ("thermal or power throttling, not the code: compare runs only at equal clocks"
                 if t1.sm_clock_mhz < 0.95 * t0.sm_clock_mhz else
                 "clocks held steady, so something in the loop grows (tensors kept alive in a list, a "
                 "growing autograd graph, a cache)")
    elif m.cuda:
        cause = "cannot tell throttling from the code: GPU clocks are unavailable (no NVML / nvidia-smi)"
    else:
        cause = ("no clocks are read on a CPU: a busy or throttled machine slows the steps as state that grows "
                 "does; run it again to tell them apart")
    # a CPU reads no clocks, so the title itself says that the machine's load is as likely as the loop
    title = ("DRIFT: steps get slower over the run" if m.cuda else
             "DRIFT: steps got slower over the watch, from other work on the machine or from state that grows (a "
             "CPU has no clocks to tell which)")
    return Finding("drift", (15,), title, drift_share, ev, cause,
                   [Fix(None, "check for state that grows per step; for throttling, improve "
                              "cooling or compare at fixed clocks")],
                   kind="note")


def busy_machine(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 24: other processes kept the cores busy while the steps were watched (a note, never the verdict): the
    times, and every share and estimate read from them, are those of a contended step."""
    c = m.cpu_load
    if c is None:
        return None
    if c.others_cores is None or not c.cpu_count:
        unavailable["24 (other work on the cores)"] = "the cores' busy time is read from Linux's /proc/stat"
        return None
    if c.others_cores < max(BUSY_OTHERS_MIN_CORES, BUSY_OTHERS_SHARE * c.cpu_count):
        return None
    left = max(1, int(c.cpu_count - c.others_cores))
    ev = [f"other processes kept {c.others_cores:.1f} of the {c.cpu_count} cores this process may use busy while "
          f"the steps were watched (this process {c.main_cores:.1f}, its loader workers {c.workers_cores:.1f})"]
    cause = ("the steps competed with other work for the cores: their times, and every share and estimate here, are "
             "a contended step's (a parallel op waits for each of its threads, and a thread the OS gives to other "
             "work holds it up: on a 2-core CPU under such load one profiled step's small updates took 16-20 ms "
             "each against microseconds)")
    return Finding("busy-machine", (24,), "BUSY MACHINE: other work shared the cores while the steps were timed",
                   c.others_cores / c.cpu_count, ev, cause,
                   [Fix(None, "measure again with the cores to itself (the other work stopped, or on a machine of "
                              "its own) before acting on the numbers here"),
                    Fix(f"--cpu-threads {left} on a machine shared for good",
                        f"on a machine shared for good: torch.set_num_threads({left}), the cores the other work "
                        f"leaves, so that no op waits on a thread that is not running")],
                   kind="note")
