"""The trace analysis and the GPU rules, on hand-built CUDA traces in torch.profiler's Chrome format.

No GPU is needed: each trace is written the way kineto writes one (user annotations, cpu_op, cuda_runtime
launches with a correlation id, kernels and memcpys on the device clock), with a host clock and a GPU clock
that the builder advances like a real launch queue. The planted GPU loops in test_doctor_planted.py check the
same verdicts on real traces when a GPU is present.
"""

from __future__ import annotations

import json
import statistics
from contextlib import contextmanager

import pytest
import torch

from fastddpm.device import cpu_native_bf16
from fastddpm.doctor.api import mfu_measurements, run_matmul_dtype
from fastddpm.doctor.marks import DATA_MARK, STEP_MARK
from fastddpm.doctor.rules import evaluate, verdict
from fastddpm.doctor.trace import analyze
from fastddpm.doctor.trace_flops import gemm_flops


# CUPTI callback ids Kineto writes as a runtime call's "cbid"
CBID = {"cudaLaunchKernel": 211, "cudaMemcpyAsync": 41, "cudaMemsetAsync": 51, "cudaStreamSynchronize": 131,
        "cudaGraphLaunch": 311}


class CudaTrace:
    """A host thread launching onto one GPU stream. Times in microseconds.

    The events imitate what torch.profiler's Kineto exports for a CUDA run:
    - host thread (pid 1, tid 1): record_function ranges as "user_annotation"; "cpu_op" events with their
      "External id", "Input Dims", "Input type", "Concrete Inputs"; "cuda_runtime" calls with "cbid",
      "correlation" and the "External id" of the op they were issued from;
    - device (pid 0, tid = stream 7): "kernel" / "gpu_memcpy" events carrying the "correlation" of the runtime
      call that launched them, plus "External id", "device", "stream", "grid", "block";
    - every record_function range that launched GPU work is written again as "gpu_user_annotation" on the
      stream, from its first kernel's start to its last kernel's end;
    - a CUDA-graph replay is one "cudaGraphLaunch" runtime call, and CUPTI files every kernel it replays under
      that call's correlation id (newer Kineto adds "graph id" / "graph node id" on each kernel).
    """

    def __init__(self):
        self.events: list[dict] = []
        self.host = 0.0
        self.gpu = 0.0
        self.corr = 0
        self.ext = 0
        self._ops: list[int] = []  # External ids of the cpu_ops open now, outermost first
        self._ranges: list[list] = []  # open record_function ranges: [first kernel start, last kernel end]
        self._step0: float | None = None

    def _x(self, cat, name, ts, dur, pid=1, tid=1, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
                            "args": args})

    def _on_gpu(self, cat, name, start, dur, **args):
        ext = self._ops[-1] if self._ops else 0
        self._x(cat, name, start, dur, pid=0, tid=7, **{"External id": ext, "device": 0, "stream": 7,
                                                        "correlation": self.corr, **args})
        for r in self._ranges:
            r[0] = start if r[0] is None else r[0]
            r[1] = start + dur

    def _runtime(self, name, dur):
        self.corr += 1
        args = {"cbid": CBID[name], "correlation": self.corr}
        if self._ops:
            args["External id"] = self._ops[-1]
        self._x("cuda_runtime", name, self.host, dur, **args)

    def _user_range(self, name, t0):
        """Close a record_function range opened at t0: the host copy, and the GPU copy if it launched work."""
        first, last = self._ranges.pop()
        self._x("user_annotation", name, t0, self.host - t0)
        if first is not None:
            self._x("gpu_user_annotation", name, first, last - first, pid=0, tid=7)

    def begin_step(self):
        self._step0 = self.host
        self._ranges.append([None, None])

    def end_step(self):
        self._user_range(STEP_MARK, self._step0)

    def launch(self, name="void gemm_kernel", kernel_us=10.0, launch_us=5.0, latency_us=2.0, cat="kernel",
               runtime="cudaLaunchKernel", **kargs):
        self._runtime(runtime, launch_us)
        start = max(self.gpu, self.host + latency_us)
        if cat == "kernel":
            kargs = {"grid": [128, 1, 1], "block": [256, 1, 1], **kargs}
        self._on_gpu(cat, name, start, kernel_us, **kargs)
        self.gpu = start + kernel_us
        self.host += launch_us

    def graph_replay(self, kernels_us, node_gap_us=1.0, launch_us=15.0, latency_us=4.0, graph_ids=True, names=None):
        """One cudaGraphLaunch replaying a captured graph: its kernels run back to back, `node_gap_us` apart; named
        `names` (one per kernel), else triton_poi_fused_<n>."""
        self._runtime("cudaGraphLaunch", launch_us)
        start = max(self.gpu, self.host + latency_us)
        for node, us in enumerate(kernels_us, 1):
            ids = {"graph id": 3, "graph node id": 30000 + node} if graph_ids else {}
            name = names[node - 1] if names is not None else f"triton_poi_fused_{node % 7}"
            self._on_gpu("kernel", name, start, us, grid=[64, 1, 1], block=[128, 1, 1], **ids)
            self.gpu = start + us
            start = self.gpu + node_gap_us
        self.host += launch_us

    @contextmanager
    def cpu_op(self, name, input_types, dims, concrete=None, min_us=0.0):
        """A host op; kernels launched inside the block belong to it."""
        t0 = self.host
        self.ext += 1
        ext = self.ext
        self._ops.append(ext)
        yield
        self._ops.pop()
        self.host = max(self.host, t0 + min_us)
        self._x("cpu_op", name, t0, self.host - t0, **{"External id": ext, "Input Dims": dims,
                                                       "Input type": input_types,
                                                       "Concrete Inputs": concrete or [""] * len(dims)})

    def op(self, name, dur_us, input_types, dims, launches=()):
        """A cpu_op that launches kernels (for dtype/owner attribution)."""
        with self.cpu_op(name, input_types, dims, min_us=dur_us):
            for k in launches:
                self.launch(**k)

    def sync(self):
        t0 = self.host
        self.host = max(self.host, self.gpu) + 5.0
        self.corr += 1
        self._x("cuda_runtime", "cudaStreamSynchronize", t0, self.host - t0, cbid=CBID["cudaStreamSynchronize"],
                correlation=self.corr)

    def python(self, us):
        self.host += us

    def data_wait(self, us, launches=()):
        """A wait for data; `launches`: GPU work the fetch issues (a batch indexed from device-resident data)."""
        t0 = self.host
        self._ranges.append([None, None])
        for k in launches:
            self.launch(**k)
        self.host = max(self.host, t0 + us)
        self._user_range(DATA_MARK, t0)


def measurements_for(trace: CudaTrace) -> dict:
    stats = analyze(trace.events)
    steps = [{"index": i, "host_ms": s.dur_us / 1e3, "data_wait_ms": s.data_wait_us / 1e3, "data_cpu_ms": 0.0,
              "epoch_start": False, "gpu_ms": None, "recompiles": 0} for i, s in enumerate(stats.steps)]
    step_stats = {"median_ms": statistics.median(s["host_ms"] for s in steps)}
    # FLOPs as diagnose() takes them (no peak is measured here: only whether MFU can be had, and why not)
    return {"device": "cuda:0", "steps": steps, "trace": stats.to_dict(), "step_stats": {},
            **mfu_measurements(stats, step_stats, "cuda:0", measure_peak=False)}


def diagnose_trace(trace: CudaTrace, with_unavailable=False):
    m = measurements_for(trace)
    found, unavailable = evaluate(m)
    out = verdict(found, m), {f.id: f for f in found}, m["trace"]
    return out + (unavailable,) if with_unavailable else out


def graph_fixes(found: dict) -> list[str]:
    """Fixes that prescribe CUDA graphs, as a setting or as code."""
    return [f"{f.id}: {fx.fastddpm} / {fx.code}" for f in found.values() for fx in f.fixes
            if "--cuda-graphs" in (fx.fastddpm or "") or "reduce-overhead" in fx.code or "torch.cuda.graph" in fx.code]


def test_launch_bound_tiny_kernels_waiting_for_the_host():
    tr = CudaTrace()
    for _ in range(10):
        tr.begin_step()
        for _ in range(200):
            tr.launch(kernel_us=3.0, launch_us=8.0)  # each kernel shorter than its launch call
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert v["id"] == "launch-bound", v
    assert t["host_wait_share"] > 0.5 and t["short_kernel_share"] == 1.0
    assert t["median_kernel_us"] == pytest.approx(3.0)
    assert t["kernels_per_step"] == 200
    assert t["queue_depth_median"] <= 1  # the queue never fills
    assert t["graph_kernel_share"] == 0 and graph_fixes(found)  # eager launches: capture is the first fix


def captured_step_trace(host_between_replays_us: float, graph_ids: bool) -> CudaTrace:
    """A whole training step captured in one CUDA graph, as fastddpm's `--cuda-graphs capture` (or torch.compile
    mode='reduce-overhead') runs it: the batch is copied into the static input buffer by one eager kernel, then
    one cudaGraphLaunch replays 300 short fused kernels (forward, backward, optimizer) one node after another;
    no matmul or conv op appears on the host."""
    tr = CudaTrace()
    for _ in range(8):
        tr.begin_step()
        tr.python(40)
        with tr.cpu_op("aten::copy_", ["c10::BFloat16", "c10::BFloat16", ""], [[64, 3, 32, 32], [64, 3, 32, 32], []]):
            tr.launch(name="void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_copy>",
                      kernel_us=4.0, launch_us=6.0)
        tr.graph_replay([3.0] * 300, node_gap_us=1.0, launch_us=15.0, graph_ids=graph_ids)
        tr.python(host_between_replays_us)
        tr.end_step()
    return tr


@pytest.mark.parametrize("graph_ids", [True, False], ids=["graph-ids", "correlation-only"])
@pytest.mark.parametrize("host_us", [2500.0, 20.0], ids=["host-slower-than-replay", "gpu-bound"])
def test_a_captured_step_is_never_launch_bound_nor_told_to_capture(host_us, graph_ids):
    v, found, t, unavailable = diagnose_trace(captured_step_trace(host_us, graph_ids), with_unavailable=True)
    assert t["graph_kernel_share"] == pytest.approx(300 / 301) and t["graph_launches_per_step"] == 1
    assert t["eager_kernels_per_step"] == 1 and t["kernels_per_step"] == 301
    # launch metrics read the one eager copy only: the replay's 300 kernels share one launch call, and a
    # replay is one unit in the launch queue, not 300
    assert t["median_launch_us"] == 6.0 and t["median_eager_kernel_us"] == 4.0 and t["short_kernel_share"] == 1.0
    # (16 launch calls in the whole trace: a deeper queue would count a replay's kernels one by one)
    assert t["queue_depth_max"] <= (1 if host_us > 1000 else 16)
    assert "launch-bound" not in found, found["launch-bound"].evidence
    assert graph_fixes(found) == []
    if host_us > 1000:  # the GPU waits between replays: host-bound, with fixes for what is outside the graph
        assert v["id"] == "host-bound" and "graph replays" in found["host-bound"].title
    else:  # the queue is full; the GPU idles only between the replay's nodes
        assert v["id"] == "kernel-gaps" and "graph replay" in found["kernel-gaps"].title
    # the matmuls ran inside the graph: FLOPs, GEMM share and autocast coverage cannot be read, and say why
    assert t["gemm_flops_per_step"] == {} and t["gemm_time_share"] == {} and t["groupnorm_share"] is None
    why = unavailable["12 (FLOPs by dtype, GEMM share, autocast coverage)"]
    assert "CUDA graphs" in why and "no shapes or dtypes" in why
    assert "CUDA graphs" in unavailable["13 (MFU)"] and "flops_per_step" in unavailable["13 (MFU)"]
    assert "autocast-gap" not in found and "fp32" not in found


def test_gpu_bound_is_healthy_with_a_deep_queue():
    tr = CudaTrace()
    for _ in range(10):
        tr.begin_step()
        for _ in range(50):
            tr.launch(kernel_us=400.0, launch_us=5.0)
        tr.python(20)
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert v["healthy"], (v, list(found))
    assert t["idle_share"] < 0.01
    assert t["queue_depth_median"] > 10  # the host runs far ahead
    assert "GPU-bound" in v["title"]


def test_sync_every_step_idles_the_gpu_and_is_named():
    tr = CudaTrace()
    for _ in range(10):
        tr.begin_step()
        for _ in range(20):
            tr.launch(kernel_us=50.0, launch_us=5.0)
        tr.sync()  # loss.item()
        tr.python(600)  # Python after the sync: logging, the next step's set-up; the GPU has nothing queued
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert t["syncs_per_step"] == 1
    assert t["host_wait_by_cause"]["sync"] > 0.3
    assert v["id"] == "sync-bound", v
    assert "1 host-device syncs" in found["sync-bound"].evidence[0]


def test_data_wait_gaps_are_blamed_on_data_not_on_python():
    tr = CudaTrace()
    for _ in range(8):
        tr.begin_step()
        tr.data_wait(2000)
        for _ in range(10):
            tr.launch(kernel_us=50.0, launch_us=5.0)
        tr.end_step()
    stats = analyze(tr.events)
    assert stats.host_wait_by_cause["data"] > 0.5
    assert stats.host_wait_by_cause["host"] < 0.05
    v, found, _ = diagnose_trace(tr)
    assert "host-bound" not in found and "launch-bound" not in found
    assert v["id"] == "data-bound"  # from the step records: data wait dominates each step


def test_a_data_wait_that_launches_gpu_work_is_counted_once():
    # device-resident data (--data-placement device): the fetch indexes the batch and flips it on the GPU, so
    # Kineto writes `fastddpm::data_wait` twice, on the host thread and as a gpu_user_annotation on the stream
    tr = CudaTrace()
    for _ in range(6):
        tr.begin_step()
        tr.data_wait(300, launches=[{"name": "void at::native::index_elementwise_kernel", "kernel_us": 20.0},
                                    {"name": "void at::native::flip_kernel", "kernel_us": 10.0}])
        for _ in range(10):
            tr.launch(kernel_us=50.0, launch_us=5.0)
        tr.python(600)
        tr.end_step()
    gpu_copies = [e for e in tr.events if e["name"] == DATA_MARK and e["cat"] == "gpu_user_annotation"]
    assert len(gpu_copies) == 6  # the trace has both copies, each GPU copy inside its step
    stats = analyze(tr.events)
    assert [s.data_wait_us for s in stats.steps] == [300.0] * 6
    assert len(stats.timeline["data_wait"]) == 6
    assert sum(b - a for a, b in stats.timeline["data_wait"]) == 6 * 300.0


def test_pageable_copies_are_transfer_bound():
    tr = CudaTrace()
    for _ in range(8):
        tr.begin_step()
        tr.launch(name="Memcpy HtoD (Pageable -> Device)", cat="gpu_memcpy", runtime="cudaMemcpyAsync",
                  kernel_us=1500.0, launch_us=1500.0, bytes=24 * 2**20)
        for _ in range(10):
            tr.launch(kernel_us=40.0, launch_us=5.0)
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert t["h2d_pageable"] == 8 and t["h2d_pinned"] == 0
    assert t["h2d_share"] > 0.5
    assert v["id"] == "transfer-bound", v
    assert t["h2d_bytes_per_step"] == 24 * 2**20


def test_layout_conversion_kernels_are_found_by_name_and_by_contiguous():
    tr = CudaTrace()
    for _ in range(8):
        tr.begin_step()
        for _ in range(10):
            tr.launch(name="void cudnn::ops::nchwToNhwcKernel<float>", kernel_us=40.0, launch_us=5.0)
            tr.op("aten::contiguous", 6.0, ["c10::BFloat16"], [[16, 64, 32, 32]],
                  launches=[{"name": "void at::native::elementwise_kernel<copy>", "kernel_us": 40.0,
                             "launch_us": 5.0}])
            tr.launch(name="void implicit_convolve_sgemm", kernel_us=60.0, launch_us=5.0)
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert t["layout_kernels_per_step"] == 20
    assert t["layout_share"] == pytest.approx(80 / 140, rel=0.01)
    assert t["layout_format_share"] == pytest.approx(0.5)  # cuDNN's nchwToNhwc; the other half a .contiguous()
    assert v["id"] == "layout-thrash", v


def test_strided_copies_inside_a_cuda_graph_are_layout_conversions():
    """A replayed graph has no aten::contiguous around its copies: aten's direct_copy_kernel without a cast (its
    gpu_kernel_impl_nocast kernel: one dtype, tensors not both contiguous) is found by its name, as in the
    compiled, graphed ddpm-cifar10 step with channels_last on an H200 (76 a step, 12%); the vectorized contiguous
    copy, the fused kernels and direct_copy's casts (autocast's fp32 upcasts before a GroupNorm) are not."""
    strided = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
               "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
               "{lambda()#10}::operator()() const::{lambda(c10::BFloat16)#1}> >(int, T3)")
    cast = ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda("
            "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::"
            "{lambda(float)#1}, std::array<char*, 2ul> >(int, T2, T3)")
    tr = CudaTrace()
    for _ in range(6):
        tr.begin_step()
        with tr.cpu_op("aten::copy_", ["c10::BFloat16", "c10::BFloat16", ""], [[64, 3, 32, 32], [64, 3, 32, 32], []]):
            tr.launch(name="void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_copy>",
                      kernel_us=4.0, launch_us=6.0)
        tr.graph_replay([10.0] * 100, names=[strided if i % 5 == 0 else cast if i % 5 == 1 else f"triton_poi_fused_{i}"
                                             for i in range(100)])
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert t["layout_kernels_per_step"] == 20
    assert t["layout_share"] == pytest.approx(200 / 1004, rel=0.01)
    assert t["layout_format_share"] == 0.0
    assert "layout-thrash" in found


def test_fp32_matmuls_under_autocast_are_measured_by_input_dtype():
    tr = CudaTrace()
    for _ in range(6):
        tr.begin_step()
        tr.op("aten::mm", 10.0, ["c10::BFloat16", "c10::BFloat16"], [[1024, 1024], [1024, 1024]],
              launches=[{"name": "sm90_xmma_gemm_bf16bf16", "kernel_us": 100.0, "launch_us": 5.0}])
        tr.op("aten::mm", 10.0, ["float", "float"], [[1024, 4096], [4096, 1024]],
              launches=[{"name": "sm90_xmma_gemm_f32f32_tf32", "kernel_us": 800.0, "launch_us": 5.0}])
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert t["gemm_flops_per_step"]["bf16"] == 2 * 1024**3
    assert t["gemm_flops_per_step"]["fp32"] == 2 * 1024 * 4096 * 1024
    assert t["gemm_time_share"]["fp32"] == pytest.approx(800 / 900, rel=0.01)
    assert v["id"] == "autocast-gap", v


def test_a_profiled_step_that_began_an_epoch_is_left_out_of_where_the_step_goes():
    """A loader's start-up in one of three profiled CPU steps (0.5 s of data wait beside 4.5 ms steps) took 97% of
    the profile: the matmuls' share, and every estimate made from it, was of that start-up."""
    tr = CudaTrace()
    for wait_us in (1000.0, 500_000.0, 1000.0):
        tr.begin_step()
        tr.data_wait(wait_us)
        tr.op("aten::mm", 3000.0, ["float", "float"], [[256, 256], [256, 256]])
        tr.python(500.0)
        tr.end_step()
    everything = analyze(tr.events)
    assert everything.breakdown["data"] > 0.95 and everything.epoch_starts_left_out == 0
    steady = analyze(tr.events, [False, True, False])
    assert steady.epoch_starts_left_out == 1 and len(steady.steps) == 2
    assert steady.breakdown["data"] == pytest.approx(1000 / 4500, rel=1e-6)
    assert steady.breakdown["matmul"] == pytest.approx(3000 / 4500, rel=1e-6)
    assert steady.profiled_step_ms == pytest.approx(4.5) and steady.gemm_time_share["fp32"] == pytest.approx(3 / 4.5)
    # a profile of epoch starts only (one-step epochs) is read whole: there is nothing else to read
    assert len(analyze(tr.events, [True, True, True]).steps) == 3


def test_kernel_wait_gaps_between_queued_kernels():
    tr = CudaTrace()
    for _ in range(8):
        tr.begin_step()
        for _ in range(100):
            tr.launch(kernel_us=5.0, launch_us=1.0, latency_us=0.0)
            tr.gpu += 8.0  # the queued kernel still starts 8 us after the previous one ends
        tr.end_step()
    v, found, t = diagnose_trace(tr)
    assert t["kernel_wait_share"] > 0.5 > t["host_wait_share"]
    assert t["small_gap_count"] >= 700
    assert v["id"] == "kernel-gaps", v


def test_trace_without_step_marks_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="fastddpm::step"):
        analyze([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}])


def test_gemm_flops_formulas():
    assert gemm_flops("aten::mm", [[8, 16], [16, 4]]) == 2 * 8 * 16 * 4
    assert gemm_flops("aten::addmm", [[4], [8, 16], [16, 4]]) == 2 * 8 * 16 * 4
    assert gemm_flops("aten::bmm", [[2, 8, 16], [2, 16, 4]]) == 2 * 2 * 8 * 16 * 4
    # 3x3 conv, stride 2, padding 1: 16x16 -> 8x8
    fwd = 2 * 4 * 8 * 8 * 8 * 3 * 9
    assert gemm_flops("aten::convolution", [[4, 3, 16, 16], [8, 3, 3, 3], [8]],
                      ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]"]) == fwd
    bwd_args = ["", "", "", "[8]", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1", "[False, True, True]"]
    assert gemm_flops("aten::convolution_backward", [[4, 8, 8, 8], [4, 3, 16, 16], [8, 3, 3, 3]], bwd_args) == fwd
    # transposed, 2 groups: weight (C_in, C_out/groups, kH, kW); 2 * N * C_in * H_in * W_in * C_out * kH * kW / groups
    up_args = ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "True", "[1, 1]", "2"]
    up_flops = 2 * 2 * 6 * 16 * 16 * 4 * 9 // 2
    assert gemm_flops("aten::convolution", [[2, 6, 16, 16], [6, 2, 3, 3], [4]], up_args) == up_flops


def cpu_trace_flops(tmp_path, step) -> dict[str, float]:
    """FLOPs per step by dtype, as the doctor reads them from a real CPU profile of two calls of `step`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            with torch.autograd.profiler.record_function(STEP_MARK):
                step()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    stats = analyze(json.loads(path.read_text())["traceEvents"])
    assert len(stats.steps) == 2
    return stats.gemm_flops_per_step


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_transposed_conv_flops_match_flop_counter_mode(tmp_path, backward):
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    # a U-Net decoder's upsampling: ConvTranspose2d records as aten::convolution(transposed=True), whose
    # multiply-adds go per *input* pixel; a plain conv after it, and an input that needs no gradient
    model = nn.Sequential(nn.ConvTranspose2d(8, 6, 4, stride=2, padding=1), nn.Conv2d(6, 6, 3, padding=1),
                          nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1))
    x = torch.randn(2, 8, 8, 8)

    def step():
        out = model(x)
        if backward:
            out.sum().backward()

    with FlopCounterMode(display=False) as counter:
        step()
    assert cpu_trace_flops(tmp_path, step) == {"fp32": counter.get_total_flops()}


@pytest.mark.parametrize("kind, d_v", [("flash", 32), ("efficient", 16)])
def test_attention_backward_is_counted_once_through_its_nest(kind, d_v):
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    # cross-attention, 64 queries over 48 keys, shapes (B, H, L, D); the kernel ops take (B, L, H, D).
    # Memory-efficient attention allows a value head dim unlike the query's.
    q, k, v, o = [2, 4, 64, 32], [2, 4, 48, 32], [2, 4, 48, d_v], [2, 4, 64, d_v]
    q_, k_, v_, o_ = ([t[0], t[2], t[1], t[3]] for t in (q, k, v, o))
    bf16 = "c10::BFloat16"
    # what Kineto records for SDPA on CUDA: the forward op calls the kernel op, and so does the backward op
    # (autograd's ScaledDotProduct*AttentionBackward0 -> aten::_scaled_dot_product_*_backward -> aten::_*_backward)
    tr = CudaTrace()
    for _ in range(2):
        tr.begin_step()
        with tr.cpu_op(f"aten::_scaled_dot_product_{kind}_attention", [bf16] * 3, [q, k, v]):
            with tr.cpu_op(f"aten::_{kind}_attention_forward", [bf16] * 3, [q_, k_, v_]):
                tr.launch(name=f"{kind}_fwd_kernel", kernel_us=80.0)
        with tr.cpu_op(f"aten::_scaled_dot_product_{kind}_attention_backward", [bf16] * 5, [o, q, k, v, o]):
            with tr.cpu_op(f"aten::_{kind}_attention_backward", [bf16] * 5, [o_, q_, k_, v_, o_]):
                tr.launch(name=f"{kind}_bwd_kernel", kernel_us=200.0)
        tr.end_step()
    stats = analyze(tr.events)
    assert stats.gemm_flops_per_step == {"bf16": sdpa_flop_count(q, k, v) + sdpa_backward_flop_count(o, q, k, v)}
    # the kernel op alone (outermost when called directly) is read in its own (B, L, H, D) layout
    assert gemm_flops(f"aten::_{kind}_attention_backward", [o_, q_, k_, v_]) == sdpa_backward_flop_count(o, q, k, v)


def test_flops_from_a_real_cpu_trace_match_flop_counter_mode(tmp_path):
    from torch import nn
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1),
                          nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
    x = torch.randn(4, 3, 16, 16)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            with torch.autograd.profiler.record_function(STEP_MARK):
                model(x).sum().backward()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    stats = analyze(json.loads(path.read_text())["traceEvents"])
    assert len(stats.steps) == 2
    assert stats.gemm_flops_per_step == {"fp32": counter.get_total_flops()}
    assert stats.has_gpu is False and stats.syncs_per_step is None


@contextmanager
def allow_tf32(on: bool):
    # torch.backends.cuda.matmul is not a plain object (monkeypatch cannot restore it): set and restore by hand
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_the_mfu_peak_dtype_is_the_runs_own():
    # most FLOPs decide; fp32 on CUDA is the TF32 rate when the run allowed TF32 (read in the run's process)
    with allow_tf32(True):
        assert run_matmul_dtype({"fp32": 9.0, "bf16": 1.0}, "cuda:0") == (torch.float32, "tf32")
        assert run_matmul_dtype({"fp32": 9.0}, "cpu") == (torch.float32, "fp32")  # TF32 is a CUDA setting
        assert run_matmul_dtype({"bf16": 9.0, "fp32": 1.0}, "cuda:0") == (torch.bfloat16, "bf16")
        assert run_matmul_dtype({"fp16": 9.0, "fp32": 1.0}, "cuda:0") == (torch.float16, "fp16")
    with allow_tf32(False):
        assert run_matmul_dtype({"fp32": 9.0, "bf16": 1.0}, "cuda:0") == (torch.float32, "fp32")
    dtype, why = run_matmul_dtype({"fp8": 9.0, "bf16": 1.0}, "cuda:0")
    assert dtype is None and "fp8" in why


def test_a_known_precision_picks_the_peak_when_the_trace_hides_the_dtypes(monkeypatch):
    """fastddpm's own trainer under capture (or without a profile window): the dtypes are unseen in the trace,
    so its configured precision picks the peak instead of the device's usual dtype being assumed."""
    import fastddpm.measure
    from fastddpm.doctor.api import mfu_measurements

    asked = []
    monkeypatch.setattr(fastddpm.measure, "measure_matmul_peak",
                        lambda device, *, dtype=None, **kw: asked.append(dtype) or {"tflops": 1.0, "label": "fake"})
    stats = {"median_ms": 10.0}
    known = mfu_measurements(None, stats, "cpu", flops_per_step=1e9, matmul_dtype="bf16")
    assert asked == [torch.bfloat16]
    assert known["mfu"]["peak_dtype"] == "bf16" and "configured precision" in known["mfu"]["peak_dtype_basis"]
    assert known["mfu"]["mfu"] == pytest.approx(1e9 / 0.01 / 1e12)
    assumed = mfu_measurements(None, stats, "cpu", flops_per_step=1e9)
    assert asked[-1] == torch.float32 and assumed["mfu"]["peak_dtype_basis"].startswith("assumed")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mfu_is_measured_against_a_peak_in_the_runs_dtype(monkeypatch, precision):
    import fastddpm.doctor
    import fastddpm.measure

    asked = []

    def fake_peak(device, *, n=None, dtype=None, trials=5, iters=None, emulated=False):
        asked.append((dtype, emulated))
        # the doctor names the peak's dtype itself (this dict's vocabulary has no tf32), so this is never read
        return {"tflops": 0.5, "label": f"fake {dtype} peak", "dtype": "never read"}

    monkeypatch.setattr(fastddpm.measure, "measure_matmul_peak", fake_peak)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    loader = [torch.randn(32, 64) for _ in range(4)]
    with fastddpm.doctor.watch(loader, warmup_steps=1, steps=3, profile_steps=2, loader_probe_s=0,
                               device="cpu", print_report=False) as dr:
        for x in dr.batches():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(x).float().square().mean()
            loss.backward()
            dr.step()
    m = dr.report.measurements
    by_dtype = m["trace"]["gemm_flops_per_step"]
    assert max(by_dtype, key=by_dtype.get) == precision  # the run's matmuls are the dtype it was run in
    # an fp32 run also measures bf16's rate, for rule 16 (would autocast pay here?); the fp32 peak is reused. A bf16
    # run on a CPU that emulates bf16 measures both, for rule 12 (is bf16 slower here?). An emulated bf16 peak is
    # measured small (emulated=True), where a 1024^3 matmul took 25 s
    emulated = not cpu_native_bf16()[0]
    if precision == "fp32":
        assert asked == [(torch.float32, False), (torch.bfloat16, emulated)]
    else:
        assert asked == [(torch.bfloat16, emulated)] + [(torch.float32, False), (torch.bfloat16, True)] * emulated
    assert ("low_precision" in m) == (precision == "fp32" or emulated)
    if precision == "fp32":
        assert m["low_precision"]["peak_ratio"] == 1.0 and m["low_precision"]["dtype"] == "bf16"
    assert m["mfu"]["peak_dtype"] == precision and m["mfu"]["peak_dtype_basis"].startswith("the input dtype of")
    # a bf16 peak on a CPU that emulates bf16 says so (its MFU would read as fair for a step slower than fp32's)
    said = ", emulated by this device; " if precision == "bf16" and emulated else ")"
    assert f"({precision} peak 0.5 TFLOP/s{said}" in dr.report.text()
    assert f"{precision} peak 0.5 TFLOP/s" in dr.report.html()
    assert json.loads(json.dumps(dr.report.to_dict(), default=str))["measurements"]["mfu"]["peak_dtype"] == precision


# ---- the compute breakdown (docs/DOCTOR.md "Where the step goes")

class _Mixed(torch.nn.Module):
    """One of each: a conv, a GroupNorm, SiLU, nn.MultiheadAttention (materialised), SDPA (fused), a linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 32, 3, padding=1)
        self.norm = torch.nn.GroupNorm(8, 32)
        self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        # (B, L, C), contiguous: a transposed view would send SDPA to its math fallback on a CPU
        h = torch.nn.functional.silu(self.norm(self.conv(x))).flatten(2).transpose(1, 2).contiguous()
        a, _ = self.mha(h, h, h)
        f = torch.nn.functional.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None])[:, 0]
        return self.out(a + f)


def _profiled_steps(model, opt, steps=2) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from fastddpm.doctor.session import profiler_logs_muted

    x = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with profiler_logs_muted():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                with torch.autograd.profiler.record_function(STEP_MARK):
                    with torch.autograd.profiler.record_function(DATA_MARK):
                        batch = x.clone()
                    loss = model(batch).square().mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    return json.loads(_export(prof))["traceEvents"]


def _export(prof) -> str:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.json"
        prof.export_chrome_trace(str(path))
        return path.read_text()


@pytest.mark.parametrize("kind", ["per-tensor", "foreach", "fused"])
def test_cpu_breakdown_on_a_real_trace(kind):
    torch.manual_seed(0)
    model = _Mixed()
    flags = {"per-tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)
    t = analyze(_profiled_steps(model, opt))
    b = t.breakdown
    assert list(b) == ["matmul", "attention", "norm", "elementwise", "optimizer", "copy", "data", "framework",
                       "python"]
    assert sum(b.values()) == pytest.approx(1.0)  # the categories partition the training thread's step time
    for cat in ("matmul", "attention", "norm", "elementwise", "optimizer", "data", "framework", "python"):
        assert b[cat] > 0, cat
    assert set(t.matmul_share_by_dtype) == {"fp32"} and sum(t.matmul_share_by_dtype.values()) == pytest.approx(
        b["matmul"])
    assert set(t.attention_share_by_impl) == {"softmax(QK^T)V (materialised)", "SDPA flash (CPU)"}
    assert sum(t.attention_share_by_impl.values()) == pytest.approx(b["attention"])
    assert t.optimizer_kind == kind
    # per-tensor AdamW issues ops for each of the 10 tensors; foreach and fused a handful for all of them
    assert (t.optimizer_ops_per_step > 100) == (kind == "per-tensor")


def test_an_optimizer_range_that_outlasts_its_step_is_charged_only_its_steps_part():
    """`doctor run` ends a step in torch.optim's post-hook, inside the `Optimizer.step#` range: that range runs on
    past the step's end, and in the last profiled step over the profiler's own stop. Made-up times (us), so the
    share is exact: a 1,000 us step whose optimizer range starts at 800 and lasts 6,000 us is charged 200 us."""
    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": {}}

    events = [x("user_annotation", STEP_MARK, 0, 1000),
              x("cpu_op", "aten::mm", 100, 600),
              x("user_annotation", "Optimizer.step#SGD.step", 800, 6000),
              x("cpu_op", "aten::add_", 820, 100)]
    b = analyze(events).breakdown
    assert b["optimizer"] == pytest.approx(0.2) and b["matmul"] == pytest.approx(0.6)
    assert sum(b.values()) == pytest.approx(1.0)


def test_bf16_matmuls_are_split_by_dtype():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            with torch.autograd.profiler.record_function(STEP_MARK):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(torch.randn(16, 64)).float().square().mean()
                loss.backward()
                opt.step()
    t = analyze(json.loads(_export(prof))["traceEvents"])
    assert "bf16" in t.matmul_share_by_dtype and t.breakdown["copy"] > 0  # autocast's casts are copies


def test_gpu_breakdown_charges_kernels_to_the_op_that_launched_them():
    tr = CudaTrace()
    for _ in range(3):
        tr.begin_step()
        tr.op("aten::addmm", 10.0, ["float", "c10::BFloat16", "c10::BFloat16"], [[64], [64, 64], [64, 64]],
              launches=[{"name": "gemm", "kernel_us": 60.0}])
        tr.op("aten::native_group_norm", 5.0, ["c10::BFloat16"], [[8, 64]],
              launches=[{"name": "gn", "kernel_us": 20.0}])
        tr.op("aten::_scaled_dot_product_flash_attention", 5.0, ["c10::BFloat16"] * 3,
              [[1, 1, 8, 8]] * 3, launches=[{"name": "flash_fwd", "kernel_us": 30.0}])
        tr.op("aten::silu", 5.0, ["c10::BFloat16"], [[8, 64]], launches=[{"name": "silu", "kernel_us": 10.0}])
        tr.python(200.0)  # the GPU idles while Python runs
        tr.end_step()
    t = analyze(tr.events)
    b = t.breakdown
    assert t.has_gpu and "python" not in b and b["idle"] == pytest.approx(t.idle_share)
    busy = {k: v for k, v in b.items() if k != "idle" and v > 0}
    assert set(busy) == {"matmul", "norm", "attention", "elementwise"}
    # kernel time in proportion: 60 : 20 : 30 : 10
    assert b["matmul"] / b["norm"] == pytest.approx(3.0) and b["attention"] / b["elementwise"] == pytest.approx(3.0)
    assert t.matmul_share_by_dtype == {"bf16": pytest.approx(b["matmul"])}
    assert t.attention_share_by_impl == {"SDPA flash": pytest.approx(b["attention"])}
    # the top kernels by name, largest first, each with its launching op's category and its share of the span
    top = [(o["name"], o["category"], o["calls_per_step"]) for o in t.top_ops]
    assert top == [("gemm", "matmul", 1), ("flash_fwd", "attention", 1), ("gn", "norm", 1),
                   ("silu", "elementwise", 1)]
    assert t.top_ops[0]["share"] == pytest.approx(b["matmul"])


def test_top_kernels_of_a_captured_step_are_named_and_marked_as_replayed():
    t = analyze(captured_step_trace(20.0, graph_ids=True).events)
    by_name = {o["name"]: o for o in t.top_ops}
    # the replay's 300 kernels are 7 fused Triton kernels by name, ahead of the eager copy into the graph's input
    replayed = [o for o in t.top_ops if o["category"] == "cuda graph"]
    assert set(by_name) - {o["name"] for o in replayed} == {
        "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_copy>"}
    assert t.top_ops[-1]["category"] == "copy" and t.top_ops[-1]["calls_per_step"] == 1
    assert {o["name"] for o in replayed} == {f"triton_poi_fused_{i}" for i in range(7)}
    assert sum(o["calls_per_step"] for o in replayed) == 300
    assert sum(o["share"] for o in replayed) == pytest.approx(900 * len(t.steps) / t.span_us)


def test_kernel_names_are_cut_to_read():
    from fastddpm.doctor.trace import kernel_name

    assert kernel_name("void cutlass::Kernel2<gemm_bf16_128x2_tn>(gemm_bf16_128x2_tn::Params)") == \
        "cutlass::Kernel2<gemm_bf16_128x2_tn>"
    assert kernel_name("void at::native::f<(int)4>(at::native::g<(int)4>, float)") == "at::native::f<(int)4>"
    assert kernel_name("triton_poi_fused_add_0") == "triton_poi_fused_add_0"
    assert kernel_name("(unnamed)") == "(unnamed)"
    # two kernels alike in their first 90 characters stay two entries, each shown cut
    tr = CudaTrace()
    for _ in range(2):
        tr.begin_step()
        for dtype, us in (("float", 30.0), ("c10::BFloat16", 10.0)):
            tr.launch(name=f"void at::native::elementwise_kernel<{'x' * 100}, {dtype}>(int)", kernel_us=us)
        tr.end_step()
    top = analyze(tr.events).top_ops
    assert len(top) == 2 and all(len(o["name"]) == 90 and o["name"].endswith("...") for o in top)
    assert [o["full_name"] for o in top] == [f"at::native::elementwise_kernel<{'x' * 100}, {dtype}>"
                                             for dtype in ("float", "c10::BFloat16")]  # report.json keeps it whole
    assert top[0]["share"] == pytest.approx(3 * top[1]["share"]) and top[0]["calls_per_step"] == 1


def test_a_kernel_under_two_categories_is_one_top_entry_for_each():
    # the same copy kernel: once a step inside a matmul op (large), 20 times a step from the data fetch (small)
    tr = CudaTrace()
    for _ in range(2):
        tr.begin_step()
        tr.data_wait(40.0, launches=[{"name": "copy_k", "kernel_us": 1.0}] * 20)
        tr.op("aten::mm", 5.0, ["float", "float"], [[64, 64], [64, 64]],
              launches=[{"name": "gemm", "kernel_us": 100.0}, {"name": "copy_k", "kernel_us": 50.0}])
        tr.end_step()
    t = analyze(tr.events)
    top = {(o["name"], o["category"]): o for o in t.top_ops}
    assert set(top) == {("gemm", "matmul"), ("copy_k", "matmul"), ("copy_k", "data")}
    assert top["copy_k", "matmul"]["calls_per_step"] == 1 and top["copy_k", "data"]["calls_per_step"] == 20
    assert top["copy_k", "matmul"]["share"] == pytest.approx(2.5 * top["copy_k", "data"]["share"])
    assert [o["name"] for o in t.top_ops] == ["gemm", "copy_k", "copy_k"]  # by time


def test_cpu_native_bf16_reads_the_flags():
    from fastddpm.device import cpu_native_bf16

    assert cpu_native_bf16(frozenset({"avx512f", "amx_bf16", "amx_tile"})) == (
        True, "the CPU has amx_bf16: native bf16 matmuls")
    assert cpu_native_bf16(frozenset({"avx512f", "avx512_vnni"}))[0] is False
    assert cpu_native_bf16(frozenset({"fp", "asimd", "bf16"}))[0] is True  # Arm's FEAT_BF16
    ok, why = cpu_native_bf16(frozenset())
    assert not ok and "amx_bf16" in why


# ---- a Python loop over the batch's samples (rule 22)

def _profiled(step, steps=3) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from fastddpm.doctor.session import profiler_logs_muted

    with profiler_logs_muted():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                with torch.autograd.profiler.record_function(STEP_MARK):
                    step()
    return json.loads(_export(prof))["traceEvents"]


@pytest.mark.parametrize("style", ["per-sample", "one-item slices", "zip", "micro-batches", "dataset reads",
                                   "batched", "layer gains"])
def test_a_loop_over_the_batchs_samples_is_found_and_nothing_else_is(style):
    torch.manual_seed(0)
    model = torch.nn.Conv2d(1, 4, 3, padding=1)
    head = torch.nn.Conv2d(4, 1, 1)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=1e-3)
    data = torch.randn(8, 1, 6, 6)
    gains = torch.ones(6, requires_grad=True)

    def step():
        if style == "dataset reads":  # a map-style dataset read item by item, inside the data wait
            with torch.autograd.profiler.record_function(DATA_MARK):
                x = torch.stack([data[i] for i in range(8)])
        else:
            x = data
        pred = head(model(x))
        if style == "per-sample":
            loss = sum(torch.nn.functional.mse_loss(pred[i], x[i]) for i in range(8)) / 8
        elif style == "one-item slices":
            loss = sum(torch.nn.functional.mse_loss(pred[i:i + 1], x[i:i + 1]) for i in range(8)) / 8
        elif style == "zip":  # iterating tensors: one aten::unbind each, then the items' ops
            loss = sum(torch.nn.functional.mse_loss(p, t) for p, t in zip(pred, x)) / 8
        elif style == "micro-batches":  # chunks of several samples: gradient accumulation's shape, not one by one
            loss = sum(torch.nn.functional.mse_loss(pred[i:i + 4], x[i:i + 4]) for i in (0, 4)) / 2
        elif style == "layer gains":  # a vector's scalars indexed in a loop (a gain per layer): no items to batch
            loss = sum(gains[i] * pred.square().mean() for i in range(6))
        else:
            loss = torch.nn.functional.mse_loss(pred, x)
        opt.zero_grad()
        loss.backward()
        opt.step()

    loops = analyze(_profiled(step)).item_loops
    if style in ("per-sample", "one-item slices", "zip"):
        assert len(loops) == 1
        loop = loops[0]
        assert loop["items"] == 8 and loop["indexed_per_step"] == 8 and loop["shapes"] == [[8, 1, 6, 6]]
        assert "aten::mse_loss" in loop["per_item_ops"]
        assert 0 < loop["span_us"] < loop["step_us"] and loop["ops_in_span"] >= 16
        # the backward evaluates the loss's gradient once per sample too
        assert loop["backward_us"] > 0 and loop["backward_ops"] >= 8
    else:
        assert loops == []
