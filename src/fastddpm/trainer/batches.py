"""Where data becomes a batch on the device.

Two sources of batches, one contract: batch m (a micro-step counter, m = step * accum_steps + micro) holds the
same images, timesteps and noise whichever source made it, and it is a function of (seed, m) only (see
fastddpm.rng), so resuming at any step, or switching placement, reproduces an uninterrupted run exactly.

- ResidentBatches: the whole uint8 dataset lives on the device (60,000 MNIST images are 47 MB). A step gathers
  its rows by the epoch permutation and converts them to [-1, 1] floats on the device: no DataLoader, no worker
  processes, no host work per step.
- StreamingBatches: for data larger than the device budget. Rows are gathered from the memory-mapped uint8
  cache into pinned host buffers allocated once, and copied with non_blocking=True on a side stream, double
  buffered, so the copy of batch m+1 overlaps the compute of batch m.

Both drop the ragged tail of each epoch, so every batch has one static shape (what torch.compile and CUDA
graphs need; a DataLoader's drop_last=True). With gradient accumulation the tail dropped is that of the optimizer
step: an epoch is a whole number of steps of accum_steps micro-batches, so a step never mixes two epochs' orders
and an epoch ends where a step ends (--max-epochs and the logged epoch count passes over the data). The epoch
permutation is drawn on the CPU (both sources need the same one, and CPU and CUDA generators differ); timesteps,
noise and flips are drawn on the device.

Under torchrun, rank r of W holds the shard of images r, r+W, r+2W, ... (the first W * (N // W) images),
resident on its own device: 1/W of the dataset each. The epoch permutation of shard positions is a function
of (seed, epoch), the same on every rank, so global batch k is the union over ranks of shard_r[perm[k]];
timesteps and noise come from a per-rank stream (seed, "step/rank<r>", m), independent across ranks and
reproducible. With W = 1 all of this reduces to the single-process order and streams exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from fastddpm.config import ConfigError
from fastddpm.rng import generator_for


@dataclass
class Batch:
    x0: torch.Tensor      # (B, C, H, W) float32 in [-1, 1]
    # (B,) int64 timesteps in [0, T) (DDPM), or float32 N(0, 1) draws that EDM / flow map to their levels
    t: torch.Tensor
    noise: torch.Tensor   # (B, C, H, W) float32 standard normal
    indices: torch.Tensor  # (B,) int64 dataset indices (for tests and provenance)
    y: torch.Tensor | None = None  # (B,) int64 class ids of a conditional run; num_classes = dropped (null class)


class _BatchSource(ABC):
    placement = "?"

    def __init__(self, images_NCHW: np.ndarray, *, batch_size: int, num_timesteps: int, seed: int,
                 device: torch.device, hflip: bool = False, rank: int = 0, world_size: int = 1,
                 labels: np.ndarray | None = None, cond_drop_prob: float = 0.0, num_classes: int = 0,
                 continuous: bool = False, accum_steps: int = 1):
        num_images = int(images_NCHW.shape[0])
        shard = num_images // world_size
        if shard < batch_size:
            per = f" ({world_size} ranks: {shard} images each)" if world_size > 1 else ""
            raise ConfigError(
                f"the dataset has {num_images} images{per}, fewer than batch_size={batch_size}: "
                f"lower --batch-size to at most {shard}"
            )
        self.num_images = num_images
        self.rank, self.world_size = rank, world_size
        self.shard_size = shard  # images this rank draws from: dataset rows rank, rank + W, ...
        self.batch_size = batch_size
        # drop_last at the optimizer step: static shapes, and whole steps of accum_steps micro-batches per epoch
        self.steps_per_epoch = shard // batch_size // accum_steps * accum_steps  # micro-batches per epoch
        if self.steps_per_epoch < 1:
            per = f" ({world_size} ranks: {shard} images each)" if world_size > 1 else ""
            raise ConfigError(
                f"batch {batch_size} x accum_steps {accum_steps} is more than the dataset's {num_images} "
                f"images{per}: lower one of them")
        self._step_purpose = "step" if rank == 0 else f"step/rank{rank}"
        self.num_timesteps = num_timesteps
        self.continuous = continuous  # EDM / flow: t is a standard normal draw per image, mapped to a noise level
        self.seed = seed
        self.device = torch.device(device)
        self.hflip = hflip
        # Classifier-free guidance: each label is replaced by the null class (id num_classes) with this probability
        self.cond_drop_prob, self.num_classes = cond_drop_prob, num_classes
        self._perm_epoch = -1
        self._perm_cpu: torch.Tensor | None = None
        self._cpu_gen = torch.Generator()
        self._dev_gen = torch.Generator(device=self.device)
        self._hold(images_NCHW, labels)

    @abstractmethod
    def _hold(self, images_NCHW: np.ndarray, labels: np.ndarray | None) -> None:
        """Keep this rank's images (and labels) where `get` reads them from."""

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of epoch `epoch` (CPU int64): a function of (seed, epoch) only."""
        if epoch != self._perm_epoch:
            g = generator_for("cpu", self.seed, "epoch-permutation", epoch, self._cpu_gen)
            self._perm_cpu = torch.randperm(self.shard_size, generator=g)
            self._perm_epoch = epoch
            self._on_new_epoch()
        return self._perm_cpu

    def _on_new_epoch(self) -> None:
        pass

    def shard_positions(self, m: int) -> torch.Tensor:
        """Positions in this rank's shard of batch m (CPU int64)."""
        epoch, k = divmod(m, self.steps_per_epoch)
        return self.permutation(epoch)[k * self.batch_size:(k + 1) * self.batch_size]

    def indices_cpu(self, m: int) -> torch.Tensor:
        """Dataset row indices of batch m (CPU int64)."""
        return self.shard_positions(m) * self.world_size + self.rank

    def _finish(self, m: int, x0_u8: torch.Tensor, idx: torch.Tensor, y: torch.Tensor | None = None) -> Batch:
        """uint8 rows (and labels) on the device -> the Batch, drawing t, noise, flips and label dropout from the
        (seed, m) generator, in that order (an unconditional run draws exactly what it drew before labels)."""
        x0 = x0_u8.to(torch.float32).div_(127.5).sub_(1.0)  # uint8 -> [-1, 1]
        g = generator_for(self.device, self.seed, self._step_purpose, m, self._dev_gen)  # host-side seeding: no sync
        if self.continuous:
            t = torch.randn((self.batch_size,), generator=g, device=self.device)
        else:
            t = torch.randint(0, self.num_timesteps, (self.batch_size,), generator=g, device=self.device)
        noise = torch.randn(x0.shape, generator=g, device=self.device)
        if self.hflip:
            flip = torch.rand(self.batch_size, generator=g, device=self.device) < 0.5
            x0 = torch.where(flip[:, None, None, None], x0.flip(-1), x0)
        if y is not None and self.cond_drop_prob > 0:
            drop = torch.rand(self.batch_size, generator=g, device=self.device) < self.cond_drop_prob
            y = torch.where(drop, torch.full_like(y, self.num_classes), y)
        return Batch(x0=x0, t=t, noise=noise, indices=idx, y=y)

    @abstractmethod
    def get(self, m: int) -> Batch:
        """Batch number m (m = step * accum_steps + micro-step)."""


class ResidentBatches(_BatchSource):
    placement = "device"

    def _hold(self, images_NCHW: np.ndarray, labels: np.ndarray | None) -> None:
        rank, world_size = self.rank, self.world_size
        # One read of this rank's shard of the memory-mapped cache into RAM (a private, writable copy), then one
        # copy to the device.
        rows = slice(rank, self.shard_size * world_size, world_size) if world_size > 1 else slice(None)
        self.images_u8 = torch.from_numpy(np.array(images_NCHW[rows], dtype=np.uint8, copy=True)).to(self.device)
        # A conditional run's labels live beside the images: (shard,) int64 on the device
        self.labels = (torch.from_numpy(np.asarray(labels[rows], dtype=np.int64)).to(self.device)
                       if labels is not None else None)
        self._perm_dev: torch.Tensor | None = None

    def _on_new_epoch(self) -> None:
        # Once per epoch: the permutation goes to the device, so per-step slicing launches no copy.
        perm = self._perm_cpu
        if self.device.type == "cuda":
            perm = perm.pin_memory()
        self._perm_dev = perm.to(self.device, non_blocking=True)

    def positions(self, m: int) -> torch.Tensor:
        """Shard positions of batch m, on the device."""
        epoch, k = divmod(m, self.steps_per_epoch)
        self.permutation(epoch)
        return self._perm_dev[k * self.batch_size:(k + 1) * self.batch_size]

    def get(self, m: int) -> Batch:
        pos = self.positions(m)
        idx = pos if self.world_size == 1 else pos * self.world_size + self.rank
        return self._finish(m, self.images_u8[pos], idx, self.labels[pos] if self.labels is not None else None)


class StreamingBatches(_BatchSource):
    placement = "stream"

    def _hold(self, images_NCHW: np.ndarray, labels: np.ndarray | None) -> None:
        batch_size = self.batch_size
        self.images = images_NCHW  # the np.memmap: pages are read on demand, never the whole file
        # Labels are 8 bytes an image: all of them stay in RAM, gathered per batch into the pinned buffers below.
        self.labels = np.asarray(labels, dtype=np.int64) if labels is not None else None
        shape = (batch_size, *images_NCHW.shape[1:])
        cuda = self.device.type == "cuda"
        # Allocated once. Pinned host memory lets the copy engine DMA without a staging copy (a DataLoader's
        # pin_memory=True), and lets non_blocking=True return immediately.
        self._host = [torch.empty(shape, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self._dev = [torch.empty(shape, dtype=torch.uint8, device=self.device) for _ in range(2)] if cuda else None
        with_y = labels is not None
        self._host_y = ([torch.empty(batch_size, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
                        if with_y else None)
        self._dev_y = ([torch.empty(batch_size, dtype=torch.int64, device=self.device) for _ in range(2)]
                       if with_y and cuda else None)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:  # the buffers were allocated on the compute stream; the copy stream writes them first
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._copied = [None, None]    # event: H2D copy into slot done (copy stream)
        self._consumed = [None, None]  # event: compute stream finished reading slot
        self._ready_m = [-1, -1]

    def _fill_host(self, m: int, slot: int) -> torch.Tensor:
        idx = self.indices_cpu(m)
        if self._copied[slot] is not None:
            # note: host waits for the copy issued two batches ago to leave this pinned buffer; by now it has.
            self._copied[slot].synchronize()
        order = np.argsort(idx.numpy())  # read the memmap in file order, then restore the batch order
        rows = self.images[idx.numpy()[order]]
        host = self._host[slot]
        host.numpy()[order] = rows
        if self.labels is not None:
            self._host_y[slot].numpy()[:] = self.labels[idx.numpy()]
        return idx

    def _prefetch(self, m: int) -> None:
        slot = m % 2
        if self._ready_m[slot] == m:
            return
        self._fill_host(m, slot)
        with torch.cuda.stream(self._stream):
            if self._consumed[slot] is not None:
                self._stream.wait_event(self._consumed[slot])  # don't overwrite rows still being read
            self._dev[slot].copy_(self._host[slot], non_blocking=True)
            if self._dev_y is not None:
                self._dev_y[slot].copy_(self._host_y[slot], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
            self._copied[slot] = ev
        self._ready_m[slot] = m

    def get(self, m: int) -> Batch:
        if self._stream is None:  # CPU: gather rows straight from the memmap
            slot = m % 2
            idx = self._fill_host(m, slot)
            y = self._host_y[slot].clone() if self._host_y is not None else None
            return self._finish(m, self._host[slot].clone(), idx, y)
        slot = m % 2
        self._prefetch(m)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self._copied[slot])
        x0_u8 = self._dev[slot]
        # The indices stay on the host: copying them from pageable memory would block on the stream.
        # The labels are cloned here, on the compute stream, before the slot is released below (like x0's conversion)
        y = self._dev_y[slot].clone() if self._dev_y is not None else None
        batch = self._finish(m, x0_u8, self.indices_cpu(m), y)
        ev = torch.cuda.Event()
        ev.record(current)
        self._consumed[slot] = ev
        self._prefetch(m + 1)  # overlaps with this step's compute
        return batch


def split_batch(b: Batch, parts: int) -> list[Batch]:
    """A batch cut into `parts` equal micro-batches (views: the same images, timesteps and noise)."""
    if parts == 1:
        return [b]
    ys = b.y.chunk(parts) if b.y is not None else [None] * parts
    return [Batch(x0=x0, t=t, noise=noise, indices=idx, y=y) for x0, t, noise, idx, y in
            zip(b.x0.chunk(parts), b.t.chunk(parts), b.noise.chunk(parts), b.indices.chunk(parts), ys)]


def step_batches(batches, step: int, accum_steps: int, micro_split: int = 1) -> list[Batch]:
    """The micro-batches of optimizer step `step`: batches m = step * accum_steps + k of the source (its `get`),
    each cut into `micro_split` parts after an out-of-memory step (the same data, a smaller activation peak)."""
    micro = [batches.get(step * accum_steps + k) for k in range(accum_steps)]
    return [part for b in micro for part in split_batch(b, micro_split)]


def choose_placement(images_NCHW: np.ndarray, device: torch.device, requested: str,
                     budget_fraction: float, world_size: int = 1) -> tuple[str, str]:
    """'device' if this rank's uint8 shard fits `budget_fraction` of free device memory, else 'stream'; with
    the reason."""
    nbytes = int(np.prod(images_NCHW.shape)) // world_size
    mib = nbytes / 2**20
    size = f"{mib:,.0f} MiB" if mib >= 1 else f"{nbytes / 2**10:,.0f} KiB"  # a small set is not "0 MiB"
    if requested != "auto":
        return requested, f"requested ({size} of uint8 images)"
    if device.type != "cuda":
        return "device", f"{device.type}: the {size} dataset is held in RAM"
    free, _ = torch.cuda.mem_get_info(device)
    budget = budget_fraction * free
    if nbytes <= budget:
        return "device", f"{mib:,.0f} MiB of uint8 images fit the budget ({budget_fraction:.0%} of " \
                         f"{free / 2**30:.1f} GiB free)"
    return "stream", f"{mib:,.0f} MiB exceeds the budget ({budget / 2**20:,.0f} MiB): streaming through pinned buffers"


def make_batches(images_NCHW: np.ndarray, placement: str, **kwargs) -> _BatchSource:
    if placement == "device":
        return ResidentBatches(images_NCHW, **kwargs)
    if placement == "stream":
        return StreamingBatches(images_NCHW, **kwargs)
    raise ConfigError(f"train.data_placement={placement!r}: choose auto, device or stream")
