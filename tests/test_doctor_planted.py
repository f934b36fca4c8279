"""Planted faults (fastddpm.doctor.planted): the doctor must name each one. The CPU-observable cases run
everywhere; the GPU cases (launch, sync, transfer, layout) skip without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from fastddpm.doctor import planted

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU_CASES = [n for n in planted.CASES if n not in planted.GPU_ONLY]


@pytest.fixture(scope="session")
def cpu_case(tmp_path_factory):
    """Each CPU case run once per module with its default window (the tests below read the same report)."""
    cache = {}

    def run(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[name] = (planted.CASES[name](torch.device("cpu"), out=out, print_report=False), out)
        return cache[name]

    return run


@pytest.mark.parametrize("name", CPU_CASES)
def test_planted_fault_is_diagnosed_on_cpu(name, cpu_case):
    report, out = cpu_case(name)
    want = planted.expected(name, "cpu")
    assert report.bottleneck == want, report.text()
    saved = json.loads((out / "report.json").read_text())
    assert saved["verdict"]["id"] == want
    if not report.healthy:
        top = report.finding(report.bottleneck)
        assert top.evidence and top.fixes and report.verdict["cost"] >= 0.05
    if top_is_compute := (not report.healthy and top.group == "compute"):
        # the planted compute fault is the first of the ranked compute fixes, in the text report too
        assert report.verdict["ranked"][0] == want
        assert f"1. [{want}:" in report.text()
    assert top_is_compute == (want in ("fp32", "autocast-gap", "emulated-bf16", "attention-weights",
                                       "eager-elementwise", "per-tensor-optimizer", "item-loop"))


def test_fp32_case_says_why_fp32_stays_where_bf16_is_not_native(cpu_case):
    """On a CPU without amx_bf16/avx512_bf16 the fp32 case is healthy, and the doctor says it measured bf16 slower;
    with native bf16 the same loop is COMPUTE-BOUND with autocast as the top fix (the parametrised test)."""
    report, _ = cpu_case("fp32-matmuls")
    lp = report.measurements["low_precision"]
    note = report.finding("fp32")
    assert note is not None and lp["dtype"] == "bf16"
    if planted.expected("fp32-matmuls", "cpu") == "healthy":
        assert note.kind == "note" and not lp["native"] and f"{lp['peak_ratio']:.2f}x" in note.cause
    else:
        assert note.kind == "bottleneck" and lp["native"]
    # the breakdown: the loop is its matmuls, all fp32, and the optimizer is the fused one the case asked for
    tr = report.measurements["trace"]
    assert tr["breakdown"]["matmul"] > 0.5 and set(tr["matmul_share_by_dtype"]) == {"fp32"}
    assert tr["optimizer_kind"] == "fused" and sum(tr["breakdown"].values()) == pytest.approx(1.0)


def test_mha_case_counts_the_calls_that_asked_for_weights(cpu_case):
    report, _ = cpu_case("mha-need-weights")
    calls = report.measurements["attention_calls"]
    import inspect

    from fastddpm.doctor import planted as planted_module

    line = inspect.getsource(planted_module).splitlines().index(
        "        h, _weights = self.attn(x, x, x)  # need_weights=True by default: the planted fault") + 1
    assert calls == {"calls_per_step": 1.0, "need_weights_per_step": 1.0, "modules": 1,
                     "call_sites": [f"planted.py:{line} in forward"],  # the line to change, not torch's own
                     "call_code": ["h, _weights = self.attn(x, x, x)"]}
    impl = report.measurements["trace"]["attention_share_by_impl"]
    assert list(impl) == ["softmax(QK^T)V (materialised)"]
    finding = report.finding("attention-weights")
    # the script's own call, as written there, not a generic attn(x, x, x)
    assert finding.fixes[0].code.startswith("`h, _weights = self.attn(x, x, x)` with need_weights=False added at "
                                            f"planted.py:{line} in forward: ")
    # the module that built the weights is the nn.MultiheadAttention itself: its fix is need_weights, and there is
    # no hand-written softmax to replace
    sites = report.measurements["attention_sites"]
    assert [s["cls"] for s in sites] == ["MultiheadAttention"] and sites[0]["tokens"] > 1
    assert len(finding.fixes) == 1
    import torch.nn as nn

    assert not hasattr(nn.MultiheadAttention.forward, "__wrapped__")  # the watch put the method back


def test_slow_loader_names_latency_and_heavy_transform_names_the_cpu(cpu_case):
    sleep = cpu_case("slow-loader")[0].finding("data-bound")
    heavy = cpu_case("heavy-transform")[0].finding("data-bound")
    assert sleep.rules == (1,) and "not the limit" in sleep.cause
    assert heavy.rules == (1, 3) and "CPU-bound" in heavy.cause
    # the loader alone was timed and is slower than training could go
    assert any("the loader alone gives" in e for e in sleep.evidence)


def test_epoch_spike_evidence_points_at_the_epoch_start_steps(cpu_case):
    report, _ = cpu_case("epoch-respawn")
    steps = report.measurements["steps"]
    starts = [s for s in steps if s["epoch_start"]]
    assert starts, "the watch window must cross an epoch boundary"
    median = sorted(s["host_ms"] for s in steps)[len(steps) // 2]
    assert all(s["host_ms"] > 3 * median for s in starts)
    assert "persistent_workers=True" in report.finding("epoch-spikes").fixes[0].code


def test_item_every_step_is_counted_on_cpu_but_not_called_a_sync():
    """On a CPU device .item() reads memory: it is counted, and honestly not blamed."""
    with_item = planted.CASES["item-every-step"](torch.device("cpu"), print_report=False)
    reads = with_item.measurements["trace"]["scalar_reads_per_step"]
    assert reads >= 1
    assert with_item.measurements["trace"]["syncs_per_step"] is None
    assert with_item.bottleneck != "sync-bound"
    assert "7 (syncs)" in with_item.unavailable


def test_recompile_step_is_the_ragged_one(cpu_case):
    report, _ = cpu_case("uneven-last-batch")
    comp = report.measurements["compile"]
    assert comp["recompiles_after_warmup"] >= 1
    hit = [s for s in report.measurements["steps"] if s["recompiles"]]
    assert hit and all(s["index"] % 8 == 7 for s in hit)  # 7 full batches, then the ragged 8th
    assert "drop_last=True" in report.finding("recompiles").fixes[0].code


def test_watch_overhead_is_small_on_cpu():
    """A sanity bound, not the benchmark (benchmarks/doctor_overhead.py measures the <= 3% promise): the
    timers add microseconds to millisecond steps."""
    report = planted.CASES["big-matmul"](torch.device("cpu"), print_report=False, profile_steps=0)
    assert report.measurements["step_stats"]["median_ms"] > 1.0
    assert report.environment["profile_wall_s"] is None


def test_a_full_profile_of_a_run_is_bounded_in_time(cpu_case):
    report, _ = cpu_case("slow-loader")
    assert report.environment["wall_s"] < 60


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", [n for n in planted.CASES if n not in planted.CPU_ONLY])
def test_planted_fault_is_diagnosed_on_gpu(name, tmp_path):
    report = planted.CASES[name](torch.device("cuda"), out=tmp_path, print_report=False)
    assert report.bottleneck == planted.EXPECTED[name], report.text()
    trace = report.measurements["trace"]
    assert trace is None or trace["has_gpu"]  # a CUDA run's trace holds the GPU timeline


@pytest.mark.parametrize("claimed,hardware,want", [
    ("avx2", "avx2", "emulated-bf16"),         # an AVX2-only CPU: bf16 is emulated, measured slower
    ("avx2", "avx2 avx512_bf16", "autocast-gap"),  # the suite's flags on a Zen 4/5: measured no slower, so the gap
    ("avx2 avx512_bf16", "avx2 avx512_bf16", "autocast-gap"),
])
def test_the_autocast_gap_case_expects_emulated_bf16_only_where_the_hardware_emulates_it(
        claimed, hardware, want, monkeypatch):
    """The doctor calls bf16 emulated only when flags say so and a measurement agrees; the suite claims no bf16 on
    every machine (FASTDDPM_CPU_FLAGS), so on a CPU with native bf16 the planted case is still the autocast gap."""
    import fastddpm.device

    monkeypatch.setenv("FASTDDPM_CPU_FLAGS", claimed)
    monkeypatch.setattr(fastddpm.device, "hardware_cpu_flags", lambda: frozenset(hardware.split()))
    assert planted.expected("autocast-gap", "cpu") == want
    assert planted.expected("fp32-matmuls", "cpu") == ("healthy" if "bf16" not in claimed else "fp32")
