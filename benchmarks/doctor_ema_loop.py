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

from doctor_truth import compare  # benchmarks/, this script's folder

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


if __name__ == "__main__":
    compare(SCRIPT, finding="per-tensor-ema", fixed="foreach", stem="ema_loop", rounds=ROUNDS, steps=STEPS, threads=1)
