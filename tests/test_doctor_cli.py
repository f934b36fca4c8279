"""`fastddpm doctor run` on an unchanged script, `fastddpm doctor train` on the built-in trainer, the report
files, and the HTML rendered by a real browser (headless Chromium; skipped where it is not installed)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from fastddpm.cli import main
from fastddpm.doctor import DoctorConfig
from fastddpm.doctor.session import DoctorError
from fastddpm.doctor.runners import run_script

SLOW_SCRIPT = textwrap.dedent("""
    import argparse, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 2048
        def __getitem__(self, i):
            time.sleep(ARGS.sleep)
            return torch.randn(64)

    p = argparse.ArgumentParser()
    p.add_argument("--sleep", type=float, required=True)
    p.add_argument("--epochs", type=int, default=100)
    ARGS = p.parse_args()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(ARGS.epochs):
        for x in DataLoader(Slow(), batch_size=16):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    print("SCRIPT FINISHED")
""")


def _window(tmp_path, **kw) -> DoctorConfig:
    return DoctorConfig(**{"warmup_steps": 2, "steps": 12, "profile_steps": 3, "loader_probe_s": 0.5,
                           "out_dir": tmp_path / "report", **kw})


def test_doctor_run_diagnoses_an_unchanged_script_and_stops_it(tmp_path, capsys):
    script = tmp_path / "train_mine.py"
    script.write_text(SLOW_SCRIPT)
    report = run_script(script, ["--sleep", "0.0005"], _window(tmp_path))
    assert report.bottleneck == "data-bound", report.text()
    assert len(report.measurements["steps"]) == 12 and report.measurements["profiled_steps"] == 3
    assert "SCRIPT FINISHED" not in capsys.readouterr().out  # the bounded run ended the script
    # the hooks are gone afterwards: DataLoader and optimizers behave as before
    from torch.utils.data import DataLoader

    assert DataLoader.__iter__.__name__ == "__iter__"


def test_doctor_run_passes_the_scripts_exit_and_short_runs(tmp_path):
    script = tmp_path / "short.py"
    script.write_text(SLOW_SCRIPT)
    # one epoch of 128 steps is plenty; a script that ends early is diagnosed on what it ran
    report = run_script(script, ["--sleep", "0", "--epochs", "1"],
                        _window(tmp_path, steps=200, profile_steps=0, loader_probe_s=0))
    assert len(report.measurements["steps"]) == 128 - 2
    assert any("the loop ended after 128 steps" in n for n in report.measurements["notes"])


def test_doctor_run_without_an_optimizer_explains_how_to_mark_steps(tmp_path):
    script = tmp_path / "no_opt.py"
    script.write_text("import torch\nprint(torch.ones(2).sum())\n")
    with pytest.raises(DoctorError, match="never called optimizer.step"):
        run_script(script, [], _window(tmp_path))


def test_doctor_run_cli_missing_script_is_a_clear_error(tmp_path, capsys):
    assert main(["doctor", "run", "--report-dir", str(tmp_path), str(tmp_path / "nope.py")]) == 2
    assert "no script at" in capsys.readouterr().err


def test_doctor_run_reports_a_failing_script_exit(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert main(["doctor", "run", "--report-dir", str(tmp_path), str(script)]) == 2
    assert "exited with status 3" in capsys.readouterr().err


def test_doctor_cli_json_and_files(tmp_path, capsys):
    script = tmp_path / "train_mine.py"
    script.write_text(SLOW_SCRIPT)
    out = tmp_path / "rep"
    code = main(["doctor", "run", "--warmup", "2", "--steps", "10", "--profile-steps", "2", "--loader-probe-s",
                 "0.3", "--report-dir", str(out), "--json", "--save-trace", str(script), "--sleep", "0.0005"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["verdict"]["id"] == "data-bound"
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["verdict"] == printed["verdict"]
    traces = list(out.glob("*.pt.trace.json.gz"))  # --save-trace: kept, gzipped
    assert len(traces) == 1 and on_disk["measurements"]["trace_file"] == str(traces[0])
    with gzip.open(traces[0], "rt") as f:
        trace = json.load(f)
    assert any(e.get("name") == "fastddpm::step" for e in trace["traceEvents"])  # loadable, and ours
    text = (out / "report.txt").read_text()
    assert text.count("\n") < 40 and "verdict: DATA-BOUND" in text


def test_doctor_rejects_a_window_too_short_to_judge(tmp_path, capsys):
    assert main(["doctor", "run", "--steps", "2", "--report-dir", str(tmp_path), "x.py"]) == 2
    assert "at least 3 watched steps" in capsys.readouterr().err


def test_doctor_train_fast_path_is_healthy(tmp_path, fmnist_npz, capsys):
    out = tmp_path / "doc"
    code = main(["doctor", "train", "--preset", "tiny", "--data", str(fmnist_npz), "--warmup", "2", "--steps", "6",
                 "--profile-steps", "2", "--report-dir", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["healthy"], capsys.readouterr().out
    assert report["context"] == "fastddpm"
    m = report["measurements"]
    assert m["mfu"]["flops_per_step"] > 0 and 0 < m["mfu"]["mfu"] < 1
    assert m["profiled_steps"] == 2 and len(m["steps"]) == 6
    assert m["trace"]["item_loops"] == []  # the trainer's step handles its batch whole
    assert not (out / "run" / "samples" / "final.png").exists()  # a diagnostic run draws no grid


def test_doctor_train_stops_the_trainer_when_the_time_bound_ends_the_windows(tmp_path, fmnist_npz):
    out = tmp_path / "doc"
    code = main(["doctor", "train", "--preset", "tiny", "--data", str(fmnist_npz), "--warmup", "5", "--steps", "40",
                 "--profile-steps", "10", "--max-seconds", "0.05", "--report-dir", str(out)])
    assert code == 0
    m = json.loads((out / "report.json").read_text())["measurements"]
    # each window cut to its fewest steps (2 warm-up, 3 watched, 1 profiled): the trainer stopped there too,
    # not after the 55 planned steps
    assert len(m["steps"]) == 3 and m["profiled_steps"] == 1
    assert [p.name for p in (out / "run" / "checkpoints").glob("ckpt_*.pt")] == ["ckpt_000000006.pt"]
    assert any(n.startswith("watched 3 of 40 planned steps") for n in m["notes"])


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="needs headless Chromium (apt-get install chromium)")
def test_html_report_renders_in_a_real_browser(tmp_path):
    from fastddpm.doctor import planted

    report = planted.CASES["epoch-respawn"](torch.device("cpu"), out=tmp_path / "rep", print_report=False,
                                   profile_steps=3)
    page = tmp_path / "rep" / "report.html"
    assert page.is_file()
    browser = _chromium()
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + str(tmp_path / "prof")]
    dom = subprocess.run(common + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    # the browser parsed the page: the verdict, both charts and one bar per watched step are in its DOM
    assert "EPOCH SPIKES" in dom
    assert 'id="steps-chart"' in dom and 'id="timeline"' in dom
    assert dom.count('class="bar-compute"') == len(report.measurements["steps"])
    shot = tmp_path / "shot.png"
    subprocess.run(common + ["--window-size=1200,900", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    from PIL import Image
    import numpy as np

    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    # the verdict box is drawn in its red tint, and the step bars in their blue
    assert ((abs(img[..., 0] - 0xFD) < 4) & (abs(img[..., 1] - 0xE8) < 4) & (abs(img[..., 2] - 0xE6) < 4)).sum() > 1000
    assert ((abs(img[..., 0] - 0x4A) < 4) & (abs(img[..., 1] - 0x7F) < 4) & (abs(img[..., 2] - 0xC1) < 4)).sum() > 200


def test_the_step_chart_keeps_ordinary_steps_readable_beside_an_epoch_spike():
    import re

    from fastddpm.doctor.report import STEPS_AXIS_MEDIANS, _steps_svg

    # ten 5 ms steps and one epoch start that waited 495 ms for respawned loader workers
    steps = [{"index": i, "host_ms": 5.0, "data_wait_ms": 1.0, "epoch_start": False, "recompiles": 0}
             for i in range(10)]
    steps[4] = {**steps[4], "host_ms": 500.0, "data_wait_ms": 495.0, "epoch_start": True}
    svg = _steps_svg(steps, height=180)
    heights = [float(h) for h in re.findall(r'class="bar-compute"[^>]* height="([0-9.]+)"', svg)]
    data = [float(h) for h in re.findall(r'class="bar-data"[^>]* height="([0-9.]+)"', svg)]
    whole = [c + d for c, d in zip(heights, data)]
    axis = 180 - 20 - 16  # the chart less its bottom and top margins
    # the axis ends at 4 median steps (20 ms): an ordinary step fills a quarter of it, not 1% as on a 500 ms axis
    assert STEPS_AXIS_MEDIANS == 4.0 and f">{20.0:.1f} ms<" in svg
    assert all(abs(w - axis / 4) < 0.2 for i, w in enumerate(whole) if i != 4), whole
    # the spike reaches the top, keeps its own proportions (99% data wait), is cut, and says its time
    assert abs(whole[4] - axis) < 0.2 and abs(data[4] / whole[4] - 0.99) < 0.01
    assert svg.count('class="bar-cut"') == 1 and 'class="bar-cut-label"' in svg and ">500 ms<" in svg
    # no step past the axis: drawn as before, the longest step at the top, nothing cut
    calm = _steps_svg(steps[:4] + steps[5:], height=180)
    assert "bar-cut" not in calm and f">{5.0:.1f} ms<" in calm


def test_what_was_not_measured_reads_as_one_rule_or_several():
    from fastddpm.doctor.report import rules_label
    from fastddpm.doctor.rules_compute import NO_TRACE_RULES

    assert rules_label("7 (syncs)") == "rule 7 (syncs)"
    assert rules_label("15 (GPU clocks: throttling or growth)") == "rule 15 (GPU clocks: throttling or growth)"
    assert rules_label("4-6,8,9,11 (GPU timeline)") == "rules 4-6,8,9,11 (GPU timeline)"
    assert rules_label(NO_TRACE_RULES).startswith("rules 12, 16-20")


# ---------------------------------------------------------------------- doctor train --try
def test_a_fastddpm_fix_is_read_as_the_settings_it_makes():
    from fastddpm.doctor.findings import Finding, Fix
    from fastddpm.doctor.trials import plan_trainer, settings_of

    assert settings_of("--precision bf16 (auto picks it)") == ("--precision bf16", {"train.precision": "bf16"})
    assert settings_of("--compile on (fuses elementwise chains); --precision bf16") == ("--compile on",
                                                                                         {"train.compile": "on"})
    assert settings_of("--cuda-graphs capture") == ("--cuda-graphs capture", {"train.cuda_graphs": "capture"})
    assert settings_of("--log-every N (fastddpm reads the loss only on logging steps)") is None  # a placeholder
    assert settings_of("keep --precision fp32 (auto does)") is None and settings_of("--no-such-flag on") is None
    findings = [Finding("eager-elementwise", (18,), "", 0.3, [], "", [Fix("--compile on", "torch.compile(model)")]),
                Finding("fp32", (16,), "", 0.4, [], "", [Fix("--precision bf16 (auto picks it)", "autocast")]),
                Finding("drift", (15,), "", 0.0, [], "", [Fix("--compile on", "x")], kind="note")]
    trials = plan_trainer(findings, 3)
    assert [(t.fix, t.finding, t.settings) for t in trials] == [
        ("--precision bf16", "fp32", {"train.precision": "bf16"}), ("--compile on", "eager-elementwise",
                                                                    {"train.compile": "on"})]
    # every finding's first fix before any finding's second; a setting already planned is not tried twice
    findings[1].fixes += [Fix("--compile on", "x"), Fix("--cuda-graphs capture", "y")]
    assert [(t.fix, t.finding) for t in plan_trainer(findings, 3)] == [
        ("--precision bf16", "fp32"), ("--compile on", "eager-elementwise"), ("--cuda-graphs capture", "fp32")]
    assert [t.fix for t in plan_trainer(findings, 2)] == ["--precision bf16", "--compile on"]


def test_try_fits_its_rounds_and_steps_to_try_seconds_at_the_diagnosed_step_time():
    """--try ran 3 rounds of 5 + 20 steps per run whatever a step cost: a 3.9 s step made `--try 1` take about ten
    minutes past a 60 s diagnosis, with no way to bound it."""
    from fastddpm.doctor.trials import MIN_ROUNDS, MIN_STEPS, MIN_WINDOW_S, STARTUP_S, fit_shape

    shape = fit_shape(3900.0, 2, 300.0)  # fewer timed steps first, all three rounds kept
    assert (shape.rounds, shape.warmup, shape.steps) == (3, 5, 6)
    assert shape.estimate_s == pytest.approx(3 * 2 * (STARTUP_S + 11 * 3.9)) and shape.estimate_s <= 300
    assert "3 rounds of 2 runs, each 5 warm-up + 6 timed steps, about 4.8 min" == shape.describe(2)
    floor = fit_shape(20000.0, 2, 300.0)  # no shape fits: the floor, said as it is
    assert (floor.rounds, floor.steps) == (MIN_ROUNDS, MIN_STEPS) and floor.estimate_s > 300
    assert (fit_shape(300.0, 3, 300.0).rounds, fit_shape(300.0, 3, 300.0).steps) == (3, 20)  # fits as asked
    # a fast step times a second at the least (20 steps of 10 ms would time 0.2 s: a shared CPU's stall is 20%)
    fast = fit_shape(10.0, 3, 300.0)
    assert (fast.rounds, fast.steps) == (3, 100) and fast.steps * 10.0 >= MIN_WINDOW_S * 1e3
    # where it does not fit, a round goes before the window shrinks, and the floor is what it was
    assert (fit_shape(10.0, 3, 40.0).rounds, fit_shape(10.0, 3, 40.0).steps) == (2, 100)
    assert (fit_shape(10.0, 3, 25.0).rounds, fit_shape(10.0, 3, 25.0).steps) == (MIN_ROUNDS, MIN_STEPS)
    assert fit_shape(3900.0, 2, None).steps == 20 and fit_shape(None, 2, 300.0).estimate_s is None


def test_a_trainer_trial_runs_the_steps_its_plan_says(tmp_path, monkeypatch):
    """`doctor train --try` runs fastddpm train, which logs (and so times) whole intervals of the warm-up's length:
    the plan said 5 + 6 steps and the trial ran 5 + 10, past --try-seconds; its start (data, model, the final
    checkpoint) is longer than a script's, and its final grid is one image."""
    from fastddpm.doctor import trials as trials_mod
    from fastddpm.doctor.trials import TRAINER_STARTUP_S, fit_shape

    shape = fit_shape(3900.0, 2, 300.0, trainer=True)
    assert shape.steps % shape.warmup == 0 and shape.estimate_s <= 300
    assert fit_shape(3900.0, 2, 10.0, trainer=True, warmup=10).steps == 10  # one interval: the floor (it looped)
    assert shape.estimate_s == pytest.approx(3 * 2 * (TRAINER_STARTUP_S + (shape.warmup + shape.steps) * 3.9))
    commands = []
    monkeypatch.setattr(trials_mod.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or
                        type("Done", (), {"returncode": 1, "stderr": "stub", "stdout": ""})())
    trials_mod._run_trainer({}, None, shape.warmup, shape.steps, tmp_path / "t", 10.0)
    cmd = commands[0]
    assert int(cmd[cmd.index("--max-steps") + 1]) == shape.warmup + shape.steps
    assert cmd[cmd.index("--num-sample-images") + 1] == "1" and cmd[cmd.index("--sample-steps") + 1] == "1"


def test_try_starts_no_round_that_would_end_past_its_budget(monkeypatch):
    from fastddpm.doctor import trials as trials_mod
    from fastddpm.doctor.trials import Trial, run_trials

    clock = [0.0]

    def run(script, args, fix, warmup, steps, out, timeout_s):  # each run takes 10 s of the fake clock
        clock[0] += 10.0
        return {"step_ms": 10.0 if fix is None else 5.0, "applied": ["x"]}

    monkeypatch.setattr(trials_mod, "_run", run)
    monkeypatch.setattr(trials_mod.time, "perf_counter", lambda: clock[0])
    lines = []
    (trial,) = run_trials(Path("s.py"), [], [Trial("compile", "c", None, None)], rounds=5, budget_s=50.0,
                          log=lines.append)
    assert len(trial.speedups) == 2 and trial.measured == 2.0  # rounds of 20 s: a third would end at 60 s
    assert "doctor --try: stopped after round 2 of 5: another would end past --try-seconds 50 (40 s spent)" in lines
    clock[0] = 0.0
    (trial,) = run_trials(Path("s.py"), [], [Trial("compile", "c", None, None)], rounds=1, budget_s=1.0,
                          log=lines.append)
    assert len(trial.speedups) == 1  # the first round always runs


def test_try_says_why_it_tries_fewer_fixes_than_asked_and_what_each_measured_means():
    from fastddpm.doctor.report import trial_line
    from fastddpm.doctor.runners import try_plan_line
    from fastddpm.doctor.trials import Trial, fit_shape

    line = try_plan_line([Trial("channels-last", "w", None, None)], 2, fit_shape(300.0, 2, 300.0), what="fix",
                         against="the script without it", none="")
    assert line.startswith("doctor --try: 1 fix of the 2 asked (no other can be tried), each against the script "
                           "without it, alternating: channels-last; 3 rounds of 2 runs, each 5 warm-up + 20 timed")
    t = {"fix": "channels-last", "what": "channels_last weights and inputs", "failed": None, "predicted": None,
         "applied": ["channels_last weights and inputs: SmallUNet.forward"], "measured": 0.95, "spread": [0.88, 0.97],
         "rounds": 3}
    assert trial_line(t) == ("channels-last: measured 0.95x [0.88-0.97] over 3 alternating rounds (slower here: "
                             "leave it out); channels_last weights and inputs: SmallUNet.forward")
    assert "(no gain beyond the runs' spread)" in trial_line({**t, "measured": 1.02, "spread": [0.97, 1.1]})
    assert "(faster in every round)" in trial_line({**t, "measured": 1.3, "spread": [1.2, 1.4], "predicted": 1.5,
                                                    "applied": ["other words"]})
    assert trial_line({**t, "applied": ["other words"]}).startswith("channels-last (channels_last weights and "
                                                                    "inputs): measured")
    # --try-seconds spent after one round: no spread, and no "faster in every round" from one pair of runs
    one = trial_line({**t, "measured": 1.34, "spread": [1.34, 1.34], "rounds": 1, "predicted": 1.2})
    assert one.startswith("channels-last: measured 1.34x in 1 round; predicted 1.20x (not conclusive") and \
        "[1.34" not in one and "every round" not in one
    two = try_plan_line([Trial("compile", "w", None, None), Trial("channels-last", "w", None, None)], 2,
                        fit_shape(300.0, 3, 300.0), what="fix", against="the script without it", none="")
    assert two.startswith("doctor --try: 2 fixes, each against") and \
        two.endswith("(and torch.compile's own time in its runs' first steps)")


def test_try_seconds_is_checked_and_is_a_doctor_option(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    assert main(["doctor", "run", "--try", "1", "--try-seconds", "-5", str(script)]) == 2
    assert "--try-seconds -5: a number of seconds > 0 (0 = no bound)" in capsys.readouterr().err
    assert main(["doctor", "run", str(script), "--try-seconds", "60"]) == 2
    assert "--try-seconds comes after the script name" in capsys.readouterr().err


def test_doctor_train_try_runs_fastddpm_train_with_and_without_the_setting(fmnist_npz, monkeypatch):
    """A trainer trial is `fastddpm train` on the diagnosed config with the setting, alternating with it as it
    was, timed from metrics.jsonl; a setting that changes the batch is compared per image (the base's batch)."""
    from fastddpm.config import apply_overrides, get_preset
    from fastddpm.doctor import trials as trials_mod
    from fastddpm.doctor.trials import Trial, run_trials

    runs = []
    real = trials_mod._run_trainer

    def recorded(cfg, settings, *a, **kw):
        runs.append(real(cfg, settings, *a, **kw))
        return runs[-1]

    monkeypatch.setattr(trials_mod, "_run_trainer", recorded)
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.device": "cpu"})
    (trial,) = run_trials(cfg.to_dict(), [], [Trial("--batch-size 8", "x", None, None,
                                                    settings={"train.batch_size": "8"})],
                          rounds=1, warmup=2, steps=4, log=lambda *a: None)
    assert trial.failed is None and trial.applied == ["fastddpm train --set train.batch_size=8"]
    assert len(trial.base_ms) == len(trial.fix_ms) == 1 and trial.measured > 0
    base, fix = runs  # each read from its own run's metrics.jsonl
    assert (base["per_step"], fix["per_step"]) == (16, 8)
    # per image, in the base run's batch of 16: the batch-8 run's step time counts twice
    assert trial.base_ms == [base["step_ms"]] and trial.fix_ms == [pytest.approx(2 * fix["step_ms"])]
    assert trial.measured == pytest.approx(base["step_ms"] / (2 * fix["step_ms"]))


def test_doctor_train_counts_the_roofline_bytes_on_the_model_the_run_built():
    """Padded attention heads move their zeros through memory: the doctor's roofline counts the model with the
    padding run.json records (bench throughput counts the trainer's own model, padded as it ran)."""
    import dataclasses

    from fastddpm.config.presets import PRESETS
    from fastddpm.doctor.runners import recorded_head_pad, run_model
    from fastddpm.measure import count_step_bytes

    assert recorded_head_pad({"attention_head_pad": "8 (auto: CUDA, compiled, bf16)"}) == 8
    assert recorded_head_pad({"attention_head_pad": "off (auto: no CUDA)"}) == 0
    assert recorded_head_pad({}) == 0  # a run.json from before the padding was recorded
    cfg = PRESETS["seed-1layer"]()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, image_channels=1, image_size=28))
    saved = []
    for fast_path in ({"attention_head_pad": "off (requested)"}, {"attention_head_pad": "8 (requested)"}):
        model = run_model(cfg, fast_path)
        saved.append(count_step_bytes(model, (1, 28, 28), images_per_step=2, device=torch.device("cpu"),
                                      autocast_dtype=torch.bfloat16)["activation_bytes_per_image"])
    assert saved[1] > saved[0]  # the seed U-Net's 4-wide heads padded to 8 save wider q, k, v
