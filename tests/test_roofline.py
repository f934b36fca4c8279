"""The roofline (fastddpm.measure): the bytes a step must move, counted on hand-countable models; the device's
memory bandwidth; the bound max(FLOPs / peak, bytes / bandwidth) and the side that binds."""

import pytest
import torch
from torch import nn

from fastddpm.measure import UPDATE_TENSORS, count_step_bytes, measure_memory_bandwidth, roofline


class OneConv(nn.Module):
    """x -> conv1x1(x) * 2: autograd saves the convolution's input (and its weight, whatever the batch); the loss
    (out.float().square().mean()) saves the square's input."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1, bias=False)

    def forward(self, x, t):
        return self.conv(x) * 2


def test_activation_bytes_are_what_autograd_saves_per_image_in_the_runs_dtype():
    c, h, w = 4, 8, 8
    model = OneConv(c)
    fp32 = count_step_bytes(model, (c, h, w), images_per_step=16, device="cpu", autocast_dtype=None)
    # the convolution's input and the square's input, fp32: two (C, H, W) tensors of 4 bytes an element
    assert fp32["activation_bytes_per_image"] == 2 * c * h * w * 4
    # under bf16 autocast the convolution saves its bf16 input (2 bytes); the loss squares an fp32 copy (4)
    bf16 = count_step_bytes(model, (c, h, w), images_per_step=16, device="cpu", autocast_dtype=torch.bfloat16)
    assert bf16["activation_bytes_per_image"] == c * h * w * (2 + 4)
    # the update: UPDATE_TENSORS fp32 passes over the c x c weights per step, spread over the step's images;
    # activations are written once and read once
    assert fp32["update_bytes_per_step"] == UPDATE_TENSORS * c * c * 4 == 13 * 64
    assert fp32["bytes_per_image"] == pytest.approx(2 * 2 * c * h * w * 4 + 13 * 64 / 16)


def test_the_bound_is_the_slower_side_and_the_share_is_of_it():
    # 1 GFLOP an image at 100 TFLOP/s: 10 us; 10 MB at 1,000 GB/s: 10 us... then twice the bytes: memory binds
    even = roofline(flops_per_image=1e9, bytes_per_image=1e7, peak_tflops=100, bandwidth_gbps=1000)
    assert even["compute_us_per_image"] == pytest.approx(10) and even["memory_us_per_image"] == pytest.approx(10)
    mem = roofline(flops_per_image=1e9, bytes_per_image=2e7, peak_tflops=100, bandwidth_gbps=1000,
                   images_per_s=25_000)
    assert mem["binds"] == "memory" and mem["bound_us_per_image"] == pytest.approx(20)
    assert mem["roofline_pct"] == pytest.approx(50)  # 25,000 images/s where the bound allows 50,000
    comp = roofline(flops_per_image=4e9, bytes_per_image=1e7, peak_tflops=100, bandwidth_gbps=1000)
    assert comp["binds"] == "compute" and comp["roofline_pct"] is None


def test_the_bandwidth_is_measured_on_the_device():
    bw = measure_memory_bandwidth("cpu", nbytes=2**24, trials=2)
    assert bw["gbps"] > 0.1 and bw["nbytes"] == 2**24 and "16 MiB copy" in bw["label"]
