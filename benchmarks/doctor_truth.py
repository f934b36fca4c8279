"""A doctor finding's predicted gain against its ground truth on this machine, shared by the rule benchmarks
(doctor_item_loop.py, doctor_ema_loop.py).

The script under test defines `step()` and reads its batch size from argv[1]; a third argument switches it to the
fix. For each batch size: the prediction is `fastddpm doctor run` on the unchanged script in a fresh process (the
finding's cost c gives 1 / (1 - c)); the measurement times the script's step and the fixed step alternating in one
process (warm-up, then `rounds` rounds of `steps` steps each, the order swapped every round; median and spread of
the per-round ratio). Results are written to OUT/<stem>.json and .md as each batch size finishes, so an interrupted
run keeps what it measured.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def predicted(script: Path, batch: int, work: Path, finding: str) -> dict:
    rep = work / f"rep{batch}"
    subprocess.run([sys.executable, "-m", "fastddpm", "doctor", "run", "--report-dir", str(rep), str(script),
                    str(batch)], check=True, capture_output=True, text=True)
    report = json.loads((rep / "report.json").read_text())
    found = [f for f in report["findings"] if f["id"] == finding]
    return {"cost": found[0]["cost"] if found else None, "evidence": found[0]["evidence"] if found else None,
            "step_ms": report["measurements"]["step_stats"]["median_ms"]}


def _step_of(script: Path, *argv: str):
    ns: dict = {"__name__": "bench"}
    sys.argv = ["x", *argv]
    exec(compile(script.read_text(), str(script), "exec"), ns)
    return ns["step"]


def measured(script: Path, batch: int, fixed: str, rounds: int, steps: int) -> dict:
    """The script's step ("loop") against the step with the fix (`fixed`, its name), alternating."""
    loop_step, fixed_step = _step_of(script, str(batch)), _step_of(script, str(batch), fixed)
    for f in (loop_step, fixed_step):
        for _ in range(10):
            f()
    ratios, ms = [], {"loop": [], fixed: []}
    for r in range(rounds):
        order = [("loop", loop_step), (fixed, fixed_step)]
        for name, f in order if r % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            for _ in range(steps):
                f()
            ms[name].append((time.perf_counter() - t) / steps * 1e3)
        ratios.append(ms["loop"][-1] / ms[fixed][-1])
    return {"speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "loop_ms_median": statistics.median(ms["loop"]), f"{fixed}_ms_median": statistics.median(ms[fixed])}


def compare(script_text: str, *, finding: str, fixed: str, stem: str, rounds: int, steps: int,
            threads: int | None = None) -> None:
    """`python benchmarks/<name>.py OUT [BATCH ...]` (default batches 32 and 128); `threads`: what the script
    sets, recorded (None: torch's count here)."""
    out = Path(sys.argv[1])
    batches = [int(b) for b in sys.argv[2:]] or [32, 128]
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "commit": commit, "cpu": platform.processor() or platform.machine(),
           "threads": threads or torch.get_num_threads(), "avx512_bf16": "avx512_bf16" in flags,
           "command": " ".join([sys.executable, *sys.argv])}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        script = work / f"{stem}.py"
        script.write_text(script_text)
        for batch in batches:
            p = predicted(script, batch, work, finding)
            m = measured(script, batch, fixed, rounds, steps)
            pred_x = 1 / (1 - p["cost"]) if p["cost"] is not None else None
            rows.append({"batch": batch, "predicted_speedup": pred_x, **p, **m})
            (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
            lines = [f"| batch | predicted | measured median [min-max] | loop ms | {fixed} ms |",
                     "| --- | --- | --- | --- | --- |"]
            lines += [f"| {r['batch']} | "
                      + (f"{r['predicted_speedup']:.2f}x" if r["predicted_speedup"] else "not found")
                      + f" | {r['speedup_median']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}] | "
                        f"{r['loop_ms_median']:.2f} | {r[f'{fixed}_ms_median']:.2f} |" for r in rows]
            (out / f"{stem}.md").write_text("\n".join([f"{k}: {v}" for k, v in env.items()] + [""] + lines) + "\n")
            print(lines[-1], flush=True)
