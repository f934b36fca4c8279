"""The run's configuration schema: one typed, keyword-only dataclass per component (model, diffusion, data,
train), each field documented (its help text generates `fastddpm train --help` and docs/config.md) and validated
in __post_init__ with a message that names the value and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from fastddpm.config.errors import ConfigError  # noqa: F401  (re-exported: the config modules import it from here)
from fastddpm.config.errors import require as _require
from fastddpm.config.model_checks import check_ddpm, check_ddpm_shape, check_seed
from fastddpm.config.sampling import DEFAULT_SAMPLER, DEFAULT_SAMPLER_STEPS, SAMPLER_CHOICES, resolve_sampling


def _doc(text: str, *, cli: str | None = None, choices: tuple[str, ...] | None = None) -> dict:
    """Field metadata: the help text, an optional CLI flag name, and allowed string values."""
    return {"help": text, "cli": cli, "choices": choices}


ATTENTION_HEAD_PADS = (0, 8, 16, 32, 64)  # train.attention_head_pad's values (fastddpm.models.attention)


LOGGERS = ("jsonl", "tensorboard", "wandb")  # train.log_to's choices


def _check_choice(section: str, obj: Any, name: str) -> None:
    choices = obj.__dataclass_fields__[name].metadata["choices"]
    value = getattr(obj, name)
    _require(value in choices, f"{section}.{name}={value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(kw_only=True)
class ModelConfig:
    """The U-Net: the seed's (family seed, 10.2M parameters by default) or DDPM / improved-diffusion's (ddpm).
    The seed family's defaults are the public DDPM-Pytorch code's config; ddpm reads base_channels, channel_mult."""

    family: str = field(
        default="seed",
        metadata=_doc("U-Net family: seed (the seed notebook's, down_channels/mid_channels/...) or ddpm (Ho et al. "
                      "2020 / improved-diffusion: base_channels, channel_mult, num_res_blocks, "
                      "attention_resolutions, dropout, scale_shift_norm, resblock_updown). A field marked for one "
                      "family is refused when given for the other (it would be ignored).",
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
    # Three details in which Ho et al.'s TensorFlow code (and the google/ddpm-* models diffusers converted from it)
    # differs from improved-diffusion's PyTorch, whose choices are the defaults: the two compute other functions, so
    # weights trained under one setting need the same setting to load (train --init-from reads them from the folder).
    time_freq_shift: int = field(
        default=0, metadata=_doc("ddpm family: the sinusoidal time embedding's frequencies are 10000^(-i / (d/2 - "
                                 "shift)), i < d/2: 0 as improved-diffusion, 1 as Ho et al.'s TensorFlow code "
                                 "(diffusers' freq_shift).")
    )
    norm_eps: float = field(
        default=1e-5, metadata=_doc("ddpm family: GroupNorm epsilon (torch's default; Ho et al.'s TensorFlow code: "
                                    "1e-6).")
    )
    downsample_padding: str = field(
        default="symmetric",
        metadata=_doc("ddpm family: padding of the stride-2 downsampling conv: symmetric (one pixel each side) or "
                      "tf-same (TensorFlow's SAME: one row and column after, none before, as Ho et al.'s code; "
                      "diffusers' downsample_padding=0).", choices=("symmetric", "tf-same")),
    )
    down_channels: tuple[int, ...] = field(
        default=(32, 64, 128, 256), metadata=_doc("seed family: channels at each U-Net level, comma-separated.")
    )
    mid_channels: tuple[int, ...] = field(
        default=(256, 256, 128),
        metadata=_doc("seed family: channels through the mid blocks; first = last down channel, last = "
                      "second-to-last."),
    )
    down_sample: tuple[bool, ...] = field(
        default=(True, True, False),
        metadata=_doc("seed family: whether each down block halves the resolution (one per block)."),
    )
    time_emb_dim: int = field(default=128, metadata=_doc("seed family: width of the sinusoidal time embedding (even)."))
    num_down_layers: int = field(default=2, metadata=_doc("seed family: ResNet+attention layers per down block."))
    num_mid_layers: int = field(default=2, metadata=_doc("seed family: Attention+ResNet pairs per mid block (after "
                                                          "one ResNet)."))
    num_up_layers: int = field(default=2, metadata=_doc("seed family: ResNet+attention layers per up block."))
    num_heads: int = field(default=4, metadata=_doc("Attention heads; each attention layer's channels must "
                                                    "divide by it."))
    norm_groups: int = field(default=8, metadata=_doc("GroupNorm groups; every channel count must divide by it."))
    attention: bool = field(
        default=True, metadata=_doc("seed family: self-attention after each ResNet block (off = faster on CPU).")
    )
    out_block_channels: int = field(
        default=16, metadata=_doc("seed family: channels of the last up block (the seed's code: 16).")
    )
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
        # before the divisibility checks below, which divide by them
        _require(self.norm_groups >= 1, f"model.norm_groups={self.norm_groups} must be >= 1, e.g. 8 or 32")
        _require(self.num_heads >= 1, f"model.num_heads={self.num_heads} must be >= 1, e.g. 4")
        if self.family == "ddpm":
            _check_choice("model", self, "downsample_padding")
            check_ddpm(self)
        else:
            check_seed(self)

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
        _require(self.image_channels >= 1 and self.image_size >= 1, f"model.image_channels={self.image_channels} and "
                 f"image_size={self.image_size} must be >= 1 (they come from the data)")
        if self.family == "ddpm":
            check_ddpm_shape(self)
            return
        factor = 2 ** sum(self.down_sample)
        _require(
            self.image_size % factor == 0,
            f"model.image_size={self.image_size} must divide by {factor} (the U-Net halves it {sum(self.down_sample)} "
            f"times): resize the data (--resize) or change model.down_sample",
        )


@dataclass(kw_only=True)
class DiffusionConfig:
    """Forward process and training target (Ho et al. 2020; Nichol & Dhariwal 2021; Salimans & Ho 2022).

    A field only one objective reads, given explicitly for a run of another, is refused (it would be ignored)."""

    num_timesteps: int = field(default=1000, metadata=_doc(
        "Diffusion steps T (DDPM only; a field marked for one objective is refused when given for another)."))
    schedule: str = field(default="linear", metadata=_doc(
        "Beta schedule (DDPM only).", choices=("linear", "cosine")))
    beta_start: float | None = field(default=None, metadata=_doc(
        "First beta of the linear schedule (DDPM only); none: Ho et al.'s 1e-4 at T = 1000, scaled by 1000 / T for "
        "another T (Nichol & Dhariwal 2021). A value given is used as written, as in diffusers' DDPMScheduler."))
    beta_end: float | None = field(default=None, metadata=_doc(
        "Last beta of the linear schedule (DDPM only); none: Ho et al.'s 0.02 at T = 1000, scaled by 1000 / T, so "
        "that any T ends near pure noise. A value given is used as written."))
    prediction: str = field(
        default="epsilon", metadata=_doc("What the network predicts: the noise, or v.", choices=("epsilon", "v"))
    )
    objective: str = field(
        default="ddpm",
        metadata=_doc("The formulation: DDPM's T discrete timesteps (with schedule and prediction above); EDM's "
                      "preconditioned continuous sigma (Karras et al. 2022); flow matching's straight path, "
                      "predicting velocity (Lipman et al. 2022).", choices=("ddpm", "edm", "flow")),
    )
    sigma_data: float = field(default=0.5, metadata=_doc("EDM: the data's standard deviation in c_skip/c_out/c_in."))
    edm_p_mean: float = field(default=-1.2, metadata=_doc("EDM: mean of ln(sigma) when training."))
    edm_p_std: float = field(default=1.2, metadata=_doc("EDM: standard deviation of ln(sigma) when training."))
    flow_shift: float = field(
        default=1.0, metadata=_doc("Flow: the sampling levels' shift t' = s t / (1 + (s - 1) t) (1 = none; SD3 "
                                   "uses 3 at 1024 px).")
    )

    def __post_init__(self) -> None:
        _check_choice("diffusion", self, "schedule")
        _check_choice("diffusion", self, "prediction")
        _check_choice("diffusion", self, "objective")
        _require(self.objective == "ddpm" or self.prediction == "epsilon",
                 f"diffusion.prediction={self.prediction} is DDPM's choice: an {self.objective} network predicts "
                 + ("EDM's F of its preconditioning" if self.objective == "edm" else "the velocity eps - x_0")
                 + "; leave --prediction out, or use --objective ddpm")
        _require(0 < self.sigma_data < math.inf and 0 < self.edm_p_std < math.inf,
                 f"diffusion.sigma_data={self.sigma_data} and edm_p_std={self.edm_p_std} must be finite and > 0 "
                 "(EDM's: 0.5 and 1.2)")
        _require(math.isfinite(self.edm_p_mean),
                 f"diffusion.edm_p_mean={self.edm_p_mean} must be a finite number (EDM's: -1.2)")
        _require(0 < self.flow_shift < math.inf,
                 f"diffusion.flow_shift={self.flow_shift} must be finite and > 0 (1 = no shift)")
        _require(self.num_timesteps >= 2, f"diffusion.num_timesteps={self.num_timesteps} must be >= 2")
        if self.schedule == "linear":
            start, end = self.linear_beta_range()
            _require(0 < start < end < 1,
                     f"diffusion betas must satisfy 0 < beta_start < beta_end < 1; at num_timesteps="
                     f"{self.num_timesteps} they are {start:g} and {end:g}"
                     + (" (Ho et al.'s 1e-4 and 0.02 scaled by 1000 / T): use num_timesteps > 20, the cosine "
                        "schedule, or give --beta-start and --beta-end"
                        if self.beta_start is None and self.beta_end is None else
                        " (a beta left unset is Ho et al.'s scaled by 1000 / T): give both --beta-start and "
                        "--beta-end, or neither"))

    def linear_beta_range(self) -> tuple[float, float]:
        """The linear schedule's first and last beta. Unset, they are Ho et al.'s 1e-4 and 0.02 for T = 1000, both
        scaled by 1000 / T for another T (Nichol & Dhariwal 2021, arXiv:2102.09672, improved-diffusion's
        get_named_beta_schedule): the last alpha_bar stays near T = 1000's 4e-5, where unscaled betas at T = 100
        end at 0.36 and sampling from N(0, I) would start where 60% of the signal remains. Given, they are used as
        written (diffusers' convention; runs saved before the scaling hold them so, and keep their schedule)."""
        scale = 1000 / self.num_timesteps
        return (1e-4 * scale if self.beta_start is None else self.beta_start,
                0.02 * scale if self.beta_end is None else self.beta_end)


@dataclass(kw_only=True)
class DataConfig:
    """Where the images come from and how they are cached (decoded once into a uint8 array)."""

    source: str = field(
        default="fashion-mnist",
        metadata=_doc("A named dataset (mnist, fashion-mnist, cifar10) or a path: IDX folder, image folder "
                      "root/<label>/*.png, .zip of that folder, CIFAR-10 batches folder or .tar.gz, .npy/.npz.",
                      cli="data"),
    )
    split: str = field(default="train", metadata=_doc(
        "Split to train on: of IDX/CIFAR sources (train, test), and of a folder or zip with split folders "
        "(train/, test/, val/ and their usual spellings).", choices=("train", "test", "val")))
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
    lr: float = field(default=1e-4,
                      metadata=_doc("AdamW learning rate (the seed notebook's recipe, seed-1layer: Adam 1e-4)."))
    adam_betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=_doc("AdamW betas."))
    weight_decay: float = field(
        default=0.0, metadata=_doc("AdamW decoupled weight decay (0 = Adam, as the seed notebook's recipe)."))
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
                      "auto = on for CUDA; on a CPU only under bf16 and for runs long enough for the compile "
                      "time to pay back twice on the slowest-gaining CPU measured (the run's log gives the "
                      "threshold in images and the measurement behind it).",
                      choices=("auto", "on", "off")),
    )
    compile_mode: str = field(
        default="default",
        metadata=_doc("Inductor's mode when compiling: max-autotune times Triton templates against cuBLAS/cuDNN for "
                      "each matmul and convolution shape (minutes more compile; a candidate for the small "
                      "convolutions of a U-Net at 28x28, pending a GPU measurement). Its CUDA graphs are "
                      "fastddpm's own (train.cuda_graphs).", choices=("default", "max-autotune")),
    )
    inductor_layout: str = field(
        default="auto",
        metadata=_doc("The layout Inductor gives the compiled step's own tensors. heuristic = Inductor's own: NCHW in "
                      "a graph with a convolution of >= 2x as many input as output channels and a kernel wider than "
                      "1 (a U-Net decoder's), so aten copies between it and cuDNN's NHWC. channels-last = its layout "
                      "optimization forced. auto = forced on one CUDA device under bf16 (on an H200: 1.18x the "
                      "heuristic on ddpm-cifar10 at batch 128, 1.02x on seed-1layer at 1024 with channels_last), "
                      "the heuristic elsewhere (unmeasured). channels-last needs --compile on (or auto that compiles).",
                      choices=("auto", "channels-last", "heuristic")),
    )
    cuda_graphs: str = field(
        default="auto",
        metadata=_doc("CUDA graphs for the step: capture = the whole step in one graph; reduce-overhead = "
                      "torch.compile's graph trees. auto = capture on CUDA (not with fp16's GradScaler).",
                      choices=("auto", "off", "capture", "reduce-overhead")),
    )
    channels_last: str = field(
        default="auto",
        metadata=_doc("NHWC memory format for the U-Net's weights and inputs (cuDNN's bf16 convolutions run in "
                      "NHWC and convert NCHW tensors). auto = on for the seed U-Net compiled on one CUDA device "
                      "under bf16 (measured 1.09x on an H200, seed-1layer at batch 1024); off for the DDPM family "
                      "(0.94x there, ddpm-cifar10 at 128), in eager (GroupNorm has no NHWC kernel), on a CPU, under "
                      "DDP/FSDP and under fp16/fp32 (unmeasured).", choices=("auto", "on", "off")),
    )
    attention_head_pad: int | str = field(
        default="auto",
        metadata=_doc("Zero-pad attention heads narrower than this (8, 16, 32 or 64; 0 = off) to it, the softmax "
                      "scale kept: the same function, on kernels a tiny head misses (cuDNN's attention needs a "
                      "multiple of 8; the seed U-Net's heads at 16 channels are 4 wide). auto = 8 on CUDA under "
                      "compile and bf16 (1.05x on seed-1layer at 1024, H200), else off (unmeasured). `fastddpm "
                      "sample` and `eval` build the U-Net unpadded."),
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
        default=1, metadata=_doc("Update the EMA every k steps (decay^k) and at the last step, outside CUDA graphs.")
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
        default=600.0, metadata=_doc("Seconds a rank waits in a collective for a peer before failing the job. "
                                     "It must cover what rank 0 does alone while the others wait: an evaluation "
                                     "(--eval-every; its first set-up may train the dataset's feature network) "
                                     "and a sample grid.")
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
    sampler: str = field(default="auto", metadata=_doc(
        f"Sampler for the grids (auto: heun for a flow model, unipc for one guided at W > 1, {DEFAULT_SAMPLER} for "
        "DDPM and EDM models, guided or not: the best of each on the CPU demo).", choices=SAMPLER_CHOICES))
    sample_steps: int | None = field(default=None, metadata=_doc(
        f"Sampler steps for the grids (none: 10 where auto picks heun or unipc, else {DEFAULT_SAMPLER_STEPS}; DDPM "
        "always uses T)."))
    sample_guidance: float = field(
        default=2.0,
        metadata=_doc("Classifier-free guidance scale W of a conditional model's grids (one row per class), its "
                      "evaluations, and `sample`/`eval` of its checkpoints: 1 = plain conditional, 0 = "
                      "unconditional, > 1 = more class-faithful, less varied. 2: the best FID of the CPU demo with "
                      "SDE-DPM-Solver++ 20 steps on the DDPM model, 93% class accuracy (benchmarks/RESULTS.md; a "
                      "flow model guided at 2 with UniPC 10 steps: FID 1.75-1.91 over three training seeds, 94% "
                      "class accuracy; at 1.5 FID 1.82 with 90%, at 3 2.82 with 97%)."),
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
                      "(none = off): records in metrics.jsonl and eval.jsonl, a curve in eval_curve.png, its time "
                      "excluded from wall_s and images_per_s; torchrun's ranks share the sampling.", cli="eval-every"),
    )
    eval_samples: int = field(
        default=1000, metadata=_doc("Images sampled per evaluation during training (FID is biased upward at small "
                                    "counts: compare runs at equal counts).")
    )
    eval_sampler: str = field(default="auto", metadata=_doc(
        "Sampler for the evaluation samples (auto: the objective's, as train.sampler).", choices=SAMPLER_CHOICES))
    eval_steps: int | None = field(default=None, metadata=_doc(
        f"Sampler steps for the evaluation samples (none: 10 where auto picks heun or unipc, else "
        f"{DEFAULT_SAMPLER_STEPS})."))
    init_from: str | None = field(
        default=None,
        metadata=_doc("A diffusers UNet2DModel folder (a DDPMPipeline's, or its unet/; e.g. a local copy of "
                      "google/ddpm-cifar10-32) whose weights start a new run of the ddpm family. The model options "
                      "(and a pipeline's schedule) are read from its config files; options given explicitly win, "
                      "and one that changes the network's function is refused by name. Not used when resuming."),
    )
    eval_inception: str | None = field(
        default=None,
        metadata=_doc("Inception weights for standard FID during training: auto (found or downloaded as "
                      "`eval --features inception` does), or a local file (pytorch-fid's pt_inception-2015-12-05 "
                      ".pth, or a TorchScript extractor); none = fastddpm-features, a classifier trained on the "
                      "dataset (not comparable to published Inception FID)."),
    )
    min_snr_gamma: float | None = field(
        default=None,
        metadata=_doc("Min-SNR-gamma loss weighting (Hang et al. 2023): weight timestep t by min(SNR_t, gamma)/SNR_t "
                      "(epsilon) or /(SNR_t+1) (v); none = the plain mean (Ho et al.'s L_simple). The paper uses 5; "
                      "off until measured faster by FID."),
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
        _require(self.attention_head_pad == "auto" or self.attention_head_pad in ATTENTION_HEAD_PADS,
                 f"train.attention_head_pad={self.attention_head_pad!r} is not one of auto, "
                 f"{', '.join(map(str, ATTENTION_HEAD_PADS))} (0 = off)")
        _require(0 < self.device_memory_budget <= 1,
                 f"train.device_memory_budget={self.device_memory_budget} must be in (0, 1]")
        _require(self.global_batch_size is None or self.global_batch_size >= 1,
                 f"train.global_batch_size={self.global_batch_size} must be a positive integer (or none)")
        _require(self.ddp_bucket_cap_mb >= 1, f"train.ddp_bucket_cap_mb={self.ddp_bucket_cap_mb} must be >= 1")
        _require(0 < self.dist_timeout_s < math.inf,
                 f"train.dist_timeout_s={self.dist_timeout_s} must be a finite number of seconds > 0, e.g. 600")
        for name in ("compile", "compile_mode", "inductor_layout", "cuda_graphs", "channels_last", "cudnn_benchmark",
                     "data_placement", "parallel"):
            _check_choice("train", self, name)
        for name in ("max_steps", "max_images", "max_epochs", "checkpoint_every", "sample_every_images",
                     "eval_every_images"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"train.{name}={v} must be positive (or none)")
        _require(self.max_epochs is None or math.isfinite(self.max_epochs),
                 f"train.max_epochs={self.max_epochs} must be a finite number of passes over the data (or none)")
        given = [n for n in ("max_steps", "max_images", "max_epochs") if getattr(self, n) is not None]
        _require(len(given) <= 1,
                 f"give only one of --max-steps, --max-images, --max-epochs (got {', '.join(given)})")
        _require(self.lr > 0 and math.isfinite(self.lr), f"train.lr={self.lr} must be > 0 and finite, e.g. 1e-4")
        _require(0 <= self.weight_decay and math.isfinite(self.weight_decay),
                 f"train.weight_decay={self.weight_decay}: must be a finite number >= 0 (0 turns it off)")
        _require(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
                 f"train.adam_betas={self.adam_betas} must be two numbers in [0, 1)")
        _require(0 <= self.ema_decay < 1, f"train.ema_decay={self.ema_decay} must be in [0, 1)")
        _require(self.grad_clip is None or self.grad_clip > 0, f"train.grad_clip={self.grad_clip} must be > 0")
        _require(self.keep_checkpoints >= 1, f"train.keep_checkpoints={self.keep_checkpoints} must be >= 1")
        _require(self.cpu_threads is None or self.cpu_threads >= 1,
                 f"train.cpu_threads={self.cpu_threads} must be >= 1 (or none for torch's own count)")
        _require(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        _require(self.num_sample_images >= 1, f"train.num_sample_images={self.num_sample_images} must be >= 1")
        _require(self.sample_steps is None or self.sample_steps >= 1,
                 f"train.sample_steps={self.sample_steps} must be >= 1 (or none for the sampler's default)")
        _require(self.warmup_images >= 0, f"train.warmup_images={self.warmup_images} must be >= 0")
        _require(0 <= self.cond_drop_prob < 1, f"train.cond_drop_prob={self.cond_drop_prob} must be in [0, 1)")
        _require(0 <= self.sample_guidance < math.inf,
                 f"train.sample_guidance={self.sample_guidance} must be a finite number >= 0 (1 = plain conditional, "
                 "2 = the default)")
        _require(self.eval_samples >= 10,
                 f"train.eval_samples={self.eval_samples} must be >= 10 (a covariance and 3-NN radii need a few "
                 "samples; 1000 is fast, 10000 is the usual final count)")
        _require(self.eval_steps is None or self.eval_steps >= 1,
                 f"train.eval_steps={self.eval_steps} must be >= 1 (or none for the sampler's default)")
        _require(self.min_snr_gamma is None or self.min_snr_gamma > 0,
                 f"train.min_snr_gamma={self.min_snr_gamma} must be > 0 (e.g. 5), or none for the plain loss")


@dataclass(kw_only=True)
class RunConfig:
    preset: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        objective = self.diffusion.objective
        if objective != "ddpm":
            _require(self.train.min_snr_gamma is None,
                     f"train.min_snr_gamma is a DDPM loss weighting; --objective {objective} weights its loss its "
                     "own way: leave --min-snr-gamma out")
            for name in ("sampler", "eval_sampler"):
                _require(getattr(self.train, name) != "ddpm",
                         f"train.{name}=ddpm walks DDPM's discrete timesteps; a {objective} model samples with "
                         "euler, ddim, dpmpp-2m, dpmpp-2m-sde, unipc or heun")

    def guided(self, guidance: float | None) -> bool:
        """Whether samples drawn at classifier-free guidance scale `guidance` (None: without labels) are guided in
        the sense `auto` picks a sampler by: a conditional model at W > 1."""
        return self.model.conditional and guidance is not None and guidance > 1

    def grid_sampling(self) -> tuple[str, int]:
        """The training grids' (sampler, steps), `auto` resolved for this run's objective (a conditional run's
        grids are guided at train.sample_guidance)."""
        return resolve_sampling(self.train.sampler, self.train.sample_steps, self.diffusion.objective,
                                guided=self.guided(self.train.sample_guidance))

    def eval_sampling(self) -> tuple[str, int]:
        """--eval-every's (sampler, steps), `auto` resolved as for the grids (evaluated at the same scale)."""
        return resolve_sampling(self.train.eval_sampler, self.train.eval_steps, self.diffusion.objective,
                                guided=self.guided(self.train.sample_guidance))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "diffusion": DiffusionConfig,
    "data": DataConfig,
    "train": TrainConfig,
}
