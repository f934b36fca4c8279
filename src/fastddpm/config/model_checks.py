"""The U-Net options' checks, family by family: which fields only one family's U-Net reads (models/unet.py, the
seed's; models/ddpm_unet.py, Ho et al.'s), the counts each needs, and the ddpm family's attention layers, whose
places and heads depend on the image size (checked once the data gives it). ModelConfig calls them."""

from __future__ import annotations

from fastddpm.config.errors import ConfigError, require

# The model fields only one family's U-Net reads (the others, image shape, classes, num_heads and norm_groups, both
# read). Given explicitly for the other family they would be ignored: config.overrides refuses them.
FAMILY_ONLY = {
    **dict.fromkeys(("down_channels", "mid_channels", "down_sample", "time_emb_dim", "num_down_layers",
                     "num_mid_layers", "num_up_layers", "attention", "out_block_channels"), "seed"),
    **dict.fromkeys(("base_channels", "channel_mult", "num_res_blocks", "attention_resolutions", "dropout",
                     "scale_shift_norm", "resblock_updown", "time_freq_shift", "norm_eps", "downsample_padding"),
                    "ddpm"),
}


def check_seed(m) -> None:
    """The seed family's options (a ModelConfig), before the data's shape is known."""
    dc, mc = m.down_channels, m.mid_channels
    require(len(dc) >= 2, f"model.down_channels={dc} needs at least two levels, e.g. 32,64,128,256")
    require(len(mc) >= 2, f"model.mid_channels={mc} needs at least two entries, e.g. 256,256,128")
    # before the divisibility checks, which 0 passes (0 % 8 == 0) and torch's layers do not
    require(min(dc) >= 1, f"model.down_channels={dc}: every level needs at least 1 channel, e.g. 32,64,128,256")
    require(min(mc) >= 1, f"model.mid_channels={mc}: every mid block needs at least 1 channel, e.g. 256,256,128")
    require(m.out_block_channels >= 1, f"model.out_block_channels={m.out_block_channels} must be >= 1 (the last up "
                                       "block's channels; the seed's code has 16)")
    require(
        mc[0] == dc[-1] and mc[-1] == dc[-2],
        f"model.mid_channels={mc} must start at the last down channel ({dc[-1]}) and end at the "
        f"second-to-last ({dc[-2]}), e.g. {dc[-1]},{dc[-1]},{dc[-2]}",
    )
    require(
        len(m.down_sample) == len(dc) - 1,
        f"model.down_sample has {len(m.down_sample)} entries but down_channels={dc} makes {len(dc) - 1} "
        "down blocks: give one true/false per block",
    )
    require(m.time_emb_dim > 0 and m.time_emb_dim % 2 == 0,
            f"model.time_emb_dim={m.time_emb_dim} must be a positive even number")
    for name in ("num_down_layers", "num_up_layers"):
        require(getattr(m, name) >= 1, f"model.{name}={getattr(m, name)} must be >= 1")
    require(m.num_mid_layers >= 0, f"model.num_mid_layers={m.num_mid_layers} must be >= 0")
    for c in (*dc, *mc, m.out_block_channels):
        require(c % m.norm_groups == 0, f"channel count {c} is not divisible by model.norm_groups={m.norm_groups}: "
                                        "change the channels or norm_groups")
        if m.attention:
            require(c % m.num_heads == 0, f"channel count {c} is not divisible by model.num_heads={m.num_heads}")


def check_ddpm(m) -> None:
    """The ddpm family's options (a ModelConfig), before the data's shape is known."""
    base, mult = m.base_channels, m.channel_mult
    require(base >= 1, f"model.base_channels={base} must be >= 1 (the first level's channels, e.g. 128)")
    require(base % 2 == 0, f"model.base_channels={base} must be even (the time embedding is sinusoidal over it)")
    require(m.time_freq_shift in (0, 1), f"model.time_freq_shift={m.time_freq_shift} must be 0 (improved-diffusion) "
                                         "or 1 (Ho et al.'s TensorFlow code)")
    # the embedding's frequencies divide by base_channels / 2 - time_freq_shift
    require(base // 2 > m.time_freq_shift, f"model.time_freq_shift={m.time_freq_shift} needs base_channels >= 4 "
                                           f"(it is {base})")
    require(0 < m.norm_eps < 1, f"model.norm_eps={m.norm_eps} must be a small positive number, e.g. 1e-5")
    require(len(mult) >= 1 and all(x >= 1 for x in mult),
            f"model.channel_mult={mult} must be positive multipliers, e.g. 1,2,2,2")
    require(m.num_res_blocks >= 1, f"model.num_res_blocks={m.num_res_blocks} must be >= 1")
    require(0 <= m.dropout < 1, f"model.dropout={m.dropout} must be in [0, 1)")
    for c in sorted({base * x for x in mult} | {base}):
        require(c % m.norm_groups == 0, f"channel count {c} (base_channels x channel_mult) is not divisible by "
                                        f"model.norm_groups={m.norm_groups}")
    # Only the attention layers split their channels into heads: the middle's here, the levels' (which need the
    # image size) in check_ddpm_shape.
    mid = base * mult[-1]
    require(mid % m.num_heads == 0, f"model.num_heads={m.num_heads}: the middle block's attention has {mid} channels "
                                    f"(base_channels x channel_mult[-1]), which do not split into {m.num_heads} "
                                    f"heads: choose a num_heads that divides {mid}")


def check_ddpm_shape(m) -> None:
    """The ddpm family's options that need the image size: each level halves it, and attention runs at the levels
    whose side attention_resolutions names (models/ddpm_unet.py), split into num_heads."""
    levels = len(m.channel_mult)
    factor = 2 ** (levels - 1)
    require(m.image_size % factor == 0,
            f"model.image_size={m.image_size} must divide by {factor} (channel_mult={m.channel_mult} halves it "
            f"{levels - 1} times): resize the data (--resize) or use fewer levels")
    sides = [m.image_size // 2 ** i for i in range(levels)]
    for i, side in enumerate(sides):
        c = m.base_channels * m.channel_mult[i]
        require(side not in m.attention_resolutions or c % m.num_heads == 0,
                f"model.num_heads={m.num_heads}: the attention at {side}x{side} has {c} channels (base_channels x "
                f"channel_mult[{i}]), which do not split into {m.num_heads} heads: choose a num_heads that divides "
                "every attention layer's channels, or change model.attention_resolutions")


def check_attention_levels(m) -> None:
    """A new ddpm-family run's attention_resolutions must each be the side of one of its levels: the U-Net builds
    attention only where one matches and would leave the others out silently. Checked where a run starts
    (resolve_model_shape), not when a saved config is loaded, so that runs saved before this check still sample,
    export and resume with the model they trained."""
    if m.family != "ddpm" or m.image_size is None:
        return
    sides = [m.image_size // 2 ** i for i in range(len(m.channel_mult))]
    missing = [r for r in m.attention_resolutions if r not in sides]
    if missing:
        nearest = dict.fromkeys(r if r in sides else min(sides, key=lambda side: abs(side - r))
                                for r in m.attention_resolutions)
        raise ConfigError(
            f"model.attention_resolutions={m.attention_resolutions}: this U-Net has no level of "
            f"{' or '.join(map(str, missing))} pixels per side, so that attention would be left out: at "
            f"image_size={m.image_size} the levels of channel_mult={m.channel_mult} are {', '.join(map(str, sides))} "
            f"pixels; name those, e.g. --set model.attention_resolutions={','.join(map(str, nearest))}")
