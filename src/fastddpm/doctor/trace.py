"""Read a profiler trace (the Chrome/Perfetto JSON that torch.profiler exports) into the numbers the rules use.

Working from the exported JSON, not from the profiler's Python objects, keeps one code path for CPU and CUDA
traces, lets the report ship the exact file it was computed from, and lets the tests feed hand-made CUDA
traces through the same analysis on a machine without a GPU.

Time is in microseconds, as in the trace. The doctor brackets each training step with a `fastddpm::step`
annotation and each wait for data with `fastddpm::data_wait` (fastddpm.doctor.session), so steps, data waits,
host ops and GPU activity all share one clock.

Terms (docs/DOCTOR.md):
- kernel span: first GPU activity start to last GPU activity end inside the measured steps.
- busy: the union of kernel, memcpy and memset intervals on all streams; idle = span - busy.
- a gap is *host-wait* when the CPU issued the launch of the work that ends the gap only after the GPU had
  gone idle: the GPU waited for Python. Otherwise it is *kernel-wait*: the work was queued and the gap is
  launch latency or a dependency between streams.
- a *graph* kernel is replayed from a CUDA graph: CUPTI gives every kernel of one replay the correlation id
  of the one `cudaGraphLaunch` that replayed it. Such kernels have no launch call of their own, so the launch
  metrics count only *eager* kernels (launched one by one); and the ops inside the graph leave no cpu_op, so
  matmul FLOPs and dtypes cannot be read from a trace that has them (`gemm_unavailable` says why).

The parts: marks.py names the ranges the session records; trace_intervals.py does the interval arithmetic;
trace_flops.py counts matmul FLOPs by input dtype; trace_optree.py charges every host op to a BREAKDOWN
category. This module reads the trace with them into one TraceStats.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fastddpm.doctor.marks import CLOSURE_MARK, DATA_MARK, HOST_MARK_CATS, STEP_MARK
from fastddpm.doctor.trace_flops import (DTYPE, GEMM_OPS, NORM_OPS, gemm_flops_of, kernel_owner_ops, nested_ops,
                                         op_dtype)
from fastddpm.doctor.trace_intervals import Ranges, any_between, coarsen, merge, overlap
from fastddpm.doctor.trace_loops import item_loops, param_update_loop
from fastddpm.doctor.trace_optree import OpTree

# Runtime calls that block the host until the GPU catches up (docs/DOCTOR.md rule 7): `.item()` or `float()` of a
# GPU tensor issues a DtoH copy and a cudaStreamSynchronize.
SYNC_RUNTIME = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                "cuStreamSynchronize", "cuCtxSynchronize"}
LAUNCH_RUNTIME = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|"
                            r"cudaLaunchCooperativeKernel|cudaMemcpyAsync|cudaMemsetAsync|cudaGraphLaunch|"
                            r"cuGraphLaunch|cudaMemcpy|cudaMemset)")
GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")  # one call replays a whole captured graph
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# aten's direct_copy_kernel_cuda runs every device copy_ that is not a cudaMemcpy (one dtype, both contiguous),
# casts included; its elementwise kernel is gpu_kernel_impl_nocast's where input and output share the dtype: that
# one is a strided, layout-changing copy, named so even inside a CUDA graph, where no aten::contiguous op is around
# it (76 a step, 12% of compiled, graphed ddpm-cifar10 with channels_last on an H200). A cast is not counted.
LAYOUT_KERNEL = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose|"
                           r"gpu_kernel_impl_nocast<at::native::direct_copy_kernel", re.IGNORECASE)
# the format conversions cuDNN runs around a convolution whose engine wants the other layout (on sm80+ its bf16 and
# fp16 tensor-core engines run in NHWC, so NCHW tensors are converted in and the result back)
FORMAT_KERNEL = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw", re.IGNORECASE)


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

    steps: list[StepTrace]  # the profiled steps measured (those that began an epoch left out: epoch_starts_left_out)
    has_gpu: bool
    epoch_starts_left_out: int = 0
    # host ops (any device)
    ops_per_step: float = 0.0
    # `.item()` and friends in the loop's own code (not the optimizer's internal ones, e.g. a per-tensor Adam's
    # step counters); on a CPU device they read memory and cost nothing, so only a CUDA trace's blocking runtime
    # calls count as syncs (syncs_per_step stays None on a CPU trace)
    scalar_reads_per_step: float = 0.0
    syncs_per_step: float | None = None
    sync_share: float | None = None  # host time blocked in syncs / step time
    gemm_flops_per_step: dict[str, float] = field(default_factory=dict)  # by input dtype
    gemm_time_share: dict[str, float] = field(default_factory=dict)  # by dtype, of step time (CPU) or busy (GPU)
    groupnorm_share: float | None = 0.0
    # why the three above could not be read (then {}, {}, None): CUDA-graph replays hide their ops
    gemm_unavailable: str | None = None
    # where the step goes (compute_breakdown): {category: share}, categories in BREAKDOWN order. A CPU trace:
    # shares of the main thread's step time, summing to 1. A GPU trace: shares of the kernel span (kernel time
    # by the op that launched it, plus "idle"). Empty when CUDA graphs hide the ops.
    breakdown: dict[str, float] = field(default_factory=dict)
    breakdown_basis: str | None = None
    # a CPU trace: the ops per step of each breakdown category (nested ones too: the profiler pays for every op
    # it records), and the profiled steps' median; Measurements.unprofiled_share takes the profiler's cost out
    breakdown_ops_per_step: dict[str, float] = field(default_factory=dict)
    profiled_step_ms: float | None = None
    matmul_share_by_dtype: dict[str, float] = field(default_factory=dict)  # the "matmul" category split by dtype
    attention_share_by_impl: dict[str, float] = field(default_factory=dict)  # "attention" by implementation
    # a GPU trace: the share of the kernels each category's ops launch (a launch-bound step's launches, by owner)
    kernel_share_by_category: dict[str, float] = field(default_factory=dict)
    optimizer_kind: str | None = None  # "per-tensor", "foreach" or "fused": how the optimizer step ran
    optimizer_ops_per_step: float | None = None  # ops inside Optimizer.step: one per tensor per op when per-tensor
    # Python loops over the items of a tensor's first dimension in the step (trace_loops.item_loops' dicts)
    item_loops: list[dict] = field(default_factory=list)
    # the longest run of in-place updates outside the optimizer, one tensor at a time (an EMA of the weights):
    # trace_loops.param_update_loop's dict
    param_update_loop: dict | None = None
    # GPU
    span_us: float | None = None
    busy_us: float | None = None
    idle_share: float | None = None
    host_wait_share: float | None = None  # of span
    kernel_wait_share: float | None = None
    host_wait_by_cause: dict[str, float] = field(default_factory=dict)  # data / sync / host, share of span
    small_gap_count: int | None = None  # kernel-wait gaps under 30 us
    kernels_per_step: float | None = None  # all kernels, eager and graph-replayed
    median_kernel_us: float | None = None
    # launch metrics: eager kernels only (a graph-replayed kernel has no launch call of its own)
    eager_kernels_per_step: float | None = None
    median_eager_kernel_us: float | None = None
    short_kernel_share: float | None = None  # eager kernels shorter than their launch call
    median_launch_us: float | None = None
    # at each launch call (one per eager kernel/copy, one per graph replay): calls whose work is not finished
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
    layout_format_share: float | None = None  # of the layout time: cuDNN's NCHW <-> NHWC format conversions
    graph_launches_per_step: float | None = None
    graph_kernel_share: float | None = None  # kernels replayed from CUDA graphs / all kernels
    # the kernels (GPU) or ops (CPU, own time) that take most of the step: [{"name", "share", "calls_per_step",
    # "category"}], largest first; share of the kernel span (GPU) or of the training thread's step (CPU)
    top_ops: list[dict] = field(default_factory=list)
    # for the HTML timeline, microseconds from the first step's start: [start, end] pairs and sync moments
    timeline: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("steps", "timeline")}
        d["steps_measured"] = len(self.steps)
        return d


def load_trace(path: str | Path) -> list[dict]:
    """The events of a Chrome/Perfetto JSON trace, plain or gzipped (.gz)."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            data = json.load(f)
    else:
        data = json.loads(path.read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def _step_index(steps: list[StepTrace], starts: list[float], ts: float) -> int | None:
    i = bisect.bisect_right(starts, ts) - 1
    if i >= 0 and ts < steps[i].end_us:
        return i
    return None


def analyze(events: list[dict], epoch_starts: list[bool] = ()) -> TraceStats:
    """Measure one trace. Only work inside `fastddpm::step` ranges counts. `epoch_starts`: per profiled step, in
    order, whether it began an epoch. Those are left out (while another step is left): a loader's start-up (worker
    processes, a first prefetch) would take most of the profile, and every share of where a step goes would be of
    it; rule 2 judges them from the watched steps."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    steps = sorted((StepTrace(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in xs
                    if e.get("name") == STEP_MARK and e.get("cat") in HOST_MARK_CATS),
                   key=lambda s: s.start_us)
    if not steps:
        raise ValueError(f"the trace has no '{STEP_MARK}' ranges: it was not recorded by fastddpm.doctor")
    steady = [s for s, began in itertools.zip_longest(steps, epoch_starts[:len(steps)]) if not began]
    left_out = len(steps) - len(steady)
    steps = steady or steps
    step_of = functools.partial(_step_index, steps, [s.start_us for s in steps])  # ts -> step index, or None
    total_step_us = sum(s.dur_us for s in steps) or 1.0
    n = len(steps)

    data_marks = [e for e in xs if e.get("name") == DATA_MARK and e.get("cat") in HOST_MARK_CATS]
    for e in data_marks:
        i = step_of(float(e["ts"]))
        if i is not None:
            steps[i].data_wait_us += float(e.get("dur", 0))

    # ---- host: op counts, matmul dtypes and FLOPs, syncs
    op_events = [e for e in xs if e.get("cat") == "cpu_op"]
    in_optimizer = Ranges([e for e in xs if e.get("cat") == "user_annotation"],
                          lambda name: name.startswith("Optimizer.step#"))
    # a closure's own .item() calls are the loop's, though its forward runs inside the optimizer's step
    in_optimizer.exclude(Ranges([e for e in xs if e.get("cat") == "user_annotation"], CLOSURE_MARK))
    host = _host_ops(op_events, step_of, in_optimizer)
    runtime = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    sync_calls = [e for e in runtime if e.get("name") in SYNC_RUNTIME]
    for e in sync_calls:
        i = step_of(float(e["ts"]))
        if i is not None:
            steps[i].syncs += 1
            steps[i].sync_us += float(e.get("dur", 0))

    stats = TraceStats(steps=steps, has_gpu=False, epoch_starts_left_out=left_out if steady else 0)
    stats.ops_per_step = host.ops / n
    stats.scalar_reads_per_step = host.scalar_reads / n
    if runtime:  # a CUDA trace: a sync is a runtime call that blocks the host (.item() on a GPU tensor makes one)
        stats.syncs_per_step = statistics.median(s.syncs for s in steps)
        stats.sync_share = sum(s.sync_us for s in steps) / total_step_us
    stats.gemm_flops_per_step = {k: v / n for k, v in host.gemm_flops.items()}
    t0_us = steps[0].start_us
    data_iv = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in data_marks]
    sync_ends_us = [float(e["ts"]) + float(e.get("dur", 0)) for e in sync_calls]
    stats.timeline = {
        "steps": [[s.start_us - t0_us, s.end_us - t0_us] for s in steps],
        "data_wait": [[a - t0_us, b - t0_us] for a, b in merge(data_iv) if step_of(a) is not None],
        "syncs": [v - t0_us for v in sync_ends_us if step_of(v) is not None],
        "gpu_busy": [],
    }

    launches = {}  # correlation id -> the runtime call that launched (or replayed) the work
    for e in runtime:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None and LAUNCH_RUNTIME.match(e.get("name", "")):
            launches[corr] = e
    # keep GPU work launched from inside the measured steps
    gpu = [g for g in xs if g.get("cat") in GPU_CATS and (g.get("args") or {}).get("correlation") in launches
           and step_of(float(launches[g["args"]["correlation"]]["ts"])) is not None]
    tree = OpTree(xs, step_of, [s.end_us for s in steps])
    stats.optimizer_kind, stats.optimizer_ops_per_step = tree.optimizer_kind()
    stats.item_loops = item_loops(tree, [(s.start_us, s.end_us) for s in steps])
    stats.param_update_loop = param_update_loop(tree, [(s.start_us, s.end_us) for s in steps])
    if not gpu:
        stats.gemm_time_share = {k: v / total_step_us for k, v in host.gemm_time_us.items()}
        stats.groupnorm_share = host.norm_us / total_step_us
        _host_breakdown(stats, tree, total_step_us)
        return stats

    # ---- GPU timeline
    stats.has_gpu = True
    kernels = [g for g in gpu if g.get("cat") == "kernel"]
    _gaps(stats, gpu, launches, data_iv, sorted(sync_ends_us), t0_us)
    for g in gpu:
        i = step_of(float(launches[g["args"]["correlation"]]["ts"]))
        if g.get("cat") == "kernel":
            steps[i].kernels += 1
        steps[i].gpu_busy_us += float(g.get("dur", 0))
    _launch_metrics(stats, gpu, kernels, launches, step_of)
    _copies(stats, gpu, kernels)
    _layout(stats, kernels, launches, op_events)
    _gpu_matmul_shares(stats, kernels, launches, op_events)
    _top_kernels(stats, kernels, launches, tree)
    if not stats.gemm_unavailable:
        _gpu_breakdown(stats, kernels, launches, tree)
    return stats


# ---------------------------------------------------------------------------------------------------------------
# Where the step goes: every op's own time (its duration less its children's) is charged to a category. An op
# inside a categorised op is charged to the outer one (the casts and reshapes inside a GroupNorm are the norm's
# cost; everything inside Optimizer.step is the optimizer's, but for a closure it calls: the loop's forward and
# backward), so the categories add up to the step.
# trace_optree.py names each op's category; the two functions below add the time up.
BREAKDOWN = ("matmul", "attention", "norm", "elementwise", "optimizer", "copy", "data", "framework", "python", "idle")
BREAKDOWN_LABELS = {
    "matmul": "matmul/conv", "attention": "attention", "norm": "norms", "elementwise": "elementwise/activation",
    "optimizer": "optimizer step", "copy": "copies/layout/casts", "data": "data wait",
    "framework": "framework (autograd, views, allocation)", "python": "Python/dispatch (no op running)",
    "idle": "GPU idle"}


def _host_breakdown(stats: TraceStats, tree: OpTree, total_step_us: float) -> None:
    """A CPU trace: the main thread's step time by category (own time of each op), the rest Python."""
    own: dict[str, float] = {}
    ops: dict[str, int] = {}
    by_dtype: dict[str, float] = {}
    by_impl: dict[str, float] = {}
    by_name: dict[tuple[str, str], list] = {}
    for n in tree.walk(tree.main_tid):
        self_us = max(0.0, (n.end - n.ts) - sum(c.end - c.ts for c in n.children))
        cat = n.cat or ("framework" if n.e.get("cat") == "cpu_op" else "python")
        own[cat] = own.get(cat, 0.0) + self_us
        if n.e.get("cat") == "cpu_op":
            ops[cat] = ops.get(cat, 0) + 1
            _add(by_name, n.e.get("name", "?"), self_us, cat)
        if n.cat == "matmul":
            d = op_dtype(n.owner.e)
            by_dtype[d] = by_dtype.get(d, 0.0) + self_us
        elif n.cat == "attention":
            by_impl[n.owner.impl] = by_impl.get(n.owner.impl, 0.0) + self_us
    covered_us = sum(n.end - n.ts for n in tree.roots.get(tree.main_tid, []))
    own["python"] = own.get("python", 0.0) + max(0.0, total_step_us - covered_us)
    stats.top_ops = _top(by_name, total_step_us, len(stats.steps))
    stats.breakdown = {k: own.get(k, 0.0) / total_step_us for k in BREAKDOWN if k != "idle"}
    stats.breakdown_basis = "share of the profiled steps' host time (the training thread)"
    stats.breakdown_ops_per_step = {k: v / len(stats.steps) for k, v in ops.items()}
    stats.profiled_step_ms = statistics.median(s.dur_us for s in stats.steps) / 1e3
    stats.matmul_share_by_dtype = {k: v / total_step_us for k, v in by_dtype.items()}
    stats.attention_share_by_impl = {k: v / total_step_us for k, v in by_impl.items()}


TOP_OPS = 8
KERNEL_NAME_WIDTH = 90  # a kernel's name is shown cut here: templated names run to hundreds of characters


def _add(by_name: dict[tuple[str, str], list], name: str, us: float, category: str) -> None:
    entry = by_name.setdefault((name, category), [0.0, 0])  # time, calls
    entry[0] += us
    entry[1] += 1


def _top(by_name: dict[tuple[str, str], list], total_us: float, steps: int, width: int | None = None) -> list[dict]:
    """The TOP_OPS (name, category) pairs with the most time. An op that runs in several categories is one entry
    for each: a conv backward's few large `aten::copy_` calls and a data loader's many small ones are different
    costs with different fixes, and neither's calls or time may be shown under the other's category. Grouped by
    the whole name, shown cut at `width`; a cut name keeps its whole self in `full_name` (report.json), which is
    what tells one aten copy from another."""
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]
    def cut(name: str) -> bool:
        return width is not None and len(name) > width

    return [{"name": name[:width - 3] + "..." if cut(name) else name, **({"full_name": name} if cut(name) else {}),
             "share": us / (total_us or 1e-9), "calls_per_step": round(calls / max(steps, 1), 2),
             "category": cat} for (name, cat), (us, calls) in ranked]


def kernel_name(name: str) -> str:
    """A kernel's name without `void ` and its argument list (the template arguments stay: they tell an fp32
    kernel from a bf16 one)."""
    short = name.removeprefix("void ")
    if short.endswith(")") and "(" in short:
        depth = 0
        for i in range(len(short) - 1, -1, -1):  # the argument list's own opening bracket, past nested ones
            depth += {")": 1, "(": -1}.get(short[i], 0)
            if depth == 0:
                short = short[:i]
                break
    return short or name  # "(unnamed)" is all argument list


def _top_kernels(stats: TraceStats, kernels: list[dict], launches: dict, tree: OpTree) -> None:
    """The kernels that take most of the kernel span, each with the category of the op that launched it
    ("cuda graph" for a replay, whose kernels have no op of their own)."""
    by_name: dict[tuple[str, str], list] = {}
    for k in kernels:
        launch = launches[k["args"]["correlation"]]
        if "Graph" in launch.get("name", ""):
            cat = "cuda graph"
        else:
            node = tree.innermost_at(launch.get("tid"), float(launch["ts"]))
            cat = node.cat if node is not None and node.cat is not None else "framework"
        _add(by_name, kernel_name(k.get("name", "?")), float(k.get("dur", 0)), cat)
    stats.top_ops = _top(by_name, stats.span_us or 0.0, len(stats.steps), width=KERNEL_NAME_WIDTH)


def _gpu_breakdown(stats: TraceStats, kernels: list[dict], launches: dict, tree: OpTree) -> None:
    """A GPU trace: kernel time by the category of the op that launched each kernel, over the kernel span."""
    own: dict[str, float] = {}
    count: dict[str, int] = {}
    by_dtype: dict[str, float] = {}
    by_impl: dict[str, float] = {}
    for k in kernels:
        launch = launches[k["args"]["correlation"]]
        node = tree.innermost_at(launch.get("tid"), float(launch["ts"]))
        cat = node.cat if node is not None and node.cat is not None else "framework"
        dur_us = float(k.get("dur", 0))
        own[cat] = own.get(cat, 0.0) + dur_us
        count[cat] = count.get(cat, 0) + 1
        if cat == "matmul":
            d = op_dtype(node.owner.e)
            by_dtype[d] = by_dtype.get(d, 0.0) + dur_us
        elif cat == "attention":
            by_impl[node.owner.impl] = by_impl.get(node.owner.impl, 0.0) + dur_us
    span = stats.span_us or 1e-9
    stats.breakdown = {k: own.get(k, 0.0) / span for k in BREAKDOWN if k not in ("python", "data")}
    stats.breakdown["idle"] = stats.idle_share or 0.0
    stats.breakdown_basis = ("share of the GPU's kernel span: kernel time by the op that launched it "
                             "(framework: kernels launched outside any known op), and idle time")
    stats.matmul_share_by_dtype = {k: v / span for k, v in by_dtype.items()}
    stats.attention_share_by_impl = {k: v / span for k, v in by_impl.items()}
    stats.kernel_share_by_category = {k: v / max(1, len(kernels)) for k, v in count.items()}


@dataclass
class _HostOps:
    ops: int = 0
    scalar_reads: int = 0  # .item() and friends
    gemm_flops: dict[str, float] = field(default_factory=dict)  # by input dtype, all steps
    gemm_time_us: dict[str, float] = field(default_factory=dict)  # host time of those ops, by dtype
    norm_us: float = 0.0  # host time in GroupNorm ops


def _host_ops(op_events: list[dict], step_of, in_optimizer: Ranges) -> _HostOps:
    """The host ops inside the measured steps: counts, the loop's own `.item()` calls (those inside an optimizer
    step are the optimizer's), matmul FLOPs and time by input dtype."""
    out = _HostOps()
    item_ranges = Ranges(op_events, "aten::item")
    nested = nested_ops(op_events, GEMM_OPS)
    for e in op_events:
        if step_of(float(e["ts"])) is None:
            continue
        name = e.get("name", "")
        out.ops += 1
        dur_us = float(e.get("dur", 0))
        if name == "aten::item" or (name == "aten::_local_scalar_dense"
                                    and not item_ranges.contains(e.get("tid"), float(e["ts"]))):
            out.scalar_reads += not in_optimizer.contains(e.get("tid"), float(e["ts"]))
        elif name in GEMM_OPS and id(e) not in nested:
            args = e.get("args", {})
            types = args.get("Input type") or []
            dtype = DTYPE.get(types[0] if types else "", types[0] if types else "?")
            if name == "aten::addmm" or name == "aten::baddbmm":
                dtype = DTYPE.get(types[1], types[1]) if len(types) > 1 else dtype
            if name == "aten::convolution_backward":
                dtype = DTYPE.get(types[0], types[0]) if types else dtype
            out.gemm_flops[dtype] = out.gemm_flops.get(dtype, 0.0) + gemm_flops_of(e)
            out.gemm_time_us[dtype] = out.gemm_time_us.get(dtype, 0.0) + dur_us
        elif name in NORM_OPS:
            out.norm_us += dur_us
    return out


def _gaps(stats: TraceStats, gpu: list[dict], launches: dict, data_iv: list[tuple[float, float]],
          sync_ends_us: list[float], t0_us: float) -> None:
    """Span, busy and idle time; each gap host-wait or kernel-wait, and a host-wait gap's cause."""
    ivs = sorted(((float(g["ts"]), float(g["ts"]) + float(g.get("dur", 0)), g) for g in gpu), key=lambda t: t[:2])
    merged = merge([(s, e) for s, e, _ in ivs])
    span_us = max(merged[-1][1] - merged[0][0], 1e-9)
    busy_us = sum(e - s for s, e in merged)
    stats.span_us, stats.busy_us = span_us, busy_us
    stats.timeline["gpu_busy"] = [[a - t0_us, b - t0_us] for a, b in coarsen(merged, 4000)]
    stats.idle_share = max(0.0, 1 - busy_us / span_us)

    # each merged interval's first activity tells who ended the previous gap
    first_at = {}
    for s, e, g in ivs:
        first_at.setdefault(s, g)
    data_ranges = merge(data_iv)
    dstarts = [s for s, _ in data_ranges]
    host_wait_us = kernel_wait_us = 0.0
    by_cause_us = {"data": 0.0, "sync": 0.0, "host": 0.0}
    small_gaps = 0
    for (s0, e0), (s1, _) in zip(merged, merged[1:]):
        gap_us = s1 - e0
        if gap_us <= 0:
            continue
        nxt = first_at.get(s1)
        launch_ts = float(launches[nxt["args"]["correlation"]]["ts"]) if nxt is not None else e0
        if launch_ts >= e0:
            host_wait_us += gap_us
            if data_ranges and overlap(e0, s1, data_ranges, dstarts) > 0.5 * gap_us:
                by_cause_us["data"] += gap_us
            elif any_between(sync_ends_us, e0 - 50.0, s1):
                by_cause_us["sync"] += gap_us
            else:
                by_cause_us["host"] += gap_us
        else:
            kernel_wait_us += gap_us
            if gap_us < 30.0:
                small_gaps += 1
    stats.host_wait_share = host_wait_us / span_us
    stats.kernel_wait_share = kernel_wait_us / span_us
    stats.host_wait_by_cause = {k: v / span_us for k, v in by_cause_us.items()}
    stats.small_gap_count = small_gaps


def _launch_metrics(stats: TraceStats, gpu: list[dict], kernels: list[dict], launches: dict, step_of) -> None:
    """Kernels per step, eager vs replayed from CUDA graphs, launch times, and the launch queue's depth."""
    n = len(stats.steps)
    stats.kernels_per_step = len(kernels) / n
    graph_ids = {id(k) for k in kernels if _graph_replayed(k, launches)}
    eager = [k for k in kernels if id(k) not in graph_ids]
    stats.eager_kernels_per_step = len(eager) / n
    if kernels:
        stats.median_kernel_us = statistics.median(float(k.get("dur", 0)) for k in kernels)
        stats.graph_kernel_share = len(graph_ids) / len(kernels)
    if eager:
        launch_us = [float(launches[k["args"]["correlation"]].get("dur", 0)) for k in eager]
        stats.median_eager_kernel_us = statistics.median(float(k.get("dur", 0)) for k in eager)
        stats.short_kernel_share = sum(float(k.get("dur", 0)) < us for k, us in zip(eager, launch_us)) / len(eager)
        stats.median_launch_us = statistics.median(launch_us)
    # queue depth at each launch call: calls whose work the GPU has not finished. One call is one unit of
    # work, whether it launched one kernel or replayed a graph of hundreds (counting a replay's kernels one by
    # one would read a single cudaGraphLaunch as a queue hundreds deep)
    work_end_us: dict = {}
    for g in gpu:
        corr = g["args"]["correlation"]
        work_end_us[corr] = max(work_end_us.get(corr, 0.0), float(g["ts"]) + float(g.get("dur", 0)))
    order = sorted((float(launches[c]["ts"]), end) for c, end in work_end_us.items())
    ends_sorted: list[float] = []
    depths = []
    for launch_ts, end in order:
        del ends_sorted[:bisect.bisect_right(ends_sorted, launch_ts)]  # work finished by now
        depths.append(len(ends_sorted))
        bisect.insort(ends_sorted, end)
    stats.queue_depth_median = float(statistics.median(depths))
    stats.queue_depth_max = max(depths)
    blocked_us = sum(float(e.get("dur", 0)) for e in launches.values()
                     if float(e.get("dur", 0)) > 100.0 and e.get("name", "").startswith(("cudaLaunch", "cuLaunch"))
                     and step_of(float(e["ts"])) is not None)
    stats.blocked_launch_us_per_step = blocked_us / n
    graph_launches = sum(1 for e in launches.values() if e.get("name", "").startswith(GRAPH_LAUNCH)
                         and step_of(float(e["ts"])) is not None)
    stats.graph_launches_per_step = graph_launches / n


def _copies(stats: TraceStats, gpu: list[dict], kernels: list[dict]) -> None:
    """Host-to-device copies: their share of busy time, the part no kernel overlaps, pageable vs pinned."""
    n = len(stats.steps)
    h2d = [g for g in gpu if g.get("cat") == "gpu_memcpy" and "HtoD" in g.get("name", "")]
    kernel_merged = merge([(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels])
    kstarts = [s for s, _ in kernel_merged]
    h2d_us = sum(float(g.get("dur", 0)) for g in h2d)
    exposed_us = sum(float(g.get("dur", 0)) - overlap(float(g["ts"]), float(g["ts"]) + float(g.get("dur", 0)),
                                                       kernel_merged, kstarts) for g in h2d)
    stats.h2d_share = h2d_us / stats.busy_us
    stats.h2d_exposed_share = exposed_us / stats.span_us
    stats.h2d_pageable = sum(1 for g in h2d if "Pageable" in g.get("name", ""))
    stats.h2d_pinned = sum(1 for g in h2d if "Pinned" in g.get("name", ""))
    stats.h2d_bytes_per_step = sum(float((g.get("args") or {}).get("bytes", 0)) for g in h2d) / n


def _layout(stats: TraceStats, kernels: list[dict], launches: dict, op_events: list[dict]) -> None:
    """Layout conversions: kernels named for one, and kernels launched inside `aten::contiguous`."""
    layout = [k for k in kernels if LAYOUT_KERNEL.search(k.get("name", ""))]
    layout_ids = {id(k) for k in layout}
    contiguous = Ranges(op_events, "aten::contiguous")
    layout += [k for k in kernels if id(k) not in layout_ids and contiguous.contains(
        launches[k["args"]["correlation"]].get("tid"), float(launches[k["args"]["correlation"]]["ts"]))]
    layout_us = sum(float(k.get("dur", 0)) for k in layout)
    stats.layout_share = layout_us / stats.busy_us
    stats.layout_kernels_per_step = len(layout) / len(stats.steps)
    format_us = sum(float(k.get("dur", 0)) for k in layout if FORMAT_KERNEL.search(k.get("name", "")))
    stats.layout_format_share = format_us / layout_us if layout_us > 0 else None


def _gpu_matmul_shares(stats: TraceStats, kernels: list[dict], launches: dict, op_events: list[dict]) -> None:
    """GEMM time by dtype on the GPU (kernel time of the kernels each matmul/conv op launched) and GroupNorm's;
    none of it, with the reason, when kernels replay from CUDA graphs."""
    gemm_us: dict[str, float] = {}
    norm_us = 0.0
    owner = kernel_owner_ops(kernels, launches, op_events)
    for k in kernels:
        op = owner.get(id(k))
        if op is None:
            continue
        if op.get("name") in GEMM_OPS:
            types = (op.get("args") or {}).get("Input type") or ["?"]
            t = types[1] if op.get("name") in ("aten::addmm", "aten::baddbmm") and len(types) > 1 else types[0]
            dtype = DTYPE.get(t, t)
            gemm_us[dtype] = gemm_us.get(dtype, 0.0) + float(k.get("dur", 0))
        elif op.get("name") in NORM_OPS:
            norm_us += float(k.get("dur", 0))
    stats.gemm_time_share = {k: v / stats.busy_us for k, v in gemm_us.items()}
    stats.groupnorm_share = norm_us / stats.busy_us
    if stats.graph_kernel_share:
        # the ops inside a graph ran at capture time, not now: a partial count would pass for the whole
        stats.gemm_unavailable = (
            f"{100 * stats.graph_kernel_share:.0f}% of kernels replay from CUDA graphs "
            f"({stats.graph_launches_per_step:g} cudaGraphLaunch per step): the matmuls and convs inside a graph "
            "run without a cpu_op, so the trace holds no shapes or dtypes for them")
        stats.gemm_flops_per_step, stats.gemm_time_share, stats.groupnorm_share = {}, {}, None


def _graph_replayed(kernel: dict, launches: dict) -> bool:
    """Replayed from a CUDA graph: CUPTI files it under the correlation id of the cudaGraphLaunch that replayed
    it (every Kineto version; newer ones also write "graph id" on the kernel)."""
    return launches[kernel["args"]["correlation"]].get("name", "").startswith(GRAPH_LAUNCH)
