"""The ddpm family's model options and diffusers' UNet2DModel config.json, both ways: one table of the switches that
make the two networks compute the same function (read from diffusers/models/unets/unet_2d.py and the blocks it
builds; the weights' names are fastddpm.diffusers_io's).

    check_exportable(cfg)        the first setting UNet2DModel has no equivalent for, as a ConfigError
    unet_config(cfg)             UNet2DModel's config.json for a run
    model_fields(config, where)  the model options of a UNet2DModel config.json
    scheduler_fields(config, where)  the diffusion options of a DDPMScheduler config
    folder_fields(folder)        both, for a folder (train --init-from reads them)
    mismatch(theirs, cfg)        the first config switch in which a folder's UNet2DModel and a run's model differ

Pure config: no torch, no diffusers import (so resolve_config can read a folder's architecture).
"""

from __future__ import annotations

import json
from pathlib import Path

from fastddpm.config.schema import ConfigError

# written into the configs when diffusers is not importable at export time: the release this module was checked
# against (diffusers reads the field for its warnings only)
DIFFUSERS_VERSION = "0.42.1"
WEIGHTS = "diffusion_pytorch_model.safetensors"
# the pickle diffusers wrote before safetensors became save_pretrained's default (0.22); diffusers still reads it
# (torch.load with weights_only=True), and so does --init-from where a folder has no WEIGHTS
WEIGHTS_BIN = "diffusion_pytorch_model.bin"

# UNet2DModel.__init__'s defaults (diffusers 0.42) for the keys read here: a config.json may leave any of them out,
# and google/ddpm-cifar10-32's leaves out several
UNET2D_DEFAULTS = {
    "sample_size": None, "in_channels": 3, "out_channels": 3, "center_input_sample": False,
    "time_embedding_type": "positional", "time_embedding_dim": None, "freq_shift": 0, "flip_sin_to_cos": True,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"],
    "mid_block_type": "UNetMidBlock2D",
    "up_block_types": ["AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [224, 448, 672, 896], "layers_per_block": 2, "mid_block_scale_factor": 1,
    "downsample_padding": 1, "downsample_type": "conv", "upsample_type": "conv", "dropout": 0.0, "act_fn": "silu",
    "attention_head_dim": 8, "norm_num_groups": 32, "attn_norm_num_groups": None, "norm_eps": 1e-5,
    "resnet_time_scale_shift": "default", "add_attention": True, "class_embed_type": None, "num_class_embeds": None,
}

# the config.json entries that decide the function a UNet2DModel computes; the others (versions, sample_size,
# dropout, num_train_timesteps) do not have to match for its weights to start a run (dropout only acts in training:
# the folder's starts the run where its config.json records one, and the command line may change it)
FUNCTION_KEYS = ("in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
                 "mid_block_type", "up_block_types", "attention_head_dim", "norm_num_groups", "attn_norm_num_groups",
                 "norm_eps", "time_embedding_type", "time_embedding_dim", "freq_shift", "flip_sin_to_cos",
                 "resnet_time_scale_shift", "downsample_padding", "downsample_type", "upsample_type", "act_fn",
                 "add_attention", "class_embed_type", "num_class_embeds", "center_input_sample",
                 "mid_block_scale_factor")  # the widths first: a mismatch there explains the ones after


EXPORT = "export --format diffusers"


def check_exportable(cfg, what: str = EXPORT) -> None:
    """ConfigError naming the first setting of `cfg` (a RunConfig) that diffusers' UNet2DModel / DDPMScheduler
    has no equivalent for; None when the run exports. `what` begins the message: the export, or --init-from
    FOLDER, for which only the network matters (its weights may start an EDM or flow run)."""
    def refuse(setting: str, why: str) -> None:
        raise ConfigError(f"{what}: {setting}: {why}")

    m, d = cfg.model, cfg.diffusion
    export = what == EXPORT
    if m.family != "ddpm":
        refuse(f"model.family={m.family}", "the seed family's U-Net has no diffusers class; only model.family=ddpm "
               "(Ho et al.'s U-Net, diffusers' UNet2DModel) " + ("exports as diffusers (use --format safetensors, "
                                                                 "onnx or torch-export)" if export else
                                                                 "takes a UNet2DModel's weights (drop --family)"))
    if export and d.objective != "ddpm":
        refuse(f"diffusion.objective={d.objective}", "diffusers' DDPMPipeline / DDPMScheduler cannot sample it "
               "(they take DDPM's discrete timesteps and betas, not "
               + ("EDM's preconditioned sigma" if d.objective == "edm" else "flow matching's velocity") + "); "
               "nothing was written: use --format onnx, torch-export or safetensors")
    if m.resblock_updown:
        refuse("model.resblock_updown=true", "diffusers' DownBlock2D and UpBlock2D resample only with a plain "
               "convolution (their downsample_type/upsample_type 'resnet' exists on the attention blocks only)")
    channels = _attention_channels(m)
    if m.num_heads > 1 and len(set(channels)) > 1:
        refuse(f"model.num_heads={m.num_heads}", f"attention runs at {sorted(set(channels))} channels, so its head "
               "width differs between levels, and UNet2DModel takes one attention_head_dim for all of them (use "
               "num_heads=1, or attention only where the channels equal the last level's)")


def _level_resolutions(m) -> list[int]:
    return [m.image_size // 2 ** i for i in range(len(m.channel_mult))]


def _attention_channels(m) -> list[int]:
    """The channel count of every attention layer: the levels at attention_resolutions, and the middle's."""
    levels = [m.base_channels * mult for mult, res in zip(m.channel_mult, _level_resolutions(m))
              if res in m.attention_resolutions]
    return [*levels, m.base_channels * m.channel_mult[-1]]


def unet_config(cfg, version: str = DIFFUSERS_VERSION) -> dict:
    """UNet2DModel's config.json for `cfg` (checked by check_exportable)."""
    m = cfg.model
    attn = [res in m.attention_resolutions for res in _level_resolutions(m)]
    return {
        "_class_name": "UNet2DModel",
        "_diffusers_version": version,
        "sample_size": m.image_size,
        "in_channels": m.image_channels,
        "out_channels": m.image_channels,
        "center_input_sample": False,
        "time_embedding_type": "positional",
        "time_embedding_dim": None,  # 4 x block_out_channels[0], fastddpm's width too
        # diffusers' get_timestep_embedding divides by (d/2 - freq_shift) and puts cos first when flip_sin_to_cos;
        # fastddpm's embedding is [sin, cos]
        "freq_shift": m.time_freq_shift,
        "flip_sin_to_cos": False,
        "down_block_types": ["AttnDownBlock2D" if a else "DownBlock2D" for a in attn],
        "mid_block_type": "UNetMidBlock2D",
        "up_block_types": ["AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attn)],
        "block_out_channels": [m.base_channels * mult for mult in m.channel_mult],
        "layers_per_block": m.num_res_blocks,
        "mid_block_scale_factor": 1,
        # Downsample2D: padding 1 each side, or with 0 an F.pad of one row and column after (TensorFlow's SAME)
        "downsample_padding": 0 if m.downsample_padding == "tf-same" else 1,
        "downsample_type": "conv",
        "upsample_type": "conv",
        "dropout": m.dropout,
        "act_fn": "silu",
        # None: one head as wide as each block (UNet2DModel passes the block's channels); else the one head width
        "attention_head_dim": None if m.num_heads == 1 else _attention_channels(m)[0] // m.num_heads,
        "norm_num_groups": m.norm_groups,
        # UNetMidBlock2D drops its attention GroupNorm under "scale_shift" unless this is set: fastddpm has one
        "attn_norm_num_groups": m.norm_groups,
        "norm_eps": m.norm_eps,
        "resnet_time_scale_shift": "scale_shift" if m.scale_shift_norm else "default",
        "add_attention": True,
        "class_embed_type": None,
        # fastddpm's embedding has num_classes + 1 rows: the last, id num_classes, is classifier-free guidance's null
        "num_class_embeds": m.num_classes + 1 if m.conditional else None,
        "num_train_timesteps": None,
    }


def weights_file(unet: Path) -> Path | None:
    """The UNet2DModel folder's weights file: the safetensors one where there is one (diffusers prefers it too),
    else the older .bin pickle; None where neither is there."""
    for name in (WEIGHTS, WEIGHTS_BIN):
        if (unet / name).is_file():
            return unet / name
    return None


def _fastddpms_own(path: Path) -> str | None:
    """What `path` is, where it is a run folder, checkpoint or weights file fastddpm wrote (for --init-from's error),
    else None."""
    if path.is_dir() and ((path / "checkpoints").is_dir() or (path / "ema.safetensors").is_file()):
        return "a fastddpm run folder"
    if path.is_dir() and (path / "schedule.json").is_file() and not (path / "unet").is_dir():
        return "a fastddpm export"
    if path.is_file() and (path.suffix == ".pt" or path.name.endswith(".safetensors") and path.name != WEIGHTS):
        return "a checkpoint or weights file"
    return None


def read_unet_config(folder: str | Path, flag: str = "--init-from") -> tuple[Path, dict]:
    """(the UNet2DModel folder, its config.json with UNet2DModel's defaults filled in) for FOLDER (a DDPMPipeline
    folder, with unet/, or a UNet2DModel folder); a ConfigError naming the file when it is not one, after `flag`
    (what gave the folder: --init-from, or --checkpoint where a diffusers folder is sampled)."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise ConfigError(f"{flag} {folder}: no such folder (give a diffusers DDPMPipeline folder, or its unet/ "
                          "folder: config.json and the weights)")
    own = _fastddpms_own(folder)
    if own:
        # a run's config.json is fastddpm's own, not UNet2DModel's: "need config.json" would name a file that is there
        raise ConfigError(f"{flag} {folder}: {own}, not a diffusers folder: --init-from reads diffusers' "
                          "UNet2DModel weights. To go on training a fastddpm run, pass its folder or a "
                          "checkpoints/ckpt_*.pt as --resume; to start a new run from a run's weights, write them as "
                          "diffusers' with `fastddpm export RUN --format diffusers --out DIR` (the ddpm family) and "
                          "pass --init-from DIR")
    if not folder.is_dir():
        hint = (f"; this is one of its files: give {folder.parent}" if folder.name in ("config.json", WEIGHTS,
                                                                                        WEIGHTS_BIN) else "")
        raise ConfigError(f"{flag} {folder}: a file, not a folder (a diffusers DDPMPipeline folder or its unet/ "
                          f"folder holds config.json and the weights{hint})")
    unet = folder / "unet" if (folder / "unet" / "config.json").is_file() else folder
    path = unet / "config.json"
    if not path.is_file() or weights_file(unet) is None:
        raise ConfigError(f"{flag} {folder}: no diffusers UNet2DModel there (need {unet}/config.json and "
                          f"{unet}/{WEIGHTS} or {WEIGHTS_BIN}; a DDPMPipeline folder has them under unet/)")
    try:
        theirs = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {path}: not valid JSON ({e})") from None
    if not isinstance(theirs, dict) or theirs.get("_class_name", "UNet2DModel") != "UNet2DModel":
        name = theirs.get("_class_name") if isinstance(theirs, dict) else type(theirs).__name__
        raise ConfigError(f"{flag} {path}: a {name}, not a UNet2DModel config")
    return unet, {**UNET2D_DEFAULTS, **theirs}


def model_fields(theirs: dict, where: str, flag: str = "--init-from") -> dict:
    """The ddpm family's model options ("model.field": value) that build the network of a UNet2DModel config.json
    (defaults filled in); a ConfigError naming the first entry fastddpm's U-Net cannot compute, and why."""
    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"{flag} {where}: {key}={theirs.get(key)!r}: {why}; fastddpm's ddpm family cannot "
                          "compute this UNet2DModel's function")

    fixed = {"time_embedding_type": "positional", "act_fn": "silu",
             "center_input_sample": False, "mid_block_scale_factor": 1, "downsample_type": "conv",
             "upsample_type": "conv", "class_embed_type": None, "add_attention": True,
             "mid_block_type": "UNetMidBlock2D"}
    for key, want in fixed.items():
        if theirs[key] != want:
            refuse(key, f"fastddpm's U-Net has only {want!r}")
    if theirs["in_channels"] != theirs["out_channels"]:
        refuse("out_channels", f"differs from in_channels={theirs['in_channels']} (the network predicts noise of "
                               "the image's shape)")
    boc = list(theirs["block_out_channels"])
    base = boc[0]
    if any(c % base for c in boc):
        refuse("block_out_channels", f"not all multiples of the first ({base}), as channel_mult needs")
    if theirs["time_embedding_dim"] not in (None, 4 * base):
        refuse("time_embedding_dim", f"fastddpm's time embedding is 4 x {base} = {4 * base} wide")
    down, up = list(theirs["down_block_types"]), list(theirs["up_block_types"])
    for key, types, plain, attn in (("down_block_types", down, "DownBlock2D", "AttnDownBlock2D"),
                                    ("up_block_types", up, "UpBlock2D", "AttnUpBlock2D")):
        if len(types) != len(boc) or any(t not in (plain, attn) for t in types):
            refuse(key, f"one {plain} or {attn} per entry of block_out_channels ({len(boc)}) is what fastddpm has")
    attention = [t == "AttnDownBlock2D" for t in down]
    if [t == "AttnUpBlock2D" for t in reversed(up)] != attention:
        refuse("up_block_types", f"attention on the way up must mirror the way down ({down})")
    size = theirs["sample_size"]
    size = size[0] if isinstance(size, (list, tuple)) and len(set(size)) == 1 else size
    if not isinstance(size, int) or size % 2 ** (len(boc) - 1):
        refuse("sample_size", "a square side that halves at every level is needed to place the attention layers")
    head_dim = theirs["attention_head_dim"]
    attn_channels = [c for c, a in zip(boc, attention) if a] + [boc[-1]]
    if head_dim is None:
        heads = 1
    else:
        counts = {c // head_dim for c in attn_channels}
        if any(c % head_dim for c in attn_channels) or len(counts) != 1:
            refuse("attention_head_dim", f"fastddpm splits every attention layer ({attn_channels} channels) into one "
                                         "number of heads")
        heads = counts.pop()
    shift = theirs["resnet_time_scale_shift"]
    if shift not in ("default", "scale_shift"):
        refuse("resnet_time_scale_shift", "fastddpm has 'default' (added) and 'scale_shift' (--scale-shift-norm)")
    groups = theirs["norm_num_groups"]
    attn_groups = theirs["attn_norm_num_groups"]
    if attn_groups != groups and not (attn_groups is None and shift == "default"):
        refuse("attn_norm_num_groups", f"fastddpm's middle attention has a GroupNorm of norm_num_groups={groups}")
    if theirs["freq_shift"] not in (0, 1):
        refuse("freq_shift", "fastddpm has 0 and 1 (model.time_freq_shift)")
    if theirs["downsample_padding"] not in (0, 1):
        refuse("downsample_padding", "fastddpm has 1 (symmetric) and 0 (tf-same)")
    return {
        "model.family": "ddpm",
        "model.base_channels": base,
        "model.channel_mult": tuple(c // base for c in boc),
        "model.num_res_blocks": int(theirs["layers_per_block"]),
        "model.attention_resolutions": tuple(size // 2 ** i for i, a in enumerate(attention) if a),
        "model.num_heads": heads,
        "model.norm_groups": groups,
        "model.norm_eps": float(theirs["norm_eps"]),
        "model.scale_shift_norm": shift == "scale_shift",
        "model.resblock_updown": False,
        "model.time_freq_shift": int(theirs["freq_shift"]),
        "model.downsample_padding": "tf-same" if theirs["downsample_padding"] == 0 else "symmetric",
        "model.conditional": theirs["num_class_embeds"] is not None,
    }


def scheduler_fields(sched: dict, where: str, flag: str = "--init-from") -> dict:
    """The diffusion options ("diffusion.field": value) of a DDPMScheduler's scheduler_config.json (any scheduler
    of DDPM's discrete betas: DDIM's, PNDM's, ... share the keys); a ConfigError naming what fastddpm has no
    equivalent for."""
    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"{flag} {where}: {key}={sched.get(key)!r}: {why} (set the diffusion options on the "
                          "command line to train another schedule)")

    if sched.get("trained_betas") is not None:
        refuse("trained_betas", "fastddpm's schedules are linear and cosine, not a list of betas")
    if sched.get("rescale_betas_zero_snr"):
        refuse("rescale_betas_zero_snr", "fastddpm's betas are not rescaled to zero terminal SNR (Lin et al. 2023)")
    kind = sched.get("beta_schedule", "linear")
    if kind not in ("linear", "squaredcos_cap_v2"):
        refuse("beta_schedule", "fastddpm has linear and squaredcos_cap_v2 (cosine)")
    prediction = sched.get("prediction_type", "epsilon")
    if prediction not in ("epsilon", "v_prediction"):
        refuse("prediction_type", "fastddpm's DDPM networks predict epsilon or v")
    # diffusers writes beta_start and beta_end into every scheduler config; squaredcos_cap_v2 does not read them,
    # nor does fastddpm's cosine schedule, so the run's config holds none (as a cosine run started otherwise)
    linear = kind == "linear"
    return {"diffusion.objective": "ddpm", "diffusion.num_timesteps": int(sched.get("num_train_timesteps", 1000)),
            "diffusion.schedule": "linear" if linear else "cosine",
            "diffusion.beta_start": float(sched.get("beta_start", 1e-4)) if linear else None,
            "diffusion.beta_end": float(sched.get("beta_end", 0.02)) if linear else None,
            "diffusion.prediction": "epsilon" if prediction == "epsilon" else "v"}


def folder_fields(folder: str | Path, flag: str = "--init-from") -> dict:
    """What FOLDER sets for train --init-from (or a diffusers folder given as `flag`, a checkpoint): model_fields
    of its UNet2DModel and, for a DDPMPipeline folder, scheduler_fields of its scheduler/scheduler_config.json."""
    unet, theirs = read_unet_config(folder, flag)
    fields = model_fields(theirs, str(unet / "config.json"), flag)
    given = json.loads((unet / "config.json").read_text())  # read_unet_config filled in the defaults
    if "dropout" in given:  # a folder that records its dropout keeps it (google/ddpm-* record none)
        fields["model.dropout"] = given["dropout"]
    path = Path(folder).expanduser() / "scheduler" / "scheduler_config.json"
    if unet != Path(folder).expanduser() and path.is_file():
        try:
            sched = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{flag} {path}: not valid JSON ({e})") from None
        fields.update(scheduler_fields(sched, str(path), flag))
    return fields


def _same_function_form(c: dict) -> dict:
    """`c` with the entries that mean the same thing written one way: flip_sin_to_cos is the weights' concern,
    time_embedding_dim None is 4 x the first
    block's channels, an attention_head_dim equal to every attention layer's channels is None (one head), and
    attn_norm_num_groups None under the "default" time shift is norm_num_groups."""
    c = dict(c)
    # flip_sin_to_cos (diffusers' default) orders the embedding [cos, sin], fastddpm's is [sin, cos]: the same
    # function once the time MLP's first layer takes its input columns in the other order, which the weights'
    # renaming does (models.diffusers_names.from_diffusers_state_dict)
    c["flip_sin_to_cos"] = False
    boc = list(c.get("block_out_channels") or [])
    if c.get("time_embedding_dim") is None and boc:
        c["time_embedding_dim"] = 4 * boc[0]
    attention = [c for c, t in zip(boc, c.get("down_block_types") or []) if t == "AttnDownBlock2D"] + boc[-1:]
    if c.get("attention_head_dim") is not None and all(ch == c["attention_head_dim"] for ch in attention):
        c["attention_head_dim"] = None  # one head as wide as every attention layer: what None means
    if c.get("attn_norm_num_groups") is None and c.get("resnet_time_scale_shift") == "default":
        c["attn_norm_num_groups"] = c.get("norm_num_groups")
    return c


def mismatch(theirs: dict, cfg) -> str | None:
    """The first FUNCTION_KEYS entry in which `theirs` (a config.json, defaults filled in) and the UNet2DModel of
    `cfg` differ, as "key is A there and B in this run's model"; None when they compute the same function."""
    theirs, ours = _same_function_form(theirs), _same_function_form({**UNET2D_DEFAULTS, **unet_config(cfg)})
    for key in FUNCTION_KEYS:
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
            a, b = list(a or []), list(b or [])
        if a != b:
            return f"{key} is {a!r} there and {b!r} in this run's model"
    return None
