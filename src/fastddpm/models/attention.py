"""Attention over (B, heads, tokens, head dim), and the same attention padded to a head dimension the fused
kernels run well.

Zero-padding q, k and v along the head dimension from d to p > d computes the same function when the softmax
scale stays 1/sqrt(d): the padded columns of q and k add 0 to every dot product, and the padded columns of the
output (from v's zeros) are sliced off; the gradients of the real columns are unchanged. It is a speed choice
only: cuDNN's attention takes head dimensions that are multiples of 8, and PyTorch's flash kernel rounds small
ones up to a tile of 32, so a U-Net that keeps its head count at every level (the seed's: 4 heads, so a head
dimension of 4 at 16 channels) sends its smallest heads to a padded kernel anyway.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastddpm.config.schema import ATTENTION_HEAD_PADS


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pad_to: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for q, k, v of shape (B, heads, tokens, d); with pad_to > d, computed on the
    inputs zero-padded to pad_to (the scale kept, the output sliced back to d)."""
    d = q.shape[-1]
    if pad_to <= d:
        return F.scaled_dot_product_attention(q, k, v)
    q, k, v = (F.pad(t, (0, pad_to - d)) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(d))[..., :d]


def set_attention_head_pad(model: torch.nn.Module, pad_to: int) -> int:
    """Pad every attention module's heads smaller than `pad_to` to it (0: off); the number of modules set."""
    if pad_to not in ATTENTION_HEAD_PADS:
        raise ValueError(f"attention head pad {pad_to} is not one of "
                         f"{', '.join(map(str, ATTENTION_HEAD_PADS))} (0 = off)")
    n = 0
    for module in model.modules():
        if hasattr(module, "head_pad"):
            module.head_pad = pad_to
            n += 1
    return n
