"""Read a profiler trace (the Chrome/Perfetto JSON that torch.profiler exports) into the numbers the rules use.

Working from the exported JSON, not from the profiler's Python objects, keeps one code path for CPU and CUDA
traces, lets the report ship the exact file it was computed from, and lets the tests feed hand-made CUDA
traces through the same analysis on a machine without a GPU.

Time is in microseconds, as in the trace. The doctor brackets each training step with a `fastddpm::step`
annotation and each wait for data with `fastddpm::data_wait` (fastddpm.doctor.session), so steps, data waits,
host ops and GPU activity all share one clock.

Terms (DOCTOR_RULES.md):
- kernel span: first GPU activity start to last GPU activity end inside the measured steps.
- busy: the union of kernel, memcpy and memset intervals on all streams; idle = span - busy.
- a gap is *host-wait* when the CPU issued the launch of the work that ends the gap only after the GPU had
  gone idle: the GPU waited for Python. Otherwise it is *kernel-wait*: the work was queued and the gap is
  launch latency or a dependency between streams.
"""

from __future__ import annotations

import bisect
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

STEP_MARK = "fastddpm::step"
DATA_MARK = "fastddpm::data_wait"

# Runtime calls that block the host until the GPU catches up (DOCTOR_RULES rule 7): `.item()` or `float()` of a
# GPU tensor issues a DtoH copy and a cudaStreamSynchronize.
SYNC_RUNTIME = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                "cuStreamSynchronize", "cuCtxSynchronize"}
LAUNCH_RUNTIME = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|"
                            r"cudaLaunchCooperativeKernel|cudaMemcpyAsync|cudaMemsetAsync|cudaGraphLaunch|"
                            r"cudaMemcpy|cudaMemset)")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAYOUT_KERNEL = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose", re.IGNORECASE)

# Matmul/conv ops whose inputs' dtype says whether autocast covered them (rule 12). Leaf ops only: under
# autocast, `aten::conv2d` and `aten::linear` appear twice (an fp32 outer call that casts, a bf16 inner one).
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution", "aten::convolution_backward",
            "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_backward",
            "aten::_efficient_attention_backward", "aten::_scaled_dot_product_flash_attention_backward",
            "aten::_scaled_dot_product_efficient_attention_backward",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
NORM_OPS = {"aten::group_norm", "aten::native_group_norm", "aten::native_group_norm_backward"}

_DTYPE = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64",
          "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8"}


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text or "")]


def gemm_flops(name: str, dims: list, concrete: list | None = None) -> int:
    """FLOPs (2 per multiply-add) of one matmul/conv/attention op from its recorded input shapes.

    Backward ops count both gradients (input and weight): twice the forward. Attention counts QK^T and PV
    (4·B·H·L·S·D forward; backward 2.5x forward, as FlashAttention-2 counts it)."""
    try:
        if name == "aten::mm":
            (m, k), (_, n) = dims[0], dims[1]
            return 2 * m * k * n
        if name == "aten::addmm":
            (m, k), (_, n) = dims[1], dims[2]
            return 2 * m * k * n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = dims[0], dims[1]
            return 2 * b * m * k * n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = dims[1], dims[2]
            return 2 * b * m * k * n
        if name in ("aten::convolution", "aten::convolution_backward"):
            concrete = concrete or []
            backward = name.endswith("backward")
            x, w = (dims[1], dims[2]) if backward else (dims[0], dims[1])
            if len(w) < 3:
                return 0
            # stride, padding, dilation follow (input, weight, bias) forward; (grad, input, weight, bias_sizes) backward
            base = 4 if backward else 3
            stride = _ints(concrete[base]) if len(concrete) > base else []
            pad = _ints(concrete[base + 1]) if len(concrete) > base + 1 else []
            dil = _ints(concrete[base + 2]) if len(concrete) > base + 2 else []
            spatial_in, kernel = x[2:], w[2:]
            if backward:
                out_spatial = dims[0][2:]
            else:
                out_spatial = [
                    (s + 2 * (pad[i] if i < len(pad) else 0) - (dil[i] if i < len(dil) else 1) * (k - 1) - 1)
                    // (stride[i] if i < len(stride) else 1) + 1
                    for i, (s, k) in enumerate(zip(spatial_in, kernel))
                ]
            fwd = 2 * x[0] * w[0] * _prod(out_spatial) * w[1] * _prod(kernel)
            if not backward:
                return fwd
            # output_mask (last argument): which of grad_input, grad_weight, grad_bias are computed; each of the
            # first two costs one forward (the first layer's input needs no gradient)
            mask = re.findall(r"True|False|1|0", concrete[-1]) if concrete else []
            return fwd * (sum(v in ("True", "1") for v in mask[:2]) if len(mask) >= 2 else 2)
        if "scaled_dot_product" in name or "attention" in name:
            q, k = dims[0], dims[1]
            if len(q) != 4:
                return 0
            b, h, l, d = q
            s = k[2]
            fwd = 4 * b * h * l * s * d
            return int(2.5 * fwd) if "backward" in name else fwd
    except (IndexError, TypeError, ValueError):
        return 0
    return 0


@dataclass
class StepTrace:
    start_us: float
    end_us: float
    data_wait_us: float = 0.0
    syncs: int = 0
    sync_us: float = 0.0  # host time blocked in sync calls
    kernels: int = 0
    gpu_busy_us: float = 0.0

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class TraceStats:
    """Everything the rules read from one trace. GPU fields stay None on a CPU-only trace."""

    steps: list[StepTrace]
    has_gpu: bool
    # host ops (any device)
    ops_per_step: float = 0.0
    # `.item()` and friends; on a CPU device they read memory and cost nothing, so only a CUDA trace's
    # blocking runtime calls count as syncs (syncs_per_step stays None on a CPU trace)
    scalar_reads_per_step: float = 0.0
    syncs_per_step: float | None = None
    sync_share: float | None = None  # host time blocked in syncs / step time
    gemm_flops_per_step: dict[str, float] = field(default_factory=dict)  # by input dtype
    gemm_time_share: dict[str, float] = field(default_factory=dict)  # by dtype, of step time (CPU) or busy (GPU)
    groupnorm_share: float = 0.0
    # GPU
    span_us: float | None = None
    busy_us: float | None = None
    idle_share: float | None = None
    host_wait_share: float | None = None  # of span
    kernel_wait_share: float | None = None
    host_wait_by_cause: dict[str, float] = field(default_factory=dict)  # data / sync / host, share of span
    small_gap_count: int | None = None  # kernel-wait gaps under 30 us
    kernels_per_step: float | None = None
    median_kernel_us: float | None = None
    short_kernel_share: float | None = None  # kernels shorter than their launch call
    median_launch_us: float | None = None
    queue_depth_median: float | None = None
    queue_depth_max: int | None = None
    blocked_launch_us_per_step: float | None = None  # launch calls > 100 us: the CPU blocked on a full queue
    h2d_share: float | None = None  # HtoD memcpy time / busy
    h2d_exposed_share: float | None = None  # HtoD time not overlapped by kernels / span
    h2d_pageable: int | None = None
    h2d_pinned: int | None = None
    h2d_bytes_per_step: float | None = None
    layout_share: float | None = None  # layout-conversion kernels / busy
    layout_kernels_per_step: float | None = None
    graph_launches_per_step: float | None = None
    # for the HTML timeline, microseconds from the first step's start: [start, end] pairs and sync moments
    timeline: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("steps", "timeline")}
        d["steps_measured"] = len(self.steps)
        return d


def load_trace(path: str | Path) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(a0: float, a1: float, merged: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [a0, a1] covered by the sorted, disjoint intervals `merged` (starts = their starts)."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, a0) - 1)
    while i < len(merged) and merged[i][0] < a1:
        s, e = merged[i]
        total += max(0.0, min(e, a1) - max(s, a0))
        i += 1
    return total


def _step_index(steps: list[StepTrace], starts: list[float], ts: float) -> int | None:
    i = bisect.bisect_right(starts, ts) - 1
    if i >= 0 and ts < steps[i].end_us:
        return i
    return None


def analyze(events: list[dict]) -> TraceStats:
    """Measure one trace. Only work inside `fastddpm::step` ranges counts."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    steps = sorted((StepTrace(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in xs
                    if e.get("name") == STEP_MARK and e.get("cat") in ("user_annotation", "cpu_op", None)),
                   key=lambda s: s.start_us)
    if not steps:
        raise ValueError(f"the trace has no '{STEP_MARK}' ranges: it was not recorded by fastddpm.doctor")
    starts = [s.start_us for s in steps]
    total_step_us = sum(s.dur_us for s in steps) or 1.0
    n = len(steps)

    for e in xs:
        if e.get("name") == DATA_MARK:
            i = _step_index(steps, starts, float(e["ts"]))
            if i is not None:
                steps[i].data_wait_us += float(e.get("dur", 0))

    # ---- host ops: syncs, op counts, matmul dtypes and FLOPs
    ops = 0
    scalar_reads = 0
    gemm_flops: dict[str, float] = {}
    gemm_time: dict[str, float] = {}
    norm_time = 0.0
    op_events = [e for e in xs if e.get("cat") == "cpu_op"]
    item_ranges = _Ranges(op_events, "aten::item")
    for e in op_events:
        i = _step_index(steps, starts, float(e["ts"]))
        if i is None:
            continue
        name = e.get("name", "")
        ops += 1
        dur = float(e.get("dur", 0))
        if name == "aten::item" or (name == "aten::_local_scalar_dense"
                                    and not item_ranges.contains(e.get("tid"), float(e["ts"]))):
            scalar_reads += 1
        elif name in GEMM_OPS:
            args = e.get("args", {})
            types = args.get("Input type") or []
            dtype = _DTYPE.get(types[0] if types else "", types[0] if types else "?")
            if name == "aten::addmm" or name == "aten::baddbmm":
                dtype = _DTYPE.get(types[1], types[1]) if len(types) > 1 else dtype
            if name == "aten::convolution_backward":
                dtype = _DTYPE.get(types[0], types[0]) if types else dtype
            gemm_flops[dtype] = gemm_flops.get(dtype, 0.0) + gemm_flops_of(e)
            gemm_time[dtype] = gemm_time.get(dtype, 0.0) + dur
        elif name in NORM_OPS:
            norm_time += dur
    runtime = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    for e in runtime:
        if e.get("name") in SYNC_RUNTIME:
            i = _step_index(steps, starts, float(e["ts"]))
            if i is not None:
                steps[i].syncs += 1
                steps[i].sync_us += float(e.get("dur", 0))

    stats = TraceStats(steps=steps, has_gpu=False)
    stats.ops_per_step = ops / n
    stats.scalar_reads_per_step = scalar_reads / n
    if runtime:  # a CUDA trace: a sync is a runtime call that blocks the host (.item() on a GPU tensor makes one)
        stats.syncs_per_step = statistics.median(s.syncs for s in steps)
        stats.sync_share = sum(s.sync_us for s in steps) / total_step_us
    stats.gemm_flops_per_step = {k: v / n for k, v in gemm_flops.items()}
    t0 = steps[0].start_us
    data_iv = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in xs if e.get("name") == DATA_MARK]
    sync_at = [float(e["ts"]) + float(e.get("dur", 0)) for e in runtime if e.get("name") in SYNC_RUNTIME]
    stats.timeline = {
        "steps": [[s.start_us - t0, s.end_us - t0] for s in steps],
        "data_wait": [[a - t0, b - t0] for a, b in _merge(data_iv) if _step_index(steps, starts, a) is not None],
        "syncs": [v - t0 for v in sync_at if _step_index(steps, starts, v) is not None],
        "gpu_busy": [],
    }

    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    launches = {}
    for e in runtime:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None and LAUNCH_RUNTIME.match(e.get("name", "")):
            launches[corr] = e
    # keep GPU work launched from inside the measured steps
    gpu = [g for g in gpu if (g.get("args") or {}).get("correlation") in launches
           and _step_index(steps, starts, float(launches[g["args"]["correlation"]]["ts"])) is not None]
    if not gpu:
        busy_ref = total_step_us
        stats.gemm_time_share = {k: v / busy_ref for k, v in gemm_time.items()}
        stats.groupnorm_share = norm_time / busy_ref
        return stats

    # ---- GPU timeline
    stats.has_gpu = True
    ivs = sorted((float(g["ts"]), float(g["ts"]) + float(g.get("dur", 0)), g) for g in gpu)
    merged = _merge([(s, e) for s, e, _ in ivs])
    mstarts = [s for s, _ in merged]
    span0, span1 = merged[0][0], merged[-1][1]
    span = max(span1 - span0, 1e-9)
    busy = sum(e - s for s, e in merged)
    stats.span_us, stats.busy_us = span, busy
    stats.timeline["gpu_busy"] = [[a - t0, b - t0] for a, b in _coarsen(merged, 4000)]
    stats.idle_share = max(0.0, 1 - busy / span)

    # each merged interval's first activity tells who ended the previous gap
    first_at = {}
    for s, e, g in ivs:
        first_at.setdefault(s, g)
    data_ranges = _merge([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in xs
                          if e.get("name") == DATA_MARK])
    dstarts = [s for s, _ in data_ranges]
    sync_ends = sorted(float(e["ts"]) + float(e.get("dur", 0)) for e in runtime if e.get("name") in SYNC_RUNTIME)
    host_wait = kernel_wait = 0.0
    by_cause = {"data": 0.0, "sync": 0.0, "host": 0.0}
    small_gaps = 0
    for (s0, e0), (s1, _) in zip(merged, merged[1:]):
        gap = s1 - e0
        if gap <= 0:
            continue
        nxt = first_at.get(s1)
        launch_ts = float(launches[nxt["args"]["correlation"]]["ts"]) if nxt is not None else e0
        if launch_ts >= e0:
            host_wait += gap
            if data_ranges and _overlap(e0, s1, data_ranges, dstarts) > 0.5 * gap:
                by_cause["data"] += gap
            elif _any_between(sync_ends, e0 - 50.0, s1):
                by_cause["sync"] += gap
            else:
                by_cause["host"] += gap
        else:
            kernel_wait += gap
            if gap < 30.0:
                small_gaps += 1
    stats.host_wait_share = host_wait / span
    stats.kernel_wait_share = kernel_wait / span
    stats.host_wait_by_cause = {k: v / span for k, v in by_cause.items()}
    stats.small_gap_count = small_gaps

    kernels = [g for g in gpu if g.get("cat") == "kernel"]
    for g in gpu:
        i = _step_index(steps, starts, float(launches[g["args"]["correlation"]]["ts"]))
        if g.get("cat") == "kernel":
            steps[i].kernels += 1
        steps[i].gpu_busy_us += float(g.get("dur", 0))
    stats.kernels_per_step = len(kernels) / n
    if kernels:
        durs = [float(k.get("dur", 0)) for k in kernels]
        stats.median_kernel_us = statistics.median(durs)
        short = sum(1 for k in kernels if float(k.get("dur", 0)) < float(launches[k["args"]["correlation"]].get("dur", 0)))
        stats.short_kernel_share = short / len(kernels)
        stats.median_launch_us = statistics.median(float(launches[k["args"]["correlation"]].get("dur", 0))
                                                   for k in kernels)
        # queue depth at each launch: work already launched that the GPU has not finished
        order = sorted(((float(launches[g["args"]["correlation"]]["ts"]), float(g["ts"]) + float(g.get("dur", 0)))
                        for g in gpu))
        ends_sorted: list[float] = []
        depths = []
        for launch_ts, end in order:
            # drop work finished by now
            cut = bisect.bisect_right(ends_sorted, launch_ts)
            del ends_sorted[:cut]
            depths.append(len(ends_sorted))
            bisect.insort(ends_sorted, end)
        stats.queue_depth_median = float(statistics.median(depths))
        stats.queue_depth_max = max(depths)
    blocked = sum(float(e.get("dur", 0)) for e in launches.values()
                  if float(e.get("dur", 0)) > 100.0 and e.get("name", "").startswith(("cudaLaunch", "cuLaunch"))
                  and _step_index(steps, starts, float(e["ts"])) is not None)
    stats.blocked_launch_us_per_step = blocked / n
    graph_launches = sum(1 for e in launches.values() if e.get("name") == "cudaGraphLaunch"
                         and _step_index(steps, starts, float(e["ts"])) is not None)
    stats.graph_launches_per_step = graph_launches / n

    h2d = [g for g in gpu if g.get("cat") == "gpu_memcpy" and "HtoD" in g.get("name", "")]
    kernel_merged = _merge([(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels])
    kstarts = [s for s, _ in kernel_merged]
    h2d_time = sum(float(g.get("dur", 0)) for g in h2d)
    exposed = sum(float(g.get("dur", 0)) - _overlap(float(g["ts"]), float(g["ts"]) + float(g.get("dur", 0)),
                                                     kernel_merged, kstarts) for g in h2d)
    stats.h2d_share = h2d_time / busy
    stats.h2d_exposed_share = exposed / span
    stats.h2d_pageable = sum(1 for g in h2d if "Pageable" in g.get("name", ""))
    stats.h2d_pinned = sum(1 for g in h2d if "Pinned" in g.get("name", ""))
    stats.h2d_bytes_per_step = sum(float((g.get("args") or {}).get("bytes", 0)) for g in h2d) / n

    layout = [k for k in kernels if LAYOUT_KERNEL.search(k.get("name", ""))]
    layout_ids = {id(k) for k in layout}
    contiguous = _Ranges(op_events, "aten::contiguous")
    layout += [k for k in kernels if id(k) not in layout_ids and contiguous.contains(
        launches[k["args"]["correlation"]].get("tid"), float(launches[k["args"]["correlation"]]["ts"]))]
    stats.layout_share = sum(float(k.get("dur", 0)) for k in layout) / busy
    stats.layout_kernels_per_step = len(layout) / n

    # GEMM time on the GPU: kernel time of the kernels each matmul/conv op launched
    gemm_gpu: dict[str, float] = {}
    norm_gpu = 0.0
    owner = _kernel_owner_ops(kernels, launches, op_events)
    for k in kernels:
        op = owner.get(id(k))
        if op is None:
            continue
        if op.get("name") in GEMM_OPS:
            types = (op.get("args") or {}).get("Input type") or ["?"]
            t = types[1] if op.get("name") in ("aten::addmm", "aten::baddbmm") and len(types) > 1 else types[0]
            dtype = _DTYPE.get(t, t)
            gemm_gpu[dtype] = gemm_gpu.get(dtype, 0.0) + float(k.get("dur", 0))
        elif op.get("name") in NORM_OPS:
            norm_gpu += float(k.get("dur", 0))
    stats.gemm_time_share = {k: v / busy for k, v in gemm_gpu.items()}
    stats.groupnorm_share = norm_gpu / busy
    return stats


def gemm_flops_of(e: dict) -> float:
    args = e.get("args") or {}
    if "flops" in args and e.get("name") not in ("aten::convolution_backward",):
        return float(args["flops"])
    return float(gemm_flops(e.get("name", ""), args.get("Input Dims") or [], args.get("Concrete Inputs")))


def _coarsen(merged: list[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """At most `limit` intervals for drawing: close the smallest gaps first (a pixel cannot show them)."""
    if len(merged) <= limit:
        return merged
    gaps = sorted(b[0] - a[1] for a, b in zip(merged, merged[1:]))
    cut = gaps[len(merged) - limit]
    out = [list(merged[0])]
    for s, e in merged[1:]:
        if s - out[-1][1] < cut:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class _Ranges:
    """Merged time ranges of one host op per thread, for 'was this moment inside op X on thread T?'."""

    def __init__(self, op_events: list[dict], name: str):
        by_tid: dict = {}
        for o in op_events:
            if o.get("name") == name:
                by_tid.setdefault(o.get("tid"), []).append((float(o["ts"]), float(o["ts"]) + float(o.get("dur", 0))))
        self.ranges = {tid: _merge(v) for tid, v in by_tid.items()}
        self.starts = {tid: [s for s, _ in v] for tid, v in self.ranges.items()}

    def contains(self, tid, ts: float) -> bool:
        r = self.ranges.get(tid)
        if not r:
            return False
        i = bisect.bisect_right(self.starts[tid], ts) - 1
        return i >= 0 and r[i][0] <= ts < r[i][1]


def _any_between(sorted_values: list[float], lo: float, hi: float) -> bool:
    i = bisect.bisect_left(sorted_values, lo)
    return i < len(sorted_values) and sorted_values[i] <= hi


def _kernel_owner_ops(kernels: list[dict], launches: dict, op_events: list[dict]) -> dict[int, dict]:
    """For each kernel, the innermost matmul/conv/norm op (on the launching thread) enclosing its launch."""
    by_tid: dict = {}
    for o in op_events:
        if o.get("name") in GEMM_OPS or o.get("name") in NORM_OPS:
            by_tid.setdefault(o.get("tid"), []).append(o)
    for lst in by_tid.values():
        lst.sort(key=lambda o: float(o["ts"]))
    starts = {tid: [float(o["ts"]) for o in lst] for tid, lst in by_tid.items()}
    out = {}
    for k in kernels:
        launch = launches[k["args"]["correlation"]]
        tid = launch.get("tid")
        lst = by_tid.get(tid)
        if not lst:
            continue
        ts = float(launch["ts"])
        i = bisect.bisect_right(starts[tid], ts) - 1
        # ops nest, so the latest-starting op that still encloses the launch is the innermost one; a few
        # steps back suffice (these ops do not nest deeply)
        for j in range(i, max(-1, i - 8), -1):
            o = lst[j]
            if float(o["ts"]) + float(o.get("dur", 0)) >= ts:
                out[id(k)] = o
                break
    return out
