"""`fastddpm doctor run --try 1` on a script that keeps its EMA in diffusers' EMAModel (foreach=False, its
default): rule 23's fix is the script's own argument, and --try runs the unchanged script against the script with
EMAModel built foreach=True (alternating fresh processes, default rounds, each timing a second of steps). The
model: an MLP denoiser of 2-D points, 48 residual blocks of width 32 (196 parameter tensors, 54k parameters), fused
AdamW, one thread; the EMA is most of what the step does besides its many small ops. Each run is a fresh
`fastddpm doctor run` (diagnosis and trial); its prediction and measurement go to OUT/emamodel_try.json and
OUT/emamodel_try.md as each run finishes.

    python benchmarks/doctor_emamodel_try.py OUT [RUNS]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.training_utils import EMAModel


class Denoiser(nn.Module):
    def __init__(self, d=32, depth=48):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.SiLU()) for _ in range(depth))
        self.out = nn.Linear(d, 2)

    def forward(self, x, t):
        h = self.inp(torch.cat([x, t[:, None]], 1))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


torch.manual_seed(0)
torch.set_num_threads(1)
model = Denoiser()
ema = EMAModel(model.parameters(), decay=0.999)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
data = torch.randn(4096, 2)
for step in range(1000000):
    x0 = data[torch.randint(0, len(data), (8,))]
    t = torch.randint(0, 1000, (8,))
    noise = torch.randn_like(x0)
    a = abar[t][:, None]
    loss = F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t / 1000), noise)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    ema.step(model.parameters())
'''


def main(out: Path, runs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "train_emamodel.py"
    script.write_text(SCRIPT)
    rows = []
    for run in range(1, runs + 1):
        rep = out / f"run{run}"
        subprocess.run([sys.executable, "-m", "fastddpm", "doctor", "run", "--device", "cpu", "--try", "1",
                        "--try-seconds", "0", "--report-dir", str(rep), str(script)], check=True)
        report = json.loads((rep / "report.json").read_text())
        finding = next((f for f in report["findings"] if f["id"] == "per-tensor-ema"), None)
        trial = (report.get("trials") or [None])[0]
        rows.append({"run": run, "fix": finding["fixes"][0]["code"] if finding else None, "trial": trial})
        (out / "emamodel_try.json").write_text(json.dumps(rows, indent=1) + "\n")
        lines = ["| run | predicted | measured median [min-max] | rounds | base ms/step | fix ms/step |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            t = r["trial"]
            if t is None or t.get("measured") is None:
                lines.append(f"| {r['run']} | - | not measured ({t and t.get('failed')}) | | | |")
                continue
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731 - the runs' middle step time
            lines.append(f"| {r['run']} | {t['predicted']:.2f}x | {t['measured']:.2f}x [{t['spread'][0]:.2f}-"
                         f"{t['spread'][1]:.2f}] | {t['rounds']} | {med(t['base_ms']):.2f} | {med(t['fix_ms']):.2f} |")
        (out / "emamodel_try.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
