"""Building the model and its optimisation, the same way for `fastddpm train` and `fastddpm bench`.

The benchmark must time exactly the step the trainer runs, so both build it here: the U-Net with its
training-only switches, then EMA, AdamW, loss scaler and the fast TrainStep, with any resumed state loaded
in between (the step reads the optimizer's learning-rate tensor only after the optimizer state is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fastddpm.config import ConfigError, RunConfig
from fastddpm.diffusion import NoiseSchedule, schedule_from_config
from fastddpm.models import UNet, build_unet
from fastddpm.rng import derive_seed
from fastddpm.train.checkpoint import load_model_state, with_current_optimizer_flags
from fastddpm.train.ema import EMA
from fastddpm.train.runtime import FastPath, Precision
from fastddpm.train.step import TrainStep, make_optimizer


@dataclass
class Optimization:
    ema: EMA
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    step_fn: TrainStep


def build_model(cfg: RunConfig, *, device: torch.device, fast: FastPath,
                keep_on_cpu: bool = False) -> tuple[UNet, NoiseSchedule]:
    """The U-Net (initialised from (seed, "init")) and the noise schedule, on `device`. `keep_on_cpu`: the U-Net
    stays on the CPU (FSDP moves each block's shards to the device as it shards it, so no rank ever holds the
    full model, or its EMA copy, on the GPU)."""
    train_cfg = cfg.train
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = fast.cudnn_benchmark
    torch.manual_seed(derive_seed(train_cfg.seed, "init"))
    model = build_unet(cfg.model).to("cpu" if keep_on_cpu else device)
    model.grad_checkpointing = train_cfg.grad_checkpointing
    if fast.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, schedule_from_config(cfg.diffusion).to(device)


def wrap_ddp(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel around the U-Net: gradients all-reduced in buckets, overlapping the backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    train_cfg = cfg.train
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               # the graph is the same every step; DDP then skips its per-step unused-parameter search. It cannot
               # be combined with no_sync (accumulation), which needs the dynamic bookkeeping.
               static_graph=train_cfg.accum_steps == 1,
               gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in or out
               bucket_cap_mb=train_cfg.ddp_bucket_cap_mb)


def build_optimization(cfg: RunConfig, model: UNet, schedule: NoiseSchedule, *, device: torch.device,
                       precision: Precision, fast: FastPath, resume_state: dict | None = None,
                       ddp: bool = False, fsdp: bool = False) -> Optimization:
    """EMA, AdamW, loss scaler and the TrainStep; `resume_state` (a checkpoint in the format this run writes, as
    Checkpointer.check_format made sure) is loaded before the step is built. With `ddp` (a process group is up),
    the loss runs through a DDP wrapper of `model`; with `fsdp`, `model` and its EMA copy are sharded in place
    (FSDP2) and a sharded checkpoint is read into them."""
    train_cfg = cfg.train
    if fsdp:
        return _build_fsdp(cfg, model, schedule, device=device, precision=precision, fast=fast,
                           resume_state=resume_state)
    ema = EMA(model, train_cfg.ema_decay, warmup=train_cfg.ema_warmup)
    capture = fast.cuda_graphs == "capture"
    # A tensor learning rate: changing it never recompiles, and a captured graph reads its current value.
    optimizer = make_optimizer(model, lr=train_cfg.lr, betas=train_cfg.adam_betas,
                               weight_decay=train_cfg.weight_decay, device=device,
                               tensor_lr=fast.compile or capture, capturable=capture)
    scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
    if resume_state is not None:
        load_model_state(model, resume_state["model"], what="the checkpoint's model weights")
        ema.load_state_dict(resume_state["ema"])
        optimizer.load_state_dict(with_current_optimizer_flags(resume_state["optimizer"], optimizer))
        if scaler is not None and resume_state.get("scaler"):
            scaler.load_state_dict(resume_state["scaler"])
    forward_model = wrap_ddp(model, cfg, device) if ddp else None
    step_fn = make_train_step(cfg, model, schedule, optimizer=optimizer, scaler=scaler, ema=ema, device=device,
                              precision=precision, fast=fast, accum_steps=train_cfg.accum_steps,
                              forward_model=forward_model)
    return Optimization(ema=ema, optimizer=optimizer, scaler=scaler, step_fn=step_fn)


def _build_fsdp(cfg: RunConfig, model: UNet, schedule: NoiseSchedule, *, device: torch.device,
                precision: Precision, fast: FastPath, resume_state: dict | None) -> Optimization:
    from fastddpm.train.fsdp import load_sharded, shard_unet

    train_cfg = cfg.train
    if precision.use_grad_scaler:
        raise ConfigError("--parallel fsdp does not run fp16's GradScaler over sharded gradients: use --precision "
                          "bf16 (same speed, no loss scaling), or fp32 on a GPU without bf16")
    # the full copy, sharded below exactly like the model
    ema = EMA(model, train_cfg.ema_decay, warmup=train_cfg.ema_warmup)
    # bf16 all-gathers and bf16 compute in each block; the fp32 shards stay the master weights AdamW updates.
    param_dtype = torch.bfloat16 if device.type == "cuda" and precision.autocast_dtype == torch.bfloat16 else None
    shard_unet(model, param_dtype=param_dtype)
    shard_unet(ema.model, param_dtype=param_dtype)
    ema.rebind(model)  # both parameter lists are DTensor shards now
    # foreach AdamW over the DTensor shards, with a float learning rate (the update is eager, nothing recompiles)
    optimizer = make_optimizer(model, lr=train_cfg.lr, betas=train_cfg.adam_betas,
                               weight_decay=train_cfg.weight_decay, device=device,
                               tensor_lr=False, capturable=False, allow_fused=False)
    if resume_state is not None:
        load_sharded(Path(resume_state["path"]), model=model, ema_model=ema.model, optimizer=optimizer)
    step_fn = make_train_step(cfg, model, schedule, optimizer=optimizer, scaler=None, ema=ema, device=device,
                              precision=precision, fast=fast, accum_steps=train_cfg.accum_steps, forward_model=model)
    return Optimization(ema=ema, optimizer=optimizer, scaler=None, step_fn=step_fn)


def make_train_step(cfg: RunConfig, model: UNet, schedule: NoiseSchedule, *, optimizer, scaler, ema: EMA,
                    device: torch.device, precision: Precision, fast: FastPath, accum_steps: int,
                    forward_model: torch.nn.Module | None = None) -> TrainStep:
    """The fast step over existing state (also rebuilt by the loop when an OOM splits the micro-batches)."""
    train_cfg = cfg.train
    return TrainStep(model=model, forward_model=forward_model, optimizer=optimizer, scaler=scaler, ema=ema,
                     schedule=schedule, prediction=cfg.diffusion.prediction, precision=precision,
                     grad_clip=train_cfg.grad_clip, accum_steps=accum_steps, compile=fast.compile,
                     cuda_graphs=fast.cuda_graphs, ema_every=train_cfg.ema_every, device=device,
                     min_snr_gamma=train_cfg.min_snr_gamma)
