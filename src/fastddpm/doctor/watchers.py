"""What the doctor sees of a loop from the outside, besides its steps and data waits: calls into
nn.MultiheadAttention (rule 17), the optimizer that steps (rule 19) and the batch size (rule 20).

`doctor run` and `watch()` install an `AttentionWatch` for the length of the run; it wraps
nn.MultiheadAttention.forward on the class (the way `doctor run` times DataLoader.__iter__), counts the calls
made during the watched steps and how many asked for the attention weights, and puts the method back after.
"""

from __future__ import annotations

import torch
from torch import nn

from fastddpm.doctor.measurements import AttentionCalls, OptimizerInfo

_NEED_WEIGHTS_ARG = 4  # forward(query, key, value, key_padding_mask, need_weights, ...)


class AttentionWatch:
    """Counts nn.MultiheadAttention.forward calls while `counting()` is true."""

    def __init__(self, counting):
        self.counting = counting
        self.calls = 0
        self.need_weights = 0
        self.modules: set[int] = set()
        self._orig = None

    def __enter__(self) -> AttentionWatch:
        orig = nn.MultiheadAttention.forward
        self._orig = orig
        watch = self

        def forward(module, *args, **kwargs):
            if watch.counting():
                watch.calls += 1
                watch.modules.add(id(module))
                need = kwargs.get("need_weights", args[_NEED_WEIGHTS_ARG] if len(args) > _NEED_WEIGHTS_ARG else True)
                watch.need_weights += bool(need)
            return orig(module, *args, **kwargs)

        forward.__wrapped__ = orig
        nn.MultiheadAttention.forward = forward
        return self

    def __exit__(self, *exc) -> bool:
        if self._orig is not None:
            nn.MultiheadAttention.forward = self._orig
            self._orig = None
        return False

    def measured(self, steps: int) -> AttentionCalls | None:
        """Per watched step; None when no call was seen (no nn.MultiheadAttention in the loop)."""
        if not self.calls or steps <= 0:
            return None
        return AttentionCalls(calls_per_step=self.calls / steps, need_weights_per_step=self.need_weights / steps,
                              modules=len(self.modules))


def optimizer_info(optimizer: torch.optim.Optimizer) -> OptimizerInfo:
    d = optimizer.defaults
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return OptimizerInfo(name=type(optimizer).__name__, param_tensors=len(params),
                         foreach=d.get("foreach"), fused=d.get("fused"),
                         conv_weights=sum(p.dim() == 4 for p in params))


def batch_size(batch) -> int | None:
    """The leading dimension of the first tensor in a batch (a tensor, or a tuple/list/dict holding tensors)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = batch_size(item)
        if found is not None:
            return found
    return None
