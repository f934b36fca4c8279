"""What the doctor costs: the watch mode's overhead on step time (promise: <= 3%), and the wall time of a full
profile of a run, end to end (promise: <= 60 s).

    PYTHONPATH=src python benchmarks/doctor_overhead.py [--device cuda] [--run-ms 1000] [--repeats 7]
        [--data fashion-mnist --report-dir DIR] [--out overhead.json]

Overhead: the same loop (an MLP on data resident on the device, several step sizes) timed plain and under
`fastddpm.doctor.watch(..., profile_steps=0)`, interleaved A/B per repeat, the order swapped every repeat, so
drift hits both alike; CUDA runs are timed with CUDA events, CPU runs with perf_counter. Two figures per run:
`steady`, the steps between the first and the last (what the <= 3% promise is about: a watched step against a
plain one), and the whole run, which also carries the watch's one-off work at its first fetch (clocks, NVML)
and at its last step (the sync that reads the step events, memory and telemetry). The report (diagnosis, peak
measurement) runs after the timed loop and is not part of either. Each run takes about --run-ms (at least
--min-steps steps): a 1 ms step needs ~1,000 steps for a 3% difference to stand above the noise.
Full profile: the wall time of `fastddpm doctor train` with its default window (5 warm-up + 40 watched + 10
profiled steps), set-up, diagnosis and report writing included; --report-dir keeps its report (the fast path's own
diagnosis). --out is rewritten after each step size, so a run stopped by a time limit keeps what it measured.
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
from fastddpm.doctor.system import EVENT_POOL_MAX  # noqa: E402
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


class Marks:
    """Time points in a run without a sync between them (a sync would drain the queue the loop keeps full): CUDA
    events, read after the run's closing sync; perf_counter on a CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.points = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append(ev)
        else:
            self.points.append(time.perf_counter())

    def ms(self, i: int, j: int) -> float:
        a, b = self.points[i], self.points[j]
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


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


def run_plain(model, opt, batches, steps, device) -> tuple[float, float]:
    """(steady ms per step, whole-run ms per step) of `steps` + 2 steps: steady leaves out the first and the last."""
    marks = Marks(device)
    with Timer(device) as t:
        for i, x in enumerate(Loader(batches, steps + 2)):
            if i == 1:
                marks.mark()
            one_step(model, opt, x)
            if i == steps:
                marks.mark()
    return marks.ms(0, 1) / steps, t.ms / (steps + 2)


def run_watched(model, opt, batches, steps, device) -> tuple[float, float]:
    """As run_plain, the loop watched: its first fetch starts the watch's clocks and its last step ends the
    session (the sync that reads the events), both inside the whole run and outside steady."""
    marks = Marks(device)
    with watch(Loader(batches, steps + 2), warmup_steps=0, steps=steps + 2, profile_steps=0, loader_probe_s=0,
               device=device, print_report=False) as dr:
        with Timer(device) as t:
            for i, x in enumerate(dr.batches()):
                if i == 1:
                    marks.mark()
                one_step(model, opt, x)
                dr.step()
                if i == steps:
                    marks.mark()
    return marks.ms(0, 1) / steps, t.ms / (steps + 2)


def _figures(plain: list[float], watched: list[float]) -> dict:
    ratios = [w / p - 1 for p, w in zip(plain, watched)]
    return {"plain_step_ms_median": statistics.median(plain), "watched_step_ms_median": statistics.median(watched),
            "overhead_median": statistics.median(ratios), "overhead_min": min(ratios), "overhead_max": max(ratios)}


def overhead(width: int, batch: int, run_ms: float, min_steps: int, repeats: int, device: torch.device) -> dict:
    model, opt, batches = make(width, batch, device)
    step_ms, _ = run_plain(model, opt, batches, 20, device)  # warm-up (allocator, kernels, clocks), and a step's time
    # at most what the watch makes CUDA events for before its window (past that a boundary makes its own)
    steps = min(max(min_steps, round(run_ms / max(step_ms, 1e-3))), EVENT_POOL_MAX - 3)
    runs = {"plain": [], "watched": []}
    for r in range(repeats):
        for name in (("plain", "watched") if r % 2 == 0 else ("watched", "plain")):
            run = run_plain if name == "plain" else run_watched
            runs[name].append(run(model, opt, batches, steps, device))
    steady = _figures([p[0] for p in runs["plain"]], [w[0] for w in runs["watched"]])
    # the whole run's figures keep the keys of the earlier rows (2026-11-27 and before: whole runs of 200 steps)
    return {"width": width, "batch": batch, "steps": steps + 2, "repeats": repeats, "steady": steady,
            **_figures([p[1] for p in runs["plain"]], [w[1] for w in runs["watched"]])}


def bookkeeping_us_per_step(device: torch.device, n: int = 1900) -> float:
    """The doctor's own host work per step (one data wait + one step boundary, with the step's CUDA event on a
    GPU) on an empty loop: the floor of its overhead, independent of the model."""
    from fastddpm.doctor.session import DoctorConfig, Session

    s = Session(DoctorConfig(warmup_steps=0, steps=n + 10, profile_steps=0, loader_probe_s=0), device=device)
    s.wait_for_data(lambda: 0)  # the first fetch starts the watch's clocks (events, telemetry): once, not a step's
    s.step()
    t0 = time.perf_counter()
    for i in range(n):
        s.wait_for_data(lambda: i)
        s.step()
    per_step = (time.perf_counter() - t0) / n * 1e6
    s.finish_early("benchmark")
    return per_step


def cuda_costs_us(device: torch.device, n: int = 2000) -> dict:
    """What the watch's CUDA-only pieces cost the host, each alone: a step event made and recorded (the watch up to
    2026-11-27), a made event recorded (since), and one GPU telemetry read (NVML, else nvidia-smi)."""
    from fastddpm.doctor.system import gpu_telemetry

    def per_call_us(fn) -> float:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    stream = torch.cuda.current_stream(device)
    kept: list = []
    made = per_call_us(lambda: kept.append(torch.cuda.Event(enable_timing=True)) or kept[-1].record())
    pool = iter([torch.cuda.Event(enable_timing=True) for _ in range(n)])
    premade_first = per_call_us(lambda: next(pool).record(stream))  # the first record creates the CUDA event
    again = iter(kept)
    premade = per_call_us(lambda: next(again).record(stream))  # created already: what a watched step pays now
    t0 = time.perf_counter()
    gpu_telemetry(device)
    return {"event_made_and_recorded": made, "event_created_on_first_record": premade_first,
            "event_recorded_again": premade, "telemetry_read": (time.perf_counter() - t0) * 1e6}


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
    p.add_argument("--run-ms", type=float, default=1000.0, help="about how long each timed run lasts (default 1000)")
    p.add_argument("--min-steps", type=int, default=50, help="the fewest steps a timed run takes (default 50)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--data", default=None, help="a dataset for the full-profile timing (e.g. fashion-mnist)")
    p.add_argument("--report-dir", default=None, help="keep the full profile's report here (default: discarded)")
    p.add_argument("--out", default=None, help="write the JSON result here (rewritten after each step size)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    sizes = [(1024, 256), (4096, 1024), (8192, 4096)] if device.type == "cuda" else [(256, 64), (512, 256), (1024, 256)]
    floor_us = bookkeeping_us_per_step(device)
    print(f"doctor bookkeeping: {floor_us:.1f} us per step (empty loop, {device.type})")
    env = environment_record(device, sys.argv if argv is None else [sys.argv[0], *argv])
    costs = cuda_costs_us(device) if device.type == "cuda" else None
    if costs:
        print("the watch's CUDA pieces, us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    rows = []

    def save(prof: dict | None, complete: bool) -> None:
        if args.out:
            write_json(Path(args.out), {"environment": env, "complete": complete, "bookkeeping_us_per_step": floor_us,
                                        "cuda_costs_us": costs, "overhead": rows, "full_profile": prof})

    for width, batch in sizes:
        r = overhead(width, batch, args.run_ms, args.min_steps, args.repeats, device)
        rows.append(r)
        save(None, complete=False)
        st = r["steady"]
        print(f"width {width:5d} batch {batch:5d}, {r['steps']} steps: step {st['plain_step_ms_median']:.3f} ms "
              f"plain, {st['watched_step_ms_median']:.3f} ms watched: overhead {100 * st['overhead_median']:+.2f}% "
              f"(min {100 * st['overhead_min']:+.2f}%, max {100 * st['overhead_max']:+.2f}%); whole runs "
              f"{100 * r['overhead_median']:+.2f}% (first fetch and last step included)", flush=True)
    prof = full_profile_wall_s(device, args.data, args.report_dir)
    if prof:
        print(f"full profile (doctor train, default window): {prof['wall_s']:.1f} s end to end, "
              f"verdict {prof['verdict'] and prof['verdict']['id']}")
    save(prof, complete=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
