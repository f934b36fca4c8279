"""Presets: plain functions returning a RunConfig, each saying in its docstring what it is for (the first
paragraph is its line in `fastddpm train --help`)."""

from __future__ import annotations

import dataclasses
import difflib

from fastddpm.config.schema import (ConfigError, DataConfig, DiffusionConfig, ModelConfig, RunConfig,
                                    TrainConfig)


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
    """Five minutes on a 2-core CPU with native bf16: a 0.6M-parameter U-Net without attention, trained by flow
    matching on 150k Fashion-MNIST images, samples you can recognise (unconditional).

    A narrower U-Net without attention (attention at 28x28 dominates CPU time), a larger learning rate with a
    short warm-up and a faster EMA, so garments are recognisable after 100,000 images (1.7 epochs) instead of
    forty epochs. The budget is 150,000 images (2.5 epochs): what bf16 trains on such a CPU in the time fp32 took
    for 100,000, with a better FID at that equal wall time (benchmarks/RESULTS.md, "The CPU fast path"); a CPU
    without native bf16 trains it in fp32, about 1.5x longer.

    The objective is flow matching: at this budget it scored a better FID than every other objective at every
    training seed measured (three for the epsilon DDPMs), by 3.0-3.9 at 10 network calls and 0.5-1.1 at about 20
    against the cosine-schedule epsilon DDPM this preset trained before (benchmarks/RESULTS.md, "Objectives on the
    CPU demo"). Its samples default to Heun with 10 steps (`--sampler auto`). `--objective ddpm --schedule cosine`
    trains the DDPM.
    """
    return RunConfig(
        preset="cpu-demo",
        model=ModelConfig(down_channels=(32, 64, 64), mid_channels=(64, 64), down_sample=(True, True),
                          time_emb_dim=64, num_down_layers=1, num_mid_layers=1, num_up_layers=1,
                          attention=False, out_block_channels=32),
        diffusion=DiffusionConfig(objective="flow"),
        train=TrainConfig(batch_size=64, max_images=150_000, lr=2e-3, warmup_images=10_000, ema_decay=0.999,
                          log_every=20, checkpoint_every=1000, sample_every_images=75_000),
    )


def preset_cpu_demo_cond() -> RunConfig:
    """The cpu-demo recipe, class-conditional: the same 0.6M-parameter U-Net with a class embedding, trained on
    the data's labels (10% dropped for classifier-free guidance); grids show one row per class.

    For Fashion-MNIST the final grid is ten rows of garments, each row its class, at guidance W = 2. The CPU's
    default preset. Like cpu-demo it trains flow matching, sampled guided with UniPC 10 steps (`--sampler auto`):
    at 150k images (fp32) that scored FID 1.90, 1.75 and 1.91 at W = 2 at three training seeds (94.0-94.5% of the
    samples the class asked for), against 2.50, 2.34 and 2.15 for the cosine-schedule epsilon DDPM this preset
    trained before at the same 10 network calls (its best at 10), and 1.96, 2.05 and 1.77 for that DDPM at its own
    default, SDE-DPM-Solver++ 20 steps (benchmarks/RESULTS.md, "The conditional arm"): the same FID in half the
    calls. `--objective ddpm --schedule cosine` trains the DDPM.
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



def default_preset(cuda: bool) -> tuple[str, str]:
    """The preset a run starts from when none is named (`fastddpm train` and fastddpm.train alike): the seed's
    one-layer U-Net where a CUDA device can train it, else the CPU quickstart. Returns (name, why)."""
    return ("seed-1layer", "CUDA is available") if cuda else ("cpu-demo-cond", "no CUDA device")


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        hint = difflib.get_close_matches(name, PRESETS, n=1)
        raise ConfigError(
            f"unknown preset {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; choose one of: {', '.join(PRESETS)}"
        )
    return PRESETS[name]()
