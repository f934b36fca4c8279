"""Exponential moving average of the weights, the copy that sampling uses."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from fastddpm.rundir.state_dicts import load_model_state


class EMA:
    """ema <- beta * ema + (1 - beta) * theta after each optimizer step. With warm-up, beta = min(decay,
    (1 + step) / (10 + step)): early on the average forgets the random initialisation quickly, so grids written
    in the first epochs are already meaningful.

    The update is three foreach ops over all tensors (sub, mul by a 0-dim device tensor, add), not one
    _foreach_lerp_: lerp has no tensor-weight overload, and a float weight would be read back to the host each
    step (a sync) and baked into a captured CUDA graph as a constant."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.rebind(model)

    def rebind(self, model: nn.Module) -> None:
        """(Re)read both parameter lists: at construction, and after both models were sharded in place (FSDP2
        swaps in DTensors)."""
        self.params = list(self.model.parameters())
        self._src_params = list(model.parameters())

    def beta(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()  # without it every EMA tensor grows an autograd chain, one node per step
    def update(self, weight: torch.Tensor) -> None:
        """ema += weight * (theta - ema), with `weight` = 1 - beta as a 0-dim tensor on the device (0 skips)."""
        delta = torch._foreach_sub(self._src_params, self.params)
        torch._foreach_mul_(delta, weight)
        torch._foreach_add_(self.params, delta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_model_state(self.model, state, what="the checkpoint's EMA weights")


def ema_steps(step: int, every: int, *, last: bool, off_grid: int | None) -> int:
    """How many optimizer steps the EMA update after `step` (0-based) folds in, its decay raised to that power;
    0 for no update. A step on the every-k grid (step % every == 0) folds in `every`; the run's last step folds in
    the steps since the previous update, so the final EMA misses none of the run's last steps. `off_grid`: the
    step of such a last-step update off the grid (TrainState.ema_off_grid: the run was then resumed longer), from
    which the next update counts, so no step is folded in twice."""
    if step % every and not last:
        return 0
    previous = step - every if step % every == 0 else step - step % every
    if off_grid is not None:
        previous = max(previous, off_grid)
    return step - previous
