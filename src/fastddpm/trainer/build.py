"""Building the model and its optimisation, the same way for `fastddpm train` and `fastddpm bench`.

The benchmark must time exactly the step the trainer runs, so both build it here: the U-Net with its
training-only switches, then EMA, AdamW and the loss scaler (the state a checkpoint holds), then the fast
TrainStep over that state, built once the state is final (after a resume has loaded it: the step reads the
optimizer's learning-rate tensor when it is built).
"""

from __future__ import annotations

import torch

from fastddpm.config import ConfigError, RunConfig
from fastddpm.device import Precision
from fastddpm.diffusion import NoiseSchedule, schedule_from_config
from fastddpm.models import UNet, build_unet, set_attention_head_pad
from fastddpm.rng import derive_seed, seed_torch
from fastddpm.trainer.ema import EMA
from fastddpm.trainer.fast_path import FastPath
from fastddpm.trainer.step import TrainStep, make_optimizer


def build_model(cfg: RunConfig, *, device: torch.device, fast: FastPath,
                keep_on_cpu: bool = False) -> tuple[UNet, NoiseSchedule]:
    """The U-Net (initialised from (seed, "init")) and the noise schedule, on `device`. `keep_on_cpu`: the U-Net
    stays on the CPU (FSDP moves each block's shards to the device as it shards it, so no rank ever holds the
    full model, or its EMA copy, on the GPU)."""
    train_cfg = cfg.train
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = fast.cudnn_benchmark
    seed_torch(derive_seed(train_cfg.seed, "init"), device)
    model = build_unet(cfg.model).to("cpu" if keep_on_cpu else device)
    model.grad_checkpointing = train_cfg.grad_checkpointing
    set_attention_head_pad(model, fast.attention_head_pad)
    if fast.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, schedule_from_config(cfg.diffusion).to(device)


def wrap_ddp(model: torch.nn.Module, cfg: RunConfig, device: torch.device, *, micro_batches: int
             ) -> torch.nn.Module:
    """DistributedDataParallel around the U-Net: gradients all-reduced in buckets, overlapping the backward.
    `micro_batches`: backward passes per step (accumulation, times an out-of-memory split)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               # the graph is the same every step; DDP then skips its per-step unused-parameter search. It cannot
               # be combined with no_sync (accumulation), which needs the dynamic bookkeeping.
               static_graph=micro_batches == 1,
               gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in or out
               bucket_cap_mb=cfg.train.ddp_bucket_cap_mb)


class Optimization:
    """EMA, AdamW and the loss scaler of a run (the state the Checkpointer saves and loads), and the fast
    TrainStep over them.

    `parallel`: None (one process), "ddp" (the loss runs through a DistributedDataParallel wrapper of the model,
    made when the first step is built, after any resumed weights are in) or "fsdp" (the model and its EMA copy
    are sharded in place here, FSDP2, before the optimizer sees their parameters)."""

    def __init__(self, cfg: RunConfig, model: UNet, schedule: NoiseSchedule, *, device: torch.device,
                 precision: Precision, fast: FastPath, parallel: str | None = None):
        train_cfg = cfg.train
        self.cfg, self.model, self.schedule = cfg, model, schedule
        self.device, self.precision, self.fast, self.parallel = device, precision, fast, parallel
        self.ema = EMA(model, train_cfg.ema_decay, warmup=train_cfg.ema_warmup)
        if parallel == "fsdp":
            self._shard()
        capture = fast.cuda_graphs == "capture"
        # A tensor learning rate: changing it never recompiles, and a captured graph reads its current value. FSDP:
        # foreach AdamW over the DTensor shards, with a float learning rate (its update is eager).
        self.optimizer = make_optimizer(model, lr=train_cfg.lr, betas=train_cfg.adam_betas,
                                        weight_decay=train_cfg.weight_decay, device=device,
                                        tensor_lr=(fast.compile or capture) and parallel != "fsdp",
                                        capturable=capture and parallel != "fsdp", allow_fused=parallel != "fsdp")
        self.scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
        self._forward_model: torch.nn.Module | None = None
        self.step_fn: TrainStep | None = None

    def _shard(self) -> None:
        from fastddpm.trainer.fsdp import shard_unet

        if self.precision.use_grad_scaler:
            raise ConfigError("--parallel fsdp does not run fp16's GradScaler over sharded gradients: use --precision "
                              "bf16 (same speed, no loss scaling), or fp32 on a GPU without bf16")
        # bf16 all-gathers and bf16 compute in each block; the fp32 shards stay the master weights AdamW updates.
        cuda_bf16 = self.device.type == "cuda" and self.precision.autocast_dtype == torch.bfloat16
        param_dtype = torch.bfloat16 if cuda_bf16 else None
        shard_unet(self.model, param_dtype=param_dtype)
        shard_unet(self.ema.model, param_dtype=param_dtype)
        self.ema.rebind(self.model)  # both parameter lists are DTensor shards now

    def build_step(self, micro_split: int = 1) -> TrainStep:
        """The fast step over this state, for batches of accum_steps micro-batches each cut into `micro_split`
        parts (more than 1 after an out-of-memory step: the same data and result, smaller activations). Build it
        once the state is final, and again (it is cheap) when the split changes."""
        train_cfg = self.cfg.train
        if self._forward_model is None:  # DDP's wrapper is made once (a resumed split is known by then)
            self._forward_model = (wrap_ddp(self.model, self.cfg, self.device,
                                            micro_batches=train_cfg.accum_steps * micro_split)
                                   if self.parallel == "ddp" else self.model)
        self.step_fn = TrainStep(model=self.model, forward_model=self._forward_model, optimizer=self.optimizer,
                                 scaler=self.scaler, ema=self.ema, schedule=self.schedule,
                                 prediction=self.cfg.diffusion.prediction, precision=self.precision,
                                 grad_clip=train_cfg.grad_clip, accum_steps=train_cfg.accum_steps * micro_split,
                                 compile=self.fast.compile, compile_mode=self.fast.compile_mode,
                                 inductor_layout=self.fast.inductor_layout,
                                 cuda_graphs=self.fast.cuda_graphs,
                                 ema_every=train_cfg.ema_every, device=self.device,
                                 min_snr_gamma=train_cfg.min_snr_gamma)
        return self.step_fn
