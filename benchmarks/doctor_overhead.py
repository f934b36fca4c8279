"""What the doctor costs: the watch mode's overhead on step time (promise: <= 3%), and the wall time of a full
profile of a run, end to end (promise: <= 60 s).

    PYTHONPATH=src python benchmarks/doctor_overhead.py [--device cuda] [--steps 200] [--repeats 7]
        [--data fashion-mnist --report-dir DIR] [--out overhead.json]

Overhead: the same loop (an MLP on data resident on the device, several step sizes) timed plain and under
`fastddpm.doctor.watch(..., profile_steps=0)`, interleaved A/B per repeat so drift hits both alike; CUDA runs
are timed with CUDA events around the loop, CPU runs with perf_counter. The report (diagnosis, peak
measurement) runs after the timed loop and is not part of the overhead. Full profile: the wall time of
`fastddpm doctor train` with its default window (5 warm-up + 40 watched + 10 profiled steps), set-up,
diagnosis and report writing included; --report-dir keeps its report (the fast path's own diagnosis).
--out is rewritten after each step size, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fastddpm.bench.store import write_json  # noqa: E402
from fastddpm.doctor import watch  # noqa: E402
from fastddpm.measure import environment_record  # noqa: E402


def make(width: int, batch: int, device: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    data = torch.randn(batch * 16, width, device=device)
    batches = [data[i * batch:(i + 1) * batch] for i in range(16)]
    return model, opt, batches


class Loader:
    def __init__(self, batches, steps):
        self.batches, self.steps = batches, steps

    def __iter__(self):
        for i in range(self.steps):
            yield self.batches[i % len(self.batches)]


def one_step(model, opt, x):
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


class Timer:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)
            self.a.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.b.record()
            torch.cuda.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def run_plain(model, opt, batches, steps, device) -> float:
    with Timer(device) as t:
        for x in Loader(batches, steps):
            one_step(model, opt, x)
    return t.ms / steps


def run_watched(model, opt, batches, steps, device) -> float:
    with watch(Loader(batches, steps), warmup_steps=0, steps=steps, profile_steps=0, loader_probe_s=0,
               device=device, print_report=False) as dr:
        with Timer(device) as t:
            for x in dr.batches():
                one_step(model, opt, x)
                dr.step()
    return t.ms / steps


def overhead(width: int, batch: int, steps: int, repeats: int, device: torch.device) -> dict:
    model, opt, batches = make(width, batch, device)
    run_plain(model, opt, batches, 20, device)  # warm-up: allocator, kernels, clocks
    plain, watched = [], []
    for _ in range(repeats):
        plain.append(run_plain(model, opt, batches, steps, device))
        watched.append(run_watched(model, opt, batches, steps, device))
    ratios = [w / p - 1 for p, w in zip(plain, watched)]
    return {"width": width, "batch": batch, "steps": steps, "repeats": repeats,
            "plain_step_ms_median": statistics.median(plain), "watched_step_ms_median": statistics.median(watched),
            "overhead_median": statistics.median(ratios), "overhead_min": min(ratios), "overhead_max": max(ratios)}


def bookkeeping_us_per_step(n: int = 20000) -> float:
    """The doctor's own host work per step (one data wait + one step boundary) on an empty loop: the floor of
    its overhead, independent of the model."""
    from fastddpm.doctor.session import DoctorConfig, Session

    s = Session(DoctorConfig(warmup_steps=0, steps=n + 10, profile_steps=0, loader_probe_s=0), device="cpu")
    t0 = time.perf_counter()
    for i in range(n):
        s.wait_for_data(lambda: i)
        s.step()
    per_step = (time.perf_counter() - t0) / n * 1e6
    s.finish_early("benchmark")
    return per_step


def full_profile_wall_s(device: torch.device, data: str | None, report_dir: str | None = None) -> dict | None:
    if data is None:
        return None
    preset = "seed-1layer" if device.type == "cuda" else "tiny"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(report_dir or tmp)
        cmd = [sys.executable, "-m", "fastddpm", "doctor", "train", "--preset", preset, "--data", data,
               "--device", str(device), "--report-dir", str(report)]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        verdict = json.loads((report / "report.json").read_text())["verdict"] if out.returncode == 0 else None
    return {"command": " ".join(cmd[1:]), "wall_s": wall, "returncode": out.returncode, "verdict": verdict,
            "report_dir": report_dir, "stdout_tail": out.stdout[-2000:],
            "stderr_tail": out.stderr[-2000:] if out.returncode else ""}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--data", default=None, help="a dataset for the full-profile timing (e.g. fashion-mnist)")
    p.add_argument("--report-dir", default=None, help="keep the full profile's report here (default: discarded)")
    p.add_argument("--out", default=None, help="write the JSON result here (rewritten after each step size)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    sizes = [(1024, 256), (4096, 1024), (8192, 4096)] if device.type == "cuda" else [(256, 64), (512, 256), (1024, 256)]
    floor_us = bookkeeping_us_per_step()
    print(f"doctor bookkeeping: {floor_us:.1f} us per step (empty loop)")
    env = environment_record(device, sys.argv if argv is None else [sys.argv[0], *argv])
    rows = []

    def save(prof: dict | None, complete: bool) -> None:
        if args.out:
            write_json(Path(args.out), {"environment": env, "complete": complete, "bookkeeping_us_per_step": floor_us,
                                        "overhead": rows, "full_profile": prof})

    for width, batch in sizes:
        r = overhead(width, batch, args.steps, args.repeats, device)
        rows.append(r)
        save(None, complete=False)
        print(f"width {width:5d} batch {batch:5d}: step {r['plain_step_ms_median']:.3f} ms plain, "
              f"{r['watched_step_ms_median']:.3f} ms watched: overhead {100 * r['overhead_median']:+.2f}% "
              f"(min {100 * r['overhead_min']:+.2f}%, max {100 * r['overhead_max']:+.2f}%)", flush=True)
    prof = full_profile_wall_s(device, args.data, args.report_dir)
    if prof:
        print(f"full profile (doctor train, default window): {prof['wall_s']:.1f} s end to end, "
              f"verdict {prof['verdict'] and prof['verdict']['id']}")
    save(prof, complete=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
