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


def generator_for(device: torch.device | str, seed: int, purpose: str, counter: int = 0,
                  generator: torch.Generator | None = None) -> torch.Generator:
    """A torch.Generator on `device` seeded for (seed, purpose, counter); reuses `generator` when given."""
    g = generator if generator is not None else torch.Generator(device=device)
    return g.manual_seed(derive_seed(seed, purpose, counter))
