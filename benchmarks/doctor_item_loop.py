"""Rule 22 (a per-sample loop in the step) against its ground truth, on this machine.

For each batch size: the doctor's predicted gain for the loop it finds in a small training script whose loss is
summed sample by sample (`fastddpm doctor run`, a fresh process), and the gain measured by timing the same step
with the loop and with one batched F.mse_loss, alternating in one process (warm-up, then ROUNDS rounds of
STEPS steps each; median and spread of the per-round ratio). Writes item_loop.json and item_loop.md to OUT as
each batch size finishes.

    python benchmarks/doctor_item_loop.py OUT [BATCH ...]
"""

from __future__ import annotations

from doctor_truth import compare  # benchmarks/, this script's folder

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


if __name__ == "__main__":
    compare(SCRIPT, finding="item-loop", fixed="batched", stem="item_loop", rounds=ROUNDS, steps=STEPS)
