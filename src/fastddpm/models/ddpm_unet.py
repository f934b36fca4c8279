"""The U-Net of the DDPM / improved-diffusion line (model.family = "ddpm"), beside the seed's.

Ho et al. 2020 (arXiv:2006.11239, appendix B; the authors' diffusion/models/unet.py): a PixelCNN++-style U-Net.

    conv_in -> [ResBlock x num_res_blocks (+ attention at attention_resolutions), downsample] per level
            -> mid: ResBlock, attention, ResBlock
            -> [ResBlock x (num_res_blocks + 1) over the concatenated skip (+ attention), upsample] per level
            -> GN -> SiLU -> conv_out

    ResBlock:  GN -> SiLU -> conv3x3 -> + Linear(SiLU(t_emb)) -> GN -> SiLU -> dropout -> conv3x3, + skip
               (a 1x1 conv when the channels change). With scale_shift_norm (Nichol & Dhariwal 2021,
               arXiv:2102.09672) the embedding gives a scale and a shift: GN(h) * (1 + scale) + shift.
    Attention: x + proj(SDPA(q, k, v)) over the H*W positions after a GroupNorm; heads of num_heads.
    Down/up:   a stride-2 conv3x3 / nearest x2 + conv3x3; with resblock_updown, a ResBlock that resamples
               inside (BigGAN, Brock et al. 2019), as improved-diffusion does.
    Time:      sinusoidal(base_channels) -> Linear -> SiLU -> Linear, width 4 x base_channels; a conditional
               model adds a class embedding (num_classes + 1 entries: the last is the null class).

The defaults follow improved-diffusion's PyTorch; time_freq_shift=1, norm_eps=1e-6 and downsample_padding=tf-same
are the TensorFlow code of Ho et al. (the weights of the google/ddpm-* models diffusers converted).

ddpm-cifar10 (base 128, mult 1,2,2,2, 2 blocks, attention at 16x16, one head, dropout 0.1) has the paper's
35.7M parameters. The output layer starts at zero (as in both papers): the first steps predict eps = 0.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fastddpm.config import ModelConfig
from fastddpm.models.attention import attend
from fastddpm.models.unet import batch_timesteps, sinusoidal_time_embedding, with_class


def _zero(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


class Resample(nn.Module):
    """x2 down (stride-2 conv3x3) or up (nearest, then conv3x3). Down with tf_same pads one row and column after
    the image and none before, as TensorFlow's SAME padding does for a stride-2 3x3 conv on an even side."""

    def __init__(self, channels: int, up: bool, tf_same: bool = False):
        super().__init__()
        self.up, self.tf_same = up, tf_same and not up
        self.conv = nn.Conv2d(channels, channels, 3, stride=1 if up else 2, padding=0 if self.tf_same else 1)

    def forward(self, x_BCHW: torch.Tensor, t_emb_BD: torch.Tensor | None = None) -> torch.Tensor:
        if self.up:
            x_BCHW = F.interpolate(x_BCHW, scale_factor=2.0, mode="nearest")
        elif self.tf_same:
            x_BCHW = F.pad(x_BCHW, (0, 1, 0, 1))
        return self.conv(x_BCHW)


class ResBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, in_channels: int, out_channels: int, emb_dim: int,
                 resample: str | None = None):
        super().__init__()
        g, eps = cfg.norm_groups, cfg.norm_eps
        self.scale_shift = cfg.scale_shift_norm
        self.resample = resample  # None, "up" or "down": resampled inside the block (BigGAN style)
        self.norm1, self.conv1 = nn.GroupNorm(g, in_channels, eps), nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.emb = nn.Linear(emb_dim, out_channels * (2 if self.scale_shift else 1))
        self.norm2 = nn.GroupNorm(g, out_channels, eps)
        self.dropout = nn.Dropout(cfg.dropout)
        self.conv2 = _zero(nn.Conv2d(out_channels, out_channels, 3, padding=1))  # the block starts as identity
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def _resample(self, x: torch.Tensor) -> torch.Tensor:
        if self.resample == "up":
            return F.interpolate(x, scale_factor=2.0, mode="nearest")
        if self.resample == "down":
            return F.avg_pool2d(x, 2)
        return x

    def forward(self, x_BCHW: torch.Tensor, t_emb_BD: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm1(x_BCHW))
        h = self.conv1(self._resample(h))
        x_BCHW = self._resample(x_BCHW)
        e = self.emb(F.silu(t_emb_BD))[:, :, None, None]
        if self.scale_shift:
            scale, shift = e.chunk(2, dim=1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h + e)
        h = self.conv2(self.dropout(F.silu(h)))
        return self.skip(x_BCHW) + h


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, channels: int):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_pad = 0  # > head dim: attention zero-padded to it (the same function; models.attention)
        self.norm = nn.GroupNorm(cfg.norm_groups, channels, cfg.norm_eps)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = _zero(nn.Conv2d(channels, channels, 1))

    def forward(self, x_BCHW: torch.Tensor, t_emb_BD: torch.Tensor | None = None) -> torch.Tensor:
        B, C, H, W = x_BCHW.shape
        nh = self.num_heads
        # The 1x1 convolutions run as matmuls over (B, HW, C), so q, k and v come out with a unit-stride head
        # dimension. Made contiguous from the (B, C, HW) layout instead, the stride was lost where Inductor
        # recomputed the attention for gradient checkpointing, and cuDNN's attention rejected it (H100).
        h_BNC = self.norm(x_BCHW).flatten(2).transpose(1, 2)
        qkv = F.linear(h_BNC, self.qkv.weight.flatten(1), self.qkv.bias).view(B, H * W, 3, nh, C // nh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, HW, C/nh)
        out = attend(q, k, v, pad_to=self.head_pad).transpose(1, 2).reshape(B, H * W, C)
        out = F.linear(out, self.proj.weight.flatten(1), self.proj.bias)  # (B, HW, C)
        return x_BCHW + out.transpose(1, 2).reshape(B, C, H, W)


class Level(nn.Module):
    """The blocks one U-Net level runs in order: (ResBlock[, Attention]) pairs, optionally a resampler. Each
    ResBlock's output (and the resampler's) is a skip on the way down."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class DDPMUNet(nn.Module):
    """eps_theta(x_t, t[, y]) of the DDPM / improved-diffusion family; the seed's UNet's signature."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate_resolved()
        self.cfg = cfg
        ch, mult = cfg.base_channels, cfg.channel_mult
        emb = 4 * ch
        self.t_proj = nn.Sequential(nn.Linear(ch, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.conv_in = nn.Conv2d(cfg.image_channels, ch, 3, padding=1)
        res, skip_channels, c = cfg.image_size, [ch], ch
        self.downs = nn.ModuleList()
        for i, m in enumerate(mult):
            layers: list[nn.Module] = []
            for _ in range(cfg.num_res_blocks):
                layers.append(ResBlock(cfg, c, ch * m, emb))
                c = ch * m
                if res in cfg.attention_resolutions:
                    layers.append(Attention(cfg, c))
                skip_channels.append(c)
            if i != len(mult) - 1:
                layers.append(ResBlock(cfg, c, c, emb, resample="down") if cfg.resblock_updown
                              else Resample(c, False, tf_same=cfg.downsample_padding == "tf-same"))
                skip_channels.append(c)
                res //= 2
            self.downs.append(Level(layers))
        self.mids = nn.ModuleList([Level([ResBlock(cfg, c, c, emb), Attention(cfg, c), ResBlock(cfg, c, c, emb)])])
        self.ups = nn.ModuleList()
        for i, m in reversed(list(enumerate(mult))):
            layers = []
            for _ in range(cfg.num_res_blocks + 1):
                layers.append(ResBlock(cfg, c + skip_channels.pop(), ch * m, emb))
                c = ch * m
                if res in cfg.attention_resolutions:
                    layers.append(Attention(cfg, c))
            if i != 0:
                layers.append(ResBlock(cfg, c, c, emb, resample="up") if cfg.resblock_updown else Resample(c, True))
                res *= 2
            self.ups.append(Level(layers))
        self.norm_out = nn.GroupNorm(cfg.norm_groups, c, cfg.norm_eps)
        self.conv_out = _zero(nn.Conv2d(c, cfg.image_channels, 3, padding=1))
        self.grad_checkpointing = False
        self.num_classes = cfg.num_classes
        self.class_emb = nn.Embedding(cfg.num_classes + 1, emb) if cfg.num_classes else None

    def fsdp_units(self) -> list[nn.Module]:
        """The blocks FSDP shards one by one: every ResBlock, Attention and Resample (forward calls them directly;
        a Level's own forward never runs)."""
        return [layer for level in [*self.downs, *self.mids, *self.ups] for layer in level.layers]

    def _run(self, layer: nn.Module, h: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            # dropout draws random numbers: the recomputation must draw the same ones
            return checkpoint(layer, h, t_emb, use_reentrant=False, preserve_rng_state=self.cfg.dropout > 0)
        return layer(h, t_emb)

    def forward(self, x_BCHW: torch.Tensor, t_B: torch.Tensor, y_B: torch.Tensor | None = None) -> torch.Tensor:
        t_B = batch_timesteps(t_B, x_BCHW)
        embedded = sinusoidal_time_embedding(t_B, self.cfg.base_channels, self.cfg.time_freq_shift)
        embedded = embedded.to(self.t_proj[0].weight.dtype)  # float32 angles; a model cast to bf16 takes bf16
        t_emb = with_class(self.t_proj(embedded), self.class_emb, y_B, t_B, self.num_classes, x_BCHW.shape[0])
        h = self.conv_in(x_BCHW)
        skips = [h]
        for level in self.downs:
            for layer in level.layers:
                h = self._run(layer, h, t_emb)
                if not isinstance(layer, Attention):
                    skips.append(h)
                else:
                    skips[-1] = h  # the skip is taken after a ResBlock's attention
        for level in self.mids:
            for layer in level.layers:
                h = self._run(layer, h, t_emb)
        for level in self.ups:
            for layer in level.layers:
                if isinstance(layer, ResBlock) and layer.resample is None:
                    h = torch.cat([h, skips.pop()], dim=1)
                h = self._run(layer, h, t_emb)
        return self.conv_out(F.silu(self.norm_out(h)))
