"""A DDPM training script of the kind a user writes after following the seed tutorial (a U-Net on MNIST-style PNGs).

It is kept deliberately unoptimised, the way such loops usually are: every step opens and decodes PNG files with
PIL, the model trains in fp32 and eager mode, and the attention calls `nn.MultiheadAttention` with its default
need_weights=True, which materialises the (B, L, L) attention weights instead of taking the fused
scaled_dot_product_attention path. It imports nothing from fastddpm: it is the "unmodified user script" that
`fastddpm doctor run` is tested and measured on.

Each flag below is one fix a profiler report would prescribe, applied here in the script. All are off by default,
so the plain command stays the baseline:
  --bf16             torch.autocast(device_type, dtype=torch.bfloat16) around forward + loss
  --sdpa-attention   call the attention with need_weights=False, so nn.MultiheadAttention uses the fused
                     scaled_dot_product_attention and never builds the weights
  --compile          torch.compile(model)
  --fused-adam       AdamW(..., fused=True) where this torch supports it on the device, else foreach=True

Run it:
  python examples/seed_ddpm/train.py --data DIR                        # DIR: a folder of PNGs, searched recursively
  python examples/seed_ddpm/train.py --data DIR --max-steps 50 --bf16 --sdpa-attention
and under the doctor, unchanged:
  fastddpm doctor run examples/seed_ddpm/train.py --data DIR

At the end it prints one line starting with `steady:` (images/s over the steps after the first 3) for benchmarks.
"""

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

STEADY_AFTER_STEPS = 3  # the first steps pay for allocator warm-up (and compilation with --compile): not timed


# ----------------------------------------------------------------------------------------------------------------
# data: one PNG opened and decoded per __getitem__, as in the seed's first version (before its RAM pre-loading)

class PngFolder(Dataset):
    """Every *.png under `root` (recursively), as float tensors (C, H, W) in [-1, 1].

    The channel count follows the first file: grayscale files give C=1, anything else C=3, and every file is
    converted to that mode. Files of another size are resized to image_size x image_size."""

    def __init__(self, root: str, image_size: int):
        self.paths = sorted(Path(root).rglob("*.png"))
        if not self.paths:
            raise SystemExit(f"no .png files under {root!r}: point --data at a folder of PNGs "
                             f"(see examples/seed_ddpm/README.md for how to make one)")
        self.image_size = image_size
        with Image.open(self.paths[0]) as im:
            self.mode = "L" if im.mode in ("1", "L", "LA", "I", "I;16", "F") else "RGB"
        self.channels = 1 if self.mode == "L" else 3

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        with Image.open(self.paths[index]) as im:
            im = im.convert(self.mode)
            if im.size != (self.image_size, self.image_size):
                im = im.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
            x = np.asarray(im, dtype=np.float32) / 127.5 - 1.0  # uint8 [0, 255] -> [-1, 1]
        if x.ndim == 2:
            x = x[:, :, None]
        return torch.from_numpy(x).permute(2, 0, 1).contiguous()  # (H, W, C) -> (C, H, W)


# ----------------------------------------------------------------------------------------------------------------
# model: the seed's DDPM U-Net (ResNet blocks with a time-embedding projection, self-attention at every level)

def sinusoidal_time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(B,) integer timesteps -> (B, dim): sin/cos at geometrically spaced frequencies (Transformer / DDPM)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> conv3x3, plus the projected time embedding, then GroupNorm -> SiLU -> conv3x3,
    with a 1x1 conv on the skip path."""

    def __init__(self, in_ch: int, out_ch: int, t_emb_dim: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.GroupNorm(8, in_ch), nn.SiLU(), nn.Conv2d(in_ch, out_ch, 3, padding=1))
        self.t_proj = nn.Sequential(nn.SiLU(), nn.Linear(t_emb_dim, out_ch))
        self.conv2 = nn.Sequential(nn.GroupNorm(8, out_ch), nn.SiLU(), nn.Conv2d(out_ch, out_ch, 3, padding=1))
        self.skip = nn.Conv2d(in_ch, out_ch, 1)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x)
        h = h + self.t_proj(t_emb)[:, :, None, None]
        h = self.conv2(h)
        return h + self.skip(x)


class SelfAttention(nn.Module):
    """GroupNorm, then multi-head self-attention over the H*W positions, added back to the input."""

    def __init__(self, channels: int, num_heads: int, sdpa_attention: bool):
        super().__init__()
        self.norm = nn.GroupNorm(8, channels)
        self.attn = nn.MultiheadAttention(channels, num_heads, batch_first=True)
        self.sdpa_attention = sdpa_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.norm(x).reshape(B, C, H * W).transpose(1, 2)  # (B, L, C), L = H*W
        if self.sdpa_attention:
            h, _ = self.attn(h, h, h, need_weights=False)  # fused scaled_dot_product_attention, no weights kept
        else:
            # The default need_weights=True: the (B, L, L) head-averaged weights are built and returned (and the
            # per-head (B*heads, L, L) softmax is kept for backward), though nothing here uses them.
            h, _ = self.attn(h, h, h)
        return x + h.transpose(1, 2).reshape(B, C, H, W)


class DownBlock(nn.Module):
    def __init__(self, in_ch, out_ch, t_emb_dim, down_sample, num_heads, num_layers, sdpa_attention):
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(in_ch if i == 0 else out_ch, out_ch, t_emb_dim)
                                     for i in range(num_layers))
        self.attns = nn.ModuleList(SelfAttention(out_ch, num_heads, sdpa_attention) for _ in range(num_layers))
        self.down = nn.Conv2d(out_ch, out_ch, 4, stride=2, padding=1) if down_sample else nn.Identity()

    def forward(self, x, t_emb):
        for resnet, attn in zip(self.resnets, self.attns):
            x = attn(resnet(x, t_emb))
        return self.down(x)


class MidBlock(nn.Module):
    """resnet, then (attention, resnet) num_layers times."""

    def __init__(self, in_ch, out_ch, t_emb_dim, num_heads, num_layers, sdpa_attention):
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(in_ch if i == 0 else out_ch, out_ch, t_emb_dim)
                                     for i in range(num_layers + 1))
        self.attns = nn.ModuleList(SelfAttention(out_ch, num_heads, sdpa_attention) for _ in range(num_layers))

    def forward(self, x, t_emb):
        x = self.resnets[0](x, t_emb)
        for attn, resnet in zip(self.attns, self.resnets[1:]):
            x = resnet(attn(x), t_emb)
        return x


class UpBlock(nn.Module):
    """Upsample the input (half of in_ch), concatenate the skip (the other half), then resnet + attention."""

    def __init__(self, in_ch, out_ch, t_emb_dim, up_sample, num_heads, num_layers, sdpa_attention):
        super().__init__()
        self.up = (nn.ConvTranspose2d(in_ch // 2, in_ch // 2, 4, stride=2, padding=1) if up_sample
                   else nn.Identity())
        self.resnets = nn.ModuleList(ResnetBlock(in_ch if i == 0 else out_ch, out_ch, t_emb_dim)
                                     for i in range(num_layers))
        self.attns = nn.ModuleList(SelfAttention(out_ch, num_heads, sdpa_attention) for _ in range(num_layers))

    def forward(self, x, skip, t_emb):
        x = torch.cat([self.up(x), skip], dim=1)
        for resnet, attn in zip(self.resnets, self.attns):
            x = attn(resnet(x, t_emb))
        return x


class UNet(nn.Module):
    """The seed's U-Net with base channels b; b=32 is the seed's MNIST config (down channels 32, 64, 128, 256,
    time embedding 128, 4 heads): 10.2M parameters.

        conv_in -> b
        down:  b -> 2b (28 -> 14),  2b -> 4b (14 -> 7),  4b -> 8b (7)        each: 2 x (resnet, attention)
        mid:   8b -> 8b -> 4b (7)                                            resnet, 2 x (attention, resnet)
        up:    4b + 4b -> 2b (7),  2b + 2b -> b (7 -> 14),  b + b -> b (14 -> 28)   skip concatenated first
        GroupNorm -> SiLU -> conv_out -> image channels (the predicted noise)
    """

    def __init__(self, image_channels: int = 1, base_channels: int = 32, num_heads: int = 4, num_layers: int = 2,
                 sdpa_attention: bool = False):
        super().__init__()
        b = base_channels
        down_channels = [b, 2 * b, 4 * b, 8 * b]
        down_sample = [True, True, False]
        mid_channels = [8 * b, 8 * b, 4 * b]
        self.t_emb_dim = 4 * b
        self.t_mlp = nn.Sequential(nn.Linear(self.t_emb_dim, self.t_emb_dim), nn.SiLU(),
                                   nn.Linear(self.t_emb_dim, self.t_emb_dim))
        self.conv_in = nn.Conv2d(image_channels, b, 3, padding=1)
        self.downs = nn.ModuleList(
            DownBlock(down_channels[i], down_channels[i + 1], self.t_emb_dim, down_sample[i], num_heads, num_layers,
                      sdpa_attention) for i in range(len(down_channels) - 1))
        self.mids = nn.ModuleList(
            MidBlock(mid_channels[i], mid_channels[i + 1], self.t_emb_dim, num_heads, num_layers, sdpa_attention)
            for i in range(len(mid_channels) - 1))
        self.ups = nn.ModuleList(
            UpBlock(down_channels[i] * 2, down_channels[i - 1] if i > 0 else b, self.t_emb_dim, down_sample[i],
                    num_heads, num_layers, sdpa_attention) for i in reversed(range(len(down_channels) - 1)))
        self.norm_out = nn.GroupNorm(8, b)
        self.conv_out = nn.Conv2d(b, image_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t_emb = self.t_mlp(sinusoidal_time_embedding(t, self.t_emb_dim))
        x = self.conv_in(x)
        skips = []
        for down in self.downs:
            skips.append(x)
            x = down(x, t_emb)
        for mid in self.mids:
            x = mid(x, t_emb)
        for up in self.ups:
            x = up(x, skips.pop(), t_emb)
        return self.conv_out(F.silu(self.norm_out(x)))


# ----------------------------------------------------------------------------------------------------------------
# diffusion: linear beta schedule, forward process q(x_t | x_0), epsilon-prediction loss (Ho et al. 2020)

class LinearNoiseSchedule:
    def __init__(self, num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02, device="cpu"):
        self.num_timesteps = num_timesteps
        betas = torch.linspace(beta_start, beta_end, num_timesteps, device=device)
        alpha_bars = torch.cumprod(1.0 - betas, dim=0)
        self.sqrt_alpha_bars = alpha_bars.sqrt()
        self.sqrt_one_minus_alpha_bars = (1.0 - alpha_bars).sqrt()

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps  (DDPM eq. 4)."""
        return (self.sqrt_alpha_bars[t][:, None, None, None] * x0
                + self.sqrt_one_minus_alpha_bars[t][:, None, None, None] * noise)


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a DDPM U-Net on a folder of PNG images (seed-style loop).")
    p.add_argument("--data", required=True, help="folder of .png files (searched recursively)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--base-channels", type=int, default=32,
                   help="U-Net width b, a multiple of 8; the seed's 32 gives ~10.2M parameters")
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    p.add_argument("--bf16", action="store_true", help="fix: bf16 autocast around forward + loss")
    p.add_argument("--sdpa-attention", action="store_true",
                   help="fix: attention with need_weights=False (fused scaled_dot_product_attention)")
    p.add_argument("--compile", action="store_true", help="fix: torch.compile(model)")
    p.add_argument("--fused-adam", action="store_true", help="fix: AdamW(fused=True), else foreach=True")
    args = p.parse_args(argv)
    if args.base_channels <= 0 or args.base_channels % 8:
        p.error(f"--base-channels {args.base_channels}: must be a positive multiple of 8 (GroupNorm uses 8 groups)")
    if args.image_size % 4:
        p.error(f"--image-size {args.image_size}: must be a multiple of 4 (the U-Net halves it twice)")
    return args


def make_optimizer(model: nn.Module, lr: float, fused_adam: bool) -> torch.optim.Optimizer:
    if not fused_adam:
        return torch.optim.AdamW(model.parameters(), lr=lr)
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    except RuntimeError:  # this torch has no fused AdamW for the parameters' device
        return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    dataset = PngFolder(args.data, args.image_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
                        drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"{len(dataset)} images under {args.data!r} make no full batch of {args.batch_size}: "
                         f"add images or lower --batch-size")

    model = UNet(dataset.channels, args.base_channels, sdpa_attention=args.sdpa_attention).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters ({num_params / 1e6:.2f}M), base channels {args.base_channels}")
    optimizer = make_optimizer(model, args.lr, args.fused_adam)
    if args.compile:
        model = torch.compile(model)
    schedule = LinearNoiseSchedule(device=device)

    opt_impl = ("fused" if optimizer.defaults.get("fused") else
                "foreach" if optimizer.defaults.get("foreach") else "default")
    print(f"data: {len(dataset)} PNGs from {args.data}, {dataset.channels}x{args.image_size}x{args.image_size}, "
          f"batch {args.batch_size}, {args.num_workers} workers")
    sdpa_attention = all(m.sdpa_attention for m in model.modules() if isinstance(m, SelfAttention))
    print(f"settings: device={device.type} bf16={args.bf16} sdpa_attention={sdpa_attention} "
          f"compile={args.compile} adamw={opt_impl}")

    step = 0
    steady_start = None
    done = False
    model.train()
    for epoch in range(args.epochs):
        for x0 in loader:
            x0 = x0.to(device)
            t = torch.randint(0, schedule.num_timesteps, (x0.shape[0],), device=device)
            noise = torch.randn_like(x0)
            xt = schedule.add_noise(x0, noise, t)

            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                noise_pred = model(xt, t)
                loss = F.mse_loss(noise_pred.float(), noise)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1

            if step == 1:
                print(f"first step: prediction dtype {noise_pred.dtype}")
            if step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")  # .item(): a device sync, only here
            if step == STEADY_AFTER_STEPS:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # start the clock when the GPU has finished the untimed steps
                steady_start = time.perf_counter()
            if args.max_steps is not None and step >= args.max_steps:
                done = True
                break
        if done:
            break

    if device.type == "cuda":
        torch.cuda.synchronize()  # the clock stops when the GPU has finished, not when the last launch returned
    steady_steps = step - STEADY_AFTER_STEPS
    if steady_start is None or steady_steps <= 0:
        print(f"steady: n/a ({step} steps; the first {STEADY_AFTER_STEPS} are not timed)")
    else:
        seconds = time.perf_counter() - steady_start
        print(f"steady: {steady_steps * args.batch_size / seconds:.1f} images/s over {steady_steps} steps "
              f"({1000 * seconds / steady_steps:.1f} ms/step, batch {args.batch_size}, {step} steps in all)")


if __name__ == "__main__":
    main()
