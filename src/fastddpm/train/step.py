"""One optimizer step: forward, loss, backward, clip, update. No host syncs."""

from __future__ import annotations

import torch

from fastddpm.diffusion.objective import diffusion_loss
from fastddpm.train.batches import Batch
from fastddpm.train.runtime import Precision


def train_step(model, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, schedule,
               prediction: str, batch: Batch, precision: Precision, grad_clip: float | None) -> torch.Tensor:
    """Returns the detached loss on the device; reading it (.item()) is the caller's choice of sync point."""
    with precision.autocast(batch.x0.device):
        loss = diffusion_loss(model, schedule, prediction, batch.x0, batch.t, batch.noise)
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        if grad_clip is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)  # skips the step when the scaled gradients hold inf/nan
        scaler.update()
    else:
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return loss.detach()
