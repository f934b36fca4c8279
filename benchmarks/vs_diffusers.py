"""One network, two trainers: fastddpm's training step against diffusers' own training loop, side by side.

fastddpm's ddpm family and diffusers' UNet2DModel compute the same function (tests/test_diffusers_io.py), so the
same architecture can be trained by each with nothing else different: here google/ddpm-cifar10-32's network
(Ho et al. 2020, 35.7M parameters at 3x32x32; `--width small` narrows it to 32/64/64/64 for a CPU) from one
UNet2DModel config.json, at one batch size, on resident synthetic images (no input pipeline on either side).

  diffusers  the step of diffusers' examples/unconditional_image_generation/train_unconditional.py, as written
             there: accelerate's Accelerator (its --mixed_precision), AdamW with the script's defaults, noise and
             timesteps drawn per step, DDPMScheduler.add_noise, MSE in fp32, accelerator.backward, gradient norm
             clipped at 1, the LR scheduler's step, EMAModel.step (the script's --use_ema, as its train.sh runs it)
             and the loss read back for the progress bar each step.
  fastddpm   the step `fastddpm train --init-from FOLDER` runs for that network: built by the trainer's own code
             (bench throughput's VariantTimer), with its defaults for the device (on a GPU: bf16, compiled, one
             CUDA graph per step; on a CPU: bf16 where native, eager), gradient clipping at 1 and EMA each step.

Both draw their own noise and timesteps every step. Each side is built and warmed up (its compile time apart),
then timed in rounds that alternate the two, the order swapped every round; the per-round ratio's median and
spread are reported with each side's median step time and images/s. Results go to OUT/vs_diffusers.json and .md
as each batch size finishes.

    PYTHONPATH=src python benchmarks/vs_diffusers.py --device cpu --width small --batch-sizes 32 --out DIR
    PYTHONPATH=src python benchmarks/vs_diffusers.py --device cuda --batch-sizes 128 --out DIR      # on a GPU

Needs diffusers and accelerate (the test extras).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# google/ddpm-cifar10-32's unet/config.json (the keys it leaves out take UNet2DModel's defaults)
CIFAR10_32 = {
    "act_fn": "silu", "attention_head_dim": None, "block_out_channels": [128, 256, 256, 256],
    "center_input_sample": False, "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
    "downsample_padding": 0, "flip_sin_to_cos": False, "freq_shift": 1, "in_channels": 3, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-06, "norm_num_groups": 32, "out_channels": 3, "sample_size": 32,
    "time_embedding_type": "positional", "up_block_types": ["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
}
WIDTHS = {"cifar10": [128, 256, 256, 256], "small": [32, 64, 64, 64]}


class DiffusersStep:
    """train_unconditional.py's step for `unet_config` (defaults of its flags: lr 1e-4, AdamW betas (0.95, 0.999),
    weight decay 1e-6, eps 1e-8, cosine schedule with 500 warm-up steps, EMA with warm-up, inv_gamma 1, power 3/4,
    max decay 0.9999)."""

    def __init__(self, unet_config: dict, batch_size: int, device: torch.device, mixed_precision: str, seed: int):
        from accelerate import Accelerator
        from diffusers import DDPMScheduler, UNet2DModel
        from diffusers.optimization import get_scheduler
        from diffusers.training_utils import EMAModel

        torch.manual_seed(seed)
        self.accelerator = Accelerator(mixed_precision=mixed_precision, cpu=device.type == "cpu")
        model = UNet2DModel(**unet_config)
        self.ema = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75,
                            model_cls=UNet2DModel, model_config=model.config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
        lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=500, num_training_steps=10**6)
        self.model, self.optimizer, self.lr_scheduler = self.accelerator.prepare(model, optimizer, lr_scheduler)
        self.ema.to(self.accelerator.device)
        self.scheduler = DDPMScheduler(num_train_timesteps=1000)
        g = torch.Generator().manual_seed(seed)
        c, s = unet_config["in_channels"], unet_config["sample_size"]
        self.clean = (torch.rand(batch_size, c, s, s, generator=g) * 2 - 1).to(self.accelerator.device)
        self.loss = None

    def __call__(self) -> None:
        clean, acc = self.clean, self.accelerator
        noise = torch.randn(clean.shape, device=clean.device)
        timesteps = torch.randint(0, self.scheduler.config.num_train_timesteps, (clean.shape[0],),
                                  device=clean.device).long()
        noisy = self.scheduler.add_noise(clean, noise, timesteps)
        with acc.accumulate(self.model):
            out = self.model(noisy, timesteps).sample
            loss = F.mse_loss(out.float(), noise.float())
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.lr_scheduler.step()
            self.optimizer.zero_grad()
        if acc.sync_gradients:
            self.ema.step(self.model.parameters())
        self.loss = loss.detach().item()  # the script's progress bar and logs read it every step


class FastddpmStep:
    """The step `fastddpm train` runs for the same network (config read from the UNet2DModel config by the table
    --init-from uses), built by bench throughput's VariantTimer: model, optimizer, EMA and TrainStep as the
    trainer builds them, on resident uint8 images."""

    def __init__(self, unet_config: dict, batch_size: int, device: torch.device, precision: str, compile_: str,
                 seed: int, warmup_steps: int):
        from fastddpm.bench.throughput import ThroughputSettings
        from fastddpm.bench.variant_timer import Variant, VariantTimer, peak_dtype
        from fastddpm.config import resolve_config, resolve_model_shape
        from fastddpm.config.diffusers_unet import UNET2D_DEFAULTS, model_fields
        from fastddpm.device import resolve_precision
        from fastddpm.measure import Peaks

        c, s = unet_config["in_channels"], unet_config["sample_size"]
        fields = model_fields({**UNET2D_DEFAULTS, **unet_config}, "unet_config")
        # UNet2DModel's dropout (0, its default) rather than the preset's 0.1: the same network, the same work
        cfg = resolve_config("ddpm-cifar10", layers=[("vs_diffusers", {
            **fields, "model.dropout": 0.0, "train.batch_size": batch_size, "train.precision": precision,
            "train.compile": compile_, "train.device": str(device), "train.seed": seed,
            "train.data_placement": "device"})])
        num_images = max(10 * batch_size, 1024)
        cfg = resolve_model_shape(cfg, (num_images, c, s, s))
        p = resolve_precision(precision, device)
        settings = ThroughputSettings(batch_sizes=(batch_size,), presets=("ddpm-cifar10",), warmup_steps=warmup_steps,
                                      steps=1, repeats=1, image_shape=(c, s, s), num_images=num_images)
        images = np.random.default_rng(seed).integers(0, 256, (num_images, c, s, s), dtype=np.uint8)
        peaks = Peaks(device, log=lambda line: None)
        self.timer = VariantTimer(Variant(preset="ddpm-cifar10", batch_size=batch_size, cfg=cfg, precision=p),
                                  images, device=device, settings=settings, peak=peaks.matmul(peak_dtype(p)),
                                  bandwidth=peaks.bandwidth())
        self.step = warmup_steps
        self.precision = p.name
        self.fast_path = self.timer.fast.reasons

    def __call__(self) -> None:
        self.timer.one_step(self.step)
        self.step += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rounds(sides: dict, device: torch.device, rounds: int, steps: int) -> dict:
    """Per side, the milliseconds per step of each round (CUDA events on a GPU, perf_counter on a CPU), the two
    sides alternating, the order swapped every round."""
    ms = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            f = sides[name]
            _sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(steps):
                    f()
                end.record()
                end.synchronize()
                ms[name].append(start.elapsed_time(end) / steps)
            else:
                t = time.perf_counter()
                for _ in range(steps):
                    f()
                ms[name].append((time.perf_counter() - t) * 1e3 / steps)
    return ms


def markdown(record: dict) -> str:
    lines = [f"# fastddpm vs diffusers' train_unconditional.py: the same UNet2DModel ({record['width']})", "",
             f"{record['environment']['device_name']}, torch {record['environment']['torch']}, diffusers "
             f"{record['diffusers']}, accelerate {record['accelerate']}, {record['environment']['date_utc']}, commit "
             f"{record['environment'].get('git_commit')}", "", f"command: `{record['command']}`", "",
             "| batch | diffusers ms/step | fastddpm ms/step | diffusers img/s | fastddpm img/s | fastddpm / diffusers "
             "(median [min-max] of rounds) | precision (diffusers / fastddpm) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["rows"]:
        d, f = r["diffusers"], r["fastddpm"]
        lines.append(f"| {r['batch_size']} | {d['ms_median']:.1f} | {f['ms_median']:.1f} | {d['images_per_s']:,.0f} | "
                     f"{f['images_per_s']:,.0f} | **{r['speedup_median']:.2f}x** [{r['speedup_min']:.2f}-"
                     f"{r['speedup_max']:.2f}] | {d['precision']} / {f['precision']} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", choices=sorted(WIDTHS), default="cifar10")
    ap.add_argument("--batch-sizes", default="128", help="comma-separated")
    ap.add_argument("--precision", default="auto", help="fastddpm's --precision; diffusers' --mixed_precision "
                                                         "follows it (bf16 -> bf16, fp16 -> fp16, fp32 -> no)")
    ap.add_argument("--compile", default="auto", help="fastddpm's --compile (train_unconditional.py has none)")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20, help="steps per side per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import accelerate
    import diffusers

    from fastddpm.measure import environment_record

    device = torch.device(args.device)
    unet_config = {**CIFAR10_32, "block_out_channels": WIDTHS[args.width]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"width": args.width, "unet_config": unet_config, "diffusers": diffusers.__version__,
              "accelerate": accelerate.__version__, "environment": environment_record(device),
              "command": " ".join(["python", *sys.argv]), "rows": []}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        fast = FastddpmStep(unet_config, batch, device, args.precision, args.compile, args.seed, args.warmup_steps)
        mixed = {"bf16": "bf16", "fp16": "fp16"}.get(fast.precision, "no")
        theirs = DiffusersStep(unet_config, batch, device, mixed, args.seed)
        t = time.perf_counter()
        for _ in range(args.warmup_steps):
            theirs()
        _sync(device)
        theirs_warmup_s = time.perf_counter() - t
        ms = time_rounds({"diffusers": theirs, "fastddpm": fast}, device, args.rounds, args.steps)
        ratios = [d / f for d, f in zip(ms["diffusers"], ms["fastddpm"])]
        row = {"batch_size": batch, "speedup_median": statistics.median(ratios), "speedup_min": min(ratios),
               "speedup_max": max(ratios), "ratios": ratios,
               "diffusers": {"ms": ms["diffusers"], "ms_median": statistics.median(ms["diffusers"]),
                             "precision": mixed, "warmup_s": theirs_warmup_s, "final_loss": theirs.loss},
               "fastddpm": {"ms": ms["fastddpm"], "ms_median": statistics.median(ms["fastddpm"]),
                            "precision": fast.precision, "fast_path": fast.fast_path,
                            "warmup_s": fast.timer.compile_s}}
        for side in ("diffusers", "fastddpm"):
            row[side]["images_per_s"] = batch / (row[side]["ms_median"] / 1e3)
        assert all(math.isfinite(x) for x in ratios)
        record["rows"].append(row)
        (out / "vs_diffusers.json").write_text(json.dumps(record, indent=2, default=str))
        (out / "vs_diffusers.md").write_text(markdown(record))
        print(markdown(record).splitlines()[-1], flush=True)
        del fast, theirs
    return 0


if __name__ == "__main__":
    sys.exit(main())
