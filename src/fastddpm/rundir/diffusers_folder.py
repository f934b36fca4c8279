"""A diffusers folder read as a checkpoint: a DDPMPipeline folder (model_index.json, unet/, scheduler/) or a
UNet2DModel folder alone, such as a local copy of google/ddpm-cifar10-32 or a model trained with diffusers'
train_unconditional.py. `fastddpm sample`, `eval` (with --data: a folder records no dataset), `export` and
`fastddpm.load` take one where they take a run, so a diffusers model gets fastddpm's few-step samplers and FID
without being retrained.

The network is fastddpm's ddpm family (Ho et al.'s U-Net) built from the folder's config.json by the same table
`train --init-from` reads (fastddpm.config.diffusers_unet), its weights renamed by fastddpm.models.diffusers_names;
the schedule and what the network predicts come from scheduler/scheduler_config.json (DDPMScheduler's defaults,
Ho et al.'s linear schedule over 1000 steps predicting the noise, for a UNet2DModel folder alone).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from fastddpm.config import ConfigError, resolve_config
from fastddpm.config.diffusers_unet import folder_fields, read_unet_config, weights_file

# what a result or a model card names as the weights: the one set a diffusers folder holds (a DDPMPipeline on the
# Hub holds the EMA weights, as Ho et al. released them and `fastddpm export` writes them)
HELD = "ema"
NO_DATA = "(not recorded: a diffusers folder)"


def is_diffusers_folder(path: Path) -> bool:
    """Whether `path` is a folder diffusers wrote: a UNet2DModel's config.json in it or in its unet/."""
    for config in (path / "unet" / "config.json", path / "config.json"):
        try:
            found = json.loads(config.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and found.get("_class_name") == "UNet2DModel":
            return True
    return False


def diffusers_meta(folder: Path, what: str) -> dict:
    """A Checkpoint's meta for a diffusers folder: the run config that builds its network and schedule (the ddpm
    family's preset under the folder's architecture and scheduler), no step, no images seen. A ConfigError, its
    message led by `what` and the folder, names what fastddpm cannot compute."""
    unet, theirs = read_unet_config(folder, what)
    fields = folder_fields(folder, what)
    if fields["model.conditional"]:
        # fastddpm's class embedding keeps its last row for the null class of classifier-free guidance; a
        # diffusers model's num_class_embeds rows are all classes, with no null class to guide from
        raise ConfigError(f"{what} {folder}: a class-conditional UNet2DModel (num_class_embeds "
                          f"{theirs['num_class_embeds']}); fastddpm samples unconditional diffusers models. For a "
                          "folder `fastddpm export --format diffusers` wrote, pass the run it came from (its "
                          "export.json names the checkpoint)")
    size = theirs["sample_size"]
    fields["model.image_size"] = size[0] if isinstance(size, (list, tuple)) else size
    fields["model.image_channels"] = int(theirs["in_channels"])
    # a diffusers folder does not record its dataset: said so where the config is shown (a model card, a log),
    # and `fastddpm eval` asks for --data
    fields["data.source"] = NO_DATA
    if theirs["in_channels"] in (1, 3):  # the real data `fastddpm eval --data` reads, in the network's channels
        fields["data.image_mode"] = "L" if theirs["in_channels"] == 1 else "RGB"
    if unet == folder.expanduser() or not (folder.expanduser() / "scheduler" / "scheduler_config.json").is_file():
        warnings.warn(f"{what} {folder}: no scheduler/scheduler_config.json beside the UNet2DModel, so the schedule "
                      "is DDPMScheduler's default: linear betas over 1000 steps, predicting the noise. Pass the "
                      "DDPMPipeline folder (the one holding unet/ and scheduler/) if the model was trained otherwise",
                      stacklevel=3)
    cfg = resolve_config("ddpm-cifar10", layers=[(f"{what} {folder}", fields)])
    cfg.preset = None  # the preset supplied the training fields only: the network and schedule are the folder's
    try:
        cfg.model.validate_resolved()
    except ConfigError as e:
        raise ConfigError(f"{what} {folder}: {e}") from None
    return {"config": cfg.to_dict(), "step": None, "images_seen": None, "weights": HELD,
            "diffusers": str(unet), "named_by": what,
            "flip_sin_to_cos": bool(theirs["flip_sin_to_cos"])}


def diffusers_weights(meta: dict) -> dict[str, torch.Tensor]:
    """The folder's UNet2DModel weights under diffusers' names (fastddpm.sampling.load_for_sampling renames them into
    the U-Net the meta's config builds, models.diffusers_names)."""
    unet, what = Path(meta["diffusers"]), meta["named_by"]
    return read_weights(weights_file(unet), what)


def read_weights(path: Path, what: str = "--init-from") -> dict:
    """The tensors of a UNet2DModel weights file: safetensors, or the .bin pickle read as diffusers reads it,
    torch.load(weights_only=True), which runs no code from the file. A ConfigError names the file it cannot read,
    after `what` (the flag or call that gave the folder)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors' and torch's errors for a damaged file share no base class
        with open(path, "rb") as f:
            lfs = f.read(40).startswith(b"version https://git-lfs")
        # the first line only: torch's weights_only message goes on to suggest weights_only=False
        first = (str(e).strip().splitlines() or [""])[0]
        why = ("it is a git-lfs pointer, not the weights: run `git lfs pull` in the clone" if lfs else
               f"{type(e).__name__}: {first}" + ("; a .bin is read with torch.load(weights_only=True), which refuses "
                                                 "pickles that carry code" if path.suffix == ".bin" else ""))
        raise ConfigError(f"{what} {path}: cannot read the weights ({why})") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ConfigError(f"{what} {path}: not a state dict of tensors (a {type(sd).__name__}); diffusers' "
                          "save_pretrained writes one")
    return sd
