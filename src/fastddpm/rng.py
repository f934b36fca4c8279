"""Randomness as a function of (seed, purpose, counter).

Every random draw in training is seeded from (run seed, what it is for, step or epoch), never from a generator
whose state drifts with history. Resume is therefore exact by construction: step k draws the same indices,
timesteps and noise whether the run got there in one go or through any number of restarts, with any loader.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, purpose: str, counter: int = 0) -> int:
    """A 63-bit seed from (seed, purpose, counter); stable across processes, platforms and Python versions."""
    digest = hashlib.blake2b(f"{seed}/{purpose}/{counter}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_torch(seed: int, device: torch.device) -> None:
    """Seed torch's global generators for work on `device`: the CPU's, which initial weights draw from, and on a
    CUDA device that device's own, which dropout draws from. Not torch.manual_seed: it seeds every GPU of the
    process, so a notebook training on cuda:0 would also reset the generator it samples with on cuda:1."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()  # initialises CUDA
        torch.cuda.default_generators[index].manual_seed(seed)


def generator_for(device: torch.device | str, seed: int, purpose: str, counter: int = 0,
                  generator: torch.Generator | None = None) -> torch.Generator:
    """A torch.Generator on `device` seeded for (seed, purpose, counter); reuses `generator` when given."""
    g = generator if generator is not None else torch.Generator(device=device)
    return g.manual_seed(derive_seed(seed, purpose, counter))


class ImageNoise:
    """Standard normal noise for a batch of images, each image drawn from its own generator: image i of the batch
    (the (first + i)-th image of a draw of many) takes its noise from (seed, "image", first + i). An image is
    then the same whatever batch it is drawn in and whatever the batch size, as with EDM's per-seed generators
    (Karras et al. 2022, generate.py) and diffusers' list of generators, one per image.

    The cost is a generator call per image instead of one per batch (a kernel launch each on a GPU), so each image's
    draws after the first come DRAWS_PER_CALL at a time: a stochastic sampler's 20-1,000 draws take 1/8 as many
    calls per image, and a deterministic one, which draws once, generates nothing it does not use. The calls' sizes
    depend on the order of the draws alone, never on the batch, so neither do the numbers. The block of the next
    draws, (count, DRAWS_PER_CALL, *image_shape), is 8 times the batch's noise: small next to the network's
    activations for the same batch."""

    DRAWS_PER_CALL = 8

    def __init__(self, device: torch.device | str, seed: int, first: int, count: int):
        self.device = torch.device(device)
        self.generators = [torch.Generator(device=self.device).manual_seed(derive_seed(seed, "image", first + i))
                           for i in range(count)]
        self._calls = 0
        self._block: torch.Tensor | None = None  # (count, draws, *image_shape): each image's next draws
        self._next = 0

    def randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        """(count, *image_shape) float32 on the device, contiguous; each call takes every image's next draw."""
        if shape[0] != len(self.generators):
            raise ValueError(f"noise for a batch of {shape[0]} from {len(self.generators)} image generators")
        if self._block is not None and self._block.shape[2:] != shape[1:]:
            raise ValueError(f"noise of image shape {tuple(shape[1:])} after draws of {tuple(self._block.shape[2:])}: "
                             "one ImageNoise draws for one image shape")
        if self._block is None or self._next == self._block.shape[1]:
            draws = 1 if self._calls == 0 else self.DRAWS_PER_CALL
            self._block = None  # freed before the next one is made: never two blocks at once
            self._block = torch.empty((shape[0], draws, *shape[1:]), device=self.device)
            for x_DCHW, g in zip(self._block, self.generators):
                x_DCHW.normal_(generator=g)
            self._next = 0
            self._calls += 1
        self._next += 1
        return self._block[:, self._next - 1].contiguous()
