"""Classifier-free guidance (Ho & Salimans 2022, arXiv:2207.12598), for every sampler.

A conditional model trained with its labels dropped to the null class (train.cond_drop_prob) predicts both
out(x_t, y) and out(x_t, null). Guidance extrapolates from the unconditional prediction toward the conditional one:

    out = out(x_t, null) + W * (out(x_t, y) - out(x_t, null))      (their eq. 6, with their w = W - 1)

W = 1 is plain conditional sampling, W = 0 unconditional, W > 1 trades diversity for class fidelity. Both outputs
come from one forward of the 2B batch [x_t; x_t] with labels [y; null], not two calls. The network output is
epsilon, v, EDM's F or flow's velocity: for a fixed x_t and level each is an affine function of x0_hat with the same
coefficients for both labels, so guiding any of them is the same extrapolation of x0_hat.
"""

from __future__ import annotations

import torch


def guided(model, labels_B: torch.Tensor, guidance: float, null_class: int):
    """`model` as the samplers call it, f(x_t, t_B) -> output, with the class labels and the guidance scale W folded
    in. `null_class` is the model's num_classes (the id of "no label")."""
    if guidance == 1.0:
        return lambda x_t, t_B: model(x_t, t_B, labels_B)
    null_B = torch.full_like(labels_B, null_class)
    if guidance == 0.0:
        return lambda x_t, t_B: model(x_t, t_B, null_B)
    both_labels = torch.cat([labels_B, null_B])

    def denoise(x_t: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
        out = model(torch.cat([x_t, x_t]), torch.cat([t_B, t_B]), both_labels).float()
        cond, uncond = out.chunk(2)
        return uncond + guidance * (cond - uncond)

    return denoise
