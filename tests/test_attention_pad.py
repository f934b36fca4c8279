"""train.attention_head_pad: attention heads zero-padded to a wider head dimension compute the same function (the
output and every gradient), in both U-Net families, and the trainer and `bench throughput -apN` set it."""

import dataclasses

import pytest
import torch

from fastddpm.bench.throughput import parse_choice
from fastddpm.config import ConfigError, ModelConfig, apply_overrides, get_preset
from fastddpm.models import build_unet, set_attention_head_pad
from fastddpm.models.attention import attend


def _tiny(family: str) -> torch.nn.Module:
    # 4 heads over 16 and 32 channels: head dimensions of 4 and 8, as the seed U-Net's smallest
    cfg = (ModelConfig(family="ddpm", image_channels=3, image_size=8, base_channels=16, channel_mult=(1, 2),
                       num_res_blocks=1, attention_resolutions=(8, 4), num_heads=4, norm_groups=4)
           if family == "ddpm" else
           ModelConfig(image_channels=1, image_size=8, down_channels=(16, 32, 32), down_sample=(True, False),
                       mid_channels=(32, 32),
                       num_down_layers=1, num_mid_layers=1, num_up_layers=1, num_heads=4, norm_groups=4,
                       time_emb_dim=32))
    torch.manual_seed(0)
    model = build_unet(cfg)
    with torch.no_grad():  # the ddpm family zero-initialises output projections, which would hide the attention
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("family", ["seed", "ddpm"])
@pytest.mark.parametrize("pad_to", [8, 16])
def test_padded_heads_compute_the_same_model(family, pad_to):
    model = _tiny(family)
    x = torch.randn(2, model.conv_in.in_channels, 8, 8, dtype=torch.float32)
    t = torch.tensor([3, 700])

    def run():
        model.zero_grad(set_to_none=True)
        out = model(x, t)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    want, grads_want = run()
    assert set_attention_head_pad(model, pad_to) >= 2  # every attention module
    got, grads_got = run()
    # fp32: the padded kernel sums in another order, so equal to rounding (a wrong scale would differ by ~1e-1)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(grads_got, grads_want))


def test_attend_pads_only_heads_narrower_than_the_pad():
    q = torch.randn(1, 2, 5, 16)
    assert torch.equal(attend(q, q, q, pad_to=8), attend(q, q, q))  # 16 wide already: untouched
    with pytest.raises(ValueError, match="not one of 0, 8, 16, 32, 64"):
        set_attention_head_pad(torch.nn.Linear(2, 2), 12)


def test_the_setting_reaches_the_trainers_model_and_the_bench_choices():
    from fastddpm.device import resolve_precision
    from fastddpm.trainer.build import build_model
    from fastddpm.trainer.fast_path import resolve_fast_path

    cfg = apply_overrides(get_preset("seed-1layer"), {"train.attention_head_pad": "8"})
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, image_channels=1, image_size=28))
    fast = resolve_fast_path(cfg.train, torch.device("cpu"), resolve_precision("fp32", torch.device("cpu")))
    model, _ = build_model(cfg, device=torch.device("cpu"), fast=fast)
    pads = [m.head_pad for m in model.modules() if hasattr(m, "head_pad")]
    assert pads and set(pads) == {8}
    assert parse_choice("auto-compile-ap8")["train.attention_head_pad"] == 8
    assert parse_choice("auto-compile-cl")["train.attention_head_pad"] == 0
    with pytest.raises(ConfigError, match="train.attention_head_pad=12 is not one of"):
        apply_overrides(get_preset("cpu-demo"), {"train.attention_head_pad": "12"})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU with bf16 (sm80+)")
def test_padded_heads_compile_and_match_on_a_gpu():
    # a head dimension of 4 padded to 8 reaches cuDNN's attention (a multiple of 8), compiled, in bf16
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(8, 4, 784, 4, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        padded = attend(q, q, q, pad_to=8)
    torch.testing.assert_close(padded, attend(q, q, q), atol=2e-2, rtol=2e-2)
    model = _tiny("seed").cuda()
    x, t = torch.randn(4, 1, 8, 8, device="cuda"), torch.tensor([1, 10, 100, 900], device="cuda")
    step = torch.compile(lambda: model(x, t))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = step().float()
        set_attention_head_pad(model, 8)
        torch._dynamo.reset()
        got = step().float()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_flops_are_the_models_with_or_without_padding():
    # bench throughput's MFU and roofline count the model's FLOPs: padded heads multiply zeros, not counted
    from fastddpm.measure import count_step_flops

    model = _tiny("seed")
    plain = count_step_flops(model, (2, 1, 8, 8))
    set_attention_head_pad(model, 32)
    assert count_step_flops(model, (2, 1, 8, 8)) == plain
    assert all(m.head_pad == 32 for m in model.modules() if hasattr(m, "head_pad"))  # the model keeps its pad
