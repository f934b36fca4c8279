"""Ho et al.'s U-Net (the ddpm family, models/ddpm_unet.py) under diffusers' UNet2DModel parameter names, both
ways: the one table of which fastddpm weight is which UNet2DModel weight (diffusers/models/unets/unet_2d.py and the
blocks it builds). `fastddpm export --format diffusers` writes with it, `train --init-from` and a diffusers folder
given as a checkpoint read with it (fastddpm.rundir.diffusers_folder reads the files). The config switches that must match for the two to compute the same function
are fastddpm.config.diffusers_unet's; the folder writer is fastddpm.diffusers_io.

    to_diffusers_state_dict(model)        a DDPMUNet's weights under UNet2DModel's names
    from_diffusers_state_dict(model, sd)  the inverse (a UNet2DModel's weights as the DDPMUNet's state_dict)
"""

from __future__ import annotations

import re

import torch

from fastddpm.config import ConfigError
from fastddpm.models.ddpm_unet import Attention, ResBlock


def _layer_names(model) -> list[tuple[object, str]]:
    """(fastddpm layer, UNet2DModel module prefix) for every block of a DDPMUNet, in diffusers' order."""
    out = []
    for group, name in ((model.downs, "down_blocks"), (model.mids, "mid_block"), (model.ups, "up_blocks")):
        for i, level in enumerate(group):
            prefix = f"{name}.{i}" if name != "mid_block" else name
            counts = {"resnets": 0, "attentions": 0}
            for layer in level.layers:
                if isinstance(layer, ResBlock):
                    kind = "resnets"
                elif isinstance(layer, Attention):
                    kind = "attentions"
                else:  # Resample: Downsample2D / Upsample2D, named conv inside
                    out.append((layer, f"{prefix}.{'upsamplers' if layer.up else 'downsamplers'}.0"))
                    continue
                out.append((layer, f"{prefix}.{kind}.{counts[kind]}"))
                counts[kind] += 1
    return out


def to_diffusers_state_dict(model) -> dict:
    """A DDPMUNet's weights under UNet2DModel's parameter names (float32, contiguous)."""
    ours = model.state_dict()
    sd = {}
    for name, (key, chunk) in _name_table(model).items():
        t = ours[key].detach().float()
        if chunk is not None:  # the qkv conv's (3C, C, 1, 1) rows: q, k, v, heads contiguous in each
            t = t.chunk(3, dim=0)[chunk]
        if t.ndim == 4 and ".attentions." in name:  # a 1x1 conv as diffusers' Linear
            t = t.flatten(1)
        sd[name] = t.contiguous().clone()
    return sd


def from_diffusers_state_dict(model, sd: dict, *, flip_sin_to_cos: bool = False) -> dict:
    """The inverse of to_diffusers_state_dict, for loading a UNet2DModel's weights (diffusion_pytorch_model.safetensors)
    into `model`, a DDPMUNet: its state_dict; ConfigError naming the first weight that is missing, left over or of
    another shape. (The config switches are not compared here: unet_config(cfg) is what they must equal.)
    `flip_sin_to_cos`: the UNet2DModel's config.json's, diffusers' default: its time embedding is [cos, sin], so
    the first time layer's input columns are swapped into fastddpm's [sin, cos] order, the same function."""
    ours = model.state_dict()
    table = _name_table(model)
    sd = _current_attention_names(sd)
    first = "time_embedding.linear_1.weight"
    if flip_sin_to_cos and first in sd:
        w, half = sd[first], sd[first].shape[1] // 2  # an odd width's last column is diffusers' zero padding
        sd = {**sd, first: torch.cat([w[:, half:2 * half], w[:, :half], w[:, 2 * half:]], dim=1)}
    missing = [n for n in table if n not in sd]
    if missing:
        _refuse_mismatch(f"it has no weight {missing[0]} ({len(missing)} missing)")
    extra = sorted(set(sd) - set(table))
    if extra:
        _refuse_mismatch(f"weight {extra[0]} has no place in this run's model ({len(extra)} such)")
    parts: dict = {}
    for name, (key, chunk) in table.items():
        parts.setdefault(key, {})[chunk] = sd[name]
    state = {}
    for key, got in parts.items():
        t = torch.cat([got[j] for j in range(3)]) if None not in got else got[None]
        want = ours[key].shape
        if t.numel() != want.numel():
            name = next(n for n, (k, _) in table.items() if k == key)
            _refuse_mismatch(f"{name} has shape {tuple(sd[name].shape)}, where this run's model has {key} of shape "
                             f"{tuple(want)}")
        state[key] = t.reshape(want).to(ours[key].dtype)
    return state


# Attention weights as diffusers named them before 0.15 (google/ddpm-* and other early hub folders still ship them);
# diffusers renames them on load (ModelMixin's deprecated-attention-block conversion), and so does this.
_LEGACY_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_LEGACY_ATTENTION_KEY = re.compile(r"(\.attentions\.\d+\.)(query|key|value|proj_attn)\.")


def _current_attention_names(sd: dict) -> dict:
    """`sd` with pre-0.15 attention names (query/key/value/proj_attn) renamed to today's (to_q/to_k/to_v/to_out.0)."""
    return {_LEGACY_ATTENTION_KEY.sub(lambda m: m.group(1) + _LEGACY_ATTENTION[m.group(2)] + ".", k): v
            for k, v in sd.items()}


def _refuse_mismatch(detail: str) -> None:
    raise ConfigError(f"the diffusers UNet2DModel's weights do not match this fastddpm model: {detail}")


def _name_table(model) -> dict:
    """UNet2DModel parameter name -> (DDPMUNet state_dict key, which third of the qkv rows or None)."""
    table: dict = {}
    ours = model.state_dict()

    def module(src_prefix, dst_prefix):
        for k in ours:
            if k.startswith(src_prefix + "."):
                table[f"{dst_prefix}.{k[len(src_prefix) + 1:]}"] = (k, None)

    names = {id(mod): n for n, mod in model.named_modules()}
    module("t_proj.0", "time_embedding.linear_1")
    module("t_proj.2", "time_embedding.linear_2")
    module("conv_in", "conv_in")
    module("class_emb", "class_embedding")
    for layer, p in _layer_names(model):
        n = names[id(layer)]
        if isinstance(layer, ResBlock):  # skip: a 1x1 conv only when the channels change, as conv_shortcut
            for src, dst in (("norm1", "norm1"), ("conv1", "conv1"), ("emb", "time_emb_proj"), ("norm2", "norm2"),
                             ("conv2", "conv2"), ("skip", "conv_shortcut")):
                module(f"{n}.{src}", f"{p}.{dst}")
        elif isinstance(layer, Attention):
            module(f"{n}.norm", f"{p}.group_norm")
            for j, name in enumerate(("to_q", "to_k", "to_v")):
                for kind in ("weight", "bias"):
                    table[f"{p}.{name}.{kind}"] = (f"{n}.qkv.{kind}", j)
            module(f"{n}.proj", f"{p}.to_out.0")
        else:
            module(f"{n}.conv", f"{p}.conv")
    module("norm_out", "conv_norm_out")
    module("conv_out", "conv_out")
    return table
