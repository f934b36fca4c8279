"""FSDP2 (`fully_shard`) for U-Nets too large for one device.

    torchrun --nproc-per-node 8 -m fastddpm train --parallel fsdp ...

Every parameter, gradient and AdamW moment is split across the ranks (dim 0 of each tensor, a DTensor); each U-Net
block all-gathers its weights just before its forward and backward and frees them after (ZeRO-3). The EMA copy is
sharded the same way, so the EMA update stays a rank-local foreach over matching shards. Data parallelism is as
under DDP: rank r trains on its own shard of the data (fastddpm.trainer.batches).

Checkpoints are sharded directories, one file per rank (fastddpm.rundir.sharded), resharded on load.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def shard_unet(model: nn.Module, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """fully_shard each block the model's forward calls (`model.fsdp_units()`: one all-gather per block; a module
    whose own forward never runs would never be gathered), then the root (the stem, the time MLP and the output
    head). `param_dtype` (bf16) all-gathers and computes in that dtype while the sharded master weights, gradient
    reduction and AdamW stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for block in model.fsdp_units():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
