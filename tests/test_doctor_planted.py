"""Planted faults (fastddpm.doctor.planted): the doctor must name each one. The CPU-observable cases run
everywhere; the GPU cases (launch, sync, transfer, layout) skip without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from fastddpm.doctor import planted

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU_CASES = [n for n in planted.CASES if n not in planted.GPU_ONLY]


@pytest.mark.parametrize("name", CPU_CASES)
def test_planted_fault_is_diagnosed_on_cpu(name, tmp_path):
    report = planted.CASES[name](torch.device("cpu"), out=tmp_path, print_report=False)
    assert report.bottleneck == planted.EXPECTED[name], report.text()
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["verdict"]["id"] == planted.EXPECTED[name]
    if not report.healthy:
        top = report.finding(report.bottleneck)
        assert top.evidence and top.fixes and report.verdict["cost"] >= 0.05


def test_slow_loader_names_latency_and_heavy_transform_names_the_cpu():
    sleep = planted.CASES["slow-loader"](torch.device("cpu"), print_report=False).finding("data-bound")
    heavy = planted.CASES["heavy-transform"](torch.device("cpu"), print_report=False).finding("data-bound")
    assert sleep.rules == (1,) and "not the limit" in sleep.cause
    assert heavy.rules == (1, 3) and "CPU-bound" in heavy.cause
    # the loader alone was timed and is slower than training could go
    assert any("the loader alone gives" in e for e in sleep.evidence)


def test_epoch_spike_evidence_points_at_the_epoch_start_steps():
    report = planted.CASES["epoch-respawn"](torch.device("cpu"), print_report=False)
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


def test_recompile_step_is_the_ragged_one():
    report = planted.CASES["uneven-last-batch"](torch.device("cpu"), print_report=False)
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


def test_a_full_profile_of_a_run_is_bounded_in_time():
    report = planted.CASES["slow-loader"](torch.device("cpu"), print_report=False)
    assert report.environment["wall_s"] < 60


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", list(planted.CASES))
def test_planted_fault_is_diagnosed_on_gpu(name, tmp_path):
    report = planted.CASES[name](torch.device("cuda"), out=tmp_path, print_report=False)
    assert report.bottleneck == planted.EXPECTED[name], report.text()
    trace = report.measurements["trace"]
    assert trace is None or trace["has_gpu"]  # a CUDA run's trace holds the GPU timeline
