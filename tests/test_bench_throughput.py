"""`fastddpm bench throughput`: the --quick run end to end on the CPU, failure isolation, and the FLOP counter
pinned to the numbers in CONTEXT.md (3.2 / 5.8 GFLOP per training image for the seed U-Nets)."""

import argparse
import dataclasses
import json
import math
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fastddpm.bench.cli import add_bench_parser, run_bench
from fastddpm.bench.throughput import QUICK, ThroughputSettings, run_throughput
from fastddpm.bench.throughput_report import TABLE_HEADER
from fastddpm.config import ConfigError, get_preset
from fastddpm.diffusion import diffusion_loss, schedule_from_config
from fastddpm import measure
from fastddpm.measure import count_step_flops, environment_record, summarize, time_steps
from fastddpm.models import UNet


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastddpm")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _model(preset: str) -> UNet:
    cfg = get_preset(preset)
    return UNet(dataclasses.replace(cfg.model, image_channels=1, image_size=28))


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """One `fastddpm bench throughput --quick --device cpu` through the parser and run_bench."""
    out = tmp_path_factory.mktemp("bench") / "quick"
    args = _parser().parse_args(["bench", "throughput", "--quick", "--device", "cpu", "--out", str(out)])
    assert run_bench(args) == 0
    return out, json.loads((out / "throughput.json").read_text())


def test_quick_run_json_holds_one_sane_row_per_variant(quick_run):
    _, result = quick_run
    rows = result["results"]
    assert [(r["preset"], r["batch_size"]) for r in rows] == [("tiny", 8), ("tiny", 16)]
    assert result["complete"] is True and list(result["peaks"]) == ["fp32"]  # one peak, shared by both variants
    peak_tflops = result["peaks"]["fp32"]["tflops"]
    assert peak_tflops > 0 and "fp32" in result["peaks"]["fp32"]["label"]
    for r in rows:
        assert r["mfu_dtype"] == "fp32" and r["mfu_peak_tflops"] == peak_tflops
        assert r["status"] == "ok", r["error"]
        s = r["step_ms"]
        assert all(math.isfinite(s[k]) for k in ("min", "median", "max"))
        assert 0 < s["min"] <= s["median"] <= s["max"]
        assert len(s["per_repeat"]) == QUICK["repeats"]
        assert r["images_per_s"] > 0
        assert r["images_per_s"] == pytest.approx(r["batch_size"] / (s["median"] / 1000))
        assert r["compile_s"] >= 0
        assert r["flops_per_step"] > 0
        assert 0 < r["mfu_pct"] <= 100
        # MFU is exactly counted FLOPs / median step time / the peak measured in this run.
        assert r["mfu_pct"] == pytest.approx(100 * r["flops_per_step"] / (s["median"] / 1000) / (peak_tflops * 1e12))
        assert 0 <= r["input_wait_pct"] < 100
        assert r["peak_memory_bytes"] is None  # CPU: no allocator counter, reported as n/a
        assert r["recompiles_after_warmup"] is None  # compile is off on the CPU (auto)
        assert r["precision"] == "fp32" and r["data_placement"] == "device"
    assert rows[0]["ratio_to_first"] == 1.0
    assert rows[1]["ratio_to_first"] == pytest.approx(rows[1]["images_per_s"] / rows[0]["images_per_s"])


def test_quick_run_reports_each_variant_against_its_roofline(quick_run):
    """Beside MFU, the roofline: the bytes an image's step moves at least (activations saved and read back, the
    update's passes over the parameters), the bandwidth measured in the run, and images/s as a share of the
    bound max(FLOPs / peak, bytes / bandwidth)."""
    out, result = quick_run
    for r in result["results"]:
        flops_s = r["flops_per_step"] / r["batch_size"] / (r["mfu_peak_tflops"] * 1e12)
        bytes_s = r["mb_per_image"] * 1e6 / (r["bandwidth_gbps"] * 1e9)
        assert r["activation_bytes_per_image"] > 0 and r["bandwidth_gbps"] > 0
        assert r["bound_us_per_image"] == pytest.approx(1e6 * max(flops_s, bytes_s))
        assert r["roofline_binds"] == ("compute" if flops_s >= bytes_s else "memory")
        assert r["roofline_pct"] == pytest.approx(r["images_per_s"] * r["bound_us_per_image"] / 1e4)
        assert 0 < r["roofline_pct"] <= 100
    md = (out / "throughput.md").read_text()
    assert "% of roofline (binds)" in md and "memory bandwidth for the roofline" in md


def test_quick_run_records_environment_and_settings(quick_run):
    _, result = quick_run
    env = result["environment"]
    assert env["torch"] == torch.__version__
    assert env["command"] and isinstance(env["command"], list)
    assert env["device"] == "cpu" and env["python"] and env["fastddpm"]
    assert env["git_commit"] == "unknown" or len(env["git_commit"]) == 40
    assert env["date_utc"].endswith("+00:00")
    settings = result["settings"]
    assert settings["quick"] is True and settings["presets"] == ["tiny"] and settings["batch_sizes"] == [8, 16]
    assert (settings["warmup_steps"], settings["steps"], settings["repeats"]) == (2, 3, 2)
    assert any("not GPU claims" in n for n in result["notes"])


def test_quick_run_flops_match_an_independent_count(quick_run):
    """The step FLOPs the benchmark used equal a FlopCounterMode count of a real forward+backward of the loss on
    CPU tensors, and are 3x the forward (backward = 2x forward for matmuls and convolutions)."""
    _, result = quick_run
    model = _model("tiny")
    schedule = schedule_from_config(get_preset("tiny").diffusion)
    B = 2
    x0 = torch.rand(B, 1, 28, 28) * 2 - 1
    t = torch.randint(0, 1000, (B,))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fwd_counter:
        model(x0, t)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as step_counter:
        diffusion_loss(model, schedule, "epsilon", x0, t, torch.randn_like(x0)).backward()
    per_image = step_counter.get_total_flops() / B
    assert step_counter.get_total_flops() == pytest.approx(3 * fwd_counter.get_total_flops(), rel=0.10)
    for r in result["results"]:
        assert r["flops_per_step"] == pytest.approx(per_image * r["batch_size"], rel=0.01)


def test_quick_run_markdown_has_the_table(quick_run):
    out, _ = quick_run
    md = (out / "throughput.md").read_text()
    assert TABLE_HEADER in md
    for name in ("preset", "batch", "images/s", "step ms median [min-max]", "compile s", "MFU % (peak dtype)",
                 "peak mem GiB", "recompiles", "input wait %"):
        assert f" {name} |" in TABLE_HEADER
    rows = [line for line in md.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2
    assert rows[0].startswith("| tiny | 8 |") and rows[1].startswith("| tiny | 16 |")
    assert all(" (fp32) |" in line for line in rows)  # the MFU names its peak's dtype
    assert all(line.count("|") == TABLE_HEADER.count("|") for line in rows)
    # nothing compiled on this CPU: the warm-up's time is no compile time, and the table does not call it one
    assert all(not r["fast_path"]["compile"].startswith("on") for r in json.loads(
        (out / "throughput.json").read_text())["results"])
    column = [c.strip() for c in TABLE_HEADER.split("|")].index("compile s")
    assert [line.split("|")[column].strip() for line in rows] == ["-", "-"]
    # each variant's line names the layout and head padding it ran, which the table does not show
    per_variant = [line for line in md.splitlines() if line.startswith("- tiny")]
    assert len(per_variant) == 2 and all("; inductor layout heuristic (" in line and "; head pad " in line
                                         for line in per_variant)


def test_the_help_names_every_column_of_the_table(capsys):
    from fastddpm.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    columns = [c.strip() for c in TABLE_HEADER.split("|") if c.strip()]
    assert [c for c in columns if f"| {c} |" not in text.replace("| |", "|")] == []


def test_a_failing_variant_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    from fastddpm.trainer import build
    from fastddpm.trainer.step import TrainStep

    class OOMAtBatch8(TrainStep):
        def __call__(self, batches, *, lr, step):
            if batches[0].x0.shape[0] == 8:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (planted)")
            return super().__call__(batches, lr=lr, step=step)

    monkeypatch.setattr(build, "TrainStep", OOMAtBatch8)  # the builder the benchmark shares with the trainer
    lines = []
    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(8, 4), warmup_steps=1, steps=1, repeats=1,
                                  device="cpu", num_images=64)
    result = run_throughput(settings, tmp_path, log=lines.append)
    failed, ok = result["results"]
    assert failed["batch_size"] == 8 and failed["status"] == "failed"
    assert failed["error_type"] == "out of memory"
    assert "OutOfMemoryError" in failed["error"] and "planted" in failed["error"]
    assert failed["images_per_s"] is None and failed["mfu_pct"] is None
    assert ok["batch_size"] == 4 and ok["status"] == "ok" and ok["images_per_s"] > 0
    assert ok["ratio_to_first"] == 1.0  # relative to the first variant that ran
    assert any("tiny batch 8: FAILED" in line for line in lines)
    md = (tmp_path / "throughput.md").read_text()
    assert any(line.startswith("| tiny | 8 | failed |") for line in md.splitlines())
    assert "## Failed variants" in md and "planted" in md
    assert json.loads((tmp_path / "throughput.json").read_text())["results"][0]["status"] == "failed"


def test_streamed_placement_runs_from_a_memmap(tmp_path):
    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(4,), warmup_steps=1, steps=2, repeats=1,
                                  data_placement="stream", device="cpu", num_images=64)
    (row,) = run_throughput(settings, tmp_path, log=lambda line: None)["results"]
    assert row["status"] == "ok", row["error"]
    assert row["data_placement"] == "stream" and row["images_per_s"] > 0


@pytest.mark.parametrize("preset, gflop_per_image", [("seed-1layer", 3.2), ("seed-2layer", 5.8)])
def test_step_flops_of_the_seed_unets_match_context(preset, gflop_per_image):
    """CONTEXT.md: ~3.2 GFLOP per training image (one-layer seed U-Net), ~5.8 (public default)."""
    model = _model(preset)
    flops_1 = count_step_flops(model, (1, 1, 28, 28))
    assert flops_1 / 1e9 == pytest.approx(gflop_per_image, rel=0.15)
    assert count_step_flops(model, (4, 1, 28, 28)) == 4 * flops_1  # linear in the batch
    assert count_step_flops(model, (4, 1, 28, 28), accum_steps=3) == 12 * flops_1
    assert next(model.parameters()).device.type == "cpu"  # counted on a meta copy: the model is untouched


def test_time_steps_calls_fn_once_per_step_and_times_them():
    calls = []
    ms = time_steps(lambda i: (calls.append(i), time.sleep(0.005)), 3, "cpu")
    assert calls == [0, 1, 2]
    assert ms >= 15
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "q1": 1.5, "q3": 2.5, "n": 3}


def test_environment_record_names_the_command():
    env = environment_record("cpu", ["fastddpm", "bench", "throughput", "--quick"])
    assert env["command_line"] == "fastddpm bench throughput --quick"
    assert env["torch"] == torch.__version__ and env["cuda_driver"] is None


def test_cli_help_and_user_errors(capsys):
    parser = _parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "throughput", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "examples:" in help_text and "fastddpm bench throughput --quick" in help_text
    for flag in ("--presets", "--batch-sizes", "--warmup-steps", "--steps", "--repeats", "--precision", "--compile",
                 "--cuda-graphs", "--data-placement", "--device", "--quick", "--out"):
        assert flag in help_text
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "throughput", "--batch-sizes", "64,0"])
    assert e.value.code == 2
    # Config errors fail before anything is timed, with the fix in the message.
    args = parser.parse_args(["bench", "throughput", "--presets", "seed-1layr", "--device", "cpu"])
    assert run_bench(args) == 2
    assert "did you mean 'seed-1layer'" in capsys.readouterr().err
    args = parser.parse_args(["bench", "throughput", "--quick", "--cuda-graphs", "capture", "--device", "cpu"])
    assert run_bench(args) == 2
    assert "cuda_graphs=capture needs a CUDA device" in capsys.readouterr().err


def test_quick_flags_yield_to_explicit_ones():
    from fastddpm.bench.cli import throughput_settings

    args = _parser().parse_args(["bench", "throughput", "--quick", "--batch-sizes", "4", "--repeats", "3"])
    s = throughput_settings(args)
    assert (s.presets, s.batch_sizes, s.warmup_steps, s.steps, s.repeats) == (("tiny",), (4,), 2, 3, 3)
    full = throughput_settings(_parser().parse_args(["bench", "throughput"]))
    gpu = full.for_device(torch.device("cuda"))
    assert gpu.presets == ("seed-1layer", "seed-2layer") and gpu.batch_sizes == (64, 192, 512, 1024)
    assert gpu.choices == ()
    cpu = full.for_device(torch.device("cpu"))  # every CPU choice side by side, on the quickstart's model
    assert cpu.presets == ("cpu-demo",) and cpu.batch_sizes == (64,)
    assert cpu.choices == ("fp32-eager", "bf16-eager", "bf16-compile", "fp32-compile", "bf16-eager-cl")
    assert s.choices == ()  # --quick: one variant per preset and batch
    named = throughput_settings(_parser().parse_args(["bench", "throughput", "--presets", "tiny"]))
    assert named.for_device(torch.device("cpu")).choices == ()  # presets named: one variant each
    # the synthetic images take the presets' shape: CIFAR-10's for ddpm-cifar10
    cifar = throughput_settings(_parser().parse_args(["bench", "throughput", "--presets", "ddpm-cifar10", "--quick"]))
    assert cifar.for_device(torch.device("cpu")).image_shape == (3, 32, 32)
    assert gpu.image_shape == (1, 28, 28)
    with pytest.raises(ConfigError, match="differently shaped images"):
        ThroughputSettings(presets=("seed-1layer", "ddpm-cifar10")).for_device(torch.device("cuda"))


def test_choices_run_side_by_side_each_in_its_own_precision_and_mode(tmp_path):
    """--choices: each preset and batch runs every choice, with that choice's precision and compile setting, and
    `x first` compares the choices of one preset and batch."""
    from fastddpm.bench.throughput import ThroughputSettings, run_throughput

    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(2, 4), choices=("fp32-eager", "bf16-eager-cl"),
                                  warmup_steps=1, steps=1, repeats=1, device="cpu", num_images=64)
    result = run_throughput(settings, tmp_path, log=lambda *a: None)
    rows = result["results"]
    assert [(r["batch_size"], r["choice"], r["precision"]) for r in rows] == [
        (2, "fp32-eager", "fp32"), (2, "bf16-eager-cl", "bf16"),
        (4, "fp32-eager", "fp32"), (4, "bf16-eager-cl", "bf16")]
    assert all(r["status"] == "ok" and r["fast_path"]["compile"].startswith("off") for r in rows)
    assert (rows[1]["fast_path"]["channels_last"].startswith("on")
            and rows[0]["fast_path"]["channels_last"].startswith("off"))
    assert rows[0]["ratio_to_first"] == 1.0 and rows[2]["ratio_to_first"] == 1.0  # each batch against its first
    assert rows[1]["ratio_to_first"] == pytest.approx(rows[1]["images_per_s"] / rows[0]["images_per_s"])
    md = (tmp_path / "throughput.md").read_text()
    assert "| preset | batch | choice | images/s |" in md and "| tiny | 4 | bf16-eager-cl |" in md
    with pytest.raises(ConfigError, match="not PRECISION-MODE"):
        ThroughputSettings(choices=("bf16-fast",))
    from fastddpm.bench.throughput import parse_choice

    assert parse_choice("bf16-compile-gc")["train.grad_checkpointing"] is True  # memory saved vs time
    assert parse_choice("fp32-eager-cl-gc")["train.channels_last"] == "on"
    assert parse_choice("auto-compile-cl-ma")["train.compile_mode"] == "max-autotune"
    assert parse_choice("auto-compile")["train.compile_mode"] == "default"
    with pytest.raises(ConfigError, match="not with eager"):
        parse_choice("bf16-eager-ma")  # max-autotune is a mode of the compiler
    lo = parse_choice("auto-compile-cl-lo")
    assert lo["train.inductor_layout"] == "channels-last" and lo["train.channels_last"] == "on"
    # every choice names its layout, so a row keeps its meaning whatever auto picks on the device
    assert parse_choice("auto-compile-cl")["train.inductor_layout"] == "heuristic"
    assert parse_choice("bf16-eager-cl")["train.inductor_layout"] == "auto"  # no compiler: nothing to lay out
    with pytest.raises(ConfigError, match="not with eager"):
        parse_choice("bf16-eager-lo")  # the layout of the compiler's own tensors


def test_choices_are_timed_alternating_with_the_order_rotated_each_round(tmp_path, monkeypatch):
    """Each choice is warmed up once, then the repeats go round the choices, each round starting one further on:
    slow drift (clocks, a noisy neighbour) lands on every choice alike."""
    monkeypatch.setattr(measure, "measure_matmul_peak", _fake_peak([]))  # the peaks are not the point here
    from fastddpm.bench import variant_timer

    events = []
    real_init, real_repeat = variant_timer.VariantTimer.__init__, variant_timer.VariantTimer.time_repeat

    def init(self, v, *a, **kw):
        events.append(("warm", v.choice))
        real_init(self, v, *a, **kw)

    def repeat(self):
        events.append(("time", self.v.choice))
        real_repeat(self)

    monkeypatch.setattr(variant_timer.VariantTimer, "__init__", init)
    monkeypatch.setattr(variant_timer.VariantTimer, "time_repeat", repeat)
    choices = ("fp32-eager", "fp32-eager-cl", "bf16-eager")
    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(4,), choices=choices, warmup_steps=1, steps=1,
                                  repeats=3, device="cpu", num_images=64)
    rows = run_throughput(settings, tmp_path, log=lambda *a: None)["results"]
    a, b, c = choices
    assert events == [("warm", a), ("warm", b), ("warm", c),
                      ("time", a), ("time", b), ("time", c),
                      ("time", b), ("time", c), ("time", a),
                      ("time", c), ("time", a), ("time", b)]
    assert [r["choice"] for r in rows] == list(choices) and all(r["status"] == "ok" for r in rows)
    assert all(r["timing"] == "alternating" and len(r["step_ms"]["per_repeat"]) == 3 for r in rows)
    assert rows[0]["alternated_with"] == [b, c]
    assert rows[0]["peak_memory_bytes"] is None  # a CPU run has no device-memory counter
    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert any("timed alternating" in n for n in saved["notes"])


def test_a_choice_that_fails_or_does_not_fit_leaves_the_others_alternating(tmp_path, monkeypatch):
    """A choice that fails while warming up is a failed row; one that does not fit beside the others (GPU memory)
    is timed alone after them; the rest still alternate."""
    monkeypatch.setattr(measure, "measure_matmul_peak", _fake_peak([]))  # the peaks are not the point here
    from fastddpm.bench import variant_timer
    from fastddpm.trainer import build
    from fastddpm.trainer.step import TrainStep

    class OOMInBf16(TrainStep):
        def __call__(self, batches, *, lr, step):
            if self.precision.name == "bf16":
                raise torch.OutOfMemoryError("CUDA out of memory (planted)")
            return super().__call__(batches, lr=lr, step=step)

    monkeypatch.setattr(build, "TrainStep", OOMInBf16)
    prepared = []
    monkeypatch.setattr(variant_timer, "_room_for_another", lambda timers, device: (prepared.append(len(timers))
                                                                                    or len(timers) < 2))
    choices = ("fp32-eager", "bf16-eager", "fp32-eager-cl", "auto-eager-cl")
    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(4,), choices=choices, warmup_steps=1, steps=1,
                                  repeats=2, device="cpu", precision="fp32", num_images=64)
    lines = []
    rows = run_throughput(settings, tmp_path, log=lines.append)["results"]
    assert [r["choice"] for r in rows] == list(choices)
    assert rows[1]["status"] == "failed" and rows[1]["error_type"] == "out of memory"
    assert rows[0]["timing"] == rows[2]["timing"] == "alternating"
    assert rows[0]["alternated_with"] == ["fp32-eager-cl"]
    assert rows[3]["status"] == "ok" and rows[3]["timing"] == "sequential"  # did not fit: timed alone
    assert any("auto-eager-cl: timed one by one after the others" in line for line in lines)


def test_a_group_with_a_choice_left_to_measure_is_measured_again_whole(tmp_path, monkeypatch):
    """A re-run with a choice never measured (the first call was cut short before it) measures its whole group
    again, alternating: a ratio to the group's first choice never divides rows of two runs. A choice that failed
    before is tried again alone (a failure that repeats must not cost the group every call)."""
    monkeypatch.setattr(measure, "measure_matmul_peak", _fake_peak([]))
    from fastddpm.bench import variant_timer
    from fastddpm.trainer import build
    from fastddpm.trainer.step import TrainStep

    real_step = build.TrainStep

    class FailsInBf16(TrainStep):
        def __call__(self, batches, *, lr, step):
            if self.precision.name == "bf16":
                raise RuntimeError("planted failure")
            return super().__call__(batches, lr=lr, step=step)

    warmed = []
    real_init = variant_timer.VariantTimer.__init__

    def init(self, v, *a, **kw):
        warmed.append(v.choice)
        real_init(self, v, *a, **kw)

    monkeypatch.setattr(variant_timer.VariantTimer, "__init__", init)
    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(4,), choices=("fp32-eager", "bf16-eager"),
                                  warmup_steps=1, steps=1, repeats=2, device="cpu", num_images=64)
    monkeypatch.setattr(build, "TrainStep", FailsInBf16)
    first = run_throughput(settings, tmp_path, log=lambda *a: None)["results"]
    assert [r["status"] for r in first] == ["ok", "failed"]
    warmed.clear()
    run_throughput(settings, tmp_path, log=lambda *a: None)  # it fails again: tried alone, fp32 reused
    assert warmed == ["bf16-eager"]
    monkeypatch.setattr(build, "TrainStep", real_step)
    warmed.clear()
    lines = []
    wider = dataclasses.replace(settings, choices=("fp32-eager", "bf16-eager", "fp32-eager-cl"))  # one never measured
    again = run_throughput(wider, tmp_path, log=lines.append)["results"]
    assert warmed == ["fp32-eager", "bf16-eager", "fp32-eager-cl"]  # all three, not the new one alone
    assert all(r["status"] == "ok" and r["timing"] == "alternating" for r in again)
    assert len({json.dumps(r["run"], sort_keys=True) for r in again}) == 1
    assert any("measuring the whole group again" in line for line in lines)


def test_room_for_another_compares_the_largest_footprint_with_what_cuda_has_free(monkeypatch):
    from fastddpm.bench.variant_timer import _room_for_another

    class Prepared:
        def __init__(self, peak_bytes):
            self.peak_bytes = peak_bytes

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gib)
    cuda = torch.device("cuda", 0)
    assert _room_for_another([Prepared(5 * gib), Prepared(9 * gib)], cuda)  # 12 GiB free or cached > 1.2 x 9
    assert not _room_for_another([Prepared(11 * gib)], cuda)  # 13.2 GiB needed
    assert _room_for_another([], cuda) and _room_for_another([Prepared(99 * gib)], torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------------
# MFU against a peak in the step's own dtype


def _fake_peak(calls: list, tflops: float = 0.5):
    """A measure_matmul_peak that records the dtype it was asked for and returns a fixed peak."""
    from fastddpm.measure import matmul_dtype_name

    def fake(device, *, dtype=None, **kw):
        calls.append(dtype)
        name = matmul_dtype_name(dtype, torch.device(device)) if dtype is not None else "bf16 (the old default)"
        return {"tflops": tflops, "label": f"fake {name}", "device": str(device), "dtype": name}

    return fake


@pytest.mark.parametrize("precision, dtype, name", [("bf16", torch.bfloat16, "bf16"), ("fp32", torch.float32, "fp32")])
def test_mfu_divides_by_the_peak_of_the_steps_own_dtype(tmp_path, monkeypatch, precision, dtype, name):
    calls = []
    monkeypatch.setattr(measure, "measure_matmul_peak", _fake_peak(calls, tflops=0.5))
    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(4, 8), warmup_steps=1, steps=1, repeats=1,
                                  precision=precision, device="cpu", num_images=64)
    result = run_throughput(settings, tmp_path, log=lambda line: None)
    assert calls == [dtype]  # one peak per dtype, measured once and shared by both variants
    assert list(result["peaks"]) == [name]
    for r in result["results"]:
        assert r["status"] == "ok", r["error"]
        assert r["precision"] == precision and r["mfu_dtype"] == name and r["mfu_peak_tflops"] == 0.5
        assert r["mfu_pct"] == pytest.approx(100 * r["flops_per_step"] / (r["step_ms"]["median"] / 1000) / 0.5e12)
    md = (tmp_path / "throughput.md").read_text()
    assert f"peak for MFU ({name}): 0.500 TFLOP/s (fake {name})" in md
    assert all(f" ({name}) |" in line for line in md.splitlines() if line.startswith("| tiny |"))


def test_fp32_on_cuda_is_measured_and_labelled_as_tf32_when_training_allows_it(monkeypatch):
    """Training turns TF32 on for fp32 matmuls, so an fp32 run's peak on CUDA is an fp32 matmul run as TF32."""
    from fastddpm.bench import throughput
    from fastddpm.device import Precision
    from fastddpm.measure import matmul_dtype_name

    cuda = torch.device("cuda")  # never touched: the peak is faked
    calls = []
    monkeypatch.setattr(measure, "measure_matmul_peak", _fake_peak(calls))
    before = torch.backends.cuda.matmul.allow_tf32  # a module with its own __setattr__: set and restore by hand
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        peaks = measure.Peaks(cuda, log=lambda line: None)
        fp32, fp16 = (throughput.peak_dtype(Precision(n, d, s, "test")) for n, d, s in (("fp32", None, False),
                                                                                        ("fp16", torch.float16, True)))
        assert peaks.matmul(fp32)["dtype"] == "tf32"
        assert peaks.matmul(fp16)["dtype"] == "fp16"
        assert peaks.matmul(fp32)["dtype"] == "tf32"  # cached, not measured again
        assert calls == [torch.float32, torch.float16]
        torch.backends.cuda.matmul.allow_tf32 = False
        assert matmul_dtype_name(torch.float32, cuda) == "fp32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert matmul_dtype_name(torch.float32, torch.device("cpu")) == "fp32"
    assert matmul_dtype_name(torch.bfloat16, cuda) == "bf16"


def test_measure_matmul_peak_measures_in_the_dtype_asked():
    from fastddpm.measure import measure_matmul_peak

    peak = measure_matmul_peak("cpu", dtype=torch.bfloat16, n=64, trials=1, iters=1)
    assert peak["dtype"] == "bf16" and "bf16 " in peak["label"] and peak["tflops"] > 0


def test_the_cpu_peak_is_the_faster_of_blas_and_a_onednn_convolution(monkeypatch):
    """MKL's sgemm runs an AMD CPU's fp32 matmul on AVX2 at under half oneDNN's rate, and a peak read off it put an
    fp32 U-Net (oneDNN convolutions) above 100% MFU: the CPU peak is the faster kernel, named, with its FLOPs
    counted as FlopCounterMode counts the model's."""
    from torch.utils.flop_counter import FlopCounterMode

    from fastddpm import measure

    fn, flops = measure.conv3x3_peak_case(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        out = fn(0)
    assert counter.get_total_flops() == flops and out.shape == measure.CONV_PEAK_SHAPE

    n = 32
    for slow, fast in (("conv3x3 (oneDNN)", f"matmul {n}^3"), (f"matmul {n}^3", "conv3x3 (oneDNN)")):
        def fake_time(fn, steps, device, slow=slow):  # the slow kernel at 1 TFLOP/s, the fast one at 4
            is_conv = fn(0).dim() == 4
            tflops = 1.0 if (slow == "conv3x3 (oneDNN)") == is_conv else 4.0
            return 1000 * steps * (flops if is_conv else 2 * n**3) / (tflops * 1e12)

        monkeypatch.setattr(measure, "time_steps", fake_time)
        peak = measure.measure_matmul_peak("cpu", dtype=torch.float32, n=n, trials=2, iters=1)
        assert peak["path"] == fast and f"fp32 {fast} on " in peak["label"] and f"; {slow} 1.000" in peak["label"]
        assert peak["tflops"] == pytest.approx(4.0)


def test_an_emulated_cpu_dtype_is_measured_small_and_the_doctor_says_which_is(monkeypatch):
    """bf16 on a CPU without avx512_bf16/amx_bf16 runs its matmuls at 1-2 GFLOP/s: at n = 1024 its peak took 25 s of
    every doctor run on an fp32 loop. A dtype the caller calls emulated (and fp16) is measured at n = 256 with a
    2-image convolution; the doctor's low-precision check calls bf16 emulated exactly where the flags lack it."""
    from fastddpm import measure
    from fastddpm.device import cpu_native_bf16
    from fastddpm.doctor import api

    batches, real_conv = [], measure.conv3x3_peak_case
    monkeypatch.setattr(measure, "conv3x3_peak_case",
                        lambda *a, batch=None: batches.append(batch) or real_conv(*a, batch=batch))
    monkeypatch.setattr(measure, "time_steps", lambda fn, steps, device: 1.0)  # the warm-ups run, timing is faked
    sizes = [measure.measure_matmul_peak("cpu", dtype=dt, trials=1, iters=1, emulated=emulated)["n"]
             for dt, emulated in ((torch.float32, True), (torch.float32, False), (torch.float16, False))]
    assert sizes == [256, 1024, 256] and batches == [2, None, 2]
    small, small_flops = real_conv(torch.float32, torch.device("cpu"), torch.Generator(), batch=2)
    _, full_flops = real_conv(torch.float32, torch.device("cpu"), torch.Generator())
    assert small(0).shape[0] == 2 and small_flops * 8 == full_flops

    asked = []
    monkeypatch.setattr(measure, "measure_matmul_peak",
                        lambda device, dtype, emulated=False: asked.append((dtype, emulated)) or {"tflops": 1.0})
    native, _ = cpu_native_bf16()
    low = api.low_precision("cpu", fp32_peak={"tflops": 2.0})
    assert asked == [(torch.bfloat16, not native)] and low.native == native and low.peak_ratio == 0.5


# ---------------------------------------------------------------------------------------------------------------
# Results written after every variant, and a re-run that skips what is measured


def test_a_killed_run_keeps_its_first_variant_and_a_rerun_measures_only_the_rest(tmp_path, monkeypatch):
    from fastddpm.bench import throughput

    monkeypatch.setattr(measure, "measure_matmul_peak", _fake_peak([]))
    real = throughput.measure_variant
    measured = []

    def killed_at_the_second(v, *a, **kw):
        if measured:
            raise KeyboardInterrupt  # what a time limit's signal looks like from inside: not an Exception
        measured.append(v.batch_size)
        return real(v, *a, **kw)

    settings = ThroughputSettings(presets=("tiny",), batch_sizes=(4, 8), warmup_steps=1, steps=1, repeats=1,
                                  device="cpu", num_images=64)
    monkeypatch.setattr(throughput, "measure_variant", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        run_throughput(settings, tmp_path, log=lambda line: None)
    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert saved["complete"] is False and [r["batch_size"] for r in saved["results"]] == [4]
    assert saved["results"][0]["status"] == "ok"
    assert "Incomplete" in (tmp_path / "throughput.md").read_text()
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic writes left no temporary file behind

    def counting(v, *a, **kw):
        measured.append(v.batch_size)
        return real(v, *a, **kw)

    measured.clear()
    monkeypatch.setattr(throughput, "measure_variant", counting)
    lines = []
    result = run_throughput(settings, tmp_path, log=lines.append)
    assert measured == [8]  # batch 4 was reused, not measured again
    assert any("tiny batch 4: already measured" in line for line in lines)
    assert [r["batch_size"] for r in result["results"]] == [4, 8] and result["complete"] is True
    assert result["results"][0] == saved["results"][0] | {"ratio_to_first": 1.0}
    assert len(result["runs"]) == 2  # both runs are named as the rows' provenance

    # Other timing settings: nothing matches, everything is measured again (and the old file is kept aside).
    measured.clear()
    run_throughput(dataclasses.replace(settings, steps=2), tmp_path, log=lambda line: None)
    assert measured == [4, 8] and (tmp_path / "throughput.replaced.json").is_file()
    # --remeasure: the same settings, measured again.
    measured.clear()
    run_throughput(dataclasses.replace(settings, steps=2, remeasure=True), tmp_path, log=lambda line: None)
    assert measured == [4, 8]


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
    shutil.copytree(out, tmp_path / "throughput-tiny")
    md = "\n".join(summarize_gpu.section_throughput(tmp_path, summarize_gpu.Calls(tmp_path)))
    assert "### Throughput: tiny" in md and result["environment"]["command_line"] in md
    assert f"torch {torch.__version__}" in md and "| tiny | 8 |" in md and "(fp32) |" in md


def test_a_share_over_100_percent_is_flagged_where_it_is_printed(quick_run):
    """An MFU over 100% says the peak was measured low (under load): the progress line and the report say so; a
    sane row carries no warning."""
    from fastddpm.bench.throughput_report import progress_line, report_markdown

    _, result = quick_run
    sane = result["results"][0]
    assert "WARNING" not in progress_line(sane)
    assert "Warning" not in report_markdown(result)
    over = {**sane, "mfu_pct": 130.0}
    assert "WARNING: MFU 130% is over 100%" in progress_line(over) and "rerun on an idle device" in progress_line(over)
    assert "**Warning**: MFU 130% is over 100%" in report_markdown({**result, "results": [over]})
    memory = {**sane, "mfu_pct": 20.0, "roofline_pct": 140.0, "roofline_binds": "memory"}
    assert "140% of a memory-bound roofline" in progress_line(memory)
