"""The verdict: docs/DOCTOR.md's fifteen rules applied to one bounded run.

Each rule is one function: the typed measurements (fastddpm.doctor.measurements) in, its Finding or None out.
RULES lists them in docs/DOCTOR.md's order and `evaluate` walks it: adding a rule is one function there and one
test in tests/test_doctor_rules.py. A Finding has
- `cost`: the share of step time the problem is estimated to take (what fixing it could give back); the
  verdict is the triggered finding with the largest cost, and a run whose findings all cost < HEALTHY_FLOOR
  is healthy;
- `evidence`: the numbers that drove it, as sentences a user can check against the trace;
- `fixes`: ranked, each both as a fastddpm setting (for `doctor train`) and as a code change (for a user's
  own loop): the report shows the kind that fits what was diagnosed.
A measurement that could not be taken (no CUDA, no NVML, no trace) is recorded as unavailable with the reason;
a rule that needs it does not fire, and the report says which rules could not be checked.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from fastddpm.doctor.measurements import CompileCounts, Measurements, StepRecord
from fastddpm.doctor.trace import BREAKDOWN_LABELS, TraceStats

HEALTHY_FLOOR = 0.05  # a finding that costs less than 5% of step time does not make a verdict

# thresholds (docs/DOCTOR.md), tuned on the planted cases in tests/test_doctor_planted.py
DATA_WAIT_SHARE = 0.10
LOADER_MARGIN = 1.5
IN_PROCESS_CPU_SHARE = 0.4  # share of an in-process data wait spent computing that makes it CPU-bound
EPOCH_SPIKE_X = 3.0
GPU_IDLE_SHARE = 0.20
SMALL_KERNEL_US = 10.0
SHORT_KERNEL_SHARE = 0.5
# a step with at least this share of its kernels replayed from CUDA graphs is not launch-bound, whatever its
# few eager kernels look like: the graph already pays one launch for the rest
GRAPH_KERNEL_SHARE = 0.5
H2D_SHARE = 0.05
LAYOUT_SHARE = 0.05
FP32_GEMM_SHARE = 0.20
LOW_MFU_SHARE = 0.05
MEMORY_HEADROOM_SHARE = 0.50
DRIFT_SHARE = 0.05
# the compute rules (16-20). Their costs are deliberately conservative: a fix must give at least what the
# report promised (benchmarks/RESULTS.md measures the seed-style script before and after its top fix)
LOW_PRECISION_MIN_RATIO = 1.2  # bf16/fp16 matmuls must measure this much faster than fp32 to be prescribed
LOW_PRECISION_MAX_SPEEDUP = 2.0  # the matmul speed-up the estimate counts, however fast the peak ratio reads
ATTENTION_WEIGHTS_SHARE = 0.03  # materialised attention over this share of the step fires rule 17
FUSED_ATTENTION_SAVES = 0.5  # of the materialised attention's time: the fused kernel's usual gain, halved
ELEMENTWISE_SHARE = 0.25  # eager elementwise + norm over this share of the step fires rule 18
COMPILE_SAVES = 0.3  # of that time: fusion removes the memory round trips, not the math (conservative)
OPTIMIZER_SHARE = 0.05  # a per-tensor optimizer over this share of the step fires rule 19 ...
OPTIMIZER_OPS = 300  # ... with this many ops per step (~25 tensors for AdamW): a few big tensors are memory-bound
FOREACH_SAVES = 0.5  # of the optimizer's time: multi-tensor kernels replace one op per tensor per update
SMALL_BATCH = 32  # rule 20: at or under this batch, the per-step overhead is a large share of each image's cost
OVERHEAD_SHARE = 0.2  # ... when Python, framework and optimizer time take this share of the step
BATCH_DOUBLING_SAVES = 0.5  # doubling the batch spreads the per-step overhead over twice the images
CPU_LOW_MFU = 0.3  # rule 13 on a CPU: MFU under this with less than half the step in the matmuls
CPU_MATMUL_SHARE = 0.5


@dataclass
class Fix:
    fastddpm: str | None  # a setting of the built-in trainer
    code: str  # a change to a user's own loop


@dataclass
class Finding:
    id: str
    rules: tuple[int, ...]
    title: str
    cost: float
    evidence: list[str]
    cause: str
    fixes: list[Fix] = field(default_factory=list)
    kind: str = "bottleneck"  # or "opportunity" (never a verdict) / "note"
    group: str = "pipeline"  # or "compute": the model's own arithmetic is slow (rules 12, 13, 16-20)

    @property
    def speedup(self) -> float:
        """The step-rate gain the cost estimate promises: 1 / (1 - cost)."""
        return 1.0 / max(1e-9, 1.0 - self.cost)

    def to_dict(self) -> dict:
        return {"id": self.id, "rules": list(self.rules), "title": self.title, "cost": self.cost,
                "expected_speedup": self.speedup, "evidence": self.evidence, "cause": self.cause,
                "kind": self.kind, "group": self.group,
                "fixes": [{"fastddpm": f.fastddpm, "code": f.code} for f in self.fixes]}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.1f}%"


# ---------------------------------------------------------------------------------------------- the rules
# Each rule reads the typed measurements and returns its Finding, or None; where a measurement it needs was not
# taken, it writes {"the rules": "why"} into `unavailable` (the report lists those as not checked).
Rule = Callable[[Measurements, dict[str, str]], Finding | None]


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
          f"({_pct(wait_share)} of step time, threshold {_pct(DATA_WAIT_SHARE)})"]
    if probe is not None and probe.batches_per_s:
        ev.append(f"the loader alone gives {probe.batches_per_s:.1f} batches/s; training could take "
                  f"{_or_nan(probe.train_steps_per_s):.1f}/s ({_or_nan(probe.ratio):.2f}x, want >= {LOADER_MARGIN}x)")
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
            Fix(None, "more loader processes: DataLoader(..., num_workers=<cores - 1>, persistent_workers=True, "
                      "prefetch_factor=4, pin_memory=True)"),
        ]
    else:
        cause = ("data-starved: the loader delivers batches slower than the step consumes them, and the CPU is "
                 "not the limit (latency: file I/O, sleeps, locks, too few workers or too little prefetch)")
        rules = (1,)
        fixes = [
            Fix("--data-placement device (whole dataset on the GPU as uint8: no loader at all)",
                "preload the dataset into RAM (or onto the GPU) once, instead of reading per sample"),
            Fix(None, "overlap the waits: DataLoader(..., num_workers=8, persistent_workers=True, "
                      "prefetch_factor=4, pin_memory=True)"),
            Fix("fastddpm data prepare SOURCE (a uint8 memory-mapped cache)",
                "read from a memory-mapped uint8 array (np.load(..., mmap_mode='r')) instead of files"),
        ]
    bound = wait_share > DATA_WAIT_SHARE  # else only the slow loader fired it: a note, costed under the floor
    cost = wait_share if bound else min(wait_share, HEALTHY_FLOOR / 2)
    return Finding("data-bound", rules, "DATA-BOUND: the step waits for the loader", cost, ev, cause, fixes,
                   kind="bottleneck" if bound else "note")


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
        ev.append(f"loading runs in the training process (num_workers=0): for {_pct(min(in_process_cpu_share, 1.0))} "
                  "of the wait this thread is computing (or queued for a core); the rest it is blocked (I/O, "
                  "sleep, locks)")
    return cpu_bound, workers, ev


def epoch_spikes(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 2: an epoch-start step over 3x the median step, its time spent waiting for data."""
    starts = [s for s in m.steps if s.epoch_start]
    watched_ms, median_ms = _watched_ms(m.steps)
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
         f"these stalls are {_pct(excess_ms / watched_ms)} of the watched time; with longer epochs the share "
         f"shrinks but each stall stays"],
        "DataLoader workers are started again at each epoch (persistent_workers=False): process start-up, "
        "dataset pickling and the first prefetch, every epoch",
        [Fix("--data-placement device (no workers to start)",
             "DataLoader(..., persistent_workers=True) keeps the workers alive across epochs"),
         Fix(None, "or hold the dataset on the GPU and index it per epoch (no DataLoader)")])


def host_bound(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rules 4 and 6: the GPU idles > 20% of the kernel span, mostly waiting for Python to launch work
    (host-bound); with tiny eager kernels shorter than their launch call, launch-bound."""
    t = m.gpu_trace
    if t is None:
        # one entry for all the rules that read the GPU timeline, recorded with the first of them
        unavailable["4-6,8,9,11" if m.cuda else "4-6,8,9,11 (GPU timeline)"] = (
            "no CUDA device: the GPU timeline needs a CUDA trace" if not m.cuda
            else "no profile window (profile_steps=0)" if m.trace is None
            else "the trace holds no GPU activity")
        return None
    python_share = t.host_wait_by_cause.get("host", 0.0)  # host-wait with no data wait or sync to blame
    if not (t.idle_share > GPU_IDLE_SHARE and t.host_wait_share >= t.kernel_wait_share
            and python_share > 0.5 * t.host_wait_share):
        return None
    graph_share = t.graph_kernel_share or 0.0
    captured = graph_share > 0  # some of the step already replays from CUDA graphs: never prescribe them
    eager_per_step = t.eager_kernels_per_step or 0.0
    # rule 6 reads eager kernels only: a graph replay has no per-kernel launch to be bound by
    tiny = (graph_share < GRAPH_KERNEL_SHARE and t.median_eager_kernel_us is not None
            and t.median_eager_kernel_us < SMALL_KERNEL_US and t.short_kernel_share > SHORT_KERNEL_SHARE)
    if tiny:
        title, rules = "LAUNCH-BOUND: kernels are shorter than the time to launch them", (4, 6)
        cause = ("many tiny kernels: the CPU spends longer issuing each kernel than the GPU spends running "
                 "it, so the GPU drains its queue and waits")
    elif captured:
        title, rules = "HOST-BOUND: the GPU waits for the host between graph replays", (4,)
        cause = ("the step already replays from a CUDA graph, yet the host takes longer between replays than "
                 "the GPU takes to run one: Python outside the graph (data, logging, the replay call)")
    else:
        title, rules = "HOST-BOUND: the GPU waits for Python between launches", (4,)
        cause = "the CPU cannot enqueue work fast enough (Python and framework overhead per op)"
    if captured:  # what is left outside the graph: its eager kernels, and the host time between replays
        fixes = ([Fix(None, f"kernels launched outside the graph ({eager_per_step:.0f} per step): move that "
                            "work inside the captured region, or fuse it with torch.compile")]
                 if eager_per_step >= 1 else [])
        fixes += [Fix("--batch-size auto (the throughput knee)",
                      "a larger batch: each replay does more work for the same host time between replays"),
                  Fix(None, "take per-step host work off the path between replays: log and read metrics "
                            "every N steps, prepare the next batch while the graph runs")]
    else:
        fixes = [Fix("--cuda-graphs capture (the whole step replayed as one graph: one launch per step)",
                     "capture the step in a CUDA graph: torch.compile(model, mode='reduce-overhead'), or "
                     "torch.cuda.graphs with static input buffers"),
                 Fix("--compile on (fuses elementwise chains into fewer, larger kernels)",
                     "torch.compile(model) with static shapes (drop_last=True)"),
                 Fix("--batch-size auto (the throughput knee)",
                     "a larger batch: the same launches, more work each"),
                 Fix(None, "fused optimizer and EMA: AdamW(..., fused=True); torch._foreach_lerp_ for the EMA")]
    idle_ev, kernels_ev = _gpu_evidence(t)
    evidence = [idle_ev, f"{_pct(python_share)} of the span is host-wait with no data wait or sync to blame",
                kernels_ev]
    # the launches a per-tensor optimizer issues have their own finding (rule 19) and fix: not counted twice
    optimizer = _per_tensor_launch_share(t)
    if optimizer:
        evidence.append(f"{_pct(optimizer)} of the kernels are launched by a per-tensor optimizer step: that part "
                        "of the wait is costed under PER-TENSOR OPTIMIZER")
    return Finding("launch-bound" if tiny else "host-bound", rules, title, python_share * (1 - optimizer), evidence,
                   cause, fixes)


def _per_tensor_launch_share(t: TraceStats) -> float:
    """The share of a GPU step's kernels launched by a per-tensor optimizer (0 for foreach / fused ones)."""
    if t.optimizer_kind != "per-tensor" or (t.optimizer_ops_per_step or 0) < OPTIMIZER_OPS:
        return 0.0
    return (t.kernel_share_by_category or {}).get("optimizer", 0.0)


def kernel_gaps(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 5: the GPU idles > 20% of the kernel span, mostly between kernels already queued."""
    t = m.gpu_trace
    if t is None or not (t.idle_share > GPU_IDLE_SHARE and t.kernel_wait_share > t.host_wait_share):
        return None
    if t.graph_kernel_share:  # some of the step already replays from CUDA graphs: never prescribe them
        title = "KERNEL GAPS: the GPU idles between the kernels of a graph replay"
        cause = ("the work is queued (replayed from a CUDA graph) but the GPU still idles between its "
                 "kernels: many small dependent kernels, each a node the GPU schedules in turn")
        fixes = [Fix("--compile on (fuses elementwise chains: fewer, larger nodes in the graph)",
                     "torch.compile before capturing, to fuse kernels"),
                 Fix("--batch-size auto (the throughput knee)",
                     "a larger batch: the same nodes, more work each")]
    else:
        title = "KERNEL GAPS: launch latency between back-to-back kernels"
        cause = "the work is queued but each kernel still pays launch latency; many small dependent kernels"
        fixes = [Fix("--cuda-graphs capture", "CUDA graphs (torch.compile mode='reduce-overhead')"),
                 Fix("--compile on", "torch.compile to fuse kernels")]
    idle_ev, kernels_ev = _gpu_evidence(t)
    return Finding("kernel-gaps", (5,), title, t.kernel_wait_share,
                   [idle_ev, f"{t.small_gap_count} gaps under 30 us between queued kernels", kernels_ev], cause, fixes)


def _gpu_evidence(t: TraceStats) -> tuple[str, str]:
    """The evidence rules 4-6 share: where the GPU's idle time goes; the kernels, and the queue (rule 9)."""
    idle = (f"the GPU is idle {_pct(t.idle_share)} of the kernel span (threshold {_pct(GPU_IDLE_SHARE)}): "
            f"{_pct(t.host_wait_share)} waiting for the host to launch work, {_pct(t.kernel_wait_share)} between "
            f"queued kernels")
    kernels = f"{t.kernels_per_step:.0f} kernels per step, median kernel {t.median_kernel_us:.1f} us"
    if t.graph_kernel_share:
        kernels += (f"; {_pct(t.graph_kernel_share)} of them replay from CUDA graphs "
                    f"({t.graph_launches_per_step:g} cudaGraphLaunch per step), "
                    f"{t.eager_kernels_per_step or 0.0:.0f} per step are launched one by one")
    if t.short_kernel_share is not None:
        kernels += (f"; of the kernels launched one by one {_pct(t.short_kernel_share)} run shorter than "
                    f"their launch call (median launch {t.median_launch_us:.1f} us)")
    kernels += f"; queue depth median {t.queue_depth_median:.0f}, max {t.queue_depth_max}"
    return idle, kernels


def sync_bound(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 7: the median step makes at least one blocking host-device sync."""
    t = m.gpu_trace
    if t is None or t.syncs_per_step is None:
        if not m.cuda:
            unavailable["7 (syncs)"] = ("a CPU device has no host-device syncs; .item() calls are counted "
                                        "(scalar_reads_per_step) but cost nothing here")
        return None
    if not t.syncs_per_step >= 1:
        return None
    sync_idle_share = t.host_wait_by_cause.get("sync", 0.0)
    return Finding(
        "sync-bound", (7,), "SYNC-BOUND: the step forces the host to wait for the GPU", sync_idle_share,
        [f"{t.syncs_per_step:g} host-device syncs in the median step (cudaStreamSynchronize / cudaDeviceSynchronize "
         f"/ blocking copies, e.g. from .item()), in every step rather than on logging steps only",
         f"after them the GPU sits idle {_pct(sync_idle_share)} of the kernel span while Python refills the "
         f"queue; the host spends {_pct(t.sync_share)} of step time blocked in them"],
        "hidden syncs: .item(), float(tensor), printing or branching on a GPU value every step, or "
        "GradScaler under bf16",
        [Fix("--log-every N (fastddpm reads the loss only on logging steps)",
             "accumulate the loss on the device (loss_sum += loss.detach()) and call .item() every N steps"),
         Fix(None, "no .item() in EMA or metrics; no GradScaler with bf16; find the sync with "
                   "torch.cuda.set_sync_debug_mode('warn')")])


def transfer_bound(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 8: host-to-device copies take > 5% of GPU busy time, or any copy is from pageable memory."""
    t = m.gpu_trace
    if t is None or t.h2d_share is None:
        return None
    pageable = t.h2d_pageable or 0
    if not (t.h2d_share > H2D_SHARE or pageable > 0):
        return None
    # a pageable copy blocks the host: the GPU's wait for Python is charged to it too
    cost = max(t.h2d_exposed_share, t.host_wait_by_cause.get("host", 0.0) if pageable else 0.0)
    return Finding(
        "transfer-bound", (8,), "TRANSFER-BOUND: host-to-device copies are not overlapped", cost,
        [f"HtoD copies take {_pct(t.h2d_share)} of GPU busy time ({t.h2d_bytes_per_step / 2**20:.1f} "
         f"MiB per step); {_pct(t.h2d_exposed_share)} of the span they run with no kernel alongside",
         f"{pageable} copies from pageable memory, {t.h2d_pinned} from pinned (pageable copies "
         "block the host and cannot overlap)"],
        "transfers on the critical path: pageable source memory, or copies not issued ahead of use",
        [Fix("--data-placement device (no per-step copies at all)",
             "keep the dataset on the GPU, or copy from pinned buffers: DataLoader(pin_memory=True) and "
             "x.to(device, non_blocking=True)"),
         Fix("--data-placement stream (pinned double buffers copied on a side stream)",
             "pinned buffers allocated once, filled by the CPU, copied with non_blocking=True on a side "
             "stream one batch ahead; avoid calling .pin_memory() per batch")])


def recompiles(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 10: graphs compiled, graph breaks or CUDA-graph skips after the warm-up."""
    c = m.compile or CompileCounts()
    if not (c.recompiles_after_warmup or c.graph_breaks_after_warmup or c.cudagraph_skips):
        return None
    watched_ms, median_ms = _watched_ms(m.steps)
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
         Fix(None, "pass the learning rate as a tensor (AdamW(lr=torch.tensor(lr))); run with "
                   "TORCH_LOGS=recompiles,graph_breaks to see the failing guard"),
         Fix(None, "with mode='reduce-overhead', call torch.compiler.cudagraph_mark_step_begin() each step")])


def layout_thrash(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 11: layout-conversion kernels take > 5% of GPU busy time."""
    t = m.gpu_trace
    if t is None or t.layout_share is None or not t.layout_share > LAYOUT_SHARE:
        return None
    return Finding(
        "layout-thrash", (11,), "LAYOUT THRASH: time spent converting between NCHW and NHWC",
        t.layout_share * (1 - t.idle_share),
        [f"layout-conversion kernels (nchwToNhwc / nhwcToNchw / transposes / .contiguous() copies) take "
         f"{_pct(t.layout_share)} of GPU busy time, {t.layout_kernels_per_step:.0f} per step"],
        "channels_last tensors meet ops without an NHWC kernel (GroupNorm in eager mode), so every such op "
        "converts back and forth",
        [Fix("--channels-last off in eager, or keep --compile on (inductor picks layouts end to end)",
             "drop .to(memory_format=torch.channels_last) in eager mode, or compile the model")])


def precision(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 12: > 20% of matmul/conv FLOPs in fp32 while some run in bf16/fp16 (autocast gap); or, on a GPU,
    none in reduced precision at all (fp32)."""
    t = m.trace
    if t is None:
        return None
    if t.gemm_unavailable:
        unavailable["12 (FLOPs by dtype, GEMM share, autocast coverage)"] = t.gemm_unavailable
        return None
    flops = t.gemm_flops_per_step
    total = sum(flops.values())
    low = flops.get("bf16", 0.0) + flops.get("fp16", 0.0) + flops.get("fp8", 0.0)
    fp32 = flops.get("fp32", 0.0)
    fp32_time_share = t.gemm_time_share.get("fp32", 0.0)
    if total > 0 and low > 0 and fp32 / total > FP32_GEMM_SHARE:
        return Finding(
            "autocast-gap", (12,), "AUTOCAST GAP: part of the matmul work still runs in fp32",
            0.5 * fp32_time_share,
            [f"{_pct(fp32 / total)} of matmul/conv FLOPs run with fp32 inputs while {_pct(low / total)} run in "
             f"bf16/fp16: autocast covers only part of the hot path",
             f"fp32 matmuls/convs take {_pct(fp32_time_share)} of " + ("GPU busy" if t.has_gpu else "step") +
             " time; the cost is an estimate: bf16 runs about 2x the fp32/TF32 rate on tensor cores (on a CPU "
             "it depends on AMX/AVX512-BF16)"],
            "autocast does not cover the hot path: a forward outside the autocast block, explicit .float() "
            "calls, or a second model (EMA, loss network) called outside it",
            [Fix("--precision bf16 (fastddpm runs the whole loss under autocast)",
                 "wrap the full forward and loss in torch.autocast('cuda', dtype=torch.bfloat16); keep the "
                 "backward outside; look for .float() in the model")], group="compute")
    if total > 0 and low == 0:
        return _fp32_matmuls(m, t, total, fp32_time_share)
    return None


def _fp32_matmuls(m: Measurements, t: TraceStats, total: float, fp32_time_share: float) -> Finding | None:
    """Rule 16: every matmul runs in fp32. Prescribe autocast where the device's bf16/fp16 matmuls measured
    faster than fp32 (a GPU's tensor cores; a CPU with AMX or AVX512-BF16); elsewhere say fp32 is right."""
    lp = m.low_precision
    where = "GPU busy" if t.has_gpu else "step"
    ev = [f"all {total / 1e9:.2f} GFLOP of matmul/conv work per step has fp32 inputs; these take "
          f"{_pct(fp32_time_share)} of {where} time"]
    if lp is None:
        if not t.has_gpu:
            return None  # a CPU's bf16 rate was not measured (measure_peak=False): no claim either way
        ratio, dtype, native, basis = 2.0, "bf16", True, "assumed: bf16 tensor cores run ~2x the TF32 rate"
    else:
        ratio, dtype, native = lp.peak_ratio or 0.0, lp.dtype, lp.native
        basis = (f"measured now: {dtype} matmuls {lp.peak_tflops * 1e3:.3g} GFLOP/s vs fp32 "
                 f"{lp.fp32_peak_tflops * 1e3:.3g} GFLOP/s ({ratio:.2f}x); {lp.reason}")
    ev.append(basis)
    device = "cuda" if m.cuda else "cpu"
    if not (native and ratio >= LOW_PRECISION_MIN_RATIO):
        return Finding(
            "fp32", (16,), f"FP32 IS RIGHT HERE: {dtype} would not speed up this device's matmuls", 0.0, ev,
            f"{dtype} autocast pays off only where the hardware computes it natively; here it measured "
            f"{ratio:.2f}x fp32's matmul rate, so the casts would cost more than they save",
            [Fix("keep --precision fp32 (auto does)", f"keep fp32: no torch.autocast('{device}', ...) on this "
                                                      "machine")], kind="note", group="compute")
    speedup = min(ratio, LOW_PRECISION_MAX_SPEEDUP)
    cost = fp32_time_share * (1 - 1 / speedup)
    scaler = dtype == "fp16"
    code = (f"with torch.autocast('{device}', dtype=torch.{'float16' if scaler else 'bfloat16'}): loss = ... "
            "around forward and loss (not the backward)" +
            ("; and a torch.amp.GradScaler('cuda') for the backward and step" if scaler else ""))
    ev.append(f"estimate: the fp32 matmul time at {speedup:.2g}x the speed saves {_pct(cost)} of the step "
              f"(counted at most {LOW_PRECISION_MAX_SPEEDUP:g}x: casts and non-matmul work do not speed up)")
    return Finding(
        "fp32", (16,), f"FP32 MATMULS on hardware with native {dtype}", cost, ev,
        f"no autocast: the matmuls run at fp32's rate on a device whose {dtype} rate measured {ratio:.2f}x that",
        [Fix(f"--precision {dtype} (auto picks it)", code)], group="compute")


def attention_weights(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 17: attention that materialises its weights (softmax(QK^T)V written out, nn.MultiheadAttention
    with its default need_weights=True, or SDPA's math fallback) takes > 3% of the step."""
    t = m.trace
    if t is None or not t.attention_share_by_impl:
        return None
    slow = {k: v for k, v in t.attention_share_by_impl.items() if "materialised" in k}
    share = sum(slow.values())
    if share <= ATTENTION_WEIGHTS_SHARE:
        return None
    where = "GPU span" if t.has_gpu else "step"
    ev = [f"attention that builds the full L x L weight matrix takes {_pct(share)} of the {where}: " +
          ", ".join(f"{k} {_pct(v)}" for k, v in slow.items())]
    calls = m.attention_calls
    if calls is not None and calls.need_weights_per_step > 0:
        ev.append(f"nn.MultiheadAttention.forward is called {calls.calls_per_step:g} times per step "
                  f"({calls.modules} module(s)), {calls.need_weights_per_step:g} of them with need_weights=True "
                  "(the default): it then returns the averaged weights and cannot use the fused kernel")
    cost = FUSED_ATTENTION_SAVES * share
    ev.append(f"estimate: a fused kernel (scaled_dot_product_attention) saves at least half of it, "
              f"{_pct(cost)} of the step")
    mha = calls is not None and calls.need_weights_per_step > 0
    fixes = ([Fix(None, "attn(x, x, x, need_weights=False): nn.MultiheadAttention then runs "
                        "F.scaled_dot_product_attention (keep the default only where you use the weights)")]
             if mha else [])
    fixes.append(Fix("fastddpm's U-Net already calls F.scaled_dot_product_attention",
                     "replace softmax(q @ k.transpose(-2, -1) * scale) @ v with "
                     "F.scaled_dot_product_attention(q, k, v) (flash / memory-efficient kernels, no L x L matrix)"))
    return Finding("attention-weights", (17,), "MATERIALISED ATTENTION: the L x L weights are built and stored",
                   cost, ev, "attention computed as separate matmuls and a softmax: the weight matrix is written "
                   "to memory, read back, and kept for the backward", fixes, group="compute")


def eager_elementwise(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 18: uncompiled elementwise and norm ops take > 25% of the step: torch.compile fuses them."""
    t = m.trace
    if t is None or not t.breakdown:
        return None
    if m.compile is not None and m.compile.compiled_graphs > 0:
        return None  # already compiled: what is left is not eager fusion's to fix
    share = t.breakdown.get("elementwise", 0.0) + t.breakdown.get("norm", 0.0)
    if share <= ELEMENTWISE_SHARE:
        return None
    cost = COMPILE_SAVES * share
    where = "GPU span" if t.has_gpu else "step"
    return Finding(
        "eager-elementwise", (18,), "EAGER ELEMENTWISE: activations and norms run one op at a time", cost,
        [f"elementwise/activation ops take {_pct(t.breakdown.get('elementwise', 0.0))} and norms "
         f"{_pct(t.breakdown.get('norm', 0.0))} of the {where}, in eager mode (nothing compiled)",
         f"estimate: fusing them saves {_pct(COMPILE_SAVES)} of that time, {_pct(cost)} of the step "
         "(each eager op reads and writes its whole tensor; a fused kernel does it once)"],
        "each elementwise op is a separate pass over memory (and a separate dispatch): GroupNorm, SiLU, adds and "
        "scales between the matmuls",
        [Fix("--compile on", "model = torch.compile(model) (first steps compile: worth it for runs of minutes "
                             "or more)")], group="compute")


def per_tensor_optimizer(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 19: the optimizer updates one tensor at a time (torch's default on a CPU), issuing >= 300 ops and
    taking > 5% of the step: foreach (multi-tensor) or fused kernels update all parameters in a few ops."""
    t = m.trace
    if t is None or t.optimizer_kind != "per-tensor" or not t.breakdown:
        return None
    if (t.optimizer_ops_per_step or 0) < OPTIMIZER_OPS:
        return None
    opt = m.optimizer
    name = opt.name if opt is not None else "the optimizer"
    waiting = t.has_gpu and (t.idle_share or 0.0) > GPU_IDLE_SHARE  # a GPU that waits for launches
    launches = _per_tensor_launch_share(t) if waiting else 0.0
    if launches:
        # on a GPU the optimizer's kernels are tiny: its cost is the launches, while the GPU waits for them
        share = t.host_wait_by_cause.get("host", 0.0)
        cost = share * launches
        ev = [f"{_pct(launches)} of the step's {t.kernels_per_step:.0f} kernels are launched by {name}.step, "
              f"{t.optimizer_ops_per_step:.0f} ops per step: one op per parameter tensor per update term",
              f"the GPU waits for the host to launch work {_pct(share)} of the span; those launches are "
              f"{_pct(cost)} of it"]
    else:
        share = t.breakdown.get("optimizer", 0.0)
        if share <= OPTIMIZER_SHARE:
            return None
        cost = FOREACH_SAVES * share
        ev = [f"{name}.step takes {_pct(share)} of the step, {t.optimizer_ops_per_step:.0f} ops per step: one op "
              "per parameter tensor per update term"]
    if opt is not None:
        ev.append(f"{opt.param_tensors} parameter tensors; foreach={opt.foreach}, fused={opt.fused} "
                  "(None: torch picks per-tensor on a CPU, foreach on CUDA)")
    if not launches:
        ev.append(f"estimate: multi-tensor kernels save at least half of it, {_pct(cost)} of the step")
    cls = opt.name if opt is not None else "AdamW"
    return Finding(
        "per-tensor-optimizer", (19,), "PER-TENSOR OPTIMIZER: one small op per parameter per update", cost, ev,
        "the optimizer's for-loop over parameters issues several ops for every tensor: with hundreds of tensors "
        "the per-op overhead (on a GPU, a kernel launch each) outweighs the arithmetic",
        [Fix("fastddpm's AdamW is foreach (fused on CUDA) already",
             f"torch.optim.{cls}(params, ..., fused=True) (CPU and CUDA, Adam/AdamW/SGD), or foreach=True")],
        group="pipeline" if launches else "compute")  # launches are the pipeline's problem, not the math's


def small_batch(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 20: a small batch (<= 32) whose per-step overhead (Python, framework, optimizer) is > 20% of the
    step, with memory to spare: a larger batch spreads that overhead over more images."""
    t = m.trace
    if t is None or not t.breakdown or m.batch_size is None or m.batch_size > SMALL_BATCH:
        return None
    if m.memory is not None and m.memory.peak_share >= MEMORY_HEADROOM_SHARE:
        return None
    overhead = sum(t.breakdown.get(k, 0.0) for k in ("python", "framework", "optimizer"))
    if overhead <= OVERHEAD_SHARE:
        return None
    cost = BATCH_DOUBLING_SAVES * overhead
    return Finding(
        "small-batch", (20,), f"SMALL BATCH: {m.batch_size} images share each step's fixed overhead", cost,
        [f"batch {m.batch_size}; Python, framework and optimizer time, which do not grow with the batch, take "
         f"{_pct(overhead)} of the step",
         f"estimate: twice the batch halves that overhead per image, {_pct(cost)} of the time per image"],
        "the per-step costs (op dispatch, autograd bookkeeping, the optimizer over every parameter) are paid "
        "once per step however many images it holds",
        [Fix("--batch-size auto (the throughput knee; fastddpm scales the learning rate with it)",
             "raise batch_size toward the throughput knee (not the out-of-memory edge); scale the learning rate "
             "with it")], group="compute")


def low_mfu(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 13: MFU < 5% on a GPU that is idle < 20% of the time: busy, but with little math."""
    if m.mfu is None:
        unavailable["13 (MFU)"] = m.mfu_unavailable or "FLOPs or peak not measured"
        return None
    t = m.gpu_trace
    if t is None and m.trace is not None and m.trace.breakdown and not m.cuda:
        return _cpu_low_mfu(m)
    if t is None or not (m.mfu.mfu < LOW_MFU_SHARE and t.idle_share < GPU_IDLE_SHARE):
        return None
    mf = m.mfu
    # the residual: busy time that rules 17 and 18 already explain is costed there, with their own fixes (a
    # materialised attention fused, eager elementwise ops compiled), and is not counted twice here
    explained = _explained_by_compute_rules(m, t)
    residual = max(0.0, (1 - t.idle_share) - explained)
    ev = [f"MFU {_pct(mf.mfu)}: {mf.flops_per_step / 1e9:.1f} GFLOP per step in {mf.step_ms:.2f} ms "
          f"against a measured {mf.peak_dtype} matmul peak of {mf.peak_tflops:.0f} TFLOP/s, with the GPU "
          f"idle only {_pct(t.idle_share)}"]
    if explained > 0:
        ev.append(f"{_pct(explained)} of the span is layout conversions, materialised attention or eager "
                  f"elementwise work, costed by their own findings; this estimate covers the other {_pct(residual)}")
    return Finding(
        "low-mfu", (13,), "LOW MFU: the GPU is busy but does little math", min(0.5, residual * 0.5), ev,
        "memory- or elementwise-bound kernels (norms, activations, copies) dominate",
        [Fix("--compile on (fuses elementwise chains); --precision bf16; a larger --batch-size or model",
             "torch.compile for fusion, bf16, larger batch or wider layers")], group="compute")


def _explained_by_compute_rules(m: Measurements, t: TraceStats) -> float:
    """The share of the span that rules 11 (layout conversions), 17 (materialised attention) and 18 (eager
    elementwise) account for."""
    out = 0.0
    if t.layout_share is not None and t.layout_share > LAYOUT_SHARE:
        out += t.layout_share * (1 - t.idle_share)
    if t.attention_share_by_impl:
        slow = sum(v for k, v in t.attention_share_by_impl.items() if "materialised" in k)
        out += slow if slow > ATTENTION_WEIGHTS_SHARE else 0.0
    if t.breakdown and not (m.compile is not None and m.compile.compiled_graphs > 0):
        eager = t.breakdown.get("elementwise", 0.0) + t.breakdown.get("norm", 0.0)
        out += eager if eager > ELEMENTWISE_SHARE else 0.0
    return out


def _cpu_low_mfu(m: Measurements) -> Finding | None:
    """Rule 13 on a CPU: MFU < 30% with under half the step in matmuls/attention: the step's time goes to the
    work around the math. (A step that is mostly matmuls runs as fast as its shapes allow: healthy.)"""
    mf, b = m.mfu, m.trace.breakdown
    math_share = b.get("matmul", 0.0) + b.get("attention", 0.0)
    if not (mf.mfu < CPU_LOW_MFU and math_share < CPU_MATMUL_SHARE):
        return None
    rest = 1 - math_share
    top = sorted(((v, BREAKDOWN_LABELS[k]) for k, v in b.items() if k not in ("matmul", "attention")), reverse=True)
    return Finding(
        "low-mfu", (13,), "LOW MFU: most of the step is not matmul work", HEALTHY_FLOOR,
        [f"MFU {_pct(mf.mfu)}: {mf.flops_per_step / 1e9:.2f} GFLOP per step in {mf.step_ms:.1f} ms against a "
         f"measured {mf.peak_dtype} matmul peak of {mf.peak_tflops * 1e3:.3g} GFLOP/s",
         f"matmuls and attention take {_pct(math_share)} of the step; the other {_pct(rest)}: " +
         ", ".join(f"{label} {_pct(v)}" for v, label in top[:4])],
        "the arithmetic the model needs is a small part of the step: per-op overhead, memory-bound ops",
        [Fix("--compile on; a larger --batch-size", "torch.compile(model); a larger batch; fewer, larger ops")],
        group="compute")


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
         f"({_pct(mem.peak_share)})"],
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
    t0, t1 = m.telemetry_start, m.telemetry_end
    clocks = t0 is not None and t1 is not None
    if not clocks:
        unavailable["15 (clocks)"] = "no CUDA device" if not m.cuda else "NVML and nvidia-smi unavailable"
    drift_share = ss.last_fifth_median_ms / ss.first_fifth_median_ms - 1
    if not drift_share > DRIFT_SHARE:
        return None
    ev = [f"the median step grew {_pct(drift_share)} from the first to the last fifth of the watch "
          f"({ss.first_fifth_median_ms:.1f} -> {ss.last_fifth_median_ms:.1f} ms)"]
    if clocks:
        ev.append(f"SM clock {t0.sm_clock_mhz:.0f} -> {t1.sm_clock_mhz:.0f} MHz, temperature "
                  f"{t0.temperature_c:.0f} -> {t1.temperature_c:.0f} C ({t1.source})")
        cause = ("thermal or power throttling, not the code: compare runs only at equal clocks"
                 if t1.sm_clock_mhz < 0.95 * t0.sm_clock_mhz else
                 "clocks held steady, so something in the loop grows (tensors kept alive in a list, a "
                 "growing autograd graph, a cache)")
    else:
        cause = "cannot tell throttling from the code: GPU clocks are unavailable (no NVML / nvidia-smi)"
    return Finding("drift", (15,), "DRIFT: steps get slower over the run", drift_share, ev, cause,
                   [Fix(None, "check for state that grows per step; for throttling, improve "
                              "cooling or compare at fixed clocks")],
                   kind="note")


# docs/DOCTOR.md's rules in the order they are checked: findings of equal cost, and the report's list of
# rules not checked, keep this order. Rule 9 (launch-queue depth) has no function: it is evidence in rules 4-6
# and in the healthy verdict.
RULES: list[Rule] = [data_bound, epoch_spikes, host_bound, kernel_gaps, sync_bound, transfer_bound, recompiles,
                     layout_thrash, precision, low_mfu, memory_headroom, drift, attention_weights,
                     eager_elementwise, per_tensor_optimizer, small_batch]


def _watched_ms(steps: list[StepRecord]) -> tuple[float, float]:
    """(the watched steps' total host time, their median), ms."""
    return sum(s.host_ms for s in steps) or 1e-9, statistics.median(s.host_ms for s in steps)


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x


# ---------------------------------------------------------------------------------------------- the verdict
def evaluate(m: Measurements | dict) -> tuple[list[Finding], dict[str, str]]:
    """All rules over the measurements `m` (fastddpm.doctor.api.measurements; or their dict form, as in a saved
    report.json). Returns (triggered findings sorted by cost, {rules: why they could not be checked})."""
    if isinstance(m, dict):
        m = Measurements.from_dict(m)
    found: list[Finding] = []
    unavailable: dict[str, str] = {}
    for rule in RULES:
        finding = rule(m, unavailable)
        if finding is not None:
            found.append(finding)
    found.sort(key=lambda f: (f.kind != "bottleneck", -f.cost))
    return found, unavailable


def verdict(found: list[Finding], m: Measurements | dict) -> dict:
    """The one dominant bottleneck, or healthy."""
    if isinstance(m, dict):
        m = Measurements.from_dict(m)
    cands = [f for f in found if f.kind == "bottleneck" and f.cost >= HEALTHY_FLOOR]
    if cands:
        top = max(cands, key=lambda f: f.cost)
        if top.group != "compute":
            return {"healthy": False, "id": top.id, "title": top.title, "cost": top.cost}
        # the model's own arithmetic is the bottleneck: every compute fix, ranked by the gain it promises
        ranked = [f for f in found if f.group == "compute" and f.kind == "bottleneck" and f.cost > 0]
        return {"healthy": False, "id": top.id, "kind": "compute", "cost": top.cost,
                "title": f"COMPUTE-BOUND: {top.title}", "ranked": [f.id for f in ranked]}
    t = m.gpu_trace
    if t is not None:
        text = (f"HEALTHY (GPU-bound): the GPU is busy {_pct(1 - t.idle_share)} of the kernel span, launch "
                f"queue depth median {t.queue_depth_median:.0f}; no input, sync, transfer or compile "
                "problem costs 5% or more. Further gains are compute: fusion, precision, batch (rules 11-13)")
    elif m.cuda:
        text = "HEALTHY by the host-side rules; the GPU timeline was not profiled (profile_steps=0)"
    else:
        math = ""
        if m.trace is not None and m.trace.breakdown:
            b = m.trace.breakdown
            math = f" ({_pct(b.get('matmul', 0.0) + b.get('attention', 0.0))} of the step in matmuls and attention)"
        text = ("HEALTHY for a CPU run: the step is the model's math" + math + ", with no data, epoch, compile, "
                "precision or overhead problem costing 5% or more; the GPU-level rules need a CUDA device")
    return {"healthy": True, "id": "healthy", "title": text, "cost": 0.0}
