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
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

STEP_MARK = "fastddpm::step"
DATA_MARK = "fastddpm::data_wait"

# Runtime calls that block the host until the GPU catches up (docs/DOCTOR.md rule 7): `.item()` or `float()` of a
# GPU tensor issues a DtoH copy and a cudaStreamSynchronize.
SYNC_RUNTIME = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                "cuStreamSynchronize", "cuCtxSynchronize"}
LAUNCH_RUNTIME = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|"
                            r"cudaLaunchCooperativeKernel|cudaMemcpyAsync|cudaMemsetAsync|cudaGraphLaunch|"
                            r"cuGraphLaunch|cudaMemcpy|cudaMemset)")
GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")  # one call replays a whole captured graph
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# Our record_function ranges as the host thread wrote them. On a CUDA trace Kineto also writes each range a
# second time, as cat "gpu_user_annotation" on the GPU timeline (spanning the kernels launched inside it):
# counting that copy would count every range twice.
HOST_MARK_CATS = ("user_annotation", "cpu_op", None)
LAYOUT_KERNEL = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose", re.IGNORECASE)

# Matmul/conv ops whose inputs' dtype says whether autocast covered them (rule 12). `aten::conv2d` and
# `aten::linear` are left out: under autocast they appear as an fp32 outer call that casts around the bf16
# `aten::convolution` / `aten::addmm` that does the work. Some of these ops still nest (the SDPA backward op
# calls `aten::_flash_attention_backward` / `aten::_efficient_attention_backward`): only the outermost one of
# a nest is counted (`_nested_ops`).
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution", "aten::convolution_backward",
            "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward",
            "aten::_flash_attention_backward",
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
    """FLOPs (2 per multiply-add) of one matmul/conv/attention op from its recorded input shapes, counted as
    torch.utils.flop_counter.FlopCounterMode counts them.

    Conv backward counts each gradient it computes (input, weight) as one forward. Attention counts QK^T and
    PV forward; backward recomputes QK^T and adds dP, dV, dQ, dK (2.5x forward when the head dims agree)."""
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
            # after the tensors: stride, padding, dilation, transposed, output_padding, groups; the tensors are
            # (input, weight, bias) forward and (grad_output, input, weight, bias_sizes) backward
            base = 4 if backward else 3
            stride = _ints(concrete[base]) if len(concrete) > base else []
            pad = _ints(concrete[base + 1]) if len(concrete) > base + 1 else []
            dil = _ints(concrete[base + 2]) if len(concrete) > base + 2 else []
            transposed = len(concrete) > base + 3 and concrete[base + 3] in ("True", "1")
            kernel = w[2:]
            if transposed:
                # weight (C_in, C_out/groups, k...): every *input* pixel scatters into a C_out/groups x k patch
                pixels = x[2:]
            elif backward:
                pixels = dims[0][2:]  # grad_output has the forward's output size
            else:
                pixels = [
                    (s + 2 * (pad[i] if i < len(pad) else 0) - (dil[i] if i < len(dil) else 1) * (k - 1) - 1)
                    // (stride[i] if i < len(stride) else 1) + 1
                    for i, (s, k) in enumerate(zip(x[2:], kernel))
                ]
            # w[0] * w[1] is C_out * C_in/groups (or C_in * C_out/groups transposed): grouped convs included
            fwd = 2 * x[0] * w[0] * w[1] * _prod(pixels) * _prod(kernel)
            if not backward:
                return fwd
            # output_mask (last argument): which of grad_input, grad_weight, grad_bias are computed; each of the
            # first two costs one forward (the first layer's input needs no gradient). FlopCounterMode counts a
            # grouped conv's weight gradient `groups` times; this counts the work done.
            mask = re.findall(r"True|False|1|0", concrete[-1]) if concrete else []
            return fwd * (sum(v in ("True", "1") for v in mask[:2]) if len(mask) >= 2 else 2)
        if "attention" in name:
            backward = "backward" in name
            q, k, v = dims[1:4] if backward else dims[0:3]  # backward ops take grad_out first
            if not (len(q) == len(k) == len(v) == 4):
                return 0
            if name in ("aten::_flash_attention_backward", "aten::_efficient_attention_backward"):
                q, k, v = ([t[0], t[2], t[1], t[3]] for t in (q, k, v))  # these take (B, L, H, D), not (B, H, L, D)
            b, h, l, d_qk = q
            s, d_v = k[2], v[3]
            qk = 2 * b * h * l * s * d_qk  # scores = Q K^T: (B, H, L, S)
            pv = 2 * b * h * l * s * d_v  # out = P V: (B, H, L, Dv)
            # backward: QK^T again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q
            return 3 * qk + 2 * pv if backward else qk + pv
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
    groupnorm_share: float | None = 0.0
    # why the three above could not be read (then {}, {}, None): CUDA-graph replays hide their ops
    gemm_unavailable: str | None = None
    # where the step goes (compute_breakdown): {category: share}, categories in BREAKDOWN order. A CPU trace:
    # shares of the main thread's step time, summing to 1. A GPU trace: shares of the kernel span (kernel time
    # by the op that launched it, plus "idle"). Empty when CUDA graphs hide the ops.
    breakdown: dict[str, float] = field(default_factory=dict)
    breakdown_basis: str | None = None
    matmul_share_by_dtype: dict[str, float] = field(default_factory=dict)  # the "matmul" category split by dtype
    attention_share_by_impl: dict[str, float] = field(default_factory=dict)  # "attention" by implementation
    # a GPU trace: the share of the kernels each category's ops launch (a launch-bound step's launches, by owner)
    kernel_share_by_category: dict[str, float] = field(default_factory=dict)
    optimizer_kind: str | None = None  # "per-tensor", "foreach" or "fused": how the optimizer step ran
    optimizer_ops_per_step: float | None = None  # ops inside Optimizer.step: one per tensor per op when per-tensor
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
    graph_launches_per_step: float | None = None
    graph_kernel_share: float | None = None  # kernels replayed from CUDA graphs / all kernels
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
                    if e.get("name") == STEP_MARK and e.get("cat") in HOST_MARK_CATS),
                   key=lambda s: s.start_us)
    if not steps:
        raise ValueError(f"the trace has no '{STEP_MARK}' ranges: it was not recorded by fastddpm.doctor")
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
    host = _host_ops(op_events, step_of)
    runtime = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    sync_calls = [e for e in runtime if e.get("name") in SYNC_RUNTIME]
    for e in sync_calls:
        i = step_of(float(e["ts"]))
        if i is not None:
            steps[i].syncs += 1
            steps[i].sync_us += float(e.get("dur", 0))

    stats = TraceStats(steps=steps, has_gpu=False)
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
        "data_wait": [[a - t0_us, b - t0_us] for a, b in _merge(data_iv) if step_of(a) is not None],
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
    tree = _OpTree(xs, steps, step_of)
    stats.optimizer_kind, stats.optimizer_ops_per_step = tree.optimizer_kind()
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
    if not stats.gemm_unavailable:
        _gpu_breakdown(stats, kernels, launches, tree)
    return stats


# ---------------------------------------------------------------------------------------------------------------
# Where the step goes: every op's own time (its duration less its children's) is charged to a category. An op
# inside a categorised op is charged to the outer one (the casts and reshapes inside a GroupNorm are the norm's
# cost; everything inside Optimizer.step is the optimizer's), so the categories add up to the step.
BREAKDOWN = ("matmul", "attention", "norm", "elementwise", "optimizer", "copy", "data", "framework", "python", "idle")
BREAKDOWN_LABELS = {
    "matmul": "matmul/conv", "attention": "attention", "norm": "norms", "elementwise": "elementwise/activation",
    "optimizer": "optimizer step", "copy": "copies/layout/casts", "data": "data wait",
    "framework": "framework (autograd, views, allocation)", "python": "Python/dispatch (no op running)",
    "idle": "GPU idle"}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
              "aten::convolution_backward", "aten::_convolution", "aten::mkldnn_convolution",
              "aten::cudnn_convolution", "aten::addbmm", "aten::cudnn_convolution_transpose", "aten::_scaled_mm"}
SOFTMAX_OPS = {"aten::softmax", "aten::_softmax", "aten::_softmax_backward_data", "aten::_safe_softmax"}
BATCHED_MATMUL_OPS = {"aten::bmm", "aten::baddbmm"}  # with a softmax beside them: attention written out by hand
NORM_BREAKDOWN_OPS = {"aten::group_norm", "aten::native_group_norm", "aten::native_group_norm_backward",
                      "aten::layer_norm", "aten::native_layer_norm", "aten::native_layer_norm_backward",
                      "aten::batch_norm", "aten::_batch_norm_impl_index", "aten::native_batch_norm",
                      "aten::native_batch_norm_backward", "aten::_native_batch_norm_legit",
                      "aten::_native_batch_norm_legit_functional", "aten::cudnn_batch_norm",
                      "aten::cudnn_batch_norm_backward", "aten::instance_norm", "aten::rms_norm",
                      "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward"}
COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::to", "aten::contiguous", "aten::clone", "aten::cat",
            "aten::stack", "aten::index_select", "aten::gather", "aten::index", "aten::_copy_from",
            "aten::_copy_from_and_resize", "aten::to_dense", "aten::masked_select", "aten::repeat"}
# views, allocation and wrappers: cheap bookkeeping, or a call whose work is done by the op inside it
TRANSPARENT_OPS = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::as_strided", "aten::as_strided_", "aten::view",
    "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::t", "aten::transpose", "aten::permute",
    "aten::expand", "aten::select", "aten::slice", "aten::squeeze", "aten::unsqueeze", "aten::flatten",
    "aten::unflatten", "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::split", "aten::chunk", "aten::narrow", "aten::unbind", "aten::resize_",
    "aten::result_type", "aten::item", "aten::_local_scalar_dense", "aten::linear", "aten::matmul", "aten::einsum",
    "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv_transpose1d", "aten::conv_transpose2d",
    "aten::conv_transpose3d", "aten::set_", "aten::is_nonzero", "aten::view_as", "aten::expand_as",
    "aten::split_with_sizes", "aten::unsafe_split", "aten::movedim", "aten::numpy_T", "aten::record_stream"}


def _attention_impl(name: str) -> str | None:
    """The attention implementation an op belongs to, or None: fused SDPA kernels by backend, SDPA's math
    fallback, and nn.MultiheadAttention's inference fast path."""
    if "scaled_dot_product" not in name and "flash_attention" not in name and "efficient_attention" not in name \
            and "multi_head_attention" not in name:
        return None
    if "math" in name:
        return "SDPA math (materialised)"
    if "for_cpu" in name:
        return "SDPA flash (CPU)"
    if "flash" in name:
        return "SDPA flash"
    if "efficient" in name:
        return "SDPA memory-efficient"
    if "cudnn" in name:
        return "SDPA cuDNN"
    if "multi_head_attention" in name:
        return "nn.MultiheadAttention fast path"
    return "SDPA"  # the dispatching op itself: its child names the kernel


class _OpTree:
    """The host events of the measured steps as per-thread nesting trees, each node charged to a category."""

    class Node:
        __slots__ = ("e", "ts", "end", "children", "cat", "impl", "owner")

        def __init__(self, e: dict):
            self.e, self.ts = e, float(e["ts"])
            self.end = self.ts + float(e.get("dur", 0))
            self.children: list = []
            self.cat: str | None = None
            self.impl: str | None = None  # attention: its implementation
            self.owner = self  # the outermost op of this category around it (the matmul whose dtype counts)

    def __init__(self, xs: list[dict], steps: list[StepTrace], step_of):
        self.main_tid = next((e.get("tid") for e in xs if e.get("name") == STEP_MARK
                              and e.get("cat") in HOST_MARK_CATS), None)
        events = [e for e in xs if e.get("cat") in ("cpu_op", "user_annotation") and e.get("name") != STEP_MARK
                  and step_of(float(e["ts"])) is not None]
        self.softmax = any(e.get("name") in SOFTMAX_OPS for e in events)
        self.roots: dict = {}  # tid -> top-level nodes, in time order
        self._starts: dict = {}  # id(a list of sibling nodes) -> their start times, for innermost_at
        by_tid: dict = {}
        for e in events:
            by_tid.setdefault(e.get("tid"), []).append(e)
        for tid, lst in by_tid.items():
            roots, stack = [], []
            for e in sorted(lst, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
                node = _OpTree.Node(e)
                while stack and stack[-1].end <= node.ts:
                    stack.pop()
                (stack[-1].children if stack else roots).append(node)
                stack.append(node)
            for r in roots:
                self._categorise(r, None, None)
            self.roots[tid] = roots

    def _own_category(self, name: str, cat: str | None) -> str | None:
        if name == DATA_MARK:
            return "data"
        if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            return "optimizer"
        if _attention_impl(name) is not None:
            return "attention"
        if name in SOFTMAX_OPS or (name in BATCHED_MATMUL_OPS and self.softmax):
            return "attention"
        if name in MATMUL_OPS:
            return "matmul"
        if name in NORM_BREAKDOWN_OPS:
            return "norm"
        if name in COPY_OPS:
            return "copy"
        if cat == "cpu_op" and name.startswith("aten::") and name not in TRANSPARENT_OPS:
            return "elementwise?"  # unless something inside it is of another category (a wrapper we do not know)
        return None

    def _categorise(self, node: "_OpTree.Node", inherited: str | None, owner) -> None:
        """Outermost category wins; an unknown aten op is elementwise unless it wraps categorised work."""
        name = node.e.get("name", "")
        own = self._own_category(name, node.e.get("cat"))
        if inherited is not None:
            node.cat, node.owner = inherited, owner
        elif own == "elementwise?":
            node.cat = "elementwise" if not self._wraps_work(node) else None
        else:
            node.cat = own
        if node.cat == "attention" and node.owner is node:
            node.impl = self._impl(node)
        for c in node.children:
            self._categorise(c, node.cat, node.owner if node.cat is not None else None)

    def _wraps_work(self, node: "_OpTree.Node") -> bool:
        for c in node.children:
            own = self._own_category(c.e.get("name", ""), c.e.get("cat"))
            if own not in (None, "elementwise?") or self._wraps_work(c):
                return True
        return False

    def _impl(self, node: "_OpTree.Node") -> str:
        found = None
        todo = [node]
        while todo:
            n = todo.pop()
            impl = _attention_impl(n.e.get("name", ""))
            if impl is not None and (found is None or found == "SDPA"):
                found = impl
            todo.extend(n.children)
        return found or "softmax(QK^T)V (materialised)"

    def walk(self, tid=None):
        """Every node of thread `tid` (all threads when None), parents before children."""
        todo = [n for t, roots in self.roots.items() if tid is None or t == tid for n in reversed(roots)]
        while todo:
            n = todo.pop()
            yield n
            todo.extend(reversed(n.children))

    def optimizer_kind(self) -> tuple[str | None, float | None]:
        steps = [n for n in self.walk() if n.e.get("name", "").startswith("Optimizer.step#")]
        if not steps:
            return None, None
        names = [d.e.get("name", "") for s in steps for d in self._descendants(s)]
        kind = ("fused" if any("_fused_" in x for x in names) else
                "foreach" if any("_foreach_" in x for x in names) else "per-tensor")
        # the ops the optimizer itself issues (not what they call inside): one per tensor per term when
        # per-tensor, a few for all tensors when foreach or fused (on a CPU a foreach op still loops inside)
        return kind, sum(len(s.children) for s in steps) / len(steps)

    @staticmethod
    def _descendants(node: "_OpTree.Node"):
        todo = list(node.children)
        while todo:
            n = todo.pop()
            yield n
            todo.extend(n.children)

    def innermost_at(self, tid, ts: float) -> "_OpTree.Node | None":
        """The deepest node of thread `tid` open at `ts` (a binary search per level: a GPU trace asks once per
        kernel)."""
        level = self.roots.get(tid) or []
        found = None
        while level:
            starts = self._starts.get(id(level))
            if starts is None:
                starts = self._starts[id(level)] = [n.ts for n in level]
            i = bisect.bisect_right(starts, ts) - 1
            if i < 0 or level[i].end < ts:
                break
            found = level[i]
            level = found.children
        return found


def _host_breakdown(stats: TraceStats, tree: _OpTree, total_step_us: float) -> None:
    """A CPU trace: the main thread's step time by category (own time of each op), the rest Python."""
    own: dict[str, float] = {}
    by_dtype: dict[str, float] = {}
    by_impl: dict[str, float] = {}
    for n in tree.walk(tree.main_tid):
        self_us = max(0.0, (n.end - n.ts) - sum(c.end - c.ts for c in n.children))
        cat = n.cat or ("framework" if n.e.get("cat") == "cpu_op" else "python")
        own[cat] = own.get(cat, 0.0) + self_us
        if n.cat == "matmul":
            d = _op_dtype(n.owner.e)
            by_dtype[d] = by_dtype.get(d, 0.0) + self_us
        elif n.cat == "attention":
            by_impl[n.owner.impl] = by_impl.get(n.owner.impl, 0.0) + self_us
    covered_us = sum(n.end - n.ts for n in tree.roots.get(tree.main_tid, []))
    own["python"] = own.get("python", 0.0) + max(0.0, total_step_us - covered_us)
    stats.breakdown = {k: own.get(k, 0.0) / total_step_us for k in BREAKDOWN if k != "idle"}
    stats.breakdown_basis = "share of the profiled steps' host time (the training thread)"
    stats.matmul_share_by_dtype = {k: v / total_step_us for k, v in by_dtype.items()}
    stats.attention_share_by_impl = {k: v / total_step_us for k, v in by_impl.items()}


def _gpu_breakdown(stats: TraceStats, kernels: list[dict], launches: dict, tree: _OpTree) -> None:
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
            d = _op_dtype(node.owner.e)
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


def _op_dtype(e: dict) -> str:
    """The input dtype of a matmul/conv op (addmm/baddbmm: of the matrices, not the bias)."""
    types = (e.get("args") or {}).get("Input type") or ["?"]
    t = types[1] if e.get("name") in ("aten::addmm", "aten::baddbmm") and len(types) > 1 else types[0]
    return _DTYPE.get(t, t or "?")


@dataclass
class _HostOps:
    ops: int = 0
    scalar_reads: int = 0  # .item() and friends
    gemm_flops: dict[str, float] = field(default_factory=dict)  # by input dtype, all steps
    gemm_time_us: dict[str, float] = field(default_factory=dict)  # host time of those ops, by dtype
    norm_us: float = 0.0  # host time in GroupNorm ops


def _host_ops(op_events: list[dict], step_of) -> _HostOps:
    """The host ops inside the measured steps: counts, `.item()` calls, matmul FLOPs and time by input dtype."""
    out = _HostOps()
    item_ranges = _Ranges(op_events, "aten::item")
    nested = _nested_ops(op_events, GEMM_OPS)
    for e in op_events:
        if step_of(float(e["ts"])) is None:
            continue
        name = e.get("name", "")
        out.ops += 1
        dur_us = float(e.get("dur", 0))
        if name == "aten::item" or (name == "aten::_local_scalar_dense"
                                    and not item_ranges.contains(e.get("tid"), float(e["ts"]))):
            out.scalar_reads += 1
        elif name in GEMM_OPS and id(e) not in nested:
            args = e.get("args", {})
            types = args.get("Input type") or []
            dtype = _DTYPE.get(types[0] if types else "", types[0] if types else "?")
            if name == "aten::addmm" or name == "aten::baddbmm":
                dtype = _DTYPE.get(types[1], types[1]) if len(types) > 1 else dtype
            if name == "aten::convolution_backward":
                dtype = _DTYPE.get(types[0], types[0]) if types else dtype
            out.gemm_flops[dtype] = out.gemm_flops.get(dtype, 0.0) + gemm_flops_of(e)
            out.gemm_time_us[dtype] = out.gemm_time_us.get(dtype, 0.0) + dur_us
        elif name in NORM_OPS:
            out.norm_us += dur_us
    return out


def _gaps(stats: TraceStats, gpu: list[dict], launches: dict, data_iv: list[tuple[float, float]],
          sync_ends_us: list[float], t0_us: float) -> None:
    """Span, busy and idle time; each gap host-wait or kernel-wait, and a host-wait gap's cause."""
    ivs = sorted(((float(g["ts"]), float(g["ts"]) + float(g.get("dur", 0)), g) for g in gpu), key=lambda t: t[:2])
    merged = _merge([(s, e) for s, e, _ in ivs])
    span_us = max(merged[-1][1] - merged[0][0], 1e-9)
    busy_us = sum(e - s for s, e in merged)
    stats.span_us, stats.busy_us = span_us, busy_us
    stats.timeline["gpu_busy"] = [[a - t0_us, b - t0_us] for a, b in _coarsen(merged, 4000)]
    stats.idle_share = max(0.0, 1 - busy_us / span_us)

    # each merged interval's first activity tells who ended the previous gap
    first_at = {}
    for s, e, g in ivs:
        first_at.setdefault(s, g)
    data_ranges = _merge(data_iv)
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
            if data_ranges and _overlap(e0, s1, data_ranges, dstarts) > 0.5 * gap_us:
                by_cause_us["data"] += gap_us
            elif _any_between(sync_ends_us, e0 - 50.0, s1):
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
    kernel_merged = _merge([(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels])
    kstarts = [s for s, _ in kernel_merged]
    h2d_us = sum(float(g.get("dur", 0)) for g in h2d)
    exposed_us = sum(float(g.get("dur", 0)) - _overlap(float(g["ts"]), float(g["ts"]) + float(g.get("dur", 0)),
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
    contiguous = _Ranges(op_events, "aten::contiguous")
    layout += [k for k in kernels if id(k) not in layout_ids and contiguous.contains(
        launches[k["args"]["correlation"]].get("tid"), float(launches[k["args"]["correlation"]]["ts"]))]
    stats.layout_share = sum(float(k.get("dur", 0)) for k in layout) / stats.busy_us
    stats.layout_kernels_per_step = len(layout) / len(stats.steps)


def _gpu_matmul_shares(stats: TraceStats, kernels: list[dict], launches: dict, op_events: list[dict]) -> None:
    """GEMM time by dtype on the GPU (kernel time of the kernels each matmul/conv op launched) and GroupNorm's;
    none of it, with the reason, when kernels replay from CUDA graphs."""
    gemm_us: dict[str, float] = {}
    norm_us = 0.0
    owner = _kernel_owner_ops(kernels, launches, op_events)
    for k in kernels:
        op = owner.get(id(k))
        if op is None:
            continue
        if op.get("name") in GEMM_OPS:
            types = (op.get("args") or {}).get("Input type") or ["?"]
            t = types[1] if op.get("name") in ("aten::addmm", "aten::baddbmm") and len(types) > 1 else types[0]
            dtype = _DTYPE.get(t, t)
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


def _nested_ops(op_events: list[dict], names: set[str]) -> set[int]:
    """ids of the ops named in `names` that run inside another such op on the same thread: counting both would
    count one piece of work twice (an SDPA backward op and the attention kernel op it calls)."""
    by_tid: dict = {}
    for o in op_events:
        if o.get("name") in names:
            by_tid.setdefault(o.get("tid"), []).append(o)
    out = set()
    for lst in by_tid.values():
        open_ends: list[float] = []  # ends of the enclosing ops still open, outermost first
        for o in sorted(lst, key=lambda o: (float(o["ts"]), -float(o.get("dur", 0)))):
            ts = float(o["ts"])
            while open_ends and open_ends[-1] <= ts:
                open_ends.pop()
            if open_ends:
                out.add(id(o))
            open_ends.append(ts + float(o.get("dur", 0)))
    return out


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
