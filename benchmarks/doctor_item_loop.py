"""Rule 22 (a per-sample loop in the step) against its ground truth, on this machine.

For each batch size: the doctor's predicted gain for the loop it finds in a small training script whose loss is
summed sample by sample (`fastddpm doctor run`, a fresh process), and the gain measured by timing the same step
with the loop and with one batched F.mse_loss, alternating in one process (warm-up, then ROUNDS rounds of
STEPS steps each; median and spread of the per-round ratio). Writes item_loop.json and item_loop.md to OUT as
each batch size finishes.

    python benchmarks/doctor_item_loop.py OUT [BATCH ...]
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

ROUNDS, STEPS = 9, 20
SCRIPT = '''
import sys
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(16, 1, 3, padding=1))
opt = torch.optim.Adam(model.parameters(), 1e-3, foreach=True)
batch = int(sys.argv[1])
x = torch.randn(batch, 1, 28, 28)
batched = len(sys.argv) > 2


def step():
    pred = model(x)
    if batched:
        loss = F.mse_loss(pred, x)
    else:
        loss = sum(F.mse_loss(pred[i], x[i]) for i in range(batch)) / batch
    opt.zero_grad()
    loss.backward()
    opt.step()


if __name__ == "__main__":
    for _ in range(400):
        step()
'''


def predicted(script: Path, batch: int, work: Path) -> dict:
    rep = work / f"rep{batch}"
    subprocess.run([sys.executable, "-m", "fastddpm", "doctor", "run", "--report-dir", str(rep), str(script),
                    str(batch)], check=True, capture_output=True, text=True)
    report = json.loads((rep / "report.json").read_text())
    found = [f for f in report["findings"] if f["id"] == "item-loop"]
    return {"cost": found[0]["cost"] if found else None, "evidence": found[0]["evidence"] if found else None,
            "step_ms": report["measurements"]["step_stats"]["median_ms"]}


def measured(script: Path, batch: int) -> dict:
    ns: dict = {"__name__": "bench"}
    sys.argv = ["x", str(batch)]
    exec(compile(script.read_text(), str(script), "exec"), ns)
    loop_step = ns["step"]
    ns_b: dict = {"__name__": "bench"}
    sys.argv = ["x", str(batch), "batched"]
    exec(compile(script.read_text(), str(script), "exec"), ns_b)
    batched_step = ns_b["step"]
    for f in (loop_step, batched_step):
        for _ in range(10):
            f()
    ratios, loop_ms, batched_ms = [], [], []
    for r in range(ROUNDS):
        times = {}
        for name, f in ((("loop", loop_step), ("batched", batched_step)) if r % 2 == 0
                        else (("batched", batched_step), ("loop", loop_step))):
            t = time.perf_counter()
            for _ in range(STEPS):
                f()
            times[name] = (time.perf_counter() - t) / STEPS * 1e3
        loop_ms.append(times["loop"])
        batched_ms.append(times["batched"])
        ratios.append(times["loop"] / times["batched"])
    return {"speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "loop_ms_median": statistics.median(loop_ms), "batched_ms_median": statistics.median(batched_ms)}


def main() -> None:
    out = Path(sys.argv[1])
    batches = [int(b) for b in sys.argv[2:]] or [32, 128]
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "commit": commit, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "avx512_bf16": "avx512_bf16" in flags, "command": " ".join([sys.executable, *sys.argv])}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        script = work / "per_sample_loss.py"
        script.write_text(SCRIPT)
        for batch in batches:
            p = predicted(script, batch, work)
            m = measured(script, batch)
            pred_x = 1 / (1 - p["cost"]) if p["cost"] is not None else None
            rows.append({"batch": batch, "predicted_speedup": pred_x, **p, **m})
            (out / "item_loop.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
            lines = ["| batch | predicted | measured median [min-max] | loop ms | batched ms |",
                     "| --- | --- | --- | --- | --- |"]
            lines += [f"| {r['batch']} | "
                      + (f"{r['predicted_speedup']:.2f}x" if r["predicted_speedup"] else "not found")
                      + f" | {r['speedup_median']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}] | "
                        f"{r['loop_ms_median']:.2f} | {r['batched_ms_median']:.2f} |" for r in rows]
            (out / "item_loop.md").write_text("\n".join([f"{k}: {v}" for k, v in env.items()] + [""] + lines) + "\n")
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
