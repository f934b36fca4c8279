"""The seed's DDPM U-Net, rebuilt: same blocks and parameter layout, fused attention, correct time embedding.

The architecture follows the public DDPM-Pytorch code the seed notebook started from:

    conv_in -> DownBlock* -> MidBlock* -> UpBlock* (skip concatenation) -> GN -> SiLU -> conv_out

    ResNet block:  GN -> SiLU -> conv3x3 -> + Linear(SiLU(t_emb)) -> GN -> SiLU -> conv3x3, + 1x1 conv(input)
    Attention:     x + SelfAttention(GN(x)) over the H*W positions
    Down:          [ResNet, Attention] x num_layers, then a 4x4 stride-2 conv (or nothing)
    Mid:           ResNet, then [Attention, ResNet] x num_layers
    Up:            4x4 stride-2 transposed conv (or nothing), concat skip, [ResNet, Attention] x num_layers

Two deliberate differences from that code, neither of which changes the parameter count:
  * The sinusoidal time embedding uses the real frequencies 10000^(-i / (d/2)) (Vaswani et al. 2017,
    sec. 3.5). The seed notebook's variant used integer division, which made every frequency equal.
  * Attention runs through F.scaled_dot_product_attention, which reaches the fused flash / memory-efficient
    kernels. nn.MultiheadAttention(need_weights=True) never does, and materialises B x heads x HW x HW.
    The projections keep nn.MultiheadAttention's shapes (one C -> 3C in-projection, one C -> C out-projection,
    both with bias).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fastddpm.config import ModelConfig
from fastddpm.models.attention import attend


def sinusoidal_time_embedding(t_B: torch.Tensor, dim: int, freq_shift: int = 0) -> torch.Tensor:
    """Timesteps (B,) -> (B, dim) embedding [sin(t * w_i), cos(t * w_i)], w_i = 10000^(-i / (dim/2 - freq_shift)).
    freq_shift 1 is Ho et al.'s TensorFlow code (its lowest frequency is then exactly 1/10000)."""
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float32, device=t_B.device) / (half - freq_shift)
    freqs = torch.exp(-math.log(10000.0) * exponent)  # (half,)
    angles = t_B.to(torch.float32)[:, None] * freqs[None, :]  # (B, half)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


def batch_timesteps(t_B: torch.Tensor, x_BCHW: torch.Tensor) -> torch.Tensor:
    """t_B as (B,): a 0-dim timestep (one for the whole batch, as diffusers' UNet2DModel accepts) repeated."""
    return t_B.expand(x_BCHW.shape[0]) if t_B.ndim == 0 else t_B


def check_labels(y_B: torch.Tensor, batch: int, num_classes: int) -> None:
    """A ValueError naming what is wrong with a conditional model's labels. The range is checked only for labels
    on the CPU, outside torch.compile and tracing: there it costs no host-device sync. (An id past the embedding
    table is otherwise IndexError 'index out of range in self'; the samplers check CUDA labels once per call.)"""
    if y_B.dtype == torch.bool or y_B.is_floating_point() or y_B.is_complex():
        raise ValueError(f"class labels must be an integer tensor of class ids, got {y_B.dtype}")
    # batch first: under torch.export's dynamic batch the two are one symbol and no guard on the size is made
    if y_B.ndim > 1 or (y_B.ndim == 1 and y_B.shape[0] != batch and y_B.shape[0] != 1):
        raise ValueError(f"class labels of shape {tuple(y_B.shape)} for a batch of {batch}: give one class id per "
                         f"image, shape ({batch},)")
    if y_B.device.type == "cpu" and not (torch.compiler.is_compiling() or torch.jit.is_tracing()):
        bad = y_B[(y_B < 0) | (y_B > num_classes)]
        if bad.numel():
            raise ValueError(f"class label {int(bad.reshape(-1)[0])} is out of range: this model has classes 0-"
                             f"{num_classes - 1} and {num_classes} for its null class (unconditional)")


def with_class(t_emb_BD: torch.Tensor, class_emb: nn.Embedding | None, y_B: torch.Tensor | None, t_B: torch.Tensor,
               num_classes: int, batch: int | None = None) -> torch.Tensor:
    """The time embedding plus a conditional model's class embedding (y None: the null class, id num_classes);
    both U-Net families condition this way. `batch`: the images' (default: the timesteps')."""
    if class_emb is not None:
        if y_B is None:  # no label: the null class (long: t_B is a float noise level under EDM and flow)
            y_B = torch.full_like(t_B, num_classes, dtype=torch.long)
        check_labels(y_B, t_B.shape[0] if batch is None else batch, num_classes)
        return t_emb_BD + class_emb(y_B)
    if y_B is not None:
        raise ValueError("this U-Net is unconditional (model.num_classes=0): it takes no class labels")
    return t_emb_BD


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, t_emb_dim: int, groups: int):
        super().__init__()
        self.conv1 = nn.Sequential(
            nn.GroupNorm(groups, in_channels), nn.SiLU(), nn.Conv2d(in_channels, out_channels, 3, padding=1)
        )
        self.t_proj = nn.Sequential(nn.SiLU(), nn.Linear(t_emb_dim, out_channels))
        self.conv2 = nn.Sequential(
            nn.GroupNorm(groups, out_channels), nn.SiLU(), nn.Conv2d(out_channels, out_channels, 3, padding=1)
        )
        # The seed's code always has a 1x1 residual conv, even when in == out channels; kept for parity.
        self.skip = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x_BCHW: torch.Tensor, t_emb_BD: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x_BCHW)
        h = h + self.t_proj(t_emb_BD)[:, :, None, None]
        h = self.conv2(h)
        return h + self.skip(x_BCHW)


class SelfAttention(nn.Module):
    """Pre-norm multi-head self-attention over the H*W positions of a feature map, with a residual."""

    def __init__(self, channels: int, num_heads: int, groups: int):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"attention channels {channels} are not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_pad = 0  # > head dim: attention zero-padded to it (the same function; models.attention)
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x_BCHW.shape
        h = self.norm(x_BCHW).flatten(2).transpose(1, 2)  # (B, HW, C)
        q, k, v = self.qkv(h).view(B, H * W, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        # q, k, v: (B, nh, HW, hs)
        out = attend(q, k, v, pad_to=self.head_pad)  # (B, nh, HW, hs)
        out = self.proj(out.transpose(1, 2).reshape(B, H * W, C))  # (B, HW, C)
        return x_BCHW + out.transpose(1, 2).reshape(B, C, H, W)


class DownBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, in_channels: int, out_channels: int, down_sample: bool):
        super().__init__()
        n = cfg.num_down_layers
        g, d = cfg.norm_groups, cfg.time_emb_dim
        self.resnets = nn.ModuleList(
            [ResnetBlock(in_channels if i == 0 else out_channels, out_channels, d, g) for i in range(n)]
        )
        self.attns = nn.ModuleList(
            [SelfAttention(out_channels, cfg.num_heads, g) if cfg.attention else nn.Identity() for _ in range(n)]
        )
        self.down = nn.Conv2d(out_channels, out_channels, 4, stride=2, padding=1) if down_sample else nn.Identity()

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        for resnet, attn in zip(self.resnets, self.attns):
            x = attn(resnet(x, t_emb))
        return self.down(x)


class MidBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, in_channels: int, out_channels: int):
        super().__init__()
        n = cfg.num_mid_layers
        g, d = cfg.norm_groups, cfg.time_emb_dim
        self.resnets = nn.ModuleList(
            [ResnetBlock(in_channels if i == 0 else out_channels, out_channels, d, g) for i in range(n + 1)]
        )
        self.attns = nn.ModuleList(
            [SelfAttention(out_channels, cfg.num_heads, g) if cfg.attention else nn.Identity() for _ in range(n)]
        )

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x, t_emb)
        for attn, resnet in zip(self.attns, self.resnets[1:]):
            x = resnet(attn(x), t_emb)
        return x


class UpBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, in_channels: int, out_channels: int, up_sample: bool):
        super().__init__()
        n = cfg.num_up_layers
        g, d = cfg.norm_groups, cfg.time_emb_dim
        # The incoming feature map has in_channels // 2 channels; the skip brings the other half.
        half = in_channels // 2
        self.up = nn.ConvTranspose2d(half, half, 4, stride=2, padding=1) if up_sample else nn.Identity()
        self.resnets = nn.ModuleList(
            [ResnetBlock(in_channels if i == 0 else out_channels, out_channels, d, g) for i in range(n)]
        )
        self.attns = nn.ModuleList(
            [SelfAttention(out_channels, cfg.num_heads, g) if cfg.attention else nn.Identity() for _ in range(n)]
        )

    def forward(self, x: torch.Tensor, skip: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.up(x), skip], dim=1)
        for resnet, attn in zip(self.resnets, self.attns):
            x = attn(resnet(x, t_emb))
        return x


class UNet(nn.Module):
    """eps_theta(x_t, t[, y]): (B, C, H, W) images in [-1, 1] and (B,) integer timesteps -> (B, C, H, W).

    A conditional model (cfg.num_classes > 0) also takes y, (B,) class ids in [0, num_classes]: the last id is
    the null class that classifier-free guidance trains by dropping labels (Ho & Salimans 2022,
    arXiv:2207.12598). Its embedding is added to the time embedding, as improved-diffusion does; y=None means
    the null class for every image."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate_resolved()
        self.cfg = cfg
        dc, mc = cfg.down_channels, cfg.mid_channels
        d = cfg.time_emb_dim
        self.t_proj = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.conv_in = nn.Conv2d(cfg.image_channels, dc[0], 3, padding=1)
        self.downs = nn.ModuleList(
            [DownBlock(cfg, dc[i], dc[i + 1], cfg.down_sample[i]) for i in range(len(dc) - 1)]
        )
        self.mids = nn.ModuleList([MidBlock(cfg, mc[i], mc[i + 1]) for i in range(len(mc) - 1)])
        self.ups = nn.ModuleList(
            [
                UpBlock(cfg, dc[i] * 2, dc[i - 1] if i != 0 else cfg.out_block_channels, cfg.down_sample[i])
                for i in reversed(range(len(dc) - 1))
            ]
        )
        self.norm_out = nn.GroupNorm(cfg.norm_groups, cfg.out_block_channels)
        self.conv_out = nn.Conv2d(cfg.out_block_channels, cfg.image_channels, 3, padding=1)
        # Gradient checkpointing per block (a training choice, not part of the architecture): each block's
        # activations are recomputed in backward instead of stored, trading ~30% more compute for memory.
        self.grad_checkpointing = False
        # Built last: a conditional model's other weights start where the unconditional one's do (same seed).
        self.num_classes = cfg.num_classes
        self.class_emb = nn.Embedding(cfg.num_classes + 1, d) if cfg.num_classes else None

    def fsdp_units(self) -> list[nn.Module]:
        """The blocks FSDP shards one by one (fastddpm.trainer.fsdp.shard_unet): each down, mid and up block."""
        return [*self.downs, *self.mids, *self.ups]

    def _run(self, block: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            # The U-Net has no dropout: no RNG state to save (saving it also breaks CUDA graph capture).
            return checkpoint(block, *args, use_reentrant=False, preserve_rng_state=False)
        return block(*args)

    def forward(self, x_BCHW: torch.Tensor, t_B: torch.Tensor, y_B: torch.Tensor | None = None) -> torch.Tensor:
        # float32 angles (up to ~1000 rad), then the weights' dtype: a model cast to bf16/fp16, not autocast
        t_B = batch_timesteps(t_B, x_BCHW)
        embedded = sinusoidal_time_embedding(t_B, self.cfg.time_emb_dim).to(self.t_proj[0].weight.dtype)
        t_emb = with_class(self.t_proj(embedded), self.class_emb, y_B, t_B, self.num_classes, x_BCHW.shape[0])
        h = self.conv_in(x_BCHW)
        skips = []
        for down in self.downs:
            skips.append(h)
            h = self._run(down, h, t_emb)
        for mid in self.mids:
            h = self._run(mid, h, t_emb)
        for up in self.ups:
            h = self._run(up, h, skips.pop(), t_emb)
        return self.conv_out(F.silu(self.norm_out(h)))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
