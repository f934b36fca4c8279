"""benchmarks/gpu_session.sh and benchmarks/summarize_gpu.py, on the CPU: the script is bash -n clean, every
part's command line parses with the real parsers (GPU_SESSION_DRY prints the commands instead of running them),
the call budget holds parts back and names the next call, and the summary turns a fabricated results folder, in
the formats the parts write, into tables that each name device, date, torch, commit and command."""

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
PARTS = ["tests", "throughput", "throughput-2layer", "throughput-cifar10", "ladder", "ladder-fast", "doctor",
         "doctor-overhead", "doctor-try", "doctor-fast", "candidates", "doctor-fast-cl", "attention", "vs-diffusers",
         "candidates-ma",
         "ddp",
         "quality-reference", "eval", "samplers", "samplers-sde", "quality-fast", "quality-options",
         "quality-options-2", "quality-objectives", "summarize"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _session(tmp_path, *parts, **env):
    quality = tmp_path / "quality"
    (quality / "quality-reference" / "reference").mkdir(parents=True, exist_ok=True)  # what eval looks for
    full_env = {**os.environ, "GPU_SESSION_DRY": "1", "GPU_RESULTS": str(tmp_path / "res"), "QUALITY_DIR": str(quality),
                "PYTHON": sys.executable, "COMMIT": "c0ffee" * 6 + "c0ff", **env}
    full_env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *parts], capture_output=True, text=True, env=full_env, cwd=tmp_path,
                          timeout=300)


def test_script_is_bash_n_clean():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


class _Parsed(Exception):
    pass


def _parse_with_main(main, argv, monkeypatch):
    """Run a main() that builds its own ArgumentParser only as far as parse_args: the real parser, no work."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed) as got:
        main(argv)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", real)
    return got.value.args[0]


def test_every_parts_command_parses(tmp_path, monkeypatch):
    from fastddpm.bench import cli as bench_cli
    from fastddpm.cli import build_parser
    from fastddpm.doctor import planted

    done = _session(tmp_path, *PARTS)
    assert done.returncode == 0, done.stdout + done.stderr
    commands = [shlex.split(line)[1:] for line in done.stdout.splitlines() if line.startswith("DRY ")]
    parts_run = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("== ") and "left" in line]
    assert parts_run == PARTS
    parser, _ = build_parser()
    seen = set()
    for cmd in commands:
        assert cmd[0] == sys.executable, cmd
        if cmd[1:3] == ["-m", "fastddpm"]:
            args = parser.parse_args(cmd[3:])  # SystemExit(2) on a bad flag
            if args.command == "bench":  # and the settings they make: ConfigError on a bad value
                make = {"throughput": bench_cli.throughput_settings, "ladder": bench_cli.ladder_settings,
                        "quality": bench_cli.quality_settings,
                        "samplers": bench_cli.samplers_settings}[args.bench_command]
                make(args)
            if args.command == "doctor" and args.doctor_command == "run":  # its options before the script
                from fastddpm.doctor.cli import script_arguments

                script_arguments(args.script, args.script_args)
                assert args.try_fixes == 3 and Path(ROOT / args.script).is_file()
            elif args.command == "doctor":  # doctor train: the config it resolves (ConfigError on a bad value)
                from fastddpm.cli import resolve_train_config

                args.resume = None
                cfg = resolve_train_config(args, args.train_dests)
                assert cfg.train.batch_size in (1024, 128) and args.max_seconds == 60
                if cfg.model.family == "ddpm":  # CIFAR-10's shape, from the carried Fashion-MNIST
                    assert cfg.data.resize == 32 and cfg.data.image_mode == "RGB"
            seen.add(f"{args.command} {getattr(args, 'doctor_command', '') or getattr(args, 'bench_command', '')}"
                     .strip())
        elif cmd[1:3] == ["-m", "fastddpm.doctor.planted"]:
            args = _parse_with_main(planted.main, cmd[3:], monkeypatch)
            assert args.device == "cuda" and args.out
            seen.add("planted")
        elif cmd[1:3] == ["-m", "pytest"]:
            assert cmd[3:6] == ["-q", "-m", "cuda"] and cmd[-1] == "tests"
            seen.add("pytest")
        else:
            name = Path(cmd[1]).stem
            args = _load(name).build_parser().parse_args(cmd[2:])
            assert args.out
            seen.add(name)
    assert seen == {"bench throughput", "bench ladder", "bench quality", "bench samplers", "eval", "planted", "pytest",
                    "doctor_overhead", "ddp_overhead", "sdpa_shapes", "vs_diffusers", "data", "doctor run",
                    "doctor train"}
    ladder = [c for c in commands if c[3:5] == ["bench", "ladder"]]
    assert len(ladder) == 2 and len({c[c.index("--out") + 1] for c in ladder}) == 1  # one folder: resumed, merged
    res = tmp_path / "res"
    assert (res / "SUMMARY.md").is_file() and len(list((res / "calls").glob("*.json"))) == 1
    parts = [json.loads(line) for line in (res / "calls" / "parts.jsonl").read_text().splitlines()]
    assert [p["part"] for p in parts] == PARTS and all(p["commit"].startswith("c0ffee") for p in parts)
    assert "every part finished" in done.stdout


def test_budget_holds_parts_back_and_names_the_next_call(tmp_path):
    # A budget of 250 s: throughput (needs 90 s) starts unless the call's set-up took 160 s; quality-reference
    # (300 s) can never start, however fast the machine (the set-up's time must not decide this test).
    done = _session(tmp_path, "throughput", "quality-reference", BUDGET_S="250")
    out = done.stdout
    assert "DRY" in out.split("== quality-reference")[0]  # throughput: started
    assert "!! not started: it needs about 300 s" in out  # quality-reference: held back
    assert out.strip().splitlines()[-1] == ("next call (parts not started, cut short or failed): "
                                           "bash benchmarks/gpu_session.sh quality-reference")


def test_unknown_part_is_refused(tmp_path):
    done = _session(tmp_path, "throughput", "ladders")
    assert done.returncode == 2 and "unknown part ladders" in done.stdout
    assert not (tmp_path / "res").exists()  # nothing ran


# ---------------------------------------------------------------------------------------------------------------
# summarize_gpu.py on a fabricated folder


H100 = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.9.0+cu128", "cuda_runtime": "12.8",
        "cuda_driver": "570.86", "device_memory_gib": 79.19, "git_commit": "unknown", "git_dirty": None}
COMMIT = "1234567890ab" + "c" * 28


def _env(date, command):
    return {**H100, "date_utc": date, "command_line": command}


def _run(date, command):
    return {"date_utc": date, "command_line": command, "git_commit": "unknown", "git_dirty": None}


def _fabricate(folder: Path) -> None:
    def write(rel, obj):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(obj if isinstance(obj, str) else json.dumps(obj))

    write("calls/20261201T100000Z.json", {**_env("2026-12-01T10:00:00+00:00", "bash benchmarks/gpu_session.sh tests "
                                                 "throughput doctor doctor-try doctor-fast"), "commit_given": COMMIT})
    write("calls/parts.jsonl", "\n".join(json.dumps({"call": "20261201T100000Z", "part": p, "rc": 0, "wall_s": 60,
                                                     "commit": COMMIT})
                                          for p in ("tests", "throughput", "doctor", "doctor-try", "doctor-fast")))
    write("doctor-fast/seed-1layer-1024/report.json", {  # the parts of a doctor train report the summary reads
        "verdict": {"id": "low-mfu"},
        "measurements": {
            "step_stats": {"median_ms": 45.9, "gpu_median_ms": 45.6},
            "mfu": {"mfu": 0.091, "peak_dtype": "bf16"},
            "roofline": {"share": 0.42, "binds": "memory", "compute_ms": 12.1, "memory_ms": 19.2},
            "trace": {"top_ops": [{"name": "triton_red_fused_native_group_norm_0", "share": 0.21,
                                   "calls_per_step": 12, "category": "cuda graph"},
                                  {"name": "sm90_xmma_fprop_implicit_gemm_bf16", "share": 0.18, "calls_per_step": 20,
                                   "category": "cuda graph"}]}}})
    write("doctor-fast-cl/ddpm-cifar10-128/report.json", {  # the channels_last run of the same part
        "verdict": {"id": "low-mfu"},
        "measurements": {"step_stats": {"median_ms": 19.9}, "mfu": {"mfu": 0.301, "peak_dtype": "bf16"}}})
    write("attention/seed-1layer-1024.json", {  # benchmarks/sdpa_shapes.py's record
        "environment": _env("2026-12-01T10:20:00+00:00", "python benchmarks/sdpa_shapes.py --presets seed-1layer"),
        "dtype": "bf16", "batch_size": 1024, "steps": 20, "repeats": 5,
        "shapes": {"seed-1layer": [{"heads": 4, "tokens": 784, "head_dim": 4, "calls": 1, "batch": 1024,
                                    "best": "default-pad16", "best_vs_default": 2.5,
                                    "variants": {"default": {"summary": {"median": 1.25}},
                                                 "cudnn": {"error": "No available kernel"},
                                                 "default-pad16": {"summary": {"median": 0.5}}}}]}})
    write("doctor-try/report.json", {  # the parts of a doctor run --try report the summary reads
        "verdict": {"id": "attention-weights"},
        "trials": [{"fix": "autocast-bf16", "finding": "fp32", "predicted": 1.5, "measured": 1.62, "spread": [1.55, 1.7],
                    "rounds": 3, "applied": ["torch.autocast(dtype=torch.bfloat16) ...: UNet.forward"], "failed": None},
                   {"fix": "compile", "finding": "eager-elementwise", "predicted": 1.2, "measured": None,
                    "spread": None, "rounds": 0, "applied": [], "failed": "no 25 steps within 300 s"}]})
    write("tests/junit.xml", '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="1" '
          'skipped="1" tests="9" time="201.5"><testcase classname="tests.test_fast_path" name="test_cuda_step_has_no'
          '_host_syncs"><failure message="AssertionError: 2 syncs">x</failure></testcase></testsuite></testsuites>')
    cmd = "python -m fastddpm bench throughput --presets seed-1layer --out benchmarks/gpu/x/throughput-seed-1layer"
    row = {"preset": "seed-1layer", "batch_size": 512, "status": "ok", "images_per_s": 41234.0, "ratio_to_first": 1.0,
           "step_ms": {"median": 12.417, "min": 12.3, "max": 12.6}, "compile_s": 41.2, "mfu_pct": 16.54,
           "mfu_dtype": "bf16", "mfu_peak_tflops": 791.3, "mfu_peak_label": "measured bf16 matmul 8192x8192x8192",
           "peak_memory_gib": 5.61, "recompiles_after_warmup": 0, "graph_breaks": 0, "input_wait_pct": 0.4,
           "error": None, "run": _run("2026-12-01T10:04:00+00:00", cmd)}
    failed = {**row, "batch_size": 1024, "status": "failed", "error": "OutOfMemoryError: planted", "images_per_s": None}
    write("throughput-seed-1layer/throughput.json", {
        "schema": "fastddpm-bench-throughput-2", "complete": False, "planned_variants": 4,
        "environment": _env("2026-12-01T10:04:00+00:00", cmd), "runs": [row["run"]],
        "settings": {"presets": ["seed-1layer"], "precision_resolved": "bf16", "compile": "auto", "cuda_graphs": "auto",
                     "data_placement": "device", "warmup_steps": 10, "repeats": 5, "steps": 50},
        "results": [row, failed]})
    lcmd = "python -m fastddpm bench ladder --rungs 0,1,2,3,3b,4,5"
    rung = {"rung": "0", "title": "baseline", "status": "ok", "reason": None, "batch_size": 64, "precision": "fp32",
            "images_per_s": 2000.0, "images_per_s_range": [1900.0, 2100.0], "epoch_s": 30.0,
            "speedup_vs_baseline": 1.0, "speedup_vs_previous": None, "warmup_s": 3.0, "gpu_busy": 0.21,
            "peak_memory_gib": 1.2, "recompiles_after_warmup": None}
    top = {**rung, "rung": "9", "title": "auto batch", "images_per_s": 40000.0, "images_per_s_range": [39000, 41000],
           "speedup_vs_baseline": 20.0, "speedup_vs_previous": 1.3, "gpu_busy": 0.93}
    write("ladder/ladder.json", {
        "schema": "fastddpm-bench-ladder-2", "complete": True, "environment": _env("2026-12-01T10:20:00+00:00", lcmd),
        "runs": [_run("2026-12-01T10:20:00+00:00", lcmd), _run("2026-12-01T10:40:00+00:00", "ladder --rungs 6,7,8,9")],
        "settings": {"preset": "seed-1layer", "workers_resolved": 8},
        "data": {"num_images": 60000, "source": "/x/.data/fashion-mnist", "fingerprint": "abcd"},
        "rungs": [rung, {**rung, "rung": "3b", "title": "AMP bf16", "status": "skipped",
                         "reason": "skipped: Tesla T4 is sm75: bf16 would be emulated"}, top],
        "mlp": {"rows": [{"rung": "0", "name": "baseline (num_workers=0)", "status": "ok", "total_s": 40.0,
                          "speedup": 1.0, "accuracy": 0.87, "error": None}]}})
    write("doctor/planted.txt",  # as `python -m fastddpm.doctor.planted` prints it
          "slow-loader            expected data-bound      got data-bound      cost  87.0%    2.9 s  ok\n"
          "8/8 planted faults diagnosed correctly on cuda\n")
    write("doctor/overhead.json", {"environment": _env("2026-12-01T10:50:00+00:00", "doctor_overhead.py --device cuda"),
                                   "complete": True, "bookkeeping_us_per_step": 6.1,
                                   "cuda_costs_us": {"event_made_and_recorded": 30.5, "event_recorded_again": 2.25},
                                   "overhead": [{"width": 1024, "batch": 256, "plain_step_ms_median": 0.21,
                                                 "watched_step_ms_median": 0.215, "overhead_median": 0.021,
                                                 "overhead_min": 0.01, "overhead_max": 0.03},
                                                {"width": 4096, "batch": 1024, "steps": 902, "repeats": 5,
                                                 "steady": {"plain_step_ms_median": 1.1,
                                                            "watched_step_ms_median": 1.111, "overhead_median": 0.01,
                                                            "overhead_min": 0.0, "overhead_max": 0.02},
                                                 "plain_step_ms_median": 1.2, "watched_step_ms_median": 1.3,
                                                 "overhead_median": 0.083, "overhead_min": 0.05,
                                                 "overhead_max": 0.1}],
                                   "full_profile": {"command": "-m fastddpm doctor train", "wall_s": 48.2,
                                                    "returncode": 0, "verdict": {"id": "healthy"}}})
    write("ddp/ddp_overhead.json", {"environment": _env("2026-12-01T11:00:00+00:00", "ddp_overhead.py --repeats 2"),
                                    "complete": True, "plain_images_per_s": 30000.0, "plain_runs": [29900.0, 30100.0],
                                    "distributed": [{"world_size": 1, "parallel": "ddp", "images_per_s": 28500.0,
                                                     "per_gpu": 28500.0, "efficiency": 0.95, "runs": [28400, 28600]}]})
    qs = {"preset": "seed-1layer", "eval_samples": 5000, "eval_steps": 50, "fast_overrides": ["train.batch_size=512"]}
    ref = {"name": "reference", "images_seen": 2400000, "train_wall_s": 95.0, "final_fid": 3.21}
    write("quality-reference/quality.json", {"environment": _env("2026-12-01T11:10:00+00:00", "bench quality "
                                             "--reference-only"), "settings": qs, "features": "fastddpm-features",
                                             "reference": ref, "fast": None, "options": []})
    fast = {"images_seen": 1200000, "train_wall_s": 30.0, "final_fid": 2.9,
            "time_to_target": {"wall_s": 21.5, "images_seen": 720000}}
    write("quality-fast/quality.json", {"environment": _env("2026-12-01T11:20:00+00:00", "bench quality --reference"
                                        "-from x"), "settings": qs, "features": "fastddpm-features", "reference": ref,
                                        "fast": fast, "options": [], "speedup_vs_reference": 95.0 / 21.5})
    write("quality-options/quality.json", {"environment": _env("2026-12-01T11:30:00+00:00", "bench quality "
                                           "--fast-from x"), "settings": qs, "features": "fastddpm-features",
                                           "reference": ref, "fast": {**fast, "reused_from": "x"},
                                           "options": [{"name": "option-min-snr-5",
                                                        "overrides": ["train.min_snr_gamma=5"], "images_seen": 720000,
                                                        "train_wall_s": 22.0, "final_fid": 3.05}]})
    write("eval/eval_ddim50_n10000_seed0.json", {
        "fid": 3.3, "precision": 0.71, "recall": 0.69,
        "sampling": {"num_samples": 10000, "precision": "bf16", "compile": True, "samples_per_s": 2500.0,
                     "steady_samples_per_s": 3100.0},
        "environment": _env("2026-12-01T11:15:00+00:00", "python -m fastddpm eval --checkpoint x")})
    sampler_run = _run("2026-12-01T11:17:00+00:00", "python -m fastddpm bench samplers x --num-samples 5000")
    write("samplers/samplers.json", {
        "environment": _env("2026-12-01T11:17:00+00:00", "python -m fastddpm bench samplers x --num-samples 5000"),
        "settings": {"num_samples": 5000}, "checkpoint": {"file": "x/checkpoints/ckpt_000012500.pt"},
        "features": {"label": "fastddpm-features"},
        "rows": [{"sampler": "dpmpp-2m", "steps": 10, "seed": s, "run": sampler_run} for s in (0, 1)],
        "summary": [{"sampler": "dpmpp-2m", "steps": 10, "nfe": 10, "seeds": 2, "fid": 3.4, "fid_min": 3.3,
                     "fid_max": 3.5, "precision": 0.7, "recall": 0.68, "samples_per_s": 21000.0}]})


def test_summary_of_a_fabricated_session(tmp_path):
    summarize_gpu = _load("summarize_gpu")
    folder = tmp_path / "2026-12-01"
    _fabricate(folder)
    assert summarize_gpu.main([str(folder)]) == 0
    md = (folder / "SUMMARY.md").read_text()
    sections = md.split("\n### ")[1:]
    # tests, throughput (one folder here), ladder, eval, samplers, quality, doctor, doctor --try, doctor on the
    # fast path, attention, ddp
    assert len(sections) == 11
    for section in sections:
        assert "Not measured yet" not in section and "Not run yet" not in section, section
        # every table names device, torch, date, commit (the call's, as the results say unknown) and command
        assert "NVIDIA H100 80GB HBM3" in section and "torch 2.9.0+cu128" in section, section
        assert "Measured 2026-12-01T" in section and "commit 1234567890ab" in section and "`" in section, section
    assert "7 passed, 1 failed, 0 errors, 1 skipped" in md and "FAILED tests.test_fast_path::" in md
    assert "| seed-1layer | 512 | 41,234 |" in md and "16.54 (bf16)" in md and "MFU peak (bf16): 791.3" in md
    assert "**Incomplete**: 2 of 4 variants" in md and "| seed-1layer | 1024 | failed |" in md
    assert "Top rung: 9 (auto batch) at 20.0x rung 0" in md and "| 3b | AMP bf16 |" in md and "sm75" in md
    assert md.count("Measured 2026-12-01T10:") >= 4  # the ladder's two runs are both named
    assert "| slow-loader | data-bound | data-bound | 87.0% | 2.9 | ok |" in md
    assert "+2.10% [+1.00%, +3.00%]" in md and "48.2 s end to end" in md and "verdict healthy" in md
    # a row with steady figures shows them first, the whole runs beside them; an older row says it had only those
    assert "CUDA pieces, us per call: event made and recorded 30.5, event recorded again 2.2." in md
    assert "| 4096 | 1024 | 902 | 1.100 | 1.111 | +1.00% [+0.00%, +2.00%] | +8.30% [+5.00%, +10.00%] |" in md
    assert "| 1024 | 256 |  | 0.210 | 0.215 | +2.10% [+1.00%, +3.00%] | the same runs |" in md
    assert "| ddp | 1 | 28,500 | 28,500 | 95.0% |" in md
    assert "| autocast-bf16 | fp32 | 1.50x | 1.62x | 1.55-1.70x | 3 |" in md
    assert ("| seed-1layer-1024 | low-mfu | 45.600 | 9.1% (bf16) | 42% (memory) | 12.100 / 19.200 | "
            "triton_red_fused_native_group_norm_0 21% (cuda graph); sm90_xmma_fprop_implicit_gemm_bf16 18% "
            "(cuda graph) |") in md
    assert "| ddpm-cifar10-128 (channels_last) | low-mfu | 19.900 | 30.1% (bf16) |" in md
    assert "| 4 x 784 x 4 (1) | 1.250 | error | 0.500 | default-pad16 (2.50x) |" in md
    assert "| compile | eager-elementwise | 1.20x | not measured (no 25 steps within 300 s) |" in md
    assert "| reference | seed-1layer as is | 2,400,000 | 95.0 | 3.210 (target) |" in md
    assert "| fast | train.batch_size=512 | 1,200,000 | 30.0 | 2.900 | 21.5 | 720,000 |" in md
    assert "| option min-snr-5 |" in md and "4.42x" in md
    assert "| 10,000 | ddim50 | bf16 | True | 2,500.0 | 3,100.0 | 3.300 |" in md
    assert "| dpmpp-2m | 10 | 10 | 3.40 | 2 (3.30-3.50) | 0.700 | 0.680 | 21,000.0 |" in md


def test_summary_of_an_empty_session_says_what_is_missing(tmp_path):
    summarize_gpu = _load("summarize_gpu")
    text = summarize_gpu.summarize(tmp_path)
    assert text.count("Not measured yet") == 10 and "Not run yet (part `tests`)" in text
