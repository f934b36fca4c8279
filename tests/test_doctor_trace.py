"""The trace analysis and the GPU rules, on hand-built CUDA traces in torch.profiler's Chrome format.

No GPU is needed: each trace is written the way kineto writes one (user annotations, cpu_op, cuda_runtime
launches with a correlation id, kernels and memcpys on the device clock), with a host clock and a GPU clock
that the builder advances like a real launch queue. The planted GPU loops in test_doctor_planted.py check the
same verdicts on real traces when a GPU is present.
"""

from __future__ import annotations

import json

import pytest
import torch

from fastddpm.doctor.rules import evaluate, verdict
from fastddpm.doctor.trace import DATA_MARK, STEP_MARK, analyze, gemm_flops


class CudaTrace:
    """A host thread launching onto one GPU stream. Times in microseconds."""

    def __init__(self):
        self.events: list[dict] = []
        self.host = 0.0
        self.gpu = 0.0
        self.corr = 0
        self._step0: float | None = None

    def _x(self, cat, name, ts, dur, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
                            "args": args})

    def begin_step(self):
        self._step0 = self.host

    def end_step(self):
        self._x("user_annotation", STEP_MARK, self._step0, self.host - self._step0)

    def launch(self, name="void gemm_kernel", kernel_us=10.0, launch_us=5.0, latency_us=2.0, cat="kernel",
               runtime="cudaLaunchKernel", **kargs):
        self.corr += 1
        self._x("cuda_runtime", runtime, self.host, launch_us, correlation=self.corr)
        start = max(self.gpu, self.host + latency_us)
        self.events.append({"ph": "X", "cat": cat, "name": name, "ts": start, "dur": kernel_us, "pid": 0, "tid": 7,
                            "args": {"correlation": self.corr, "stream": 7, **kargs}})
        self.gpu = start + kernel_us
        self.host += launch_us

    def op(self, name, dur_us, input_types, dims, launches=()):
        """A cpu_op that launches kernels (for dtype/owner attribution)."""
        t0 = self.host
        for k in launches:
            self.launch(**k)
        self.host = max(self.host, t0 + dur_us)
        self._x("cpu_op", name, t0, self.host - t0, **{"Input type": input_types, "Input Dims": dims})

    def sync(self):
        t0 = self.host
        self.host = max(self.host, self.gpu) + 5.0
        self._x("cuda_runtime", "cudaStreamSynchronize", t0, self.host - t0)

    def python(self, us):
        self.host += us

    def data_wait(self, us):
        self._x("user_annotation", DATA_MARK, self.host, us)
        self.host += us


def measurements_for(trace: CudaTrace) -> dict:
    stats = analyze(trace.events)
    steps = [{"index": i, "host_ms": s.dur_us / 1e3, "data_wait_ms": s.data_wait_us / 1e3, "data_cpu_ms": 0.0,
              "epoch_start": False, "gpu_ms": None, "recompiles": 0} for i, s in enumerate(stats.steps)]
    return {"device": "cuda:0", "steps": steps, "trace": stats.to_dict(), "step_stats": {}}


def diagnose_trace(trace: CudaTrace):
    m = measurements_for(trace)
    found, _ = evaluate(m)
    return verdict(found, m), {f.id: f for f in found}, m["trace"]


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
    assert v["id"] == "layout-thrash", v


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
