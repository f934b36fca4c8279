"""A denoiser trained the way accelerate's examples train: a --mixed_precision flag handed to the Accelerator.
Four 64-channel conv blocks at 32x32, batch 16, on the CPU. The doctor runs it unchanged."""
import argparse

import torch
from accelerate import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
p.add_argument("--epochs", type=int, default=100)
args = p.parse_args()
accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=True)


def block(c_in: int, c: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(c_in, c, 3, padding=1), torch.nn.GroupNorm(8, c), torch.nn.SiLU())


torch.manual_seed(0)
model = torch.nn.Sequential(block(3, 64), block(64, 64), block(64, 64), block(64, 64),
                            torch.nn.Conv2d(64, 3, 3, padding=1))
data = torch.utils.data.TensorDataset(torch.randn(512, 3, 32, 32))
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, opt, loader = accelerator.prepare(model, opt, loader)
for epoch in range(args.epochs):
    for (x,) in loader:
        noise = torch.randn_like(x)
        loss = torch.nn.functional.mse_loss(model(x + noise), noise)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
