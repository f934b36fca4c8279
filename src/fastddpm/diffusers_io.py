"""fastddpm's ddpm-family U-Net as a diffusers folder: `fastddpm export RUN --format diffusers --out DIR`.

    DIR/model_index.json                           DDPMPipeline: unet + scheduler
    DIR/unet/config.json                           UNet2DModel's switches, set so it computes fastddpm's function
    DIR/unet/diffusion_pytorch_model.safetensors   the EMA (--weights model: raw) weights under UNet2DModel's names
    DIR/scheduler/scheduler_config.json            DDPMScheduler: the run's betas and what the network predicts
    DIR/README.md                                  a model card

diffusers loads it with no fastddpm installed: `DDPMPipeline.from_pretrained(DIR)`. Writing it needs only torch and
safetensors; where diffusers is importable the folder is loaded back and compared with fastddpm's model.

The ddpm family (models/ddpm_unet.py) is Ho et al. 2020's U-Net (arXiv:2006.11239, appendix B), the network of
diffusers' UNet2DModel (diffusers/models/unets/unet_2d.py) in google/ddpm-cifar10-32's configuration. The switches
that make the two compute the same function, each read from diffusers' source:
  * time embedding: fastddpm's is [sin(t w_i), cos(t w_i)], w_i = 10000^(-i / (d/2 - time_freq_shift))
    (models/unet.py); diffusers' get_timestep_embedding (diffusers/models/embeddings.py) divides by (d/2 -
    freq_shift) and puts cos first when flip_sin_to_cos: so freq_shift = time_freq_shift, flip_sin_to_cos false.
    (google/ddpm-cifar10-32 has freq_shift 1, the authors' TensorFlow code's d/2 - 1.)
  * ResnetBlock2D (diffusers/models/resnet.py): GN -> SiLU -> conv -> + Linear(SiLU(emb)) -> GN -> SiLU -> dropout
    -> conv, a 1x1 conv_shortcut only when the channels change; time_embedding_norm "scale_shift" is GN(h) * (1 +
    scale) + shift with the scale first, as fastddpm's scale_shift_norm (Nichol & Dhariwal 2021, arXiv:2102.09672).
  * attention (diffusers/models/attention_processor.py, _from_deprecated_attn_block): GroupNorm, separate q, k, v
    Linear layers (fastddpm's qkv 1x1 conv, split in three), heads of attention_head_dim channels, a residual.
    UNetMidBlock2D drops its attention GroupNorm under "scale_shift" unless attn_norm_num_groups is set: it is.
  * Downsample2D: a stride-2 3x3 conv with downsample_padding 1 (symmetric), or 0: one row and column of zeros
    after, TensorFlow's SAME (model.downsample_padding tf-same); Upsample2D: nearest x2, then a 3x3 conv.
  * GroupNorm eps: model.norm_eps everywhere (1e-5, torch's default; Ho et al.'s 1e-6).
The config half of this (the switches, both ways) is fastddpm.config.diffusers_unet, the weights' names
fastddpm.models.diffusers_names; here is the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastddpm.config import CLI, ConfigError, Spelling
from fastddpm.diffusion import schedule_from_config
from fastddpm.diffusion.ode_solvers import LAMBDA_MIN, first_timestep
from fastddpm.config.diffusers_unet import (DIFFUSERS_VERSION, WEIGHTS, check_exportable, mismatch,
                                            read_unet_config, unet_config, weights_file)
from fastddpm.models.diffusers_names import from_diffusers_state_dict, to_diffusers_state_dict
from fastddpm.rundir.diffusers_folder import read_weights

# diffusers against fastddpm, both eager fp32 on the CPU: the same operations in a different order; measured on
# the tiny test models at ~1e-6 of an output of unit scale
TOLERANCE = 1e-4

__all__ = ["TOLERANCE", "check_exportable", "unet_config", "scheduler_config", "write_folder", "check_folder",
           "model_card", "trailing_gaps", "load_init", "read_weights", "to_diffusers_state_dict",
           "from_diffusers_state_dict", "example_inputs"]


def scheduler_config(cfg, version: str = DIFFUSERS_VERSION) -> dict:
    """DDPMScheduler's scheduler_config.json for the run's schedule (diffusers/schedulers/scheduling_ddpm.py)."""
    d = cfg.diffusion
    # the betas actually trained (unset, fastddpm scales Ho et al.'s by 1000 / T); diffusers uses them as written.
    # The cosine schedule reads neither.
    beta_start, beta_end = d.linear_beta_range()
    return {
        "_class_name": "DDPMScheduler",
        "_diffusers_version": version,
        "num_train_timesteps": d.num_timesteps,
        # linear: torch.linspace(beta_start, beta_end, T), fastddpm's linear_betas. squaredcos_cap_v2:
        # betas_for_alpha_bar's cos((t + 0.008) / 1.008 * pi / 2)^2 capped at 0.999, fastddpm's cosine_betas
        # (Nichol & Dhariwal 2021, eq. 17)
        "beta_schedule": "linear" if d.schedule == "linear" else "squaredcos_cap_v2",
        "beta_start": beta_start,
        "beta_end": beta_end,
        "trained_betas": None,
        "variance_type": "fixed_small",  # beta_tilde_t, Ho et al. 2020 eq. 7
        # fastddpm's samplers clamp x0_hat to the data's [-1, 1] (and DDIM re-derives eps from it; diffusers' DDIM
        # does with step(use_clipped_model_output=True)). DDPM/DDIM read clip_sample; DPM-Solver and UniPC read
        # only thresholding, Saharia et al. 2022's dynamic threshold, whose scale is clamped to [1, sample_max_value]:
        # at 1.0 it is the same clamp, for every scheduler built from this config.
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "thresholding": True,
        "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0,
        "prediction_type": "epsilon" if d.prediction == "epsilon" else "v_prediction",
        # fewer inference steps than training steps: evenly spaced from the noisiest one down, as fastddpm samples
        # (Lin et al. 2024, arXiv:2305.08891, table 2; ode_solvers.trailing_timesteps takes diffusers' arithmetic).
        # diffusers' own "trailing" adds a step at t = -1 for some counts (61, 103, 121, ... of 1000: np.arange's
        # float stride), which the model card says.
        "timestep_spacing": "trailing",
        "steps_offset": 0,
        # the few-step solvers start at the noisiest timestep with lambda >= LAMBDA_MIN, as diffusers' DPM-Solver
        # does with lambda_min_clipped (DDPMScheduler ignores it: a key of a compatible scheduler)
        "lambda_min_clipped": LAMBDA_MIN,
        "rescale_betas_zero_snr": False,
    }


def _version() -> str:
    try:
        import diffusers
        return diffusers.__version__
    except ImportError:
        return DIFFUSERS_VERSION


def write_folder(model, cfg, out: Path) -> list[str]:
    """The diffusers folder for `model` (a DDPMUNet) and `cfg` in `out`, the card aside; the files written."""
    from safetensors.torch import save_file

    check_exportable(cfg)
    version = _version()
    (out / "unet").mkdir(parents=True, exist_ok=True)
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    save_file(to_diffusers_state_dict(model), str(out / "unet" / WEIGHTS), metadata={"format": "pt"})
    files = {"unet/config.json": unet_config(cfg, version),
             "scheduler/scheduler_config.json": scheduler_config(cfg, version),
             "model_index.json": {"_class_name": "DDPMPipeline", "_diffusers_version": version,
                                  "scheduler": ["diffusers", "DDPMScheduler"], "unet": ["diffusers", "UNet2DModel"]}}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    return [f"unet/{WEIGHTS}", *files]


def example_inputs(cfg, batch: int, seed: int = 0):
    """(x, t, y or None): random images, integer timesteps over 0..T-1, and a conditional model's labels (the
    null class included)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    m = cfg.model
    x = torch.randn(batch, m.image_channels, m.image_size, m.image_size, generator=g)
    t = torch.randint(0, cfg.diffusion.num_timesteps, (batch,), generator=g)
    y = torch.randint(0, m.num_classes + 1, (batch,), generator=g) if m.conditional else None
    return x, t, y


def check_folder(model, cfg, out: Path) -> float | None:
    """The largest |difference| between diffusers' UNet2DModel loaded from out/unet and `model` on the same
    inputs (batch 1 and 3); None where diffusers is not importable."""
    try:
        from diffusers import UNet2DModel
    except ImportError:
        return None
    import torch

    loaded = UNet2DModel.from_pretrained(str(out / "unet")).eval()
    model = model.float().eval()
    worst = 0.0
    for batch in (1, 3):
        x, t, y = example_inputs(cfg, batch, seed=batch)
        with torch.no_grad():
            want = model(x, t, y) if y is not None else model(x, t)
            got = loaded(x, t, class_labels=y).sample
        worst = max(worst, float((got - want).abs().max()))
    return worst


def model_card(cfg, info: dict, command: str, *, fid: dict | None = None, evaluated: dict | None = None) -> str:
    """The folder's README.md. `fid` and `evaluated`: the FIDs measured of these weights, as every export's card
    quotes them (fastddpm.export_card.fid_lines)."""
    from fastddpm.export_card import fid_lines, seen_line

    m, d = cfg.model, cfg.diffusion
    lines = [f"# fastddpm denoiser for diffusers ({cfg.preset or 'custom'} preset)", "",
             "Ho et al. 2020's U-Net (fastddpm's ddpm family) as diffusers' `UNet2DModel`, with a `DDPMScheduler` "
             "for the schedule it was trained on. Loading it needs diffusers and torch only, not fastddpm.", "",
             f"- trained on: `{cfg.data.source}` ({m.image_channels}x{m.image_size}x{m.image_size} images in "
             "[-1, 1])" + (f", {m.num_classes} classes: {', '.join(m.class_names)}" if m.conditional else ""),
             seen_line(info),
             f"- diffusion: {d.num_timesteps} steps, {d.schedule} schedule, predicts "
             f"{'the noise (epsilon)' if d.prediction == 'epsilon' else 'v (v_prediction)'}",
             *fid_lines(fid, evaluated),
             f"- made by: `{command}`", "", "```python", "from diffusers import DDPMPipeline"]
    if not m.conditional:
        lines += ['pipe = DDPMPipeline.from_pretrained("path/to/this/folder")',
                  f"images = pipe(batch_size=4, num_inference_steps={d.num_timesteps}).images  # PIL images", "```"]
    else:
        g = cfg.train.sample_guidance
        lines += ['pipe = DDPMPipeline.from_pretrained("path/to/this/folder")  # unet + scheduler; see below', "```",
                  "", f"The model is class-conditional (`num_class_embeds` = {m.num_classes + 1}): class ids 0.."
                  f"{m.num_classes - 1} in the order above, and id {m.num_classes}, the null class that fastddpm "
                  "trained for classifier-free guidance (no class). `DDPMPipeline.__call__` passes no class labels, "
                  "which UNet2DModel refuses, and does no guidance; sample with the scheduler directly, guided as "
                  f"`fastddpm sample --class` is, at the run's W = {g:g} (1: the class's own prediction, unguided):",
                  "", "```python", "import torch", "unet, scheduler = pipe.unet, pipe.scheduler",
                  f"guidance = {g:g}  # out(no class) + W (out(class) - out(no class)), as fastddpm samples",
                  f"x = torch.randn(4, {m.image_channels}, {m.image_size}, {m.image_size})",
                  f"labels = torch.arange(4) % {m.num_classes}  # the classes to draw",
                  f"both = torch.cat([labels, torch.full_like(labels, {m.num_classes})])  # and the null class",
                  f"scheduler.set_timesteps({d.num_timesteps})  # DDPM walks every step of the training schedule",
                  "for t in scheduler.timesteps:",
                  "    with torch.no_grad():",
                  "        cond, uncond = unet(torch.cat([x, x]), t, class_labels=both).sample.chunk(2)",
                  "    out = uncond + guidance * (cond - uncond)",
                  "    x = scheduler.step(out, t, x).prev_sample",
                  "images = (x / 2 + 0.5).clamp(0, 1)  # (B, C, H, W) in [0, 1]", "```"]
    return "\n".join(lines + _few_step_section(cfg)) + "\n"


def trailing_gaps(num_timesteps: int, up_to: int = 250) -> list[int]:
    """The step counts <= up_to at which diffusers' "trailing" spacing walks one step more than asked, the last at
    t = -1: np.arange(T, 0, -T / steps)'s float stride falls short of 0 (61, 103, 121, 122, ... for T = 1000)."""
    import numpy as np

    T = num_timesteps
    return [k for k in range(1, min(up_to, T) + 1) if len(np.arange(T, 0, -T / k)) > k]


def _few_step_section(cfg) -> list[str]:
    """The card's few-step part: which diffusers schedulers, built from the folder's scheduler config, take fastddpm's
    timesteps and clipping (tests/test_diffusers_io.py draws the same images with both from the same noise)."""
    T = cfg.diffusion.num_timesteps
    first = first_timestep(schedule_from_config(cfg.diffusion))
    gaps = trailing_gaps(T)
    lines = ["", "## Fewer steps", "",
             "The scheduler config is fastddpm's: trailing timesteps and x0 predictions clamped to [-1, 1]. Built "
             "from it, `DDIMScheduler` walks the timesteps of `fastddpm sample --sampler ddim --steps K` and, for a "
             f"K that divides {T} (its step reads the level at t - {T} // K), from the same starting noise draws its "
             "images (pass `use_clipped_model_output=True` to `DDIMPipeline`: fastddpm re-derives the noise from "
             "the clamped x0)"]
    if first == T - 1:
        lines[-1] += (", as do `DPMSolverMultistepScheduler` (`dpmpp-2m`) and `UniPCMultistepScheduler` (`unipc`).")
    else:
        lines[-1] += (f". On this schedule fastddpm's few-step solvers start at timestep {first} (half log-SNR >= "
                      f"{LAMBDA_MIN}), below its last, clipped betas, and divide the rest evenly: diffusers' "
                      "DPM-Solver starts there too (`lambda_min_clipped`) but steps by T / K, and UniPC starts at "
                      f"{T - 1}, so their images are near fastddpm's `dpmpp-2m` and `unipc`, not the same.")
    k = max(d for d in range(1, min(20, T) + 1) if T % d == 0)  # the example's steps: 20, or a count dividing T
    lines += ["", "```python", "from diffusers import DDIMPipeline, DPMSolverMultistepScheduler"]
    if not cfg.model.conditional:
        lines += ["ddim = DDIMPipeline(unet=pipe.unet, scheduler=pipe.scheduler)  # the scheduler config as a DDIM's",
                  f"images = ddim(batch_size=4, num_inference_steps={k}, eta=0.0, use_clipped_model_output=True)"
                  ".images",
                  "pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)",
                  f"images = pipe(batch_size=4, num_inference_steps={k}).images"]
    else:
        lines += ["scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)",
                  f"# then the loop above, with scheduler.set_timesteps({k})"]
    lines += ["```"]
    if gaps:
        lines += ["", f"diffusers' trailing spacing adds a last step at t = -1, which spoils the images, at "
                  f"{', '.join(map(str, gaps[:8]))}{', ...' if len(gaps) > 8 else ''} steps (np.arange's float "
                  "stride): choose another count."]
    return lines


def load_init(model, cfg, folder: str | Path, said: Spelling = CLI) -> str:
    """Put a diffusers UNet2DModel folder's weights (FOLDER/unet/ or FOLDER itself: config.json and
    diffusion_pytorch_model.safetensors, or the .bin of older diffusers) into `model`, a fresh run's DDPMUNet built
    from `cfg` (whose model options resolve_config took from the folder, unless the command line set them). A
    ConfigError names the first detail that differs (a config switch, or a weight), and the fix as the caller gives
    it (`said`: the command's flags, or fastddpm.train's keywords). Returns a line for the log."""
    unet, theirs = read_unet_config(folder)
    check_exportable(cfg, said("init-from", str(unet)))  # the families and switches that have a UNet2DModel equivalent
    differs = mismatch(theirs, cfg)
    if differs:
        hint = (" (the data's image side places the attention layers: the folder's sample_size is "
                f"{theirs.get('sample_size')}, this run's {cfg.model.image_size})" if "block_types" in differs else "")
        fix = (f"leave the model options out of {'fastddpm.train' if said.api else 'the command line'}: they are "
               "read from the folder, or set them to match")
        if differs.startswith("num_class_embeds") and theirs.get("num_class_embeds") and cfg.model.conditional:
            # the rows come from the data's classes, which no model option on the command line sets
            n = theirs["num_class_embeds"]
            fix = (f"fastddpm's class embedding has a row per class of the data and one for the null class: the "
                   f"folder's model has {n - 1} classes and this run's data {cfg.model.num_classes}; train on data "
                   f"of {n - 1} classes")
        raise ConfigError(f"{said('init-from', str(unet / 'config.json'))}: {differs}{hint}; the two would not "
                          f"compute the same function ({fix})")
    model.load_state_dict(from_diffusers_state_dict(model, read_weights(weights_file(unet)),
                                                    flip_sin_to_cos=bool(theirs["flip_sin_to_cos"])))
    return "\n".join([f"init: weights of the diffusers UNet2DModel in {unet}", *_other_task(cfg, folder)])


def _other_task(cfg, folder: str | Path) -> list[str]:
    """A note for each diffusion setting in which this run (its command line or config file) trains the weights
    for another task than the folder's scheduler_config.json says they learned: allowed (a fine-tune from epsilon
    to v is one), but the first steps relearn the output rather than go on."""
    from fastddpm.config.diffusers_unet import folder_fields

    theirs = {k.split(".", 1)[1]: v for k, v in folder_fields(folder).items() if k.startswith("diffusion.")}
    return [f"note: {folder}'s scheduler_config.json says these weights learned {key} {theirs[key]!r}; this run "
            f"trains them for {getattr(cfg.diffusion, key)!r} (as given): expect the loss to start higher"
            for key in ("prediction", "schedule", "num_timesteps") if key in theirs and
            theirs[key] != getattr(cfg.diffusion, key)]
