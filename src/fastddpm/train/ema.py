"""Exponential moving average of the weights, the copy that sampling uses."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from fastddpm.train.checkpoint import load_model_state


class EMA:
    """ema <- beta * ema + (1 - beta) * theta after each optimizer step, as one foreach lerp (no Python loop
    over tensors). With warm-up, beta = min(decay, (1 + step) / (10 + step)): early on the average forgets the
    random initialisation quickly, so grids written in the first epochs are already meaningful."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self._ema_params = list(self.model.parameters())
        self._src_params = list(model.parameters())

    def rebind(self, model: nn.Module) -> None:
        """Refresh the parameter lists after both models were sharded in place (FSDP2 swaps in DTensors)."""
        self._ema_params = list(self.model.parameters())
        self._src_params = list(model.parameters())

    def beta(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        torch._foreach_lerp_(self._ema_params, [p.detach() for p in self._src_params], 1.0 - self.beta(step))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_model_state(self.model, state, what="the checkpoint's EMA weights")
