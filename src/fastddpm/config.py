"""Typed run configuration: one keyword-only dataclass per component, each field documented and validated.

A run's config is resolved in layers, later layers winning:
    preset (a plain function below)  <  --config FILE (YAML or JSON)  <  command-line flags
and, when resuming, the checkpoint's own config takes the place of the preset. The resolved config is written
into every run directory as config.json, and `fastddpm train --help` is generated from the field docs here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _doc(text: str, *, cli: str | None = None, choices: tuple[str, ...] | None = None) -> dict:
    """Field metadata: the help text, an optional CLI flag name, and allowed string values."""
    return {"help": text, "cli": cli, "choices": choices}


class ConfigError(ValueError):
    """A user error in the configuration. The message names the field, the bad value and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# Sampler and timestep-spacing names (the math: fastddpm.diffusion.samplers and .ode_solvers).
SAMPLERS = ("ddpm", "ddim", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun")
# The default of `sample`, `eval`, the training grids and --eval-every: SDE-DPM-Solver++(2M) in 20 network calls
# (benchmarks/RESULTS.md, issue 16). On the CPU demo's checkpoints (2,000 samples) it beats every ODE sampler at
# any number of calls: unconditional FID 7.9 against 12.1-12.5 for the best ODE points (UniPC-20) and 6.5 for DDPM
# over all 1,000 steps; conditional 2.17 at W = 2 (3 seeds) against UniPC-20's best, 2.56 at W = 3. 50 steps gain ~1.4
# (unconditional) at 2.5x the time: --steps 50. The ODE solvers level off where a stochastic sampler does not: each
# step's fresh noise washes out the errors of the steps before. (Not yet measured on a GPU-trained model.)
DEFAULT_SAMPLER = "dpmpp-2m-sde"
DEFAULT_SAMPLER_STEPS = 20
LOGGERS = ("jsonl", "tensorboard", "wandb")  # train.log_to's choices
SPACINGS = ("trailing", "karras", "logsnr")


def default_spacing(sampler: str) -> str:
    """A sampler's own timesteps: EDM's Heun is defined with the Karras noise levels (its steps in sigma need them:
    uniform steps put one huge step at high noise); the others with evenly spaced 'trailing' timesteps."""
    return "karras" if sampler == "heun" else "trailing"


def _check_choice(section: str, obj: Any, name: str) -> None:
    choices = obj.__dataclass_fields__[name].metadata["choices"]
    value = getattr(obj, name)
    _require(value in choices, f"{section}.{name}={value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(kw_only=True)
class ModelConfig:
    """The U-Net: the seed's (family seed; defaults are the public DDPM-Pytorch code's default config, 10.2M
    parameters) or the DDPM / improved-diffusion one (family ddpm: base_channels, channel_mult, ...)."""

    family: str = field(
        default="seed",
        metadata=_doc("U-Net family: seed (the seed notebook's, down_channels/mid_channels/...) or ddpm (Ho et al. "
                      "2020 / improved-diffusion: base_channels, channel_mult, num_res_blocks, "
                      "attention_resolutions, dropout, scale_shift_norm, resblock_updown).",
                      choices=("seed", "ddpm")),
    )
    image_channels: int | None = field(default=None, metadata=_doc("Input channels; none = taken from the data."))
    image_size: int | None = field(default=None, metadata=_doc("Square image side in pixels; none = from the data."))
    base_channels: int = field(default=128, metadata=_doc("ddpm family: channels at the first level."))
    channel_mult: tuple[int, ...] = field(
        default=(1, 2, 2, 2), metadata=_doc("ddpm family: channels of each level as multiples of base_channels; "
                                            "each level after the first halves the resolution.")
    )
    num_res_blocks: int = field(
        default=2, metadata=_doc("ddpm family: ResBlocks per level (the up path has one more).")
    )
    attention_resolutions: tuple[int, ...] = field(
        default=(16,), metadata=_doc("ddpm family: resolutions (pixels per side) with self-attention after each "
                                     "ResBlock; the middle always has one.")
    )
    dropout: float = field(default=0.0, metadata=_doc("ddpm family: dropout inside each ResBlock (the paper: 0.1 on "
                                                      "CIFAR-10)."))
    scale_shift_norm: bool = field(
        default=False, metadata=_doc("ddpm family: the time embedding scales and shifts the normalised features "
                                     "(FiLM; improved-diffusion) instead of being added.")
    )
    resblock_updown: bool = field(
        default=False, metadata=_doc("ddpm family: resample inside ResBlocks (BigGAN style) instead of plain convs.")
    )
    down_channels: tuple[int, ...] = field(
        default=(32, 64, 128, 256), metadata=_doc("Channels at each U-Net level, comma-separated.")
    )
    mid_channels: tuple[int, ...] = field(
        default=(256, 256, 128),
        metadata=_doc("Channels through the mid blocks; first = last down channel, last = second-to-last."),
    )
    down_sample: tuple[bool, ...] = field(
        default=(True, True, False), metadata=_doc("Whether each down block halves the resolution (one per block).")
    )
    time_emb_dim: int = field(default=128, metadata=_doc("Width of the sinusoidal time embedding (even)."))
    num_down_layers: int = field(default=2, metadata=_doc("ResNet+attention layers per down block."))
    num_mid_layers: int = field(default=2, metadata=_doc("Attention+ResNet pairs per mid block (after one ResNet)."))
    num_up_layers: int = field(default=2, metadata=_doc("ResNet+attention layers per up block."))
    num_heads: int = field(default=4, metadata=_doc("Attention heads."))
    norm_groups: int = field(default=8, metadata=_doc("GroupNorm groups; every channel count must divide by it."))
    attention: bool = field(
        default=True, metadata=_doc("Self-attention after each ResNet block (off = faster on CPU).")
    )
    out_block_channels: int = field(default=16, metadata=_doc("Channels of the last up block (the seed's code: 16)."))
    conditional: bool = field(
        default=False,
        metadata=_doc("Class-conditional: a learned class embedding is added to the time embedding, with one more "
                      "entry, the null class, for classifier-free guidance. The classes come from the data's labels."),
    )
    num_classes: int = field(
        default=0, metadata=_doc("Classes of a conditional model (0 = unconditional); --conditional sets it from "
                                 "the data.")
    )
    class_names: tuple[str, ...] = field(
        default=(), metadata=_doc("A conditional model's class names, from the data (folder names, a named "
                                  "dataset's classes); `fastddpm sample --class NAME` reads them.")
    )

    def __post_init__(self) -> None:
        self.down_channels = tuple(int(c) for c in self.down_channels)
        self.channel_mult = tuple(int(c) for c in self.channel_mult)
        self.attention_resolutions = tuple(int(r) for r in self.attention_resolutions)
        self.class_names = tuple(str(c) for c in self.class_names)
        _check_choice("model", self, "family")
        _require(self.num_classes >= 0, f"model.num_classes={self.num_classes} must be >= 0 (0 = unconditional)")
        _require(self.conditional or self.num_classes == 0,
                 f"model.num_classes={self.num_classes} needs --conditional (a class embedding); or leave it at 0")
        self.mid_channels = tuple(int(c) for c in self.mid_channels)
        self.down_sample = tuple(bool(d) for d in self.down_sample)
        if self.family == "ddpm":
            self._check_ddpm()
            return
        dc, mc = self.down_channels, self.mid_channels
        _require(len(dc) >= 2, f"model.down_channels={dc} needs at least two levels, e.g. 32,64,128,256")
        _require(len(mc) >= 2, f"model.mid_channels={mc} needs at least two entries, e.g. 256,256,128")
        _require(
            mc[0] == dc[-1] and mc[-1] == dc[-2],
            f"model.mid_channels={mc} must start at the last down channel ({dc[-1]}) and end at the "
            f"second-to-last ({dc[-2]}), e.g. {dc[-1]},{dc[-1]},{dc[-2]}",
        )
        _require(
            len(self.down_sample) == len(dc) - 1,
            f"model.down_sample has {len(self.down_sample)} entries but down_channels={dc} makes {len(dc) - 1} "
            "down blocks: give one true/false per block",
        )
        _require(self.time_emb_dim > 0 and self.time_emb_dim % 2 == 0,
                 f"model.time_emb_dim={self.time_emb_dim} must be a positive even number")
        for name in ("num_down_layers", "num_up_layers"):
            _require(getattr(self, name) >= 1, f"model.{name}={getattr(self, name)} must be >= 1")
        _require(self.num_mid_layers >= 0, f"model.num_mid_layers={self.num_mid_layers} must be >= 0")
        for c in (*dc, *mc, self.out_block_channels):
            _require(c % self.norm_groups == 0,
                     f"channel count {c} is not divisible by model.norm_groups={self.norm_groups}: "
                     "change the channels or norm_groups")
            if self.attention:
                _require(c % self.num_heads == 0,
                         f"channel count {c} is not divisible by model.num_heads={self.num_heads}")

    def _check_ddpm(self) -> None:
        mult = self.channel_mult
        _require(len(mult) >= 1 and all(m >= 1 for m in mult),
                 f"model.channel_mult={mult} must be positive multipliers, e.g. 1,2,2,2")
        _require(self.num_res_blocks >= 1, f"model.num_res_blocks={self.num_res_blocks} must be >= 1")
        _require(0 <= self.dropout < 1, f"model.dropout={self.dropout} must be in [0, 1)")
        _require(self.base_channels % 2 == 0, f"model.base_channels={self.base_channels} must be even (the time "
                                               "embedding is sinusoidal over it)")
        for c in {self.base_channels * m for m in mult} | {self.base_channels}:
            _require(c % self.norm_groups == 0, f"channel count {c} (base_channels x channel_mult) is not divisible "
                                                f"by model.norm_groups={self.norm_groups}")
            _require(c % self.num_heads == 0, f"channel count {c} is not divisible by model.num_heads={self.num_heads}")

    def validate_resolved(self) -> None:
        """Checks that need the data, once the shape (and a conditional model's classes) are known."""
        self.validate_shape()
        if self.conditional:
            _require(self.num_classes >= 1 and len(self.class_names) == self.num_classes,
                     f"a conditional model needs its classes: num_classes={self.num_classes} with "
                     f"{len(self.class_names)} class names (they come from the data's labels)")

    def validate_shape(self) -> None:
        """Checks that need the data's shape, once image_channels and image_size are known."""
        _require(self.image_channels is not None and self.image_size is not None,
                 "model.image_channels and model.image_size must be set (they come from the data)")
        if self.family == "ddpm":
            factor = 2 ** (len(self.channel_mult) - 1)
            _require(self.image_size % factor == 0,
                     f"model.image_size={self.image_size} must divide by {factor} (channel_mult={self.channel_mult} "
                     f"halves it {len(self.channel_mult) - 1} times): resize the data (--resize) or use fewer levels")
            return
        factor = 2 ** sum(self.down_sample)
        _require(
            self.image_size % factor == 0,
            f"model.image_size={self.image_size} must divide by {factor} (the U-Net halves it {sum(self.down_sample)} "
            f"times): resize the data (--resize) or change model.down_sample",
        )


@dataclass(kw_only=True)
class DiffusionConfig:
    """Forward process and training target (Ho et al. 2020; Nichol & Dhariwal 2021; Salimans & Ho 2022)."""

    num_timesteps: int = field(default=1000, metadata=_doc("Diffusion steps T."))
    schedule: str = field(default="linear", metadata=_doc("Beta schedule.", choices=("linear", "cosine")))
    beta_start: float = field(default=1e-4, metadata=_doc("First beta of the linear schedule."))
    beta_end: float = field(default=0.02, metadata=_doc("Last beta of the linear schedule."))
    prediction: str = field(
        default="epsilon", metadata=_doc("What the network predicts: the noise, or v.", choices=("epsilon", "v"))
    )

    def __post_init__(self) -> None:
        _check_choice("diffusion", self, "schedule")
        _check_choice("diffusion", self, "prediction")
        _require(self.num_timesteps >= 2, f"diffusion.num_timesteps={self.num_timesteps} must be >= 2")
        _require(0 < self.beta_start < self.beta_end < 1,
                 f"diffusion betas must satisfy 0 < beta_start ({self.beta_start}) < beta_end ({self.beta_end}) < 1")


@dataclass(kw_only=True)
class DataConfig:
    """Where the images come from and how they are cached (decoded once into a uint8 array)."""

    source: str = field(
        default="fashion-mnist",
        metadata=_doc("A named dataset (mnist, fashion-mnist, cifar10) or a path: IDX folder, image folder "
                      "root/<label>/*.png, .zip of that folder, CIFAR-10 batches folder or .tar.gz, .npy/.npz.",
                      cli="data"),
    )
    split: str = field(default="train", metadata=_doc("Split of IDX/CIFAR sources.", choices=("train", "test")))
    resize: int | None = field(default=None, metadata=_doc("Resize images to NxN when caching (none = keep)."))
    resize_mode: str = field(
        default="center-crop", metadata=_doc("How --resize fits the image.", choices=("center-crop", "stretch"))
    )
    image_mode: str | None = field(
        default=None,
        metadata=_doc("Convert every image to L (gray) or RGB when caching; none = keep, must be uniform.",
                      choices=(None, "L", "RGB")),
    )
    skip_bad: bool = field(
        default=False, metadata=_doc("Skip unreadable images (counted and reported) instead of stopping.")
    )
    cache_dir: str | None = field(
        default=None, metadata=_doc("Dataset cache root (default $FASTDDPM_CACHE or ~/.cache/fastddpm).")
    )
    hflip: bool = field(
        default=False, metadata=_doc("Random horizontal flips (on for CIFAR-like data, off for digits).")
    )

    def __post_init__(self) -> None:
        _check_choice("data", self, "split")
        _check_choice("data", self, "resize_mode")
        _check_choice("data", self, "image_mode")
        _require(self.resize is None or self.resize >= 8, f"data.resize={self.resize} must be >= 8 pixels")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation, the length of the run, and what it writes along the way."""

    batch_size: int | str = field(
        default=192,
        metadata=_doc("Images per micro-batch per device (the seed's final recipe: 192), or auto: search for the "
                      "throughput knee (the batch with the best images/s, not the memory edge) before compiling."),
    )
    accum_steps: int = field(
        default=1, metadata=_doc("Gradient accumulation: micro-batches per optimizer step (batch = size x steps).")
    )
    max_steps: int | None = field(default=None, metadata=_doc("Stop after this many optimizer steps."))
    max_images: int | None = field(
        default=None, metadata=_doc("Stop after this many training images (edm2-style kimg).")
    )
    max_epochs: float | None = field(default=None, metadata=_doc("Stop after this many passes over the data."))
    lr: float = field(default=1e-4, metadata=_doc("AdamW learning rate (the seed: Adam 1e-4)."))
    adam_betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=_doc("AdamW betas."))
    weight_decay: float = field(default=0.0, metadata=_doc("AdamW decoupled weight decay (0 = Adam, as the seed)."))
    warmup_images: int = field(default=0, metadata=_doc("Linear learning-rate warm-up over this many images."))
    grad_clip: float | None = field(default=1.0, metadata=_doc("Clip the global gradient norm to this (none = off)."))
    ema_decay: float = field(default=0.9999, metadata=_doc("EMA decay of the weights used for sampling."))
    ema_warmup: bool = field(
        default=True, metadata=_doc("Ramp the EMA decay as min(decay, (1+step)/(10+step)) so early EMA is usable.")
    )
    precision: str = field(
        default="auto",
        metadata=_doc("Autocast precision. auto = bf16 on GPUs that support it, fp16+GradScaler on older GPUs; "
                      "on a CPU bf16 where it has native bf16 (amx_bf16, avx512_bf16, Arm bf16), else fp32. fp16 "
                      "also runs on a CPU (slowly: for testing the loss-scaling path).",
                      choices=("auto", "fp32", "bf16", "fp16")),
    )
    compile: str = field(
        default="auto",
        metadata=_doc("torch.compile the loss (U-Net fwd+bwd, one graph with its backward) with static shapes; "
                      "the update stays eager (fused AdamW is one kernel, clip and EMA are foreach ops). "
                      "auto = on for CUDA; on a CPU only under bf16 and for runs long enough (about 227k "
                      "images) for ~45 s of compiling to pay back twice (the run's log gives the numbers).",
                      choices=("auto", "on", "off")),
    )
    cuda_graphs: str = field(
        default="auto",
        metadata=_doc("CUDA graphs for the step: capture = the whole step in one graph; reduce-overhead = "
                      "torch.compile's graph trees. auto = capture on CUDA (not with fp16's GradScaler).",
                      choices=("auto", "off", "capture", "reduce-overhead")),
    )
    channels_last: str = field(
        default="auto",
        metadata=_doc("NHWC memory format for the U-Net. auto = off (GroupNorm has no NHWC kernel in eager; "
                      "pending a GPU measurement).", choices=("auto", "on", "off")),
    )
    cudnn_benchmark: str = field(
        default="auto",
        metadata=_doc("Let cuDNN time its conv algorithms once per shape. auto = on for CUDA (shapes are static).",
                      choices=("auto", "on", "off")),
    )
    grad_checkpointing: bool = field(
        default=False,
        metadata=_doc("Recompute each U-Net block's activations in backward: less memory, ~30% more compute."),
    )
    data_placement: str = field(
        default="auto",
        metadata=_doc("device = the uint8 dataset lives on the GPU; stream = pinned, double-buffered copies from the "
                      "memory-mapped cache. auto = device when it fits the budget.",
                      choices=("auto", "device", "stream")),
    )
    device_memory_budget: float = field(
        default=0.5, metadata=_doc("Share of free device memory the resident dataset may use (data_placement=auto).")
    )
    ema_every: int = field(
        default=1, metadata=_doc("Update the EMA every k steps (with decay^k), outside CUDA graphs.")
    )
    device: str = field(default="auto", metadata=_doc("cuda, cuda:N, cpu, or auto (CUDA when present)."))
    cpu_threads: int | None = field(
        default=None,
        metadata=_doc("Intra-op threads when training on a CPU (torch.set_num_threads). none = torch's count "
                      "(OMP_NUM_THREADS, else the cores). Recorded in each checkpoint: CPU sums run in an order that "
                      "depends on it, so a bit-exact resume needs the same count."),
    )
    global_batch_size: int | None = field(
        default=None,
        metadata=_doc("Images per optimizer step over all ranks (torchrun). none = batch_size is fixed per device and "
                      "the global batch is batch_size x accum_steps x world size; set = batch_size per device becomes "
                      "global / (accum_steps x world size), so the recipe survives a change of GPU count."),
    )
    parallel: str = field(
        default="ddp", metadata=_doc("Under torchrun: ddp = a full replica per device, gradients all-reduced "
                                     "(DistributedDataParallel); fsdp = parameters, gradients and AdamW state sharded "
                                     "across devices (FSDP2 fully_shard, ZeRO-3), for U-Nets too large for one "
                                     "device, with sharded checkpoints (torch.distributed.checkpoint).",
                                     choices=("ddp", "fsdp")),
    )
    ddp_bucket_cap_mb: int = field(
        default=25, metadata=_doc("Under torchrun (DistributedDataParallel): gradient bucket size in MiB, the "
                                  "granularity at which the all-reduce overlaps the backward.")
    )
    dist_timeout_s: float = field(
        default=600.0, metadata=_doc("Seconds a rank waits in a collective for a peer before failing the job.")
    )
    seed: int = field(default=0, metadata=_doc("Seed; data order, timesteps and noise are functions of (seed, step)."))
    log_every: int = field(default=50, metadata=_doc("Steps between metric log lines (the only host syncs)."))
    log_to: tuple[str, ...] = field(
        default=("jsonl",),
        metadata=_doc("Where the metrics go: jsonl (RUN_DIR/metrics.jsonl, always), tensorboard (RUN_DIR/tensorboard: "
                      "scalars, sample grids, the config; needs the tensorboard package), wandb (Weights & Biases, "
                      "project WANDB_PROJECT or fastddpm, WANDB_MODE=offline without an account; the same plus "
                      "ema.safetensors as an artifact; needs the wandb package), comma-separated."),
    )
    checkpoint_every: int | None = field(
        default=1000, metadata=_doc("Steps between checkpoints (none = only at the end).")
    )
    keep_checkpoints: int = field(default=3, metadata=_doc("How many recent checkpoints to keep (>= 1)."))
    sample_every_images: int | None = field(
        default=None, metadata=_doc("Write a sample grid every this many images (none = only at the end).")
    )
    num_sample_images: int = field(default=64, metadata=_doc("Images in each sample grid."))
    sampler: str = field(default=DEFAULT_SAMPLER, metadata=_doc("Sampler for the grids.", choices=SAMPLERS))
    sample_steps: int = field(default=DEFAULT_SAMPLER_STEPS,
                              metadata=_doc("Sampler steps for the grids (DDPM always uses T)."))
    sample_guidance: float = field(
        default=2.0,
        metadata=_doc("Classifier-free guidance scale W of a conditional model's grids (one row per class), its "
                      "evaluations, and `sample`/`eval` of its checkpoints: 1 = plain conditional, 0 = "
                      "unconditional, > 1 = more class-faithful, less varied. 2: the best FID of the CPU demo with "
                      "the default sampler (SDE-DPM-Solver++ 20 steps), 93% class accuracy (benchmarks/RESULTS.md)."),
    )
    cond_drop_prob: float = field(
        default=0.1,
        metadata=_doc("A conditional model's label dropout: the share of training images whose class is replaced by "
                      "the null class, so the one model also learns the unconditional prediction that classifier-free "
                      "guidance needs (Ho & Salimans 2022 use 0.1-0.2)."),
    )
    eval_every_images: int | None = field(
        default=None,
        metadata=_doc("Evaluate FID, precision/recall and class coverage from the EMA weights every this many images "
                      "(none = off): records in metrics.jsonl and eval.jsonl, a curve in eval_curve.png. Evaluation "
                      "time is excluded from wall_s and images_per_s.", cli="eval-every"),
    )
    eval_samples: int = field(
        default=1000, metadata=_doc("Images sampled per evaluation during training (FID is biased upward at small "
                                    "counts: compare runs at equal counts).")
    )
    eval_sampler: str = field(default=DEFAULT_SAMPLER,
                              metadata=_doc("Sampler for the evaluation samples.", choices=SAMPLERS))
    eval_steps: int = field(default=DEFAULT_SAMPLER_STEPS, metadata=_doc("Sampler steps for the evaluation samples."))
    eval_inception: str | None = field(
        default=None,
        metadata=_doc("Local Inception weights for standard FID during training (pytorch-fid's "
                      "pt_inception-2015-12-05 .pth, or a TorchScript extractor); none = fastddpm-features, a "
                      "classifier trained on the dataset (not comparable to published Inception FID)."),
    )
    min_snr_gamma: float | None = field(
        default=None,
        metadata=_doc("Min-SNR-gamma loss weighting (Hang et al. 2023): weight timestep t by min(SNR_t, gamma)/SNR_t "
                      "(epsilon) or /(SNR_t+1) (v); none = the plain mean (the seed). The paper uses 5; off until "
                      "measured faster by FID."),
    )
    progress: bool = field(default=True, metadata=_doc("Show a progress bar."))

    def __post_init__(self) -> None:
        self.adam_betas = tuple(float(b) for b in self.adam_betas)
        _check_choice("train", self, "precision")
        _check_choice("train", self, "sampler")
        _check_choice("train", self, "eval_sampler")
        self.log_to = tuple(dict.fromkeys(("jsonl", *self.log_to)))  # jsonl always, first, once
        unknown = [x for x in self.log_to if x not in LOGGERS]
        _require(not unknown, f"train.log_to: {', '.join(unknown)} is not one of {', '.join(LOGGERS)}")
        _require(self.batch_size == "auto" or (isinstance(self.batch_size, int) and self.batch_size >= 1),
                 f"train.batch_size={self.batch_size!r} must be a positive integer or auto")
        _require(self.accum_steps >= 1, f"train.accum_steps={self.accum_steps} must be >= 1")
        _require(self.ema_every >= 1, f"train.ema_every={self.ema_every} must be >= 1")
        _require(0 < self.device_memory_budget <= 1,
                 f"train.device_memory_budget={self.device_memory_budget} must be in (0, 1]")
        _require(self.global_batch_size is None or self.global_batch_size >= 1,
                 f"train.global_batch_size={self.global_batch_size} must be a positive integer (or none)")
        _require(self.ddp_bucket_cap_mb >= 1, f"train.ddp_bucket_cap_mb={self.ddp_bucket_cap_mb} must be >= 1")
        _require(self.dist_timeout_s > 0, f"train.dist_timeout_s={self.dist_timeout_s} must be > 0")
        for name in ("compile", "cuda_graphs", "channels_last", "cudnn_benchmark", "data_placement", "parallel"):
            _check_choice("train", self, name)
        for name in ("max_steps", "max_images", "max_epochs", "checkpoint_every", "sample_every_images",
                     "eval_every_images"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"train.{name}={v} must be positive (or none)")
        given = [n for n in ("max_steps", "max_images", "max_epochs") if getattr(self, n) is not None]
        _require(len(given) <= 1,
                 f"give only one of --max-steps, --max-images, --max-epochs (got {', '.join(given)})")
        _require(self.lr > 0, f"train.lr={self.lr} must be > 0")
        _require(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
                 f"train.adam_betas={self.adam_betas} must be two numbers in [0, 1)")
        _require(0 <= self.ema_decay < 1, f"train.ema_decay={self.ema_decay} must be in [0, 1)")
        _require(self.grad_clip is None or self.grad_clip > 0, f"train.grad_clip={self.grad_clip} must be > 0")
        _require(self.keep_checkpoints >= 1, f"train.keep_checkpoints={self.keep_checkpoints} must be >= 1")
        _require(self.cpu_threads is None or self.cpu_threads >= 1,
                 f"train.cpu_threads={self.cpu_threads} must be >= 1 (or none for torch's own count)")
        _require(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        _require(self.num_sample_images >= 1, f"train.num_sample_images={self.num_sample_images} must be >= 1")
        _require(self.sample_steps >= 1, f"train.sample_steps={self.sample_steps} must be >= 1")
        _require(self.warmup_images >= 0, f"train.warmup_images={self.warmup_images} must be >= 0")
        _require(0 <= self.cond_drop_prob < 1, f"train.cond_drop_prob={self.cond_drop_prob} must be in [0, 1)")
        _require(self.sample_guidance >= 0, f"train.sample_guidance={self.sample_guidance} must be >= 0")
        _require(self.eval_samples >= 10,
                 f"train.eval_samples={self.eval_samples} must be >= 10 (a covariance and 3-NN radii need a few "
                 "samples; 1000 is fast, 10000 is the usual final count)")
        _require(self.eval_steps >= 1, f"train.eval_steps={self.eval_steps} must be >= 1")
        _require(self.min_snr_gamma is None or self.min_snr_gamma > 0,
                 f"train.min_snr_gamma={self.min_snr_gamma} must be > 0 (e.g. 5), or none for the plain loss")


@dataclass(kw_only=True)
class RunConfig:
    preset: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "diffusion": DiffusionConfig,
    "data": DataConfig,
    "train": TrainConfig,
}

# ----------------------------------------------------------------------------------------------------------------
# Presets: plain functions returning a RunConfig. Each says what it is for.


def preset_tiny() -> RunConfig:
    """Seconds on a CPU: a 2-level U-Net with ~140k parameters, 20 steps at batch 16 (tests, smoke runs)."""
    return RunConfig(
        preset="tiny",
        model=ModelConfig(down_channels=(16, 32, 32), mid_channels=(32, 32), down_sample=(True, False),
                          time_emb_dim=32, num_down_layers=1, num_mid_layers=1, num_up_layers=1,
                          num_heads=2, out_block_channels=16),
        train=TrainConfig(batch_size=16, max_steps=20, lr=1e-3, log_every=5, checkpoint_every=10,
                          num_sample_images=16, sample_steps=10, ema_decay=0.99),
    )


def preset_cpu_demo() -> RunConfig:
    """Five minutes on a 2-core CPU with native bf16: a 0.6M-parameter U-Net without attention, 150k
    Fashion-MNIST images, samples you can recognise (the README's CPU quickstart).

    A narrower U-Net without attention (attention at 28x28 dominates CPU time), a larger learning rate with a
    short warm-up, a cosine schedule and a faster EMA, so garments are recognisable after 100,000 images
    (1.7 epochs) instead of forty epochs. The budget is 150,000 images (2.5 epochs): what bf16 trains on such a
    CPU in the time fp32 took for 100,000, with a better FID at that equal wall time (issue 18,
    benchmarks/RESULTS.md); a CPU without native bf16 trains it in fp32, about 1.5x longer.
    """
    return RunConfig(
        preset="cpu-demo",
        model=ModelConfig(down_channels=(32, 64, 64), mid_channels=(64, 64), down_sample=(True, True),
                          time_emb_dim=64, num_down_layers=1, num_mid_layers=1, num_up_layers=1,
                          attention=False, out_block_channels=32),
        diffusion=DiffusionConfig(schedule="cosine"),
        train=TrainConfig(batch_size=64, max_images=150_000, lr=2e-3, warmup_images=10_000, ema_decay=0.999,
                          log_every=20, checkpoint_every=1000, sample_every_images=75_000),
    )


def preset_cpu_demo_cond() -> RunConfig:
    """The cpu-demo recipe, class-conditional: the same 0.6M-parameter U-Net with a class embedding, trained on
    the data's labels (10% dropped for classifier-free guidance); grids show one row per class.

    For Fashion-MNIST the final grid is ten rows of garments, each row its class, at guidance W = 2. The CPU's
    default preset: after 100k images (bf16) its SDE-DPM-Solver++ 20-step samples score FID 4.5 at W = 1 and 2.2 at
    W = 2 (three seeds: 2.14-2.19), where 93% of them are the class asked for (benchmarks/RESULTS.md, issues 16 and 18).
    """
    cfg = preset_cpu_demo()
    return dataclasses.replace(cfg, preset="cpu-demo-cond", model=dataclasses.replace(cfg.model, conditional=True),
                               train=dataclasses.replace(cfg.train, num_sample_images=80))


def preset_seed_1layer() -> RunConfig:
    """The seed notebook's U-Net (6.1M params) and recipe: batch 192, Adam 1e-4, 40 epochs (GPU).

    One ResNet + attention per block; 40 epochs of 60,000 images, linear schedule, epsilon prediction."""
    return RunConfig(
        preset="seed-1layer",
        model=ModelConfig(num_down_layers=1, num_mid_layers=1, num_up_layers=1),
        train=TrainConfig(batch_size=192, max_epochs=40, lr=1e-4, checkpoint_every=2000,
                          sample_every_images=600_000),
    )


def preset_seed_2layer() -> RunConfig:
    """The public DDPM-Pytorch default U-Net (10.2M params), the seed's recipe (GPU).

    Two ResNet + attention layers per block."""
    return RunConfig(
        preset="seed-2layer",
        model=ModelConfig(),
        train=TrainConfig(batch_size=192, max_epochs=40, lr=1e-4, checkpoint_every=2000,
                          sample_every_images=600_000),
    )


def preset_ddpm_cifar10() -> RunConfig:
    """Ho et al. 2020's CIFAR-10 model and recipe (35.7M params): batch 128, Adam 2e-4, 800k steps (GPU).

    The paper's appendix B and its released code: base 128 channels, multipliers 1,2,2,2, 2 ResBlocks per level,
    self-attention at 16x16 (one head), dropout 0.1, random horizontal flips, linear betas 1e-4..0.02 over 1000
    steps, learning-rate warm-up over 5,000 steps, gradient clipping at 1, EMA 0.9999."""
    return RunConfig(
        preset="ddpm-cifar10",
        model=ModelConfig(family="ddpm", base_channels=128, channel_mult=(1, 2, 2, 2), num_res_blocks=2,
                          attention_resolutions=(16,), dropout=0.1, num_heads=1, norm_groups=32),
        data=DataConfig(source="cifar10", hflip=True),
        train=TrainConfig(batch_size=128, max_steps=800_000, lr=2e-4, warmup_images=5_000 * 128, grad_clip=1.0,
                          ema_decay=0.9999, checkpoint_every=5000, sample_every_images=1_280_000),
    )


def preset_ddpm_rgb64() -> RunConfig:
    """A 64x64 RGB U-Net in the improved-diffusion style for a folder of your own images (129.4M params, GPU).

    Nichol & Dhariwal 2021's ImageNet-64 shape: base 128, multipliers 1,2,3,4, 3 ResBlocks per level, attention
    at 16x16 and 8x8 with 4 heads, scale-shift (FiLM) time conditioning, BigGAN up/down ResBlocks, dropout 0.1;
    cosine schedule, batch 64, Adam 1e-4, flips. Point --data at a folder or zip (resized to 64x64 when cached)."""
    return RunConfig(
        preset="ddpm-rgb64",
        model=ModelConfig(family="ddpm", base_channels=128, channel_mult=(1, 2, 3, 4), num_res_blocks=3,
                          attention_resolutions=(16, 8), dropout=0.1, num_heads=4, norm_groups=32,
                          scale_shift_norm=True, resblock_updown=True),
        diffusion=DiffusionConfig(schedule="cosine"),
        data=DataConfig(hflip=True, resize=64),
        train=TrainConfig(batch_size=64, max_steps=500_000, lr=1e-4, warmup_images=64 * 1000, grad_clip=1.0,
                          ema_decay=0.9999, checkpoint_every=5000, sample_every_images=640_000),
    )


PRESETS = {
    "tiny": preset_tiny,
    "cpu-demo": preset_cpu_demo,
    "cpu-demo-cond": preset_cpu_demo_cond,
    "seed-1layer": preset_seed_1layer,
    "seed-2layer": preset_seed_2layer,
    "ddpm-cifar10": preset_ddpm_cifar10,
    "ddpm-rgb64": preset_ddpm_rgb64,
}


def preset_summaries() -> dict[str, str]:
    """{name: the first paragraph of its function's docstring}: the one source of the presets' help text."""
    return {name: " ".join(fn.__doc__.strip().split("\n\n")[0].split()) for name, fn in PRESETS.items()}


def positive_int(text: str) -> int:
    """argparse type for counts given on the command line (data, bench, eval): a positive integer or a clear error."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        hint = difflib.get_close_matches(name, PRESETS, n=1)
        raise ConfigError(
            f"unknown preset {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; choose one of: {', '.join(PRESETS)}"
        )
    return PRESETS[name]()


# ----------------------------------------------------------------------------------------------------------------
# Loading, merging and coercing values from files and the command line.


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Turn a JSON/YAML/CLI value into the field's declared type, or raise a ConfigError naming `where`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:  # e.g. int | str: an int if it parses, else the string
            try:
                return coerce(value, option, where)
            except ConfigError:
                pass
        return coerce(value, options[-1], where)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}={value!r}: expected a comma-separated list")
        elem = args[0]
        return tuple(coerce(v.strip() if isinstance(v, str) else v, elem, where) for v in items)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            if isinstance(value, str):
                value = value.replace("_", "")
                return int(float(value)) if ("e" in value.lower() and float(value).is_integer()) else int(value)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r} is not a valid {getattr(tp, '__name__', tp)}") from None
    return value


def _unknown_key(section: str, key: str, valid) -> ConfigError:
    hint = difflib.get_close_matches(key, list(valid), n=1)
    return ConfigError(
        f"unknown config field {section}.{key}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; valid fields: {', '.join(valid)}"
    )


def apply_overrides(cfg: RunConfig, overrides: dict[str, Any], source: str = "config") -> RunConfig:
    """Return a new RunConfig with {section: {field: value}} (or {"section.field": value}) applied and validated."""
    nested: dict[str, dict[str, Any]] = {}
    preset = cfg.preset
    for key, value in overrides.items():
        if key == "preset":
            preset = value
            continue
        if "." in key:
            sec, name = key.split(".", 1)
            nested.setdefault(sec, {})[name] = value
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: section {key!r} must be a mapping of field: value")
            nested.setdefault(key, {}).update(value)
        else:
            raise _unknown_key(source, key, ["preset", *SECTIONS])
    sections = {}
    for sec, cls in SECTIONS.items():
        current = dataclasses.asdict(getattr(cfg, sec))
        types = field_types(cls)
        for name, value in nested.pop(sec, {}).items():
            name = name.replace("-", "_")
            if name not in types:
                raise _unknown_key(sec, name, types)
            current[name] = coerce(value, types[name], f"{sec}.{name}")
        sections[sec] = cls(**current)
    if nested:
        raise _unknown_key(source, next(iter(nested)), ["preset", *SECTIONS])
    return RunConfig(preset=preset, **sections)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (sections model/diffusion/data/train, optional preset)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # the parser's own message says where
        raise ConfigError(f"could not parse config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping (sections model/diffusion/data/train)")
    return data


def from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from its to_dict() form (e.g. a checkpoint's config)."""
    return apply_overrides(RunConfig(preset=d.get("preset")),
                           {k: v for k, v in d.items() if k != "preset"}, source="checkpoint config")


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def resolve_model_shape(cfg: RunConfig, images_NCHW_shape: tuple[int, ...]) -> RunConfig:
    """Fill model.image_channels / image_size from the data, or check the ones the user set."""
    _, c, h, w = images_NCHW_shape
    if h != w:
        raise ConfigError(f"the data's images are {h}x{w}; the U-Net wants square images: use --resize N")
    m = cfg.model
    for name, have in (("image_channels", c), ("image_size", h)):
        want = getattr(m, name)
        if want is not None and want != have:
            raise ConfigError(
                f"model.{name}={want} but the data has {have}: drop the setting (it comes from the data) "
                + ("or use --resize" if name == "image_size" else "or use --image-mode L|RGB")
            )
    model = dataclasses.replace(m, image_channels=c, image_size=h)
    model.validate_shape()
    return dataclasses.replace(cfg, model=model)


def resolve_classes(cfg: RunConfig, labels: Any, class_names: list[str], source: str) -> RunConfig:
    """A conditional model's classes from the data: their number from the labels (or the data's class list, if
    longer) and their names (the data's, else "0", "1", ...). Data without labels is refused with the fix."""
    m = cfg.model
    if not m.conditional:
        return cfg
    unlabeled = int((labels < 0).sum()) if len(labels) else 0
    if not len(labels) or unlabeled:
        what = "no labels" if not len(labels) or unlabeled == len(labels) else f"{unlabeled} images without a label"
        raise ConfigError(
            f"--conditional trains on class labels, and {source} has {what}: use a labelled source (a folder of "
            f"class sub-folders, an .npz with `labels`, mnist / fashion-mnist / cifar10), or drop --conditional")
    n = max(int(labels.max()) + 1, len(class_names))
    names = tuple(class_names) + tuple(str(i) for i in range(len(class_names), n))
    if m.num_classes and m.num_classes != n:
        raise ConfigError(f"model.num_classes={m.num_classes} but the data has {n} classes: drop the setting (it "
                          f"comes from the data)")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, num_classes=n, class_names=names))


def class_index(model_cfg: ModelConfig, name_or_id: str) -> int:
    """The class id that `--class` names: a class name (case-insensitive) or a number. Refused naming the valid ones."""
    names = model_cfg.class_names
    if not model_cfg.conditional:
        raise ConfigError(f"--class {name_or_id}: this model is unconditional (trained without --conditional); "
                          f"sample without --class")
    wanted = name_or_id.strip()
    for i, name in enumerate(names):
        if name.lower() == wanted.lower():
            return i
    if wanted.lstrip("-").isdigit():
        i = int(wanted)
        if 0 <= i < model_cfg.num_classes:
            return i
        raise ConfigError(f"--class {i} is out of range: this model has classes 0-{model_cfg.num_classes - 1} "
                          f"({_list_classes(names)})")
    raise ConfigError(f"--class {name_or_id!r} is not one of this model's classes: {_list_classes(names)} (a name or "
                      f"its number, or all)")


def _list_classes(names: tuple[str, ...]) -> str:
    return ", ".join(f"{i} {n!r}" for i, n in enumerate(names))


def check_same_architecture(saved: RunConfig, current: RunConfig, path: Path) -> None:
    """Resuming with a different model or diffusion process cannot be exact: name the field that changed."""
    for section in ("model", "diffusion"):
        a, b = dataclasses.asdict(getattr(saved, section)), dataclasses.asdict(getattr(current, section))
        for key in a:
            if a[key] != b[key]:
                raise ConfigError(
                    f"cannot resume from {path}: {section}.{key} was {a[key]!r} in the checkpoint but is {b[key]!r} "
                    f"now; drop the change, or start a new run directory"
                )


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a config field: `--batch-size`, or its `cli` name (`--eval-every`)."""
    return "--" + (f.metadata.get("cli") or f.name).replace("_", "-")


def reference_markdown() -> str:
    """The table of every config field in docs/config.md (regenerate with `python -m fastddpm.config`)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/fastddpm/config.py` by `python -m fastddpm.config > docs/config.md`; a test keeps it",
        "in sync. Every field is a flag of `fastddpm train` (shown), a `--set section.field=value` override, and",
        "a key of a YAML/JSON `--config` file under its section. Presets change some defaults: see",
        "`fastddpm train --help`.",
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"## {section}", "", cls.__doc__.strip().splitlines()[0], "",
                  "| field | flag | default | meaning |", "| --- | --- | --- | --- |"]
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            flag = flag_name(f)
            text = f.metadata["help"]
            if f.metadata.get("choices"):
                text += " One of: " + ", ".join("none" if c is None else c for c in f.metadata["choices"]) + "."
            lines.append(f"| `{f.name}` | `{flag}` | `{shown}` | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
