"""`fastddpm bench ladder --quick` on the CPU: the outputs exist, parse, and hold one row per rung with sane
numbers; a planted failing rung is reported failed while the later rungs still run."""

import csv
import dataclasses
import json
import math
import re

import pytest

from fastddpm.bench import ladder_rungs
from fastddpm.bench.cli import main as bench_main
from fastddpm.bench.ladder import QUICK, LadderSettings, run_ladder
from fastddpm.config import ConfigError

RUNG_KEYS = ["0", "1", "2", "3", "3b", "4", "5", "6", "7", "8", "9", "10"]
PLANTED = "2"  # this rung's builder raises; rungs after it must still run


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder")
    real = ladder_rungs.prepare_rung

    def planted(rung, sw, ctx):
        if rung.key == PLANTED:
            raise RuntimeError("planted failure")
        return real(rung, sw, ctx)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ladder_rungs, "prepare_rung", planted)
        result = run_ladder(LadderSettings(**QUICK, device="cpu", quick=True), out, argv=["test"], log=lambda m: None)
    return out, result


def test_outputs_exist_and_parse(quick_run):
    out, _ = quick_run
    data = json.loads((out / "ladder.json").read_text())
    assert data["schema"] == "fastddpm-bench-ladder-2" and data["complete"] is True
    assert data["environment"]["command"] == ["test"] and data["environment"]["torch"]
    rows = list(csv.DictReader(open(out / "ladder.csv")))
    assert [r["rung"] for r in rows] == RUNG_KEYS
    assert len(list(csv.DictReader(open(out / "mlp.csv")))) == 4
    md = (out / "ladder.md").read_text()
    assert "## DDPM ladder" in md and "## MLP ladder" in md and "% of roofline (binds)" in md
    assert (out / "ladder.png").stat().st_size > 1000  # matplotlib is a dependency: every install draws it
    # the bars name the batch each rung ran (--quick: the seed's 192 / 4), not the seed's
    from fastddpm.bench.ladder_report import rung_label

    rung4 = next(r for r in data["rungs"] if r["rung"] == "4")
    assert rung4["batch_size"] == 48 and rung_label(rung4) == "4\nbatch 48"


def test_rows_are_sane(quick_run):
    _, result = quick_run
    rows = {r["rung"]: r for r in result["rungs"]}
    assert list(rows) == RUNG_KEYS
    for key in ("3", "3b", "8"):  # need CUDA
        assert rows[key]["status"] == "skipped" and "cpu" in rows[key]["reason"]
    assert rows["5"]["status"] == "skipped" and "--quick" in rows["5"]["reason"]
    assert rows[PLANTED]["status"] == "failed" and "planted failure" in rows[PLANTED]["reason"]
    ok = [r for r in result["rungs"] if r["status"] == "ok"]
    assert [r["rung"] for r in ok] == ["0", "1", "4", "6", "7", "9"]  # the ladder went on after the failure
    base = rows["0"]["images_per_s"]
    prev = None
    for r in ok:
        assert r["images_per_s"] > 0 and math.isfinite(r["epoch_s"]) and r["epoch_s"] > 0
        assert math.isfinite(r["warmup_s"]) and r["warmup_s"] >= 0 and r["gpu_busy"] is None
        lo, hi = r["images_per_s_range"]
        assert lo <= r["images_per_s"] <= hi
        # MFU and the roofline beside the throughput: the rung's own model, batch and dtype
        assert r["mfu_dtype"] == "fp32" and 0 < r["mfu_pct"] < 100 and 0 < r["roofline_pct"] <= 100
        assert r["roofline_binds"] in ("compute", "memory") and r["mb_per_image"] > 0
        assert r["epoch_s"] == pytest.approx(result["data"]["num_images"] / r["images_per_s"])
        assert r["speedup_vs_baseline"] == pytest.approx(r["images_per_s"] / base)
        if prev is not None:
            assert r["previous_rung"] == prev["rung"]
            assert r["speedup_vs_previous"] == pytest.approx(r["images_per_s"] / prev["images_per_s"])
        prev = r
    assert rows["4"]["batch_size"] == 3 * rows["0"]["batch_size"]  # 192 / 64, divided alike by --quick


@pytest.mark.parametrize("device_type, before_4", [("cpu", "3b"), ("cuda", "3")])
def test_rung_4_is_compared_with_the_rung_it_builds_on(device_type, before_4):
    """3b (bf16) is the main line on a CPU, where rung 4 is built on it (ladder_rungs.plan), and a branch on a GPU:
    speedup vs previous must divide by the rung the next one carries, not skip it."""
    from fastddpm.bench.ladder import fill_speedups

    rows = [{"rung": key, "status": "ok", "images_per_s": 100.0 * (i + 1)}
            for i, key in enumerate(["2", "3", "3b", "4"])]
    fill_speedups(rows, 60_000, device_type)
    four = rows[-1]
    assert four["previous_rung"] == before_4
    assert four["speedup_vs_previous"] == pytest.approx(400.0 / next(r for r in rows if r["rung"] == before_4)[
        "images_per_s"])


def test_mlp_ladder(quick_run):
    _, result = quick_run
    rows = result["mlp"]["rows"]
    assert [r["rung"] for r in rows] == ["0", "1", "2", "3"]
    for r in rows:
        assert r["status"] == "ok" and r["total_s"] > 0
        assert 0.3 < r["accuracy"] <= 1.0  # 10 classes: chance is 0.1
    assert rows[0]["speedup"] == 1.0
    assert rows[3]["speedup"] == pytest.approx(rows[0]["total_s"] / rows[3]["total_s"])


def test_cli_rejects_bad_flags(capsys):
    assert bench_main(["bench", "ladder", "--preset", "tiny", "--num-images", "10", "--quick"]) == 2
    assert "--num-images" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# bf16 rungs follow the compute capability, not torch.cuda.is_bf16_supported()


@pytest.mark.parametrize("name, capability, native", [("Tesla T4", (7, 5), False),
                                                      ("NVIDIA A100-SXM4-80GB", (8, 0), True)])
def test_bf16_rungs_follow_native_bf16(monkeypatch, name, capability, native):
    import torch

    from fastddpm.config import ConfigError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: True)  # a T4's answer: it counts emulation
    cuda = torch.device("cuda")  # never touched: only its type and the patched queries are read
    plan = {rung.key: (sw, skip) for rung, sw, skip in ladder_rungs.plan(cuda, workers=2, quick=False)}
    assert plan["3"][1] is None and plan["3"][0].precision == "fp16"  # fp16 + GradScaler runs on both
    if native:
        assert plan["3b"][1] is None and plan["8"][1] is None
        assert ladder_rungs.precision_of("bf16", cuda).autocast_dtype == torch.bfloat16
        assert plan["9"][0].precision == "bf16" and plan["9"][0].cuda_graphs  # rung 8's bf16 + graphs carry
    else:
        for key in ("3b", "8"):
            assert plan[key][1].startswith("skipped") and f"{name} is sm75" in plan[key][1] \
                and "emulated" in plan[key][1], plan[key][1]
        # skipped rungs do not carry: rung 9 runs fp16, uncaptured
        assert plan["9"][0].precision == "fp16" and not plan["9"][0].cuda_graphs
        # the ladder's precisions go through the trainer's resolve_precision: no emulated bf16 behind its back
        with pytest.raises(ConfigError, match="emulated"):
            ladder_rungs.precision_of("bf16", cuda)
    assert ladder_rungs.precision_of("fp16", cuda).use_grad_scaler


def test_rung_10_runs_the_layouts_auto_picks_for_the_model_on_a_gpu_and_is_skipped_on_a_cpu():
    """The ladder's top rung is what `fastddpm train` runs: on one GPU, compiled under bf16, auto turns on
    channels_last for the seed U-Net (not the DDPM family), forces Inductor's layout and pads narrow heads to 8."""
    import torch

    from fastddpm.config import get_preset
    from fastddpm.device import resolve_precision
    from fastddpm.trainer.fast_path import FastPath

    bf16 = resolve_precision("bf16", torch.device("cpu"))  # its dtype is what the choice reads
    compiled = FastPath(compile=True, cuda_graphs="capture", channels_last=False, cudnn_benchmark=True, reasons={})
    cuda = torch.device("cuda")  # never touched: only its type is read
    fast, note = ladder_rungs._auto_layout(get_preset("seed-1layer"), compiled, cuda, bf16)
    assert (fast.channels_last, fast.inductor_layout, fast.attention_head_pad) == (True, "channels-last", 8)
    assert fast.compile and fast.cuda_graphs == "capture" and fast.cudnn_benchmark  # the rung's own, kept
    assert note == "auto picks: channels_last on, Inductor layout channels-last, heads padded to 8"
    fast, _ = ladder_rungs._auto_layout(get_preset("ddpm-cifar10"), compiled, cuda, bf16)
    assert not fast.channels_last and fast.inductor_layout == "channels-last"
    eager = dataclasses.replace(compiled, compile=False, cuda_graphs="off")
    fast, _ = ladder_rungs._auto_layout(get_preset("seed-1layer"), eager, cuda, bf16)
    assert (fast.channels_last, fast.inductor_layout) == (False, "heuristic")  # auto needs the compiled step
    plan = {rung.key: (sw, skip) for rung, sw, skip in ladder_rungs.plan(torch.device("cpu"), workers=2, quick=False)}
    assert plan["10"][0].layout and plan["10"][1] == "skipped on cpu: auto picks none of them on a CPU " \
                                                      "(channels_last measured 0.77x there)"


@pytest.mark.parametrize("flags, native", [("avx512f amx_tile amx_bf16", True), ("avx512f avx512_vnni", False)])
def test_cpu_ladder_adds_bf16_where_the_cpu_has_it(monkeypatch, flags, native):
    """Issue 18: on a CPU with native bf16 the ladder runs bf16 autocast (rung 3b) and carries it forward, so the
    later rungs (batch, compile, resident, fused) run in the CPU's fast precision; elsewhere 3b is skipped with
    the reason, and the rest stay fp32. The flags are simulated."""
    import torch

    monkeypatch.setenv("FASTDDPM_CPU_FLAGS", flags)
    plan = {rung.key: (sw, skip) for rung, sw, skip in ladder_rungs.plan(torch.device("cpu"), workers=2, quick=False)}
    assert plan["3"][1].startswith("skipped on cpu") and plan["8"][1].startswith("skipped on cpu")
    if native:
        assert plan["3b"][1] is None and plan["3b"][0].precision == "bf16"
        assert plan["5"][0].precision == "bf16" and plan["5"][0].compile and plan["9"][0].precision == "bf16"
    else:
        assert "bf16 would be emulated" in plan["3b"][1]
        assert plan["5"][0].precision == "fp32" and plan["9"][0].precision == "fp32"


# ---------------------------------------------------------------------------------------------------------------
# GPU busy counts kernels, memcpy and memset only


def test_gpu_busy_counts_work_not_annotation_ranges():
    from fastddpm.bench.ladder import gpu_busy_us

    def ev(cat, ts, dur, name="x"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}

    events = [
        ev("gpu_user_annotation", 0, 1000, "fastddpm::step"),  # spans the idle gap 100..500: not work
        ev("kernel", 0, 100),
        ev("gpu_memcpy", 500, 50, "Memcpy HtoD (Pinned -> Device)"),
        ev("gpu_memset", 540, 30, "Memset (Device)"),  # overlaps the copy: counted once
        ev("kernel", 800, 100), ev("kernel", 850, 100),  # two streams, overlapping: 800..950
        ev("cuda_runtime", 0, 1000, "cudaStreamSynchronize"),  # host-side, not GPU work
        ev("cpu_op", 0, 1000, "aten::mm"),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 300},  # not a duration event
    ]
    assert gpu_busy_us(events) == pytest.approx(100 + 70 + 150)
    assert gpu_busy_us([ev("gpu_user_annotation", 0, 1000)]) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Results written after every rung, and a re-run that skips what is measured


def test_a_killed_ladder_keeps_its_rungs_and_a_rerun_measures_only_the_rest(tmp_path, monkeypatch):
    real = ladder_rungs.prepare_rung
    prepared = []

    def killed_at_rung_4(rung, sw, ctx):
        if rung.key == "4":
            raise KeyboardInterrupt  # a time limit's signal: not an Exception, the ladder does not go on
        prepared.append(rung.key)
        return real(rung, sw, ctx)

    # every batch divided by 12, not --quick's 4 (64 -> 5, 192 -> 16): what is checked is which rungs are measured,
    # kept and reused over the runs, not their numbers
    settings = LadderSettings(**{**QUICK, "repeats": 1, "steps": 1, "batch_divisor": 12}, workers=0, device="cpu",
                              quick=True, mlp=False, rungs=("0", "4", "6"))
    monkeypatch.setattr(ladder_rungs, "prepare_rung", killed_at_rung_4)
    with pytest.raises(KeyboardInterrupt):
        run_ladder(settings, tmp_path, argv=["first"], log=lambda m: None)
    saved = json.loads((tmp_path / "ladder.json").read_text())
    status = {r["rung"]: r["status"] for r in saved["rungs"]}
    assert saved["complete"] is False and status == {"0": "ok", "1": "not run", "2": "not run", "3": "skipped",
                                                     "3b": "skipped"}
    assert [r["rung"] for r in csv.DictReader(open(tmp_path / "ladder.csv"))] == ["0", "1", "2", "3", "3b"]
    # the rungs this command still owes are named; those skipped on this device count as done
    assert ("**Incomplete**: the run was stopped (or is still running) before rung(s) 4, 6; so far 1 measured, "
            "0 failed, 2 skipped on this device.") in (tmp_path / "ladder.md").read_text()

    def counting(rung, sw, ctx):
        prepared.append(rung.key)
        return real(rung, sw, ctx)

    prepared.clear()
    monkeypatch.setattr(ladder_rungs, "prepare_rung", counting)
    lines = []
    result = run_ladder(settings, tmp_path, argv=["second"], log=lines.append)
    assert prepared == ["4", "6"]  # rung 0 was reused
    assert any("rung 0 baseline: already measured" in line for line in lines)
    rows = {r["rung"]: r for r in result["rungs"]}
    assert rows["0"]["run"]["command_line"] == "first" and rows["4"]["run"]["command_line"] == "second"
    assert rows["4"]["speedup_vs_baseline"] == pytest.approx(rows["4"]["images_per_s"] / rows["0"]["images_per_s"])

    # Split over two runs into one folder: --rungs 7 adds rung 7 and keeps 0, 4 and 6 (rung 7, not 9: 9's batch
    # search would take longer than the rest of this test, for nothing that it checks).
    prepared.clear()
    result = run_ladder(LadderSettings(**{**dataclasses.asdict(settings), "rungs": ("7",)}), tmp_path,
                        argv=["third"], log=lambda m: None)
    assert prepared == ["7"]
    assert [r["rung"] for r in result["rungs"] if r["status"] == "ok"] == ["0", "4", "6", "7"]
    assert {r["run"]["command_line"] for r in result["rungs"] if r["status"] == "ok"} == {"first", "second", "third"}


def test_rungs_flag_rejects_unknown_keys(capsys):
    assert bench_main(["bench", "ladder", "--quick", "--device", "cpu", "--rungs", "0,3c"]) == 2
    assert "unknown rung(s) 3c" in capsys.readouterr().err


def test_the_gpu_summary_reads_this_runs_files(quick_run, tmp_path):
    """benchmarks/summarize_gpu.py turns the file this command writes into a RESULTS.md table."""
    import importlib.util
    import shutil
    from pathlib import Path

    out, result = quick_run
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "summarize_gpu.py"
    spec = importlib.util.spec_from_file_location("summarize_gpu", path)
    summarize_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize_gpu)
    shutil.copytree(out, tmp_path / "ladder")
    md = "\n".join(summarize_gpu.section_ladder(tmp_path, summarize_gpu.Calls(tmp_path)))
    assert "Measured " in md and "`test`" in md and result["data"]["fingerprint"] in md
    assert "| 0 | baseline |" in md and "MLP ladder" in md


def test_images_per_s_counts_the_short_batch_at_an_epochs_end(tmp_path):
    """Rung 0's DataLoader keeps the ragged last batch (no drop_last): 56 images in batches of 16 are 16, 16, 16, 8.
    A repeat of 4 steps after 1 warm-up step trains 16 + 16 + 8 + 16 = 56 images, not 4 x 16."""
    settings = LadderSettings(**{**QUICK, "num_images": 56, "repeats": 1, "steps": 4, "warmup_steps": 1},
                              workers=0, device="cpu", quick=True, mlp=False, rungs=("0",))
    result = run_ladder(settings, tmp_path, argv=["test"], log=lambda m: None)
    row = next(r for r in result["rungs"] if r["rung"] == "0")
    assert row["status"] == "ok" and row["batch_size"] == 16
    repeat_s = row["step_ms"]["per_repeat"][0] * settings.steps / 1000
    assert row["images_per_s"] * repeat_s == pytest.approx(56)
    assert row["epoch_s"] == pytest.approx(56 / row["images_per_s"])


@pytest.mark.parametrize("field, value", [("mlp_train_images", 63), ("mlp_test_images", 0)])
def test_an_mlp_ladder_too_small_to_train_one_batch_is_refused_up_front(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value}"):
        LadderSettings(**{**QUICK, field: value}, device="cpu", quick=True)
    LadderSettings(**{**QUICK, field: value}, device="cpu", quick=True, mlp=False)  # no MLP ladder: nothing to train


def test_a_rung_over_the_measured_peak_says_the_peak_was_measured_low(tmp_path, monkeypatch):
    from fastddpm import measure

    def low_peak(device, dtype, **kw):
        return {"tflops": 1e-6, "dtype": "fp32", "label": "planted: measured under load"}

    monkeypatch.setattr(measure, "measure_matmul_peak", low_peak)
    settings = LadderSettings(**{**QUICK, "repeats": 1, "steps": 1, "batch_divisor": 12}, workers=0, device="cpu",
                              quick=True, mlp=False, rungs=("6",))  # batch 16: over the planted peak at any batch
    row = next(r for r in run_ladder(settings, tmp_path, argv=["test"], log=lambda m: None)["rungs"]
               if r["rung"] == "6")
    assert row["mfu_pct"] > 100
    assert any("is over 100%" in n for n in row["notes"])
    assert "is over 100%" in (tmp_path / "ladder.md").read_text()


def test_a_failed_rows_message_is_one_table_cell_in_both_ladder_tables():
    from fastddpm.bench.ladder_report import mlp_table_markdown, table_markdown

    error = "RuntimeError: shapes (64|128) and (32|10)\nTraceback line two"
    mlp = mlp_table_markdown([{"name": "compile", "status": "failed", "error": error, "rung": "3"}]).splitlines()[-1]
    ddpm = table_markdown([{"rung": "5", "title": "compile", "status": "failed", "reason": error}]).splitlines()[-1]
    for row, columns in ((mlp, 5), (ddpm, 15)):
        # a markdown row splits at unescaped pipes only: the message stays in the status column, its first line
        assert len(re.split(r"(?<!\\)\|", row)) == columns + 2, row
        assert "(64\\|128)" in row and "Traceback" not in row
