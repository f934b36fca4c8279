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


# ---------------------------------------------------------------------------------------------------------------
# The doctor's roofline: counted in the second warm-up step of any loop


class TwoLinear(nn.Module):
    """x -> relu(x W1) W2: autograd saves x (W1's gradient), relu's output (relu's backward and W2's gradient:
    one storage), the loss's square input, and the two weights (parameters, not activations)."""

    def __init__(self, width: int):
        super().__init__()
        self.l1 = nn.Linear(width, width, bias=False)
        self.l2 = nn.Linear(width, 1, bias=False)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def test_saved_tensors_leave_out_parameters_seen_as_leaves_or_given():
    from fastddpm.measure import SavedTensors

    model, x = TwoLinear(16), torch.randn(8, 16)
    with SavedTensors() as eager:
        model(x).square().mean()
    assert eager.activation_bytes() == (8 * 16 + 8 * 16 + 8 * 1) * 4
    # the second weight, saved as weight.t() (the first is not saved: the batch needs no gradient)
    assert list(eager.leaf_numel.values()) == [16]
    # a compiled graph's autograd.Function saves its weight inputs detached: no leaf that requires grad, so only
    # `params` (or an optimizer's step) leaves them out

    class Detached(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x.detach(), w.detach())
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    w = model.l1.weight
    with SavedTensors() as compiled:
        Detached.apply(x, w).square().mean()
    assert compiled.leaf_numel == {}
    assert compiled.activation_bytes() == (8 * 16 + 16 * 16 + 8 * 16) * 4
    assert compiled.activation_bytes([w]) == (8 * 16 + 8 * 16) * 4
    # outside the block nothing is counted
    model(x).square().mean()
    assert eager.activation_bytes() == (8 * 16 + 8 * 16 + 8 * 1) * 4 and not eager.active


def test_autocasts_copies_of_the_weights_are_no_activations():
    """Under bf16 autocast the second layer's gradient input is a bf16 copy of its weight: saved, not a leaf, and a
    cost of the weights (the same at any batch), so it is counted apart from the activations."""
    from fastddpm.measure import SavedTensors

    model, x = TwoLinear(16), torch.randn(8, 16)
    with SavedTensors() as cast, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().square().mean()
    assert cast.leaf_numel == {}  # the weight itself is not saved: its bf16 copy is
    assert cast.cast_bytes() == 16 * 2
    # x and relu's output in bf16, the loss's fp32 square input; not the weight's copy
    assert cast.activation_bytes() == (8 * 16 * 2 + 8 * 16 * 2 + 8 * 4)
    assert cast.total_bytes() == cast.activation_bytes() + cast.cast_bytes()


def test_the_doctor_reports_a_loops_roofline_and_its_top_ops(tmp_path):
    import fastddpm.doctor
    from fastddpm.measure import ADAMW_UPDATE_TENSORS

    torch.manual_seed(0)
    width, batch = 64, 32
    model = TwoLinear(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = [torch.randn(batch, width) for _ in range(4)]

    def run(warmup_steps: int):
        with fastddpm.doctor.watch(loader, warmup_steps=warmup_steps, steps=3, profile_steps=2, out=tmp_path,
                                   device="cpu", print_report=False, loader_probe_s=0.1) as dr:
            for x in dr.batches():
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                dr.step()
        return dr.report

    # counted in the second warm-up step, where nothing is timed or profiled: one warm-up step is too few
    assert "warmup_steps >= 2" in run(1).measurements["roofline_unavailable"]
    report = run(2)
    m = report.measurements
    r = m["roofline"]
    # saved: the batch, relu's output, the square's input; the weights were leaves and are left out
    assert r["activation_mb_per_step"] * 1e6 == pytest.approx((batch * width + batch * width + batch) * 4)
    assert r["update_mb_per_step"] * 1e6 == pytest.approx(ADAMW_UPDATE_TENSORS * 4 * (width * width + width))
    # AdamW stepped them all, the first weight too (never saved: the batch needs no gradient)
    assert "the parameters AdamW stepped: 0.00416 M" in r["bytes_basis"]

    moved = 2 * r["activation_mb_per_step"] + r["update_mb_per_step"]
    assert r["memory_ms"] == pytest.approx(moved * 1e6 / (r["bandwidth_gbps"] * 1e9) * 1e3)
    assert r["compute_ms"] == pytest.approx(m["mfu"]["flops_per_step"] / (m["mfu"]["peak_tflops"] * 1e12) * 1e3)
    assert r["bound_ms"] == max(r["compute_ms"], r["memory_ms"])
    assert r["binds"] == ("compute" if r["compute_ms"] >= r["memory_ms"] else "memory")
    assert r["share"] == pytest.approx(r["bound_ms"] / m["mfu"]["step_ms"])
    text = report.text()
    assert f"roofline: {100 * r['share']:.0f}% of the bound ({r['binds']} binds)" in text
    # the top ops of a CPU step: the matmuls' own time leads, named as the trace names them
    top = m["trace"]["top_ops"]
    assert top and "top ops: " in text and {o["category"] for o in top} >= {"matmul"}
    assert top == sorted(top, key=lambda o: -o["share"]) and sum(o["share"] for o in top) <= 1.0


def test_the_roofline_says_why_when_it_cannot_count_the_bytes():
    from types import SimpleNamespace

    from fastddpm.doctor.api import roofline_measurements
    from fastddpm.measure import SavedTensors

    mfu = {"flops_per_step": 1e9, "peak_tflops": 1.0, "step_ms": 10.0}
    bw = {"gbps": 10.0, "label": "given"}
    assert "warm-up step" in roofline_measurements(SimpleNamespace(saved=None, saved_unavailable=None), mfu, None, bandwidth=bw)[1]
    # a step replayed from a CUDA graph runs no autograd on the host: nothing is saved
    why = roofline_measurements(SimpleNamespace(saved=SavedTensors(), saved_unavailable=None), mfu, None, bandwidth=bw)[1]
    assert "CUDA graph" in why
    assert "MFU" in roofline_measurements(SimpleNamespace(saved=None, saved_unavailable=None), {}, "no FLOPs counted", bandwidth=bw)[1]
    # bytes the caller counted (fastddpm's trainer) are used as given: 2 x activations + update
    roof, why = roofline_measurements(SimpleNamespace(saved=None, saved_unavailable=None), mfu, None, bandwidth=bw, step_bytes={
        "activation_bytes": 1e7, "update_bytes": 2e7, "basis": "counted on the model"})
    assert why is None and roof.memory_ms == pytest.approx(4e7 / 1e10 * 1e3) and roof.compute_ms == 1.0
    assert roof.binds == "memory" and roof.share == pytest.approx(0.4)


def test_micro_batches_are_counted_each_though_the_allocator_reuses_their_addresses():
    from fastddpm.measure import SavedTensors

    model, x = TwoLinear(16), torch.randn(8, 16)
    with SavedTensors() as one:
        model(x).square().mean().backward()
    with SavedTensors() as four:
        for _ in range(4):  # each backward frees its saves before the next forward allocates (often the same)
            model(x).square().mean().backward()
    assert one.activation_bytes() == (8 * 16 + 8 * 16 + 8) * 4
    assert four.activation_bytes() == 4 * one.activation_bytes() - 3 * 8 * 16 * 4  # the batch x: one storage


def test_an_observed_forward_leaves_no_graph_behind_and_the_same_gradients():
    """What the pack hook returns autograd keeps: the tensor itself would tie a saved output (sigmoid saves its
    own output) to its grad_fn in a cycle no collector frees, leaking every observed step's graph and its
    parameters' AccumulateGrad nodes (a later whole-step CUDA graph capture then failed on an H100)."""
    import gc
    import weakref

    from fastddpm.measure import SavedTensors

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid()), torch.randn(2, 4)
    with SavedTensors() as seen:
        out = model(x)
    assert seen.total_bytes() > 0
    graph = weakref.ref(out)
    del out
    gc.collect()
    assert graph() is None, "the observed forward's output (and so its graph) outlived every reference to it"

    with SavedTensors():
        model(x).square().sum().backward()
    observed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(observed, model.parameters()))


def test_a_storage_saved_through_temporary_views_is_counted_once():
    """Two ops that each save a view made inside the forward (the view itself dies at once; autograd holds its
    packed alias): one storage, counted once."""
    from fastddpm.measure import SavedTensors

    w1, w2 = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    h = torch.randn(8, 4, 4)
    with SavedTensors() as seen:
        out = (h.view(-1, 16) @ w1).sum() + (h.view(-1, 16) @ w2).sum()
    assert seen.activation_bytes() == 8 * 16 * 4  # h, once; the weights are leaves
    del out


def test_the_update_is_counted_for_the_optimizer_that_steps():
    from fastddpm.measure import optimizer_passes

    params = [nn.Parameter(torch.zeros(3))]
    assert optimizer_passes(torch.optim.AdamW(params)) == (7, "AdamW")
    assert optimizer_passes(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == (5, "SGD with momentum")
    assert optimizer_passes(torch.optim.SGD(params, lr=0.1)) == (3, "SGD")
    assert optimizer_passes(torch.optim.Adagrad(params))[1] == "Adagrad (taken as Adam's 7 passes)"
