"""Rule 23 (an EMA of the weights updated by a Python loop over the parameters) against its ground truth, here.

For each batch size: the doctor's predicted gain for the per-tensor EMA it finds in a small training script (an
MLP denoiser of 2-D points, 8.4M parameters in 52 tensors, fused AdamW, `p_ema.mul_(d).add_(p, alpha=1 - d)` per
tensor after each step; `fastddpm doctor run`, a fresh process), and the gain measured by timing the same step with
that loop and with one torch._foreach_lerp_, alternating in one process (warm-up, then ROUNDS rounds of STEPS steps
each; median and spread of the per-round ratio). The script runs on one thread: on a shared 2-core machine two
threads wait on each other's stragglers and the step's spread hides the EMA. Writes ema_loop.json and ema_loop.md
to OUT as each batch size finishes.

    python benchmarks/doctor_ema_loop.py OUT [BATCH ...]
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

ROUNDS, STEPS = 21, 10  # short rounds: the shared machine's load moves over seconds
SCRIPT = '''
import copy
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(F.silu(self.fc1(self.norm(h))))


class Denoiser(nn.Module):
    def __init__(self, d=512, depth=8):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(ResBlock(d) for _ in range(depth))
        self.out = nn.Linear(d, 2)

    def forward(self, x, t):
        h = self.inp(torch.cat([x, t[:, None]], 1))
        for b in self.blocks:
            h = b(h)
        return self.out(h)


torch.manual_seed(0)
torch.set_num_threads(1)
model = Denoiser()
ema = copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
decay = 0.999
data = torch.randn(10000, 2)
batch = int(sys.argv[1])
foreach = len(sys.argv) > 2
ema_params, model_params = list(ema.parameters()), list(model.parameters())


def step():
    x0 = data[torch.randint(0, len(data), (batch,))]
    t = torch.randint(0, 1000, (batch,))
    noise = torch.randn_like(x0)
    a = abar[t][:, None]
    loss = F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t / 1000), noise)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    with torch.no_grad():
        if foreach:
            torch._foreach_lerp_(ema_params, model_params, 1 - decay)
        else:
            for p_ema, p in zip(ema.parameters(), model.parameters()):
                p_ema.mul_(decay).add_(p.detach(), alpha=1 - decay)


if __name__ == "__main__":
    for _ in range(400):
        step()
'''


def predicted(script: Path, batch: int, work: Path) -> dict:
    rep = work / f"rep{batch}"
    subprocess.run([sys.executable, "-m", "fastddpm", "doctor", "run", "--report-dir", str(rep), str(script),
                    str(batch)], check=True, capture_output=True, text=True)
    report = json.loads((rep / "report.json").read_text())
    found = [f for f in report["findings"] if f["id"] == "per-tensor-ema"]
    return {"cost": found[0]["cost"] if found else None, "evidence": found[0]["evidence"] if found else None,
            "step_ms": report["measurements"]["step_stats"]["median_ms"]}


def measured(script: Path, batch: int) -> dict:
    ns: dict = {"__name__": "bench"}
    sys.argv = ["x", str(batch)]
    exec(compile(script.read_text(), str(script), "exec"), ns)
    loop_step = ns["step"]
    ns_f: dict = {"__name__": "bench"}
    sys.argv = ["x", str(batch), "foreach"]
    exec(compile(script.read_text(), str(script), "exec"), ns_f)
    foreach_step = ns_f["step"]
    for f in (loop_step, foreach_step):
        for _ in range(10):
            f()
    ratios, loop_ms, foreach_ms = [], [], []
    for r in range(ROUNDS):
        times = {}
        for name, f in ((("loop", loop_step), ("foreach", foreach_step)) if r % 2 == 0
                        else (("foreach", foreach_step), ("loop", loop_step))):
            t = time.perf_counter()
            for _ in range(STEPS):
                f()
            times[name] = (time.perf_counter() - t) / STEPS * 1e3
        loop_ms.append(times["loop"])
        foreach_ms.append(times["foreach"])
        ratios.append(times["loop"] / times["foreach"])
    return {"speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "loop_ms_median": statistics.median(loop_ms), "foreach_ms_median": statistics.median(foreach_ms)}


def main() -> None:
    out = Path(sys.argv[1])
    batches = [int(b) for b in sys.argv[2:]] or [32, 128]
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "commit": commit, "cpu": platform.processor() or platform.machine(), "threads": 1,  # the script sets it
           "avx512_bf16": "avx512_bf16" in flags, "command": " ".join([sys.executable, *sys.argv])}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        script = work / "ema_loop.py"
        script.write_text(SCRIPT)
        for batch in batches:
            p = predicted(script, batch, work)
            m = measured(script, batch)
            pred_x = 1 / (1 - p["cost"]) if p["cost"] is not None else None
            rows.append({"batch": batch, "predicted_speedup": pred_x, **p, **m})
            (out / "ema_loop.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
            lines = ["| batch | predicted | measured median [min-max] | loop ms | foreach ms |",
                     "| --- | --- | --- | --- | --- |"]
            lines += [f"| {r['batch']} | "
                      + (f"{r['predicted_speedup']:.2f}x" if r["predicted_speedup"] else "not found")
                      + f" | {r['speedup_median']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}] | "
                        f"{r['loop_ms_median']:.2f} | {r['foreach_ms_median']:.2f} |" for r in rows]
            (out / "ema_loop.md").write_text("\n".join([f"{k}: {v}" for k, v in env.items()] + [""] + lines) + "\n")
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
