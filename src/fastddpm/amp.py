"""Autocast, in one place: the trainer's step (train.runtime.Precision) and the samplers enter it the same way."""

from __future__ import annotations

import contextlib

import torch


def autocast(device_type: str, dtype: torch.dtype | None, cache: bool = True):
    """torch.autocast to `dtype` on `device_type`, or no autocast at all for None (fp32). `cache=False` turns the
    weight-cast cache off, as CUDA graph capture needs (a cached cast would be freed under the graph)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)
