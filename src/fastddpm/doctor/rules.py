"""The verdict: DOCTOR_RULES.md's fifteen rules applied to one bounded run.

Each rule turns measurements into a Finding with
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
from dataclasses import dataclass, field

HEALTHY_FLOOR = 0.05  # a finding that costs less than 5% of step time does not make a verdict

# thresholds (DOCTOR_RULES.md), tuned on the planted cases in tests/test_doctor_planted.py
DATA_WAIT_SHARE = 0.10
LOADER_MARGIN = 1.5
IN_PROCESS_CPU = 0.4  # share of an in-process data wait spent computing that makes it CPU-bound
EPOCH_SPIKE_X = 3.0
GPU_IDLE_SHARE = 0.20
SMALL_KERNEL_US = 10.0
SHORT_KERNEL_SHARE = 0.5
H2D_SHARE = 0.05
LAYOUT_SHARE = 0.05
FP32_GEMM_SHARE = 0.20
LOW_MFU = 0.05
MEMORY_HEADROOM = 0.50
DRIFT = 0.05


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

    def to_dict(self) -> dict:
        return {"id": self.id, "rules": list(self.rules), "title": self.title, "cost": self.cost,
                "evidence": self.evidence, "cause": self.cause, "kind": self.kind,
                "fixes": [{"fastddpm": f.fastddpm, "code": f.code} for f in self.fixes]}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.1f}%"


def evaluate(m: dict) -> tuple[list[Finding], dict[str, str]]:
    """All rules over the measurements `m` (built by fastddpm.doctor.api.measurements).
    Returns (triggered findings sorted by cost, {rule: why it could not be checked})."""
    found: list[Finding] = []
    unavailable: dict[str, str] = {}
    steps = m["steps"]  # list of StepRecord dicts from the watch window
    cuda = m["device"].startswith("cuda")
    trace = m.get("trace")  # TraceStats.to_dict() or None
    gpu = trace is not None and trace.get("has_gpu")
    no_gpu_reason = ("no CUDA device: the GPU timeline needs a CUDA trace" if not cuda
                     else "no profile window (profile_steps=0)" if trace is None
                     else "the trace holds no GPU activity")
    host_total = sum(s["host_ms"] for s in steps) or 1e-9
    median_ms = statistics.median(s["host_ms"] for s in steps)
    steady = [s for s in steps if not s["epoch_start"] and not s["recompiles"]] or steps
    steady_host = sum(s["host_ms"] for s in steady) or 1e-9
    steady_wait = sum(s["data_wait_ms"] for s in steady)
    wait_share = steady_wait / steady_host
    wait_ms = statistics.median(s["data_wait_ms"] for s in steady)

    # ---- rules 1 + 3: data wait, loader throughput, CPU load of the loader
    probe = m.get("loader_probe")
    cpu = m.get("cpu_load")
    # of the wait, the share this thread computed, out of the time it was not merely queued for a core
    not_queued = steady_wait - sum(s.get("data_queued_ms", 0.0) for s in steady)
    in_process_cpu = (sum(s["data_cpu_ms"] for s in steady) / not_queued) if not_queued > 0 else 0.0
    slow_loader = probe is not None and probe.get("ratio") is not None and probe["ratio"] < LOADER_MARGIN
    if wait_share > DATA_WAIT_SHARE or slow_loader:
        ev = [f"the loop waits {wait_ms:.1f} ms for data in a median step of {statistics.median(s['host_ms'] for s in steady):.1f} ms "
              f"({_pct(wait_share)} of step time, threshold {_pct(DATA_WAIT_SHARE)})"]
        if probe and probe.get("batches_per_s"):
            ev.append(f"the loader alone gives {probe['batches_per_s']:.1f} batches/s; training could take "
                      f"{probe.get('train_steps_per_s', float('nan')):.1f}/s ({probe.get('ratio', float('nan')):.2f}x, "
                      f"want >= {LOADER_MARGIN}x)")
        workers = m.get("loader_workers")  # the DataLoader's own setting when the doctor saw the loader
        if workers is None:
            workers = cpu["workers_seen"] if cpu else 0
        busy_workers = cpu is not None and workers > 0 and cpu["workers_cores"] >= 0.8 * min(workers, cpu["cpu_count"] or workers)
        # 0.4, not ~1: where the kernel has no schedstats, queued time cannot be taken out, and a crowded
        # machine gives a CPU-bound thread a fraction of a core; blocking waits (sleep, I/O) measure ~0.05
        cpu_bound = busy_workers or (workers == 0 and in_process_cpu >= IN_PROCESS_CPU)
        if cpu:
            ev.append(f"CPU: main process {cpu['main_cores']:.2f} cores, {workers} loader worker process(es) "
                      f"{cpu['workers_cores']:.2f} cores of {cpu['cpu_count']}")
        if workers == 0 and steady_wait > 0:
            ev.append(f"loading runs in the training process (num_workers=0): for {_pct(min(in_process_cpu, 1.0))} of "
                      "the wait this thread is computing (or queued for a core); the rest it is blocked (I/O, "
                      "sleep, locks)")
        if cpu_bound:
            cause = ("CPU-bound data pipeline: decoding/augmentation saturates the CPU " +
                     ("workers" if workers else "in the training process") + " while the accelerator waits")
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
        cost = wait_share if wait_share > DATA_WAIT_SHARE else min(wait_share, HEALTHY_FLOOR / 2)
        found.append(Finding("data-bound", rules, "DATA-BOUND: the step waits for the loader", cost, ev, cause, fixes,
                             kind="bottleneck" if wait_share > DATA_WAIT_SHARE else "note"))

    # ---- rule 2: epoch-boundary spikes
    starts = [s for s in steps if s["epoch_start"]]
    if starts:
        # an epoch-start stall is spent fetching the first batch; a slow epoch-start step whose time went to
        # compute is noise from elsewhere (another process, a GC pause), not this rule
        spikes = [s for s in starts if s["host_ms"] > EPOCH_SPIKE_X * median_ms
                  and s["data_wait_ms"] > 0.5 * (s["host_ms"] - median_ms)]
        if spikes:
            excess = sum(s["host_ms"] - median_ms for s in spikes)
            worst = max(spikes, key=lambda s: s["host_ms"])
            found.append(Finding(
                "epoch-spikes", (2,), "EPOCH SPIKES: the first step of each epoch stalls", excess / host_total,
                [f"{len(spikes)} of {len(starts)} epoch-start steps exceed {EPOCH_SPIKE_X:g}x the median step "
                 f"({median_ms:.1f} ms); the worst, step {worst['index']}, took {worst['host_ms']:.0f} ms "
                 f"({worst['host_ms'] / median_ms:.0f}x), {worst['data_wait_ms']:.0f} ms of it waiting for data",
                 f"these stalls are {_pct(excess / host_total)} of the watched time; with longer epochs the share "
                 f"shrinks but each stall stays"],
                "DataLoader workers are started again at each epoch (persistent_workers=False): process start-up, "
                "dataset pickling and the first prefetch, every epoch",
                [Fix("--data-placement device (no workers to start)",
                     "DataLoader(..., persistent_workers=True) keeps the workers alive across epochs"),
                 Fix(None, "or hold the dataset on the GPU and index it per epoch (no DataLoader)")]))

    # ---- rules 4, 5, 6, 9: GPU idle, host-wait vs kernel-wait, launch-bound, queue depth
    if gpu:
        idle, hw, kw = trace["idle_share"], trace["host_wait_share"], trace["kernel_wait_share"]
        causes = trace.get("host_wait_by_cause") or {}
        host_gap = causes.get("host", 0.0)
        ev_idle = (f"the GPU is idle {_pct(idle)} of the kernel span (threshold {_pct(GPU_IDLE_SHARE)}): "
                   f"{_pct(hw)} waiting for the host to launch work, {_pct(kw)} between queued kernels")
        ev_kernels = (f"{trace['kernels_per_step']:.0f} kernels per step, median kernel {trace['median_kernel_us']:.1f} us, "
                      f"{_pct(trace['short_kernel_share'])} of kernels run shorter than their launch call "
                      f"(median launch {trace['median_launch_us']:.1f} us); queue depth median "
                      f"{trace['queue_depth_median']:.0f}, max {trace['queue_depth_max']}")
        if idle > GPU_IDLE_SHARE and hw >= kw and host_gap > 0.5 * hw:
            tiny = (trace["median_kernel_us"] is not None and trace["median_kernel_us"] < SMALL_KERNEL_US
                    and trace["short_kernel_share"] > SHORT_KERNEL_SHARE)
            if tiny:
                title, rules = "LAUNCH-BOUND: kernels are shorter than the time to launch them", (4, 6)
                cause = ("many tiny kernels: the CPU spends longer issuing each kernel than the GPU spends running "
                         "it, so the GPU drains its queue and waits")
            else:
                title, rules = "HOST-BOUND: the GPU waits for Python between launches", (4,)
                cause = "the CPU cannot enqueue work fast enough (Python and framework overhead per op)"
            found.append(Finding(
                "launch-bound" if tiny else "host-bound", rules, title, host_gap,
                [ev_idle, f"{_pct(host_gap)} of the span is host-wait with no data wait or sync to blame", ev_kernels],
                cause,
                [Fix("--cuda-graphs capture (the whole step replayed as one graph: one launch per step)",
                     "capture the step in a CUDA graph: torch.compile(model, mode='reduce-overhead'), or "
                     "torch.cuda.graphs with static input buffers"),
                 Fix("--compile on (fuses elementwise chains into fewer, larger kernels)",
                     "torch.compile(model) with static shapes (drop_last=True)"),
                 Fix("--batch-size auto (the throughput knee)", "a larger batch: the same launches, more work each"),
                 Fix(None, "fused optimizer and EMA: AdamW(..., fused=True); torch._foreach_lerp_ for the EMA")]))
        elif idle > GPU_IDLE_SHARE and kw > hw:
            found.append(Finding(
                "kernel-gaps", (5,), "KERNEL GAPS: launch latency between back-to-back kernels", kw,
                [ev_idle, f"{trace['small_gap_count']} gaps under 30 us between queued kernels", ev_kernels],
                "the work is queued but each kernel still pays launch latency; many small dependent kernels",
                [Fix("--cuda-graphs capture", "CUDA graphs (torch.compile mode='reduce-overhead')"),
                 Fix("--compile on", "torch.compile to fuse kernels")]))

    elif cuda:
        unavailable["4-6,8,9,11"] = no_gpu_reason
    else:
        unavailable["4-6,8,9,11 (GPU timeline)"] = no_gpu_reason

    # ---- rule 7: host syncs
    if gpu and trace.get("syncs_per_step") is not None:
        spp = trace["syncs_per_step"]
        if spp >= 1:
            sync_cost = (trace.get("host_wait_by_cause") or {}).get("sync", 0.0)
            ev = [f"{spp:g} host-device syncs in the median step (cudaStreamSynchronize / cudaDeviceSynchronize / "
                  f"blocking copies, e.g. from .item()), in every step rather than on logging steps only",
                  f"after them the GPU sits idle {_pct(sync_cost)} of the kernel span while Python refills the "
                  f"queue; the host spends {_pct(trace['sync_share'])} of step time blocked in them"]
            found.append(Finding(
                "sync-bound", (7,), "SYNC-BOUND: the step forces the host to wait for the GPU", sync_cost, ev,
                "hidden syncs: .item(), float(tensor), printing or branching on a GPU value every step, or "
                "GradScaler under bf16",
                [Fix("--log-every N (fastddpm reads the loss only on logging steps)",
                     "accumulate the loss on the device (loss_sum += loss.detach()) and call .item() every N steps"),
                 Fix(None, "no .item() in EMA or metrics; no GradScaler with bf16; find the sync with "
                           "torch.cuda.set_sync_debug_mode('warn')")]))
    elif not cuda:
        unavailable["7 (syncs)"] = ("a CPU device has no host-device syncs; .item() calls are counted "
                                    "(scalar_reads_per_step) but cost nothing here")

    # ---- rule 8: host-to-device copies
    if gpu and trace.get("h2d_share") is not None:
        pageable = trace["h2d_pageable"] or 0
        if trace["h2d_share"] > H2D_SHARE or pageable > 0:
            found.append(Finding(
                "transfer-bound", (8,), "TRANSFER-BOUND: host-to-device copies are not overlapped",
                max(trace["h2d_exposed_share"], causes.get("host", 0.0) if pageable else 0.0),
                [f"HtoD copies take {_pct(trace['h2d_share'])} of GPU busy time ({trace['h2d_bytes_per_step'] / 2**20:.1f} "
                 f"MiB per step); {_pct(trace['h2d_exposed_share'])} of the span they run with no kernel alongside",
                 f"{pageable} copies from pageable memory, {trace['h2d_pinned']} from pinned (pageable copies "
                 "block the host and cannot overlap)"],
                "transfers on the critical path: pageable source memory, or copies not issued ahead of use",
                [Fix("--data-placement device (no per-step copies at all)",
                     "keep the dataset on the GPU, or copy from pinned buffers: DataLoader(pin_memory=True) and "
                     "x.to(device, non_blocking=True)"),
                 Fix("--data-placement stream (pinned double buffers copied on a side stream)",
                     "pinned buffers allocated once, filled by the CPU, copied with non_blocking=True on a side "
                     "stream one batch ahead; avoid calling .pin_memory() per batch")]))

    # ---- rule 10: recompiles, graph breaks, CUDA-graph skips
    comp = m.get("compile") or {}
    rec_after = comp.get("recompiles_after_warmup", 0)
    breaks_after = comp.get("graph_breaks_after_warmup", 0)
    skips = comp.get("cudagraph_skips", 0)
    if rec_after or breaks_after or skips:
        hit = [s for s in steps if s["recompiles"]]
        excess = sum(max(0.0, s["host_ms"] - median_ms) for s in hit)
        ev = [f"{rec_after} graph(s) compiled after warm-up, {breaks_after} graph break(s) after warm-up, "
              f"{skips} CUDA-graph skip(s)"]
        if hit:
            ev.append("compiling in step(s) " + ", ".join(f"{s['index']} ({s['host_ms']:.0f} ms vs median "
                                                          f"{median_ms:.1f})" for s in hit[:4]))
        found.append(Finding(
            "recompiles", (10,), "RECOMPILES: torch.compile compiles again after warm-up",
            max(excess / host_total, HEALTHY_FLOOR if skips else 0.0), ev,
            "a guard failed: a new input shape (an uneven last batch), a Python float that changes (learning "
            "rate), or a graph break; each recompile costs seconds and may fall back to slower code",
            [Fix("fastddpm drops the ragged tail and keeps the learning rate in a tensor already",
                 "DataLoader(..., drop_last=True) (or pad the last batch); torch.compile(..., dynamic=False)"),
             Fix(None, "pass the learning rate as a tensor (AdamW(lr=torch.tensor(lr))); run with "
                       "TORCH_LOGS=recompiles,graph_breaks to see the failing guard"),
             Fix(None, "with mode='reduce-overhead', call torch.compiler.cudagraph_mark_step_begin() each step")]))

    # ---- rule 11: layout conversions
    if gpu and trace.get("layout_share") is not None and trace["layout_share"] > LAYOUT_SHARE:
        found.append(Finding(
            "layout-thrash", (11,), "LAYOUT THRASH: time spent converting between NCHW and NHWC",
            trace["layout_share"] * (1 - trace["idle_share"]),
            [f"layout-conversion kernels (nchwToNhwc / nhwcToNchw / transposes / .contiguous() copies) take "
             f"{_pct(trace['layout_share'])} of GPU busy time, {trace['layout_kernels_per_step']:.0f} per step"],
            "channels_last tensors meet ops without an NHWC kernel (GroupNorm in eager mode), so every such op "
            "converts back and forth",
            [Fix("--channels-last off in eager, or keep --compile on (inductor picks layouts end to end)",
                 "drop .to(memory_format=torch.channels_last) in eager mode, or compile the model")]))

    # ---- rule 12: precision coverage
    if trace is not None:
        flops = trace.get("gemm_flops_per_step") or {}
        total = sum(flops.values())
        low = flops.get("bf16", 0.0) + flops.get("fp16", 0.0) + flops.get("fp8", 0.0)
        fp32 = flops.get("fp32", 0.0)
        share32 = trace.get("gemm_time_share", {}).get("fp32", 0.0)
        if total > 0 and low > 0 and fp32 / total > FP32_GEMM_SHARE:
            found.append(Finding(
                "autocast-gap", (12,), "AUTOCAST GAP: part of the matmul work still runs in fp32",
                0.5 * share32,
                [f"{_pct(fp32 / total)} of matmul/conv FLOPs run with fp32 inputs while {_pct(low / total)} run in "
                 f"bf16/fp16: autocast covers only part of the hot path",
                 f"fp32 matmuls/convs take {_pct(share32)} of " + ("GPU busy" if gpu else "step") + " time; "
                 "the cost is an estimate: bf16 runs about 2x the fp32/TF32 rate on tensor cores (on a CPU it "
                 "depends on AMX/AVX512-BF16)"],
                "autocast does not cover the hot path: a forward outside the autocast block, explicit .float() "
                "calls, or a second model (EMA, loss network) called outside it",
                [Fix("--precision bf16 (fastddpm runs the whole loss under autocast)",
                     "wrap the full forward and loss in torch.autocast('cuda', dtype=torch.bfloat16); keep the "
                     "backward outside; look for .float() in the model")]))
        elif total > 0 and low == 0 and gpu:
            found.append(Finding(
                "fp32", (12,), "FP32: no matmul runs in reduced precision", 0.5 * share32,
                [f"all {total / 1e9:.1f} GFLOP of matmul/conv work per step has fp32 inputs; these take "
                 f"{_pct(share32)} of GPU busy time (estimate: bf16 about halves it)"],
                "no autocast: the tensor cores run at the fp32/TF32 rate",
                [Fix("--precision bf16", "torch.autocast('cuda', dtype=torch.bfloat16) around forward + loss "
                                         "(bf16 on Ampere and newer; fp16 + GradScaler before)")]))

    # ---- rule 13: MFU
    mfu = m.get("mfu")
    if mfu is not None and gpu and mfu["mfu"] < LOW_MFU and trace["idle_share"] < GPU_IDLE_SHARE:
        found.append(Finding(
            "low-mfu", (13,), "LOW MFU: the GPU is busy but does little math",
            min(0.5, (1 - trace["idle_share"]) * 0.5),
            [f"MFU {_pct(mfu['mfu'])}: {mfu['flops_per_step'] / 1e9:.1f} GFLOP per step in {mfu['step_ms']:.2f} ms "
             f"against a measured peak of {mfu['peak_tflops']:.0f} TFLOP/s, with the GPU idle only "
             f"{_pct(trace['idle_share'])}"],
            "memory- or elementwise-bound kernels (norms, activations, copies) dominate",
            [Fix("--compile on (fuses elementwise chains); --precision bf16; a larger --batch-size or model",
                 "torch.compile for fusion, bf16, larger batch or wider layers")]))
    elif mfu is None:
        unavailable["13 (MFU)"] = m.get("mfu_unavailable", "FLOPs or peak not measured")

    # ---- rule 14: memory headroom (an opportunity, never the verdict)
    mem = m.get("memory")
    if mem is not None and mem["peak_share"] < MEMORY_HEADROOM:
        found.append(Finding(
            "memory-headroom", (14,), "HEADROOM: the batch can grow", 0.0,
            [f"peak allocated {mem['peak_allocated_bytes'] / 2**30:.1f} GiB of {mem['total_bytes'] / 2**30:.0f} GiB "
             f"({_pct(mem['peak_share'])})"],
            "memory is left unused; a larger batch usually raises throughput up to a knee",
            [Fix("--batch-size auto (searches the throughput knee)", "raise the batch toward the throughput knee "
                                                                      "(search before compiling)")],
            kind="opportunity"))
    elif mem is None:
        unavailable["14 (memory)"] = "no CUDA device" if not cuda else "not measured"

    # ---- rule 15: drift and clocks
    ss = m.get("step_stats") or {}
    if ss.get("first_fifth_median_ms"):
        drift = ss["last_fifth_median_ms"] / ss["first_fifth_median_ms"] - 1
        t0, t1 = m.get("telemetry_start"), m.get("telemetry_end")
        if drift > DRIFT:
            ev = [f"the median step grew {_pct(drift)} from the first to the last fifth of the watch "
                  f"({ss['first_fifth_median_ms']:.1f} -> {ss['last_fifth_median_ms']:.1f} ms)"]
            if t0 and t1:
                fell = t1["sm_clock_mhz"] < 0.95 * t0["sm_clock_mhz"]
                ev.append(f"SM clock {t0['sm_clock_mhz']:.0f} -> {t1['sm_clock_mhz']:.0f} MHz, temperature "
                          f"{t0['temperature_c']:.0f} -> {t1['temperature_c']:.0f} C ({t1['source']})")
                cause = ("thermal or power throttling, not the code: compare runs only at equal clocks" if fell else
                         "clocks held steady, so something in the loop grows (tensors kept alive in a list, a "
                         "growing autograd graph, a cache)")
            else:
                cause = "cannot tell throttling from the code: GPU clocks are unavailable (no NVML / nvidia-smi)"
            found.append(Finding("drift", (15,), "DRIFT: steps get slower over the run", drift, ev, cause,
                                 [Fix(None, "check for state that grows per step; for throttling, improve "
                                            "cooling or compare at fixed clocks")],
                                 kind="note"))
        if not (t0 and t1):
            unavailable["15 (clocks)"] = "no CUDA device" if not cuda else "NVML and nvidia-smi unavailable"

    found.sort(key=lambda f: (f.kind != "bottleneck", -f.cost))
    return found, unavailable


def verdict(found: list[Finding], m: dict) -> dict:
    """The one dominant bottleneck, or healthy."""
    cands = [f for f in found if f.kind == "bottleneck" and f.cost >= HEALTHY_FLOOR]
    if cands:
        top = max(cands, key=lambda f: f.cost)
        return {"healthy": False, "id": top.id, "title": top.title, "cost": top.cost}
    trace = m.get("trace")
    if trace is not None and trace.get("has_gpu"):
        text = (f"HEALTHY (GPU-bound): the GPU is busy {_pct(1 - trace['idle_share'])} of the kernel span, launch "
                f"queue depth median {trace['queue_depth_median']:.0f}; no input, sync, transfer or compile "
                "problem costs 5% or more. Further gains are compute: fusion, precision, batch (rules 11-13)")
    elif m["device"].startswith("cuda"):
        text = "HEALTHY by the host-side rules; the GPU timeline was not profiled (profile_steps=0)"
    else:
        text = ("HEALTHY for a CPU run: compute-bound in the training process, with no data, epoch, sync or compile "
                "problem costing 5% or more; the GPU-level rules need a CUDA device")
    return {"healthy": True, "id": "healthy", "title": text, "cost": 0.0}
