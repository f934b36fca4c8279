"""The fast path computes what the plain path computes: same loss, gradients and update for the same batch;
the streaming loader yields exactly the resident loader's batches; the batch finder never touches training
state. GPU-only behaviour (CUDA graphs, pinned streams, no host syncs) is tested where CUDA exists."""

import contextlib
import copy
import json

import numpy as np
import pytest
import torch

from fastddpm.config import apply_overrides, get_preset
from fastddpm.device import resolve_precision
from fastddpm.diffusion import make_schedule
from fastddpm.rundir.metrics import read_metrics
from fastddpm.trainer.batch_finder import Trial, choose_knee, find_batch_size, make_trial_fn
from fastddpm.trainer.batches import Batch, ResidentBatches, StreamingBatches
from fastddpm.trainer.ema import EMA
from fastddpm.trainer.loop import train
from fastddpm.trainer.step import TrainStep, make_optimizer, train_step

from conftest import ONE_BLOCK_SEED, TINY_DDPM_28, needs_bf16_gpu

CPU = torch.device("cpu")


# every equivalence below runs for both U-Net families; TINY_DDPM_28: the ddpm family at these tests' 28x28
FAMILIES = pytest.mark.parametrize("family", ["seed", "ddpm"])


def tiny_model(seed=0, family="seed"):
    from fastddpm.models import build_unet

    cfg = apply_overrides(get_preset("tiny"), TINY_DDPM_28 if family == "ddpm" else {}).model
    cfg.image_channels, cfg.image_size = 1, 28
    torch.manual_seed(seed)
    model = build_unet(cfg)
    with torch.no_grad():  # the ddpm family zero-initialises its output layers: give them weights, so that the
        for p in model.parameters():  # gradients compared below reach every layer
            if p.ndim > 1 and not p.any():
                p.normal_(0.0, 0.02)
    return model


@pytest.fixture(scope="module")
def real_images():
    from conftest import read_fmnist

    return read_fmnist(64)[0]


def _batch(images, m=0, batch_size=16):
    return ResidentBatches(images, batch_size=batch_size, num_timesteps=1000, seed=3, device=CPU).get(m)


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _fast_and_plain(precision_name, images, family="seed", **step_kwargs):
    schedule = make_schedule("linear", 1000)
    batch = _batch(images)
    plain = tiny_model(family=family)
    fast = copy.deepcopy(plain)
    init = [p.detach().clone() for p in plain.parameters()]
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)
    loss_plain = train_step(plain, opt_plain, None, schedule, "epsilon", batch, resolve_precision("fp32", CPU), 1.0)

    precision = resolve_precision(precision_name, CPU)
    opt_fast = make_optimizer(fast, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=True,
                              capturable=False)
    ema = EMA(fast, 0.999)
    step = TrainStep(model=fast, optimizer=opt_fast, scaler=None, ema=ema, schedule=schedule, prediction="epsilon",
                     precision=precision, grad_clip=1.0, device=CPU, **step_kwargs)
    loss_fast = step([batch], lr=1e-3, step=0)
    return plain, fast, loss_plain, loss_fast, (ema, init)


@FAMILIES
def test_fast_step_equals_plain_step_fp32(real_images, family):
    plain, fast, loss_plain, loss_fast, (ema, init) = _fast_and_plain("fp32", real_images, family)
    assert abs(loss_fast.item() - loss_plain.item()) <= 1e-6
    for gp, gf in zip(_grads(plain), _grads(fast)):
        torch.testing.assert_close(gf, gp, rtol=0, atol=1e-6)
    # fused (fast) and foreach (plain) AdamW: the same update
    for pp, pf in zip(plain.parameters(), fast.parameters()):
        torch.testing.assert_close(pf, pp, rtol=0, atol=1e-6)
    # EMA after the first step with warm-up: beta = min(0.999, (1+0)/(10+0)) = 0.1, so ema = 0.1 init + 0.9 new
    for e, p, p0 in zip(ema.model.parameters(), fast.parameters(), init):
        torch.testing.assert_close(e, 0.1 * p0 + 0.9 * p.detach(), rtol=0, atol=1e-6)


def test_fast_step_bf16_is_close_to_fp32(real_images):
    """bf16 autocast keeps 8 bits of mantissa: loss within 2% and gradients pointing the same way (cos > 0.99)."""
    plain, fast, loss_plain, loss_fast, _ = _fast_and_plain("bf16", real_images)
    assert loss_fast.item() == pytest.approx(loss_plain.item(), rel=0.02)
    gp = torch.cat([g.flatten() for g in _grads(plain)])
    gf = torch.cat([g.flatten() for g in _grads(fast)])
    assert torch.nn.functional.cosine_similarity(gp, gf, dim=0).item() > 0.99


@FAMILIES
def test_gradient_checkpointing_changes_nothing_but_memory(real_images, family):
    schedule = make_schedule("linear", 1000)
    batch = _batch(real_images)
    a, b = tiny_model(family=family), tiny_model(family=family)
    b.grad_checkpointing = True
    from fastddpm.diffusion import diffusion_loss

    la = diffusion_loss(a, schedule, "epsilon", batch.x0, batch.t, batch.noise)
    lb = diffusion_loss(b, schedule, "epsilon", batch.x0, batch.t, batch.noise)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) <= 1e-6
    for ga, gb in zip(_grads(a), _grads(b)):
        torch.testing.assert_close(gb, ga, rtol=0, atol=1e-6)


@FAMILIES
def test_accumulation_of_two_halves_equals_one_full_batch(real_images, family):
    schedule = make_schedule("linear", 1000)
    full = _batch(real_images, batch_size=16)
    halves = [Batch(x0=full.x0[s], t=full.t[s], noise=full.noise[s], indices=full.indices[s])
              for s in (slice(0, 8), slice(8, 16))]
    results = []
    for accum, batches in ((1, [full]), (2, halves)):
        model = tiny_model(family=family)
        opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=True,
                             capturable=False)
        step = TrainStep(model=model, optimizer=opt, scaler=None, ema=EMA(model, 0.99), schedule=schedule,
                         prediction="epsilon", precision=resolve_precision("fp32", CPU), grad_clip=None,
                         accum_steps=accum, device=CPU)
        results.append((step(batches, lr=1e-3, step=0), _grads(model)))
    (l1, g1), (l2, g2) = results
    assert abs(l1.item() - l2.item()) <= 1e-6
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_streaming_yields_exactly_the_resident_batches(real_images, tmp_path):
    path = tmp_path / "images.npy"
    np.save(path, real_images)
    mm = np.load(path, mmap_mode="r")
    kw = dict(batch_size=12, num_timesteps=1000, seed=7, device=CPU, hflip=True)
    resident, streaming = ResidentBatches(real_images, **kw), StreamingBatches(mm, **kw)
    assert resident.steps_per_epoch == streaming.steps_per_epoch == 5  # 64 // 12, ragged tail dropped
    seen = []
    for m in range(3 * resident.steps_per_epoch):  # three epochs, across the epoch boundaries
        a, b = resident.get(m), streaming.get(m)
        assert torch.equal(a.indices.cpu(), b.indices.cpu())
        assert torch.equal(a.x0, b.x0) and torch.equal(a.t, b.t) and torch.equal(a.noise, b.noise)
        seen.append(a.indices)
    first_epoch = torch.cat(seen[:5])
    assert len(set(first_epoch.tolist())) == 60  # no repeats within an epoch
    assert not torch.equal(torch.cat(seen[5:10]), first_epoch)  # a new order each epoch


def test_batch_draws_are_a_function_of_seed_and_step(real_images):
    kw = dict(batch_size=8, num_timesteps=1000, seed=11, device=CPU)
    a, b = ResidentBatches(real_images, **kw), ResidentBatches(real_images, **kw)
    later = a.get(13)
    for m in range(13):  # b walks there; a jumped straight to it
        b.get(m)
    again = b.get(13)
    assert torch.equal(later.x0, again.x0) and torch.equal(later.noise, again.noise)


def test_batch_finder_backs_off_at_oom_and_picks_the_knee():
    curve = {32: 1000.0, 64: 1800.0, 128: 2600.0, 256: 2650.0}

    def trial(bs):
        if bs > 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return curve[bs]

    best, trials = find_batch_size(trial, start=32, limit=4096, log=lambda *a: None)
    assert [t.batch_size for t in trials] == [32, 64, 128, 256, 512]
    assert trials[-1].images_per_s is None and trials[-1].error == "out of memory"
    assert best == 128  # within 5% of the best (2650) at half the memory of 256
    with pytest.raises(RuntimeError, match="even the smallest"):
        choose_knee([Trial(32, None, None, "out of memory")], 0.05)


def test_batch_finder_stops_when_throughput_is_flat():
    calls = []

    def trial(bs):
        calls.append(bs)
        return 1000.0 if bs >= 64 else 500.0

    best, _ = find_batch_size(trial, start=32, limit=10**6, log=lambda *a: None)
    assert best == 64 and calls == [32, 64, 128, 256]


def test_batch_finder_trials_leave_the_model_untouched():
    model = tiny_model()
    before = copy.deepcopy(model.state_dict())
    trial = make_trial_fn(model, make_schedule("linear", 1000), "epsilon", resolve_precision("fp32", CPU),
                          image_shape=(1, 28, 28), device=CPU, warmup_steps=1, timed_steps=1)
    assert trial(4) > 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@FAMILIES
def test_auto_batch_size_in_a_run(tmp_path, real_images, family):
    src = tmp_path / "64.npz"
    np.savez(src, images=real_images)  # 64 images: the search stops at the dataset size (trials 32, 64)
    # each trial trains seven steps at batch 32 or 64, without attention (the seed U-Net's at 28x28, over 784
    # positions, most of a step's time; the DDPM U-Net's at 14x14), which is not what this test checks
    seed = {**ONE_BLOCK_SEED, "model.attention": False}
    ddpm = {**TINY_DDPM_28, "model.attention_resolutions": ()}
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(src), "train.progress": False,
                                               "train.batch_size": "auto", "train.max_steps": 2,
                                               **(ddpm if family == "ddpm" else seed)})
    train(cfg, out_dir=tmp_path / "run", log=lambda *a: None)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert info["batch_size"] in (32, 64)
    assert saved["train"]["batch_size"] == info["batch_size"]  # resume reuses the resolved batch
    assert info["batch_size_reason"].startswith("auto: 32:")


@FAMILIES
def test_compiled_step_matches_eager_and_does_not_recompile(tmp_path, fmnist_npz, family):
    """torch.compile on a tiny model (CPU inductor): the same losses as eager, and the changing warm-up learning
    rate (a tensor) causes no recompilation after warm-up. The seed family's model has one block of each kind:
    Inductor's time grows with the blocks, and every kind of block is compiled and compared."""
    over = {"data.source": str(fmnist_npz), "train.progress": False, "train.max_steps": 6, "train.log_every": 1,
            "train.warmup_images": 1000, "train.checkpoint_every": None, "train.num_sample_images": 2,
            "train.sample_steps": 2, **(TINY_DDPM_28 if family == "ddpm" else ONE_BLOCK_SEED)}
    eager = apply_overrides(get_preset("tiny"), {**over, "train.compile": "off"})
    compiled = apply_overrides(get_preset("tiny"), {**over, "train.compile": "on"})
    train(eager, out_dir=tmp_path / "eager", log=lambda *a: None)
    train(compiled, out_dir=tmp_path / "compiled", log=lambda *a: None)
    le = [m["loss"] for m in read_metrics(tmp_path / "eager" / "metrics.jsonl")]
    mc = read_metrics(tmp_path / "compiled" / "metrics.jsonl")
    np.testing.assert_allclose([m["loss"] for m in mc], le, rtol=1e-4, atol=1e-5)
    assert mc[-1]["recompiles_after_warmup"] == 0
    assert mc[-1]["graph_breaks"] >= 0 and mc[-1]["compiled_graphs"] >= 1
    info = json.loads((tmp_path / "compiled" / "run.json").read_text())
    assert info["fast_path"]["compile"].startswith("on")


def test_cpu_precision_auto_is_bf16_only_where_the_cpu_has_native_bf16(monkeypatch):
    """Issue 18: bf16 autocast on a CPU with amx_bf16 / avx512_bf16 (1.6x on the demo U-Net there); fp32 where
    bf16 would be emulated (0.23x fp32's matmul rate measured on a CPU without them). The flags are simulated."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("FASTDDPM_CPU_FLAGS", "avx512f avx512_vnni amx_tile amx_bf16")
    p = resolve_precision("auto", cpu)
    assert p.name == "bf16" and p.autocast_dtype == torch.bfloat16 and not p.use_grad_scaler
    assert "amx_bf16" in p.reason
    monkeypatch.setenv("FASTDDPM_CPU_FLAGS", "avx512f avx512_vnni")
    p = resolve_precision("auto", cpu)
    assert p.name == "fp32" and p.autocast_dtype is None and "emulated" in p.reason
    # an explicit choice is kept either way
    assert resolve_precision("bf16", cpu).name == "bf16" and resolve_precision("fp32", cpu).name == "fp32"
    monkeypatch.setenv("FASTDDPM_CPU_FLAGS", "amx_bf16")
    assert resolve_precision("fp32", cpu).name == "fp32"


def test_cpu_compile_auto_compiles_only_bf16_runs_long_enough_to_pay_back():
    from fastddpm.config import TrainConfig
    from fastddpm.device import Precision
    from fastddpm.trainer.fast_path import CPU_COMPILE_MEASURED, cpu_compile_min_images, resolve_fast_path

    cpu = torch.device("cpu")
    bf16 = Precision("bf16", torch.bfloat16, False, "test")
    fp32 = Precision("fp32", None, False, "test")
    need = cpu_compile_min_images()
    # twice the payback on the CPU where compiling gained least: 44 s / (1/493 - 1/524 s per image) on a Zen 5 with
    # avx512_bf16 (the 2-core amx_bf16 Xeon paid back 3x sooner: 45 s / (1/371 - 1/435))
    paybacks = sorted(m.payback_images for m in CPU_COMPILE_MEASURED)
    assert 100_000 < paybacks[0] < 130_000 and 330_000 < paybacks[-1] < 400_000 and need == int(2 * paybacks[-1])
    long_run = resolve_fast_path(TrainConfig(), cpu, bf16, planned_images=need)
    assert long_run.compile and f"plans {need:,} images" in long_run.reasons["compile"]
    assert "1.06x under bf16" in long_run.reasons["compile"]  # the numbers behind the choice, in its reason
    quickstart = resolve_fast_path(TrainConfig(), cpu, bf16, planned_images=150_000)
    assert not quickstart.compile and "this run plans 150,000 images" in quickstart.reasons["compile"]
    seed_recipe = resolve_fast_path(TrainConfig(), cpu, bf16, planned_images=40 * 60_000)  # seed-1layer: 40 epochs
    assert seed_recipe.compile
    fp32_run = resolve_fast_path(TrainConfig(), cpu, fp32, planned_images=10 * need)
    assert not fp32_run.compile and "in fp32" in fp32_run.reasons["compile"]
    assert resolve_fast_path(TrainConfig(compile="on"), cpu, fp32, planned_images=1).compile  # asked for: kept


def test_the_compile_help_quotes_only_numbers_the_measurements_give():
    """--compile's help (and docs/config.md, generated from it) may quote the CPU threshold or the compile time
    only as the measurements behind `auto` give them: a number written by hand goes stale when one is added."""
    import re

    from fastddpm.config import TrainConfig
    from fastddpm.trainer.fast_path import CPU_COMPILE_MEASURED, cpu_compile_min_images

    text = TrainConfig.__dataclass_fields__["compile"].metadata["help"]
    for count in re.findall(r"([\d.,]+k?) images", text):
        assert count == f"{cpu_compile_min_images():,}", text
    for seconds in re.findall(r"(\d+) s\b", text):
        assert seconds in {f"{m.compile_s:.0f}" for m in CPU_COMPILE_MEASURED}, text


def _torch_compile_kwargs(monkeypatch, **step_kw) -> list[dict]:
    """The keyword arguments a compiled TrainStep passes torch.compile (torch.compile itself replaced)."""
    from fastddpm.device import Precision

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    model = tiny_model()
    opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=True,
                         capturable=False)
    TrainStep(model=model, optimizer=opt, scaler=None, ema=EMA(model, 0.99), schedule=make_schedule("linear", 1000),
              prediction="epsilon", precision=Precision("bf16", torch.bfloat16, False, "test"), grad_clip=None,
              device=CPU, compile=True, **step_kw)
    return seen


def test_compile_mode_reaches_torch_compile_without_inductors_own_graphs_under_capture(monkeypatch):
    from fastddpm.trainer.step import inductor_mode

    # fastddpm's own capture holds the step: Inductor must not record graphs of its own inside it
    assert inductor_mode("max-autotune", "capture") == "max-autotune-no-cudagraphs"
    assert inductor_mode("max-autotune", "off") == "max-autotune-no-cudagraphs"
    assert inductor_mode("max-autotune", "reduce-overhead") == "max-autotune"
    assert inductor_mode("default", "reduce-overhead") == "reduce-overhead"
    assert inductor_mode("default", "capture") is None
    assert _torch_compile_kwargs(monkeypatch, compile_mode="max-autotune") == [
        {"dynamic": False, "mode": "max-autotune-no-cudagraphs"}]


def test_a_forced_inductor_layout_reaches_torch_compile_as_options_with_the_modes_own(monkeypatch):
    import torch._inductor.config as inductor_config

    from fastddpm.trainer.step import compile_kwargs

    assert compile_kwargs("default", "capture") == {"mode": None}
    assert compile_kwargs("default", "capture", "channels-last") == {"options": {"force_layout_optimization": True}}
    # torch.compile takes a mode or options, not both: the mode's own settings travel in the options
    ma = compile_kwargs("max-autotune", "capture", "channels-last")["options"]
    assert ma["force_layout_optimization"] and ma["max_autotune"] and not ma.get("triton.cudagraphs")
    assert compile_kwargs("default", "reduce-overhead", "channels-last")["options"]["triton.cudagraphs"]
    for key in ma:  # every key is one of Inductor's settings in this torch (a renamed one would fail here)
        with inductor_config.patch({key: ma[key]}):
            pass
    assert _torch_compile_kwargs(monkeypatch, inductor_layout="channels-last") == [
        {"dynamic": False, "options": {"force_layout_optimization": True}}]


@pytest.mark.parametrize("field,value,reason,unset,where", [
    ("compile_mode", "max-autotune", "mode max-autotune", "default", "compile"),
    ("inductor_layout", "channels-last", "channels-last (requested)", "heuristic", "inductor_layout")])
def test_a_setting_of_the_compiler_applies_when_compiling_and_is_refused_with_compile_off(field, value, reason, unset,
                                                                                            where):
    from fastddpm.config import ConfigError, TrainConfig
    from fastddpm.device import Precision
    from fastddpm.trainer.fast_path import resolve_fast_path

    cpu, bf16 = torch.device("cpu"), Precision("bf16", torch.bfloat16, False, "test")
    on = resolve_fast_path(TrainConfig(compile="on", **{field: value}), cpu, bf16, planned_images=1)
    assert getattr(on, field) == value and reason in on.reasons[where]
    unused = resolve_fast_path(TrainConfig(**{field: value}), cpu, bf16, planned_images=1)  # auto: a short CPU run
    assert not unused.compile and getattr(unused, field) == unset and "unused" in unused.reasons[where]
    with pytest.raises(ConfigError, match="--compile on"):
        resolve_fast_path(TrainConfig(compile="off", **{field: value}), cpu, bf16, planned_images=1)
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: "fast"})


def test_inductor_layout_and_head_pad_auto_pick_what_was_measured_faster_on_a_gpu():
    from fastddpm.config import ConfigError, TrainConfig
    from fastddpm.device import Precision
    from fastddpm.trainer.fast_path import resolve_fast_path

    bf16 = Precision("bf16", torch.bfloat16, False, "test")
    gpu, cpu = torch.device("cuda"), torch.device("cpu")  # a device object only: nothing here touches a GPU

    def fast(device, world_size=0, precision=bf16, **train):
        return resolve_fast_path(TrainConfig(**train), device, precision, world_size=world_size, planned_images=1,
                                 model_family="ddpm")

    on = fast(gpu)  # compiled on one GPU under bf16: both measured faster there (an H200, 2026-11-28)
    assert on.inductor_layout == "channels-last" and "1.18x" in on.reasons["inductor_layout"]
    assert on.attention_head_pad == 8 and "1.05x" in on.reasons["attention_head_pad"]
    fp16 = Precision("fp16", torch.float16, True, "test")
    for off, why in ((fast(gpu, compile="off"), "not compiling"), (fast(cpu, compile="on"), "CPU"),
                     (fast(gpu, world_size=2), "DDP"), (fast(gpu, precision=fp16), "under fp16")):
        assert off.inductor_layout == "heuristic" and why in off.reasons["inductor_layout"], off.reasons
    for off, why in ((fast(gpu, compile="off"), "eager"), (fast(cpu, compile="on"), "CPU"),
                     (fast(gpu, precision=fp16), "under fp16")):
        assert off.attention_head_pad == 0 and why in off.reasons["attention_head_pad"], off.reasons
    # asked for: kept, whatever auto would say
    assert fast(gpu, inductor_layout="heuristic").inductor_layout == "heuristic"
    assert fast(gpu, attention_head_pad=0).attention_head_pad == 0
    assert fast(cpu, compile="on", attention_head_pad=16).attention_head_pad == 16
    with pytest.raises(ConfigError, match="inductor_layout=channels-last .* --compile on"):
        fast(gpu, compile="off", inductor_layout="channels-last")
    # Inductor's own heuristic forces nothing: a config that pins it runs uncompiled too (it had been refused)
    uncompiled = fast(gpu, compile="off", inductor_layout="heuristic")
    assert uncompiled.inductor_layout == "heuristic"
    assert uncompiled.reasons["inductor_layout"] == "heuristic (heuristic unused, not compiling)"
    with pytest.raises(ConfigError, match="attention_head_pad='eight' is not one of auto, 0, 8"):
        TrainConfig(attention_head_pad="eight")


def test_the_compile_options_follow_the_resolved_layout(monkeypatch):
    # what auto resolved reaches torch.compile: forced as options, the heuristic as the plain mode
    assert _torch_compile_kwargs(monkeypatch, inductor_layout="heuristic") == [{"dynamic": False, "mode": None}]


def test_fast_path_choices_are_recorded(tmp_path, fmnist_npz):
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.max_steps": 1, "train.accum_steps": 2})
    lines = []
    train(cfg, out_dir=tmp_path / "run", log=lines.append)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert set(info["fast_path"]) == {"compile", "cuda_graphs", "channels_last", "cudnn_benchmark", "inductor_layout",
                                      "attention_head_pad"}
    assert info["fast_path"]["attention_head_pad"].startswith("off (auto: off on a CPU")
    assert info["data"]["placement"] == "device" and info["accum_steps"] == 2
    text = "\n".join(lines)
    for word in ("placement device", "16 x 2 accumulation = 32 images/step", "compile: off", "cuda_graphs: off"):
        assert word in text


def test_channels_last_auto_is_on_only_where_it_was_measured_faster_than_nchw():
    from fastddpm.config import ConfigError, TrainConfig
    from fastddpm.device import Precision
    from fastddpm.trainer.fast_path import resolve_fast_path

    bf16 = Precision("bf16", torch.bfloat16, False, "test")
    gpu, cpu = torch.device("cuda"), torch.device("cpu")  # a device object only: nothing here touches a GPU

    def fast(device, family, world_size=0, precision=bf16, **train):
        return resolve_fast_path(TrainConfig(**train), device, precision, world_size=world_size, planned_images=1,
                                 model_family=family)

    on = fast(gpu, "seed")
    assert on.channels_last and on.compile and "1.09x" in on.reasons["channels_last"]
    for off, why in ((fast(gpu, "ddpm"), "0.94x"), (fast(gpu, "seed", compile="off"), "eager"),
                     (fast(cpu, "seed", compile="on"), "CPU"), (fast(gpu, "seed", world_size=2), "DDP"),
                     (fast(gpu, None), "off for this U-Net"),
                     (fast(gpu, "seed", precision=Precision("fp16", torch.float16, True, "test")), "under fp16"),
                     (fast(gpu, "seed", precision=Precision("fp32", None, False, "test")), "under fp32")):
        assert not off.channels_last and why in off.reasons["channels_last"], off.reasons
    assert fast(gpu, "ddpm", channels_last="on").channels_last  # asked for: kept, whatever auto would say
    assert not fast(gpu, "seed", channels_last="off").channels_last
    with pytest.raises(ConfigError, match="FSDP shards contiguous"):
        resolve_fast_path(TrainConfig(channels_last="on"), gpu, bf16, world_size=2, parallel="fsdp",
                          model_family="seed")


@pytest.mark.parametrize("before,after", [("off", "on"), ("on", "off")])
def test_a_checkpoint_resumes_in_the_other_memory_format_with_its_moments_laid_out_as_the_weights(
        tmp_path, fmnist_npz, monkeypatch, before, after):
    """A seed checkpoint written NCHW (channels_last was off until measured) resumes channels_last on a GPU, and a
    channels_last one resumes where auto is off (DDP, eager, a CPU). Optimizer.load_state_dict keeps the saved
    moments' layout, which CUDA's fused AdamW refuses beside weights of the other: they take the weights' layout."""
    import fastddpm.rundir.checkpointer as checkpointer_module

    checked = []
    real = checkpointer_module.match_state_layout

    def checked_match(optimizer):
        real(optimizer)
        moments = [(p, v) for g in optimizer.param_groups for p in g["params"]
                   for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.shape == p.shape]
        checked.append(all(v.stride() == p.stride() for p, v in moments) and any(p.dim() == 4 for p, _ in moments))

    monkeypatch.setattr(checkpointer_module, "match_state_layout", checked_match)
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.precision": "fp32", "train.channels_last": before,
                                               "train.max_steps": 2, "train.checkpoint_every": 2,
                                               "train.num_sample_images": 2, "train.sample_steps": 2})
    train(cfg, out_dir=tmp_path / "run", log=lambda _: None)
    train(apply_overrides(cfg, {"train.channels_last": after, "train.max_steps": 3}), out_dir=tmp_path / "run",
          resume="latest", log=lambda _: None)
    assert checked == [True]


def test_a_channels_last_run_resumes_exactly_and_its_checkpoint_samples(tmp_path, fmnist_npz):
    """channels_last is the CUDA default of the seed U-Net: its weights are NHWC in memory, and a checkpoint of
    them resumes bit-exactly and loads into the NCHW model that sampling builds."""
    from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint
    from fastddpm.sampling import load_for_sampling

    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.precision": "fp32", "train.channels_last": "on",
                                               "train.max_steps": 4, "train.log_every": 1,
                                               "train.checkpoint_every": 2, "train.num_sample_images": 2,
                                               "train.sample_steps": 2})
    full, half = tmp_path / "full", tmp_path / "half"
    train(cfg, out_dir=full, log=lambda _: None)
    train(apply_overrides(cfg, {"train.max_steps": 2}), out_dir=half, log=lambda _: None)
    train(cfg, out_dir=half, resume="latest", log=lambda _: None)
    assert [m["loss"] for m in read_metrics(full / "metrics.jsonl")] == [
        m["loss"] for m in read_metrics(half / "metrics.jsonl")]
    path = list_checkpoints(full / "checkpoints")[-1]
    a, b = load_checkpoint(path), load_checkpoint(list_checkpoints(half / "checkpoints")[-1])
    for part in ("model", "ema"):
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)
    assert json.loads((full / "run.json").read_text())["fast_path"]["channels_last"] == "on (requested)"
    model, _ = load_for_sampling(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v.float(), a["ema"][k].float()), k


# ------------------------------------------------------------------------------------------------ GPU only
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_streaming_equals_resident(real_images, tmp_path):
    path = tmp_path / "images.npy"
    np.save(path, real_images)
    kw = dict(batch_size=12, num_timesteps=1000, seed=7, device=torch.device("cuda"), hflip=True)
    resident, streaming = ResidentBatches(real_images, **kw), StreamingBatches(np.load(path, mmap_mode="r"), **kw)
    for m in range(12):
        a, b = resident.get(m), streaming.get(m)
        assert torch.equal(a.x0, b.x0) and torch.equal(a.noise, b.noise) and torch.equal(a.t, b.t)


def _cuda_run(tmp_path, fmnist_npz, name, **over):
    base = {"data.source": str(fmnist_npz), "train.progress": False, "train.max_steps": 8, "train.log_every": 1,
            "train.device": "cuda", "train.precision": "bf16", "train.checkpoint_every": None,
            "train.num_sample_images": 2, "train.sample_steps": 2}
    cfg = apply_overrides(get_preset("tiny"), {**base, **over})
    train(cfg, out_dir=tmp_path / name, log=lambda *a: None)
    return [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]


@pytest.mark.cuda
@cuda
@needs_bf16_gpu
def test_a_checkpoint_written_nchw_resumes_channels_last_under_cudas_fused_adamw(tmp_path, fmnist_npz):
    """The seed U-Net's channels_last auto turned on after checkpoints were written NCHW: fused AdamW on CUDA
    refuses moments of another layout than their weights, so the resume lays them out as the weights."""
    _cuda_run(tmp_path, fmnist_npz, "run", **{"train.channels_last": "off", "train.max_steps": 2,
                                              "train.checkpoint_every": 2, "train.compile": "off"})
    cfg = apply_overrides(get_preset("tiny"), {
        "data.source": str(fmnist_npz), "train.progress": False, "train.max_steps": 4, "train.log_every": 1,
        "train.device": "cuda", "train.precision": "bf16", "train.channels_last": "on", "train.compile": "off",
        "train.num_sample_images": 2, "train.sample_steps": 2})
    train(cfg, out_dir=tmp_path / "run", resume="latest", log=lambda *a: None)
    losses = [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 4 and all(np.isfinite(losses))


@pytest.mark.cuda
@cuda
@needs_bf16_gpu
def test_cuda_graph_capture_matches_eager(tmp_path, fmnist_npz):
    eager = _cuda_run(tmp_path, fmnist_npz, "eager", **{"train.compile": "off", "train.cuda_graphs": "off"})
    graphs = _cuda_run(tmp_path, fmnist_npz, "graphs", **{"train.compile": "off", "train.cuda_graphs": "capture"})
    compiled = _cuda_run(tmp_path, fmnist_npz, "both", **{"train.compile": "on", "train.cuda_graphs": "capture"})
    for name in ("graphs", "both"):
        info = json.loads((tmp_path / name / "run.json").read_text())
        assert info["cuda_graphs_used"], info["cuda_graphs_failure"]
    np.testing.assert_allclose(graphs, eager, rtol=2e-2)
    np.testing.assert_allclose(compiled, eager, rtol=2e-2)


@pytest.mark.cuda
@cuda
@needs_bf16_gpu
@FAMILIES
def test_a_step_whose_bytes_were_counted_still_captures(real_images, family):
    """`bench throughput` counts a step's bytes (saved-tensor hooks over a probe forward) on the very model it then
    compiles and captures; a hook that leaked the probe's graph made ddpm-cifar10's capture fail on an H100."""
    from fastddpm.measure import count_step_bytes

    device = torch.device("cuda")
    model = tiny_model(family=family).to(device)
    count_step_bytes(model, (1, 28, 28), images_per_step=16, device=device, autocast_dtype=torch.bfloat16)
    opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=device, tensor_lr=True,
                         capturable=True)
    step = TrainStep(model=model, optimizer=opt, scaler=None, ema=EMA(model, 0.99),
                     schedule=make_schedule("linear", 1000).to(device), prediction="epsilon",
                     precision=resolve_precision("bf16", device), grad_clip=1.0, device=device, compile=True,
                     cuda_graphs="capture")
    batches = ResidentBatches(real_images, batch_size=16, num_timesteps=1000, seed=0, device=device)
    losses = [float(step([batches.get(s)], lr=1e-3, step=s)) for s in range(3)]
    assert step.graph is not None and step.graph_failed is None
    assert all(np.isfinite(losses))


@pytest.mark.cuda
@cuda
@needs_bf16_gpu
def test_cuda_step_has_no_host_syncs(real_images):
    device = torch.device("cuda")
    model = tiny_model().to(device)
    schedule = make_schedule("linear", 1000).to(device)
    opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=device, tensor_lr=True,
                         capturable=False)
    step = TrainStep(model=model, optimizer=opt, scaler=None, ema=EMA(model, 0.99), schedule=schedule,
                     prediction="epsilon", precision=resolve_precision("bf16", device), grad_clip=1.0,
                     device=device)
    batches = ResidentBatches(real_images, batch_size=16, num_timesteps=1000, seed=0, device=device)
    step([batches.get(0)], lr=1e-3, step=0)  # lazy optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(1, 4):
            step([batches.get(s)], lr=1e-3, step=s)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fast_step_ema_builds_no_autograd_history(real_images):
    _, fast, _, _, (ema, _) = _fast_and_plain("fp32", real_images)
    for e in ema.model.parameters():
        assert e.is_leaf and not e.requires_grad and e.grad_fn is None


def test_optimizer_state_resumes_across_implementations():
    """A checkpoint from the plain path (foreach, float lr) loads into the fast path (fused, tensor lr) and back."""
    from fastddpm.rundir.state_dicts import portable_optimizer_state, with_current_optimizer_flags

    model = tiny_model()
    plain = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=False,
                           capturable=False)
    model(torch.randn(2, 1, 28, 28), torch.tensor([1, 2])).square().mean().backward()
    plain.step()
    fast = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=True,
                          capturable=False)
    fast.load_state_dict(with_current_optimizer_flags(portable_optimizer_state(plain), fast))
    # (load_state_dict deep-copies the groups: TrainStep reads the lr tensor after loading, as the loop does)
    assert isinstance(fast.param_groups[0]["lr"], torch.Tensor) and fast.param_groups[0]["fused"]
    fast.step()  # would raise "lr as a Tensor is not supported for ... foreach" with the saved flags
    back = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=False,
                          capturable=False)
    back.load_state_dict(with_current_optimizer_flags(portable_optimizer_state(fast), back))
    assert isinstance(back.param_groups[0]["lr"], float)
    back.step()


def test_schedule_tensors_are_never_replaced_in_place():
    s = make_schedule("linear", 1000)
    before = s.sqrt_alpha_bar
    assert s.to("cpu") is s and s.sqrt_alpha_bar is before


def test_a_failed_cuda_graph_capture_stops_with_the_setting_to_change(real_images, monkeypatch):
    """A capture that fails raises an error naming --cuda-graphs off, with the state as it was: the run does not
    go on eager in a process a failed capture may have broken (a segmentation fault on an H100)."""
    from fastddpm.trainer.step import CudaGraphCaptureError

    model = tiny_model()
    schedule = make_schedule("linear", 1000)
    opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=True,
                         capturable=False)
    step = TrainStep(model=model, optimizer=opt, scaler=None, ema=EMA(model, 0.99), schedule=schedule,
                     prediction="epsilon", precision=resolve_precision("fp32", CPU), grad_clip=1.0, device=CPU,
                     cuda_graphs="capture")
    monkeypatch.setattr(step, "_capture_unsupported", lambda: None)  # the capture itself is what fails here

    class Stream:  # the warm-up runs for real, on the CPU, on this stand-in side stream
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    def no_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_capture)  # after three warm-up steps that moved the weights
    before = [p.detach().clone() for p in model.parameters()]
    batches = ResidentBatches(real_images, batch_size=8, num_timesteps=1000, seed=0, device=CPU)
    with pytest.raises(CudaGraphCaptureError, match="--cuda-graphs off") as err:
        step([batches.get(0)], lr=1e-3, step=0)
    assert "operation not permitted when stream is capturing" in str(err.value)
    assert step.graph is None and step.graph_failed.startswith("RuntimeError")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_without_a_cpp_compiler_a_cpu_run_does_not_compile_and_on_is_refused_up_front(monkeypatch):
    """Inductor's CPU kernels are C++: where no compiler is found, auto stays eager (saying why) and --compile on
    is refused before the run, not a failure at the first step after the set-up."""
    from torch._inductor import cpp_builder

    from fastddpm.config import ConfigError, TrainConfig
    from fastddpm.device import Precision
    from fastddpm.trainer.fast_path import cpu_compile_min_images, resolve_fast_path

    def no_compiler():
        raise RuntimeError("No working C++ compiler found in ('g++',)")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    cpu, bf16 = torch.device("cpu"), Precision("bf16", torch.bfloat16, False, "test")
    auto = resolve_fast_path(TrainConfig(), cpu, bf16, planned_images=2 * cpu_compile_min_images())
    assert not auto.compile and "no C++ compiler" in auto.reasons["compile"] and "g++" in auto.reasons["compile"]
    with pytest.raises(ConfigError, match=r"compile=on on a CPU needs a C\+\+ compiler.*--compile off"):
        resolve_fast_path(TrainConfig(compile="on"), cpu, bf16, planned_images=1)


def test_a_capture_that_runs_out_of_memory_stops_the_run_and_is_not_retried(tmp_path, fmnist_npz, monkeypatch):
    """An out-of-memory error during CUDA graph capture is the capture's failure: the run stops with it (naming
    --cuda-graphs off), where a plain out-of-memory error re-plans the step in smaller micro-batches."""
    from fastddpm.trainer.step import CudaGraphCaptureError

    calls = []

    def capture_fails(self, micro, **kw):
        calls.append(len(micro))
        raise CudaGraphCaptureError("CUDA graph capture failed: CUDA out of memory. Tried to allocate 2.00 GiB; "
                                    "run with --cuda-graphs off")

    monkeypatch.setattr(TrainStep, "__call__", capture_fails)
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.max_steps": 2})
    with pytest.raises(CudaGraphCaptureError, match="--cuda-graphs off"):
        train(cfg, out_dir=tmp_path / "run", log=lambda m: None)
    assert calls == [1]  # tried once, not again in two micro-batches


def test_a_resumed_run_marks_its_compile_warm_up_after_its_own_first_steps(tmp_path, fmnist_npz, monkeypatch):
    """recompiles_after_warmup counts from the third step of each process: a run resumed at step 4 compiles
    afresh, and its warm-up ends at step 7 (at step 3 it never passes)."""
    from fastddpm.trainer import loop

    marked = []
    monkeypatch.setattr(loop.CompileCounters, "mark_warm", lambda self: marked.append(self))
    over = {"data.source": str(fmnist_npz), "train.progress": False, "train.checkpoint_every": 4,
            "train.num_sample_images": 2, "train.sample_steps": 2}
    train(apply_overrides(get_preset("tiny"), {**over, "train.max_steps": 4}), out_dir=tmp_path / "r",
          log=lambda m: None)
    assert len(marked) == 1
    marked.clear()
    steps = []
    real_count = loop.StepLog.count

    def count(self, loss):
        real_count(self, loss)
        steps.append((self.run.state.step, len(marked)))

    monkeypatch.setattr(loop.StepLog, "count", count)
    train(apply_overrides(get_preset("tiny"), {**over, "train.max_steps": 9}), out_dir=tmp_path / "r",
          resume="latest", log=lambda m: None)
    assert steps == [(5, 0), (6, 0), (7, 1), (8, 1), (9, 1)]
