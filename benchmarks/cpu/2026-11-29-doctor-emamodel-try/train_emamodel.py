
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
