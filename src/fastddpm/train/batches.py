"""Where data becomes a batch on the device.

The uint8 dataset is copied to the device once (60,000 MNIST images are 47 MB). Each step gathers its images
by an epoch permutation, converts them to [-1, 1] floats and draws timesteps and noise, all on the device:
no DataLoader, no worker processes, no host work per step. The ragged tail of each epoch is dropped so every
batch has the same shape (what torch.compile and CUDA graphs need; the seed's drop_last=True).

Everything a step draws is a function of (seed, step) (see fastddpm.rng), so resuming at any step reproduces
exactly the batches of an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastddpm.config import ConfigError
from fastddpm.rng import generator_for


@dataclass
class Batch:
    x0: torch.Tensor      # (B, C, H, W) float32 in [-1, 1]
    t: torch.Tensor       # (B,) int64 timesteps in [0, T)
    noise: torch.Tensor   # (B, C, H, W) float32 standard normal
    indices: torch.Tensor  # (B,) int64 dataset indices (for tests and provenance)


class ResidentBatches:
    def __init__(self, images_NCHW: np.ndarray, *, batch_size: int, num_timesteps: int, seed: int,
                 device: torch.device, hflip: bool = False):
        num_images = int(images_NCHW.shape[0])
        if num_images < batch_size:
            raise ConfigError(
                f"the dataset has {num_images} images, fewer than batch_size={batch_size}: "
                f"lower --batch-size to at most {num_images}"
            )
        # One read of the memory-mapped cache into RAM (a private, writable copy), then one copy to the device.
        self.images_u8 = torch.from_numpy(np.array(images_NCHW, dtype=np.uint8, copy=True)).to(device)
        self.num_images = num_images
        self.batch_size = batch_size
        self.steps_per_epoch = num_images // batch_size  # drop_last: static shapes
        self.num_timesteps = num_timesteps
        self.seed = seed
        self.device = device
        self.hflip = hflip
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None
        self._gen = torch.Generator(device=device)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of epoch `epoch`: a function of (seed, epoch) only."""
        if epoch != self._perm_epoch:
            g = generator_for(self.device, self.seed, "epoch-permutation", epoch, self._gen)
            self._perm = torch.randperm(self.num_images, generator=g, device=self.device)
            self._perm_epoch = epoch
        return self._perm

    def indices(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.steps_per_epoch)
        return self.permutation(epoch)[k * self.batch_size:(k + 1) * self.batch_size]

    def get(self, step: int) -> Batch:
        idx = self.indices(step)
        x0 = self.images_u8[idx].to(torch.float32).div_(127.5).sub_(1.0)  # uint8 -> [-1, 1]
        g = generator_for(self.device, self.seed, "step", step, self._gen)
        t = torch.randint(0, self.num_timesteps, (self.batch_size,), generator=g, device=self.device)
        noise = torch.randn(x0.shape, generator=g, device=self.device)
        if self.hflip:
            flip = torch.rand(self.batch_size, generator=g, device=self.device) < 0.5
            x0 = torch.where(flip[:, None, None, None], x0.flip(-1), x0)
        return Batch(x0=x0, t=t, noise=noise, indices=idx)
