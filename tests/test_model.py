"""The seed's U-Net: shapes, parameter counts against ../shared/CONTEXT.md, the fixed time embedding,
and fused attention that computes what plain attention computes."""

import math

import pytest
import torch

from fastddpm.config import ModelConfig, get_preset
from fastddpm.models import UNet, count_parameters, sinusoidal_time_embedding
from fastddpm.models.unet import SelfAttention


def _model(preset, channels=1, size=28):
    cfg = get_preset(preset).model
    cfg.image_channels, cfg.image_size = channels, size
    return UNet(cfg)


@pytest.mark.parametrize("preset,params", [("seed-1layer", 6_067_857), ("seed-2layer", 10_188_081)])
def test_seed_unets_shapes_and_parameter_counts(preset, params):
    torch.manual_seed(0)
    model = _model(preset)
    # CONTEXT.md: ~6.1M (notebook's one-layer variant) and ~10.2M (public code's default).
    assert count_parameters(model) == params
    x = torch.randn(2, 1, 28, 28)
    out = model(x, torch.tensor([0, 999]))
    assert out.shape == x.shape and out.dtype == torch.float32


@pytest.mark.parametrize("preset, shape, params", [("ddpm-cifar10", (3, 32, 32), 35_746_307),
                                                   ("ddpm-rgb64", (3, 64, 64), 129_380_611)])
def test_ddpm_family_presets_build_with_the_papers_parameter_counts(preset, shape, params):
    """Ho et al. 2020 report 35.7M parameters for their CIFAR-10 model; the 64x64 preset's count is recorded."""
    from fastddpm.config import resolve_model_shape
    from fastddpm.models import DDPMUNet, build_unet

    cfg = resolve_model_shape(get_preset(preset), (10, *shape)).model
    torch.manual_seed(0)
    model = build_unet(cfg)
    assert isinstance(model, DDPMUNet) and count_parameters(model) == params
    x = torch.randn(2, *shape)
    with torch.no_grad():
        out = model(x, torch.tensor([0, 999]))
    assert out.shape == x.shape
    assert torch.count_nonzero(out) == 0  # the output conv starts at zero, as in both papers


def test_ddpm_family_config_names_what_does_not_fit():
    from fastddpm.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="divisible by model.norm_groups=32"):
        ModelConfig(family="ddpm", base_channels=48, norm_groups=32)
    cfg = ModelConfig(family="ddpm", channel_mult=(1, 2, 2, 2), norm_groups=32, image_channels=3, image_size=28)
    with pytest.raises(ConfigError, match="must divide by 8"):
        cfg.validate_shape()
    with pytest.raises(ConfigError, match="family"):
        ModelConfig(family="adm")


def test_rgb_32x32_unet():
    model = _model("seed-2layer", channels=3, size=32)
    x = torch.randn(2, 3, 32, 32)
    assert model(x, torch.tensor([5, 500])).shape == (2, 3, 32, 32)


def test_time_embedding_has_distinct_frequencies():
    """The seed notebook's integer division made every frequency 1; here they span 1 .. 1e-4."""
    emb = sinusoidal_time_embedding(torch.tensor([1.0, 500.0]), 128)
    assert emb.shape == (2, 128)
    sines = emb[0, :64]
    assert len(set(sines.tolist())) == 64
    expected = [math.sin(1.0 * 10000 ** (-i / 64)) for i in range(64)]
    torch.testing.assert_close(sines, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(emb[1, 64], torch.tensor(math.cos(500.0)), rtol=1e-5, atol=1e-5)


def test_sdpa_attention_equals_explicit_softmax_attention():
    torch.manual_seed(0)
    attn = SelfAttention(32, num_heads=4, groups=8)
    x = torch.randn(2, 32, 5, 5)
    B, C, H, W = x.shape
    h = attn.norm(x).flatten(2).transpose(1, 2)
    q, k, v = attn.qkv(h).chunk(3, dim=-1)
    split = lambda z: z.view(B, H * W, 4, 8).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
    ref = attn.proj((w @ v).transpose(1, 2).reshape(B, H * W, C)).transpose(1, 2).reshape(B, C, H, W)
    torch.testing.assert_close(attn(x), x + ref, rtol=1e-5, atol=1e-5)


def test_attention_can_be_switched_off():
    cfg = get_preset("cpu-demo").model
    cfg.image_channels, cfg.image_size = 1, 28
    model = UNet(cfg)
    assert not any(isinstance(m, SelfAttention) for m in model.modules())
    assert model(torch.randn(1, 1, 28, 28), torch.tensor([3])).shape == (1, 1, 28, 28)


def test_bad_model_configs_name_the_field():
    with pytest.raises(ValueError, match="mid_channels"):
        ModelConfig(down_channels=(32, 64, 128), mid_channels=(64, 64))
    with pytest.raises(ValueError, match="down_sample"):
        ModelConfig(down_sample=(True, False))
    with pytest.raises(ValueError, match="norm_groups"):
        ModelConfig(down_channels=(12, 64, 128, 256))
    cfg = ModelConfig(image_channels=1, image_size=30)
    with pytest.raises(ValueError, match="image_size=30 must divide by 4"):
        UNet(cfg)


@pytest.mark.parametrize("family", ["seed", "ddpm"])
def test_a_model_cast_to_bf16_runs_in_bf16(family):
    """`model.to(torch.bfloat16)`, as diffusers-style code does, without autocast: the time embedding is computed
    in float32 and handed to the projection in the weights' dtype."""
    from fastddpm.models import build_unet

    cfg = get_preset("tiny").model if family == "seed" else ModelConfig(
        family="ddpm", base_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(8,))
    cfg.image_channels, cfg.image_size = 1, 16
    torch.manual_seed(0)
    model = build_unet(cfg).to(torch.bfloat16)
    x = torch.randn(2, 1, 16, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(x, torch.tensor([3, 999]))
    assert out.shape == x.shape and out.dtype == torch.bfloat16


def test_the_fields_marked_for_one_family_are_read_by_its_u_net_and_not_the_others():
    """config.model_checks.FAMILY_ONLY decides which explicitly given fields are refused for the other family: each
    field it marks changes its own family's U-Net (the parameters' shapes or, with the same random weights, the
    output in training mode) and leaves the other family's exactly as it was. Every other field is one both read."""
    import dataclasses

    from fastddpm.config.model_checks import FAMILY_ONLY
    from fastddpm.models import build_unet

    changed = {"down_channels": (8, 32, 32), "mid_channels": (32, 64, 32), "down_sample": (False, False),
               "time_emb_dim": 16, "num_down_layers": 2, "num_mid_layers": 2, "num_up_layers": 2, "attention": False,
               "out_block_channels": 8, "base_channels": 32, "channel_mult": (1, 1), "num_res_blocks": 2,
               "attention_resolutions": (16,), "dropout": 0.5, "scale_shift_norm": True, "resblock_updown": True,
               "time_freq_shift": 1, "norm_eps": 0.1, "downsample_padding": "tf-same"}
    shared = {"family", "image_channels", "image_size", "num_heads", "norm_groups", "conditional", "num_classes",
              "class_names"}
    assert set(changed) == set(FAMILY_ONLY) and {f.name for f in dataclasses.fields(ModelConfig)} == \
        set(FAMILY_ONLY) | shared  # a new field is placed on purpose
    bases = {"seed": get_preset("tiny").model,
             "ddpm": ModelConfig(family="ddpm", base_channels=16, channel_mult=(1, 2), num_res_blocks=1,
                                 attention_resolutions=(8,), num_heads=2)}
    x, t = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 700])

    def run(cfg):
        torch.manual_seed(0)
        model = build_unet(dataclasses.replace(cfg, image_channels=1, image_size=16)).train()
        with torch.no_grad():  # the same random weights wherever the shapes agree (ddpm zero-initialises outputs)
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            torch.manual_seed(2)  # dropout's draws
            out = model(x, t)
        return {k: v.shape for k, v in model.state_dict().items()}, out

    reference = {family: run(cfg) for family, cfg in bases.items()}
    for name, owner in FAMILY_ONLY.items():
        for family, cfg in bases.items():
            shapes, out = run(dataclasses.replace(cfg, **{name: changed[name]}))
            ref_shapes, ref_out = reference[family]
            same = shapes == ref_shapes and torch.equal(out, ref_out)
            assert same == (family != owner), f"model.{name} {'is not read by' if same else 'changes'} the " \
                                              f"{family} family's U-Net"
