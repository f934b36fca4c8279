"""Class-conditional models and classifier-free guidance: the model, the labels through training, the sampler's
guidance, the CLI, and the evaluation's class accuracy."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from fastddpm.api import Model
from fastddpm.cli import main
from fastddpm.config import ConfigError, apply_overrides, class_index, get_preset, resolve_classes, resolve_model_shape
from fastddpm.diffusion import make_schedule, sample
from fastddpm.diffusion.guidance import guided
from fastddpm.models import UNet
from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from fastddpm.rundir.metrics import read_metrics
from fastddpm.sampling import class_labels
from fastddpm.trainer.batches import ResidentBatches, StreamingBatches
from fastddpm.trainer.loop import train

from conftest import ONE_BLOCK_SEED, needs_bf16_gpu
from eval_fixtures import fmnist_splits  # noqa: F401 - a session fixture (a real train/test slice)

CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


def quiet(*args, **kwargs):
    pass


def cond_model(num_classes: int = 10, seed: int = 0, attention: bool = True) -> UNet:
    cfg = resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, conditional=True, attention=attention))
    cfg = resolve_classes(cfg, np.arange(num_classes), list(CLASSES[:num_classes]), "test labels")
    torch.manual_seed(seed)
    return UNet(cfg.model).eval()


# Without attention: at 28x28 (over 784 positions) it is most of a CPU step's and a sampler step's time, and what
# these runs follow is the class embedding and the labels (the class embedding joins the time embedding).
def tiny_cond_cfg(source, **train):
    over = {"data.source": str(source), "model.conditional": True, "train.progress": False,
            "train.num_sample_images": 10, "train.sample_steps": 2, "model.attention": False}
    over.update({f"train.{k}": v for k, v in train.items()})
    return apply_overrides(get_preset("tiny"), over)


# ------------------------------------------------------------------------------------------------ the model
def test_the_null_class_is_what_no_label_means_and_unconditional_models_are_unchanged():
    model = cond_model()
    x, t = torch.randn(4, 1, 28, 28), torch.tensor([0, 10, 500, 999])
    with torch.no_grad():
        null = model(x, t, torch.full((4,), 10))
        assert torch.equal(model(x, t), null)
        assert not torch.allclose(model(x, t, torch.tensor([1, 2, 3, 4])), null)
        level = torch.tensor([0.5, 10.0, 250.0, 999.0])  # EDM's and flow's float noise levels: the same null class
        assert torch.equal(model(x, level), model(x, level, torch.full((4,), 10)))
    # A conditional U-Net is the unconditional one plus a class embedding: the other weights start the same
    torch.manual_seed(0)
    plain = UNet(resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28)).model)
    cond_state = model.state_dict()
    assert set(cond_state) - set(plain.state_dict()) == {"class_emb.weight"}
    assert cond_state["class_emb.weight"].shape == (11, 32)  # 10 classes + the null class
    for k, v in plain.state_dict().items():
        assert torch.equal(cond_state[k], v), k
    with pytest.raises(ValueError, match="unconditional"):
        plain(x, t, torch.zeros(4, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ labels in batches
def _images_and_labels(n=200):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int64)


def test_label_dropout_rate_and_the_labels_follow_their_images():
    images, labels = _images_and_labels()
    kw = dict(batch_size=40, num_timesteps=100, seed=3, device=torch.device("cpu"))
    src = ResidentBatches(images, labels=labels, cond_drop_prob=0.25, num_classes=10, **kw)
    plain = ResidentBatches(images, **kw)
    dropped = total = 0
    for m in range(60):
        b, p = src.get(m), plain.get(m)
        kept = b.y != 10
        assert torch.equal(b.y[kept], torch.from_numpy(labels)[b.indices][kept])  # the image's own label
        dropped += int((~kept).sum())
        total += b.y.numel()
        # labels draw after t, noise and flips: an unconditional run's stream is what it was
        assert torch.equal(b.t, p.t) and torch.equal(b.noise, p.noise) and p.y is None
    assert abs(dropped / total - 0.25) < 0.03, dropped / total  # 2,400 draws: 3 sigma is 0.027
    again = ResidentBatches(images, labels=labels, cond_drop_prob=0.25, num_classes=10, **kw)
    assert torch.equal(again.get(17).y, src.get(17).y)  # a function of (seed, step): exact on resume
    no_drop = ResidentBatches(images, labels=labels, cond_drop_prob=0.0, num_classes=10, **kw)
    assert (no_drop.get(5).y != 10).all()


@pytest.mark.parametrize("world", [1, 2])
def test_streamed_and_sharded_batches_carry_the_same_labels(world):
    images, labels = _images_and_labels()
    kw = dict(batch_size=20, num_timesteps=100, seed=1, device=torch.device("cpu"), labels=labels,
              cond_drop_prob=0.1, num_classes=10, world_size=world)
    for rank in range(world):
        resident, streamed = ResidentBatches(images, rank=rank, **kw), StreamingBatches(images, rank=rank, **kw)
        for m in range(8):
            a, b = resident.get(m), streamed.get(m)
            assert torch.equal(a.y, b.y) and torch.equal(a.indices, b.indices)
            kept = a.y != 10
            assert torch.equal(a.y[kept], torch.from_numpy(labels)[a.indices][kept])


# ------------------------------------------------------------------------------------------------ guidance
def test_guidance_one_is_plain_conditional_zero_is_unconditional_and_2b_equals_two_passes():
    model = cond_model()
    x, t = torch.randn(6, 1, 28, 28), torch.full((6,), 300)
    y = torch.tensor([0, 1, 2, 7, 8, 9])
    with torch.no_grad():
        cond, uncond = model(x, t, y), model(x, t)
        assert torch.equal(guided(model, y, 1.0, 10)(x, t), cond)
        assert torch.equal(guided(model, y, 0.0, 10)(x, t), uncond)
        for w in (2.0, 3.5):
            calls = []
            counting = lambda *a: calls.append(a[0].shape[0]) or model(*a)  # noqa: E731
            out = guided(counting, y, w, 10)(x, t)
            assert calls == [12]  # one forward of the 2B batch, not two calls
            torch.testing.assert_close(out, uncond + w * (cond - uncond), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler", ["ddim", "ddpm", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun"])
def test_samplers_guide_every_class_and_null_sampling_is_the_unconditional_path(sampler):
    model = cond_model(attention=False)  # what is followed is the labels through each sampler: attention costs 4/5
    schedule = make_schedule("linear", 25)  # betas scale by 1000 / T: T = 20 would reach 1
    kw = dict(sampler=sampler, steps=5, seed=4, num_classes=10)
    y = torch.tensor([3, 7, 7, 1])
    plain = sample(model, schedule, (4, 1, 28, 28), **{k: v for k, v in kw.items() if k != "num_classes"})
    null = sample(model, schedule, (4, 1, 28, 28), labels=torch.full((4,), 10), **kw)
    w0 = sample(model, schedule, (4, 1, 28, 28), labels=y, guidance=0.0, **kw)
    assert torch.equal(plain, null) and torch.equal(plain, w0)
    w1 = sample(model, schedule, (4, 1, 28, 28), labels=y, guidance=1.0, **kw)
    w3 = sample(model, schedule, (4, 1, 28, 28), labels=y, guidance=3.0, **kw)
    assert not torch.allclose(w1, plain) and not torch.allclose(w3, w1)
    with pytest.raises(ValueError, match="conditional"):
        sample(model, schedule, (4, 1, 28, 28), labels=y, sampler=sampler, steps=5)


# ------------------------------------------------------------------------------------------------ classes by name
def test_a_wrong_class_name_or_id_is_refused_naming_the_valid_ones():
    cfg = cond_model().cfg
    assert class_index(cfg, "sneaker") == 7 and class_index(cfg, "Ankle boot") == 9 and class_index(cfg, "3") == 3
    with pytest.raises(ConfigError,
                       match=r"'boots' is not one of this model's classes: 0 'T-shirt/top'.*9 'Ankle boot'"):
        class_index(cfg, "boots")
    with pytest.raises(ConfigError, match=r"--class 10 is out of range: this model has classes 0-9"):
        class_index(cfg, "10")
    plain = resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28)).model
    with pytest.raises(ConfigError, match="unconditional"):
        class_index(plain, "sneaker")
    # as the file names spell them (sample_..._ankle-boot_w2...), where one class alone matches
    assert class_index(cfg, "ankle-boot") == 9 and class_index(cfg, "t-shirt-top") == 0
    # what is no name and no id: a clear refusal (a list or a float was a TypeError, True was class 1)
    from fastddpm.config.errors import API

    # numpy/torch bools, a batch of one, text, a complex number
    for bad in (True, 7.0, [1, 2], np.array([1, 2]), torch.tensor([1, 2]), np.True_, torch.tensor(True),
                torch.tensor([2]), np.array([2]), b"2", np.array("2"), bytearray(b"2"), np.complex128(7)):
        with pytest.raises(ConfigError, match=r"one class per call, as a name, an id \(an int\) or 'all'"):
            class_index(cfg, bad, said=API)
    assert class_index(cfg, torch.tensor(7)) == 7 and class_index(cfg, np.int64(7)) == 7
    base = resolve_model_shape(apply_overrides(get_preset("tiny"), {"model.conditional": True}), (1, 1, 28, 28))
    two = resolve_classes(base, np.arange(3), ["Cat", "cat", "?"], "folders").model
    assert class_index(two, "cat") == 1 and class_index(two, "Cat") == 0  # as written first: case tells them apart
    with pytest.raises(ConfigError, match=r"--class 'CAT' matches 2 classes ignoring case \(0 'Cat', 1 'cat'\)"):
        class_index(two, "CAT")
    with pytest.raises(ConfigError, match="is not one of this model's classes"):  # no letters: no file-name spelling
        class_index(two, "!")
    folders = resolve_classes(base, np.arange(3), ["1", "2", "3"], "folders").model
    with pytest.raises(ConfigError, match=r"--class -1 is out of range"):  # a number, not the spelling of "1"
        class_index(folders, "-1")


def test_an_int_class_is_an_id_and_a_string_names_a_folder_first():
    """Class folders 1/, 2/, 3/ are ids 0, 1, 2: the string "2" is the folder named 2 (id 1), the int 2 (or a numpy
    integer) is id 2, as fastddpm.load(...).sample(class_=2) means it."""
    cfg = resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, conditional=True))
    m = resolve_classes(cfg, np.arange(3), ["1", "2", "3"], "class folders").model
    assert class_index(m, "2") == 1 and class_index(m, 2) == 2 and class_index(m, np.int64(0)) == 0
    assert class_labels(m, 2, 3)[0].tolist() == [2, 2, 2]
    with pytest.raises(ConfigError, match=r"class id 3 is out of range: this model has classes 0-2"):
        class_index(m, 3)


def test_the_api_refuses_guidance_it_would_ignore_and_bad_batch_sizes():
    """As `fastddpm sample` refuses them: guidance without a class (the null class would be sampled unguided),
    negative guidance, a batch size below 1; all before any sampling."""
    cfg = resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, conditional=True))
    cfg = resolve_classes(cfg, np.arange(10), list(CLASSES), "test labels")
    model = Model(net=UNet(cfg.model).eval(), cfg=cfg, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"guidance=3.0 steers toward a class: give class_"):
        model.sample(2, guidance=3.0)
    with pytest.raises(ConfigError, match=r"guidance=-1.0 must be >= 0"):
        model.sample(2, class_="sneaker", guidance=-1.0)
    with pytest.raises(ConfigError, match=r"batch_size=0 must be at least 1"):
        model.sample(2, class_=1, batch_size=0)
    with pytest.raises(ConfigError, match=r"class_=\[1, 2\]: one class per call"):  # per-image labels: a TypeError
        model.sample(2, class_=[1, 2])
    drawn = model.sample(2, class_=7, guidance=2.0, steps=2, sampler="ddim")
    assert drawn.shape == (2, 1, 28, 28)
    # a numpy or torch scalar is a number; a list of scales is one call each
    for same in (np.float32(2.0), np.int64(2), torch.tensor(2.0)):
        assert np.array_equal(model.sample(2, class_=7, guidance=same, steps=2, sampler="ddim"), drawn)
    for bad in ([1, 2], True, np.True_, torch.tensor(True), torch.tensor([2.0]), np.array([2.0]), "2", b"2",
                np.array("2"), np.array(b"2"), bytearray(b"2"), 2 + 0j, np.complex128(2), torch.tensor(2 + 0j)):
        with pytest.raises(ConfigError, match=r"sample: guidance=.*: one scale, a number"):
            model.sample(2, class_=7, guidance=bad)


def test_data_without_labels_is_refused_with_the_fix(tmp_path, capsys):
    images, _ = _images_and_labels(64)
    src = tmp_path / "nolabels.npz"
    np.savez(src, images=np.repeat(np.repeat(images, 4, axis=2), 4, axis=3)[:, 0])  # (N, 32, 32), no labels
    code = main(["train", "--data", str(src), "--out", str(tmp_path / "r"), "--preset", "tiny", "--conditional",
                 "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--conditional trains on class labels" in err and "has no labels" in err and "drop --conditional" in err


# ------------------------------------------------------------------------------------------------ training
def test_conditional_training_resumes_exactly_and_its_grid_has_a_row_per_class(tmp_path, fmnist_npz):
    cfg = tiny_cond_cfg(fmnist_npz, max_steps=8, log_every=1, checkpoint_every=4)
    full, half = tmp_path / "full", tmp_path / "half"
    train(cfg, out_dir=full, log=quiet)
    train(apply_overrides(cfg, {"train.max_steps": 4}), out_dir=half, log=quiet)
    train(cfg, out_dir=half, resume="latest", log=quiet)
    la = [m["loss"] for m in read_metrics(full / "metrics.jsonl")]
    assert la == [m["loss"] for m in read_metrics(half / "metrics.jsonl")]
    a, b = (load_checkpoint(list_checkpoints(d / "checkpoints")[-1]) for d in (full, half))
    for part in ("model", "ema"):
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)
    assert a["config"]["model"]["num_classes"] == 10
    assert list(a["config"]["model"]["class_names"]) == [str(i) for i in range(10)]  # the .npz has no names
    assert "class_emb.weight" in a["model"]
    from PIL import Image

    grid = Image.open(full / "samples" / "final.png")
    # 10 rows of 1 image (num_sample_images 10 // 10 classes), each 28 px + padding at 4x, and a label strip
    assert grid.height == (2 + 10 * 30) * 4 and grid.width > (2 + 30) * 4


def test_a_checkpoint_from_before_conditional_models_loads_samples_and_resumes(tmp_path, fmnist_npz):
    """A checkpoint whose config has no conditional / num_classes / class_names (what runs wrote before them)."""
    from fastddpm.sampling import load_for_sampling

    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.max_steps": 2, "train.num_sample_images": 2,
                                               "train.sample_steps": 2})
    run = tmp_path / "old"
    train(cfg, out_dir=run, log=quiet)
    path = list_checkpoints(run / "checkpoints")[-1]
    state = load_checkpoint(path)
    for key in ("conditional", "num_classes", "class_names"):
        del state["config"]["model"][key]
    state.pop("format")
    save_checkpoint(run / "checkpoints", int(state["step"]), state, keep=3)
    model, loaded = load_for_sampling(path)
    assert not loaded.model.conditional and model.class_emb is None
    assert main(["sample", "--checkpoint", str(path), "--num-images", "2", "--steps", "2", "--no-progress",
                 "--out", str(tmp_path / "s")]) == 0
    result = train(apply_overrides(cfg, {"train.max_steps": 3}), out_dir=run, resume="latest", log=quiet)
    assert result.step == 3


def test_compiled_conditional_step_matches_eager_and_does_not_recompile(tmp_path, fmnist_npz):
    over = {"train.max_steps": 5, "train.log_every": 1, "train.warmup_images": 1000, "train.checkpoint_every": None}
    eager = tiny_cond_cfg(fmnist_npz, **{k.split(".")[1]: v for k, v in over.items()}, compile="off")
    # one block of each kind, without attention (tiny_cond_cfg's): Inductor's time grows with the kernels, and what
    # this compiles beside tests/test_fast_path.py's step (every kind of block) is the class embedding and label dropout
    eager = apply_overrides(eager, ONE_BLOCK_SEED)
    compiled = apply_overrides(eager, {"train.compile": "on"})
    train(eager, out_dir=tmp_path / "eager", log=quiet)
    train(compiled, out_dir=tmp_path / "compiled", log=quiet)
    le = [m["loss"] for m in read_metrics(tmp_path / "eager" / "metrics.jsonl")]
    mc = read_metrics(tmp_path / "compiled" / "metrics.jsonl")
    np.testing.assert_allclose([m["loss"] for m in mc], le, rtol=1e-4, atol=1e-5)
    assert mc[-1]["recompiles_after_warmup"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_bf16_gpu
def test_cuda_graph_captured_conditional_step_matches_eager(tmp_path, fmnist_npz):
    """On a GPU the whole conditional step (labels in their static buffer, label dropout on the device) is one
    CUDA graph: its losses follow the eager run's, and the grid samples with guidance from the captured run."""
    losses = {}
    for name, graphs in (("eager", "off"), ("graphs", "capture")):
        cfg = tiny_cond_cfg(fmnist_npz, max_steps=8, log_every=1, checkpoint_every=None, device="cuda",
                            precision="bf16", compile="on" if graphs == "capture" else "off", cuda_graphs=graphs)
        cfg = apply_overrides(cfg, {"model.attention": True})  # on a GPU, where it is cheap: captured too
        train(cfg, out_dir=tmp_path / name, log=quiet)
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]
    info = json.loads((tmp_path / "graphs" / "run.json").read_text())
    assert info["cuda_graphs_used"], info["cuda_graphs_failure"]
    np.testing.assert_allclose(losses["graphs"], losses["eager"], rtol=2e-2)
    assert (tmp_path / "graphs" / "samples" / "final.png").is_file()


# ------------------------------------------------------------------------------------------------ the CLI
def test_sample_a_class_by_name_and_all_classes_in_rows(tmp_path, fmnist_npz, capsys):
    run = tmp_path / "run"
    train(tiny_cond_cfg(fmnist_npz, max_steps=2), out_dir=run, log=quiet)
    args = ["sample", "--checkpoint", str(run), "--steps", "2", "--no-progress", "--out", str(tmp_path / "s")]
    assert main([*args, "--class", "7", "--guidance", "4", "--num-images", "3"]) == 0  # the default sampler: SDE
    z = np.load(tmp_path / "s" / "dpmpp-2m-sde2_n3_seed0_7_w4_step2.npz")
    assert z["images"].shape == (3, 1, 28, 28) and z["labels"].tolist() == [7, 7, 7] and float(z["guidance"]) == 4
    assert main([*args, "--class", "all", "--num-images", "20"]) == 0  # W: the run's train.sample_guidance (2)
    z = np.load(tmp_path / "s" / "dpmpp-2m-sde2_n20_seed0_all_w2_step2.npz")
    assert z["labels"].tolist() == [c for c in range(10) for _ in range(2)] and float(z["guidance"]) == 2
    capsys.readouterr()
    assert main([*args, "--class", "boots"]) == 2
    assert "is not one of this model's classes" in capsys.readouterr().err
    assert main([*args, "--guidance", "3"]) == 2
    assert "--guidance steers toward a class" in capsys.readouterr().err


def test_a_class_has_one_spelling_in_file_names():
    from fastddpm.cli import class_tag
    from fastddpm.config import ModelConfig

    names = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
    m = ModelConfig(conditional=True, num_classes=10, class_names=names)
    assert {class_tag(m, c) for c in ("7", "sneaker", " Sneaker ")} == {"sneaker"}
    assert class_tag(m, "0") == class_tag(m, "t-shirt/top") == "t-shirt-top"
    assert class_tag(m, "Ankle boot") == "ankle-boot" and class_tag(m, "ALL") == "all"
    unnamed = ModelConfig(conditional=True, num_classes=3, class_names=("猫", "犬", "鳥"))
    assert class_tag(unnamed, "1") == class_tag(unnamed, "犬") == "1"  # no letter to keep: the id
    with pytest.raises(ConfigError, match="not one of this model's classes"):
        class_tag(m, "boots")
    # names of one spelling in a file name keep their ids, so that neither class's files replace the other's
    alike = ModelConfig(conditional=True, num_classes=3, class_names=("Cat", "cat!", "dog"))
    assert [class_tag(alike, str(i)) for i in range(3)] == ["cat-0", "cat-1", "dog"]
    # and that spelling names the class again (the file's name was refused as --class)
    assert [class_index(alike, t) for t in ("cat-0", "cat-1", "Cat", "cat!")] == [0, 1, 0, 1]
    for other in ("dog-2", "cat-2", "cat-7"):  # a tag only where two names spell alike, with one of their ids
        with pytest.raises(ConfigError, match="not one of this model's classes"):
            class_index(alike, other)


def test_auto_picks_unipc_where_a_flow_model_is_guided_and_heun_where_not(tmp_path, fmnist_splits, capsys):
    """`sample`, `eval`, the API and the grids resolve `auto` by the guidance the samples are drawn at: UniPC for a
    conditional flow model guided at W > 1, Heun for the same model at W = 1 or without --class. (Without
    attention, most of the U-Net's CPU time at 28x28: the test is about the samplers picked.)"""
    import fastddpm

    run = tmp_path / "run"
    train(apply_overrides(tiny_cond_cfg(fmnist_splits, max_steps=2), {"diffusion.objective": "flow",
                                                                      "model.attention": False}),
          out_dir=run, log=quiet)
    assert json.loads((run / "run.json").read_text())["grid_sampling"] == ["unipc", 2]  # at the run's W = 2
    out = tmp_path / "s"
    args = ["sample", "--checkpoint", str(run), "--no-progress", "--out", str(out)]
    assert main([*args, "--class", "all", "--num-images", "10"]) == 0
    assert main([*args, "--class", "3", "--guidance", "1", "--num-images", "2"]) == 0
    assert main([*args, "--num-images", "2"]) == 0
    assert sorted(p.name for p in out.glob("*.npz")) == ["heun10_n2_seed0_3_w1_step2.npz", "heun10_n2_seed0_step2.npz",
                                                         "unipc10_n10_seed0_all_w2_step2.npz"]
    capsys.readouterr()
    # one sampler for every scale of a trade-off table: the guided one where any scale guides
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "20", "--no-progress", "--guidance", "1,2"]) == 0
    assert [p.name for p in (run / "eval").glob("eval_*.json")] == ["eval_unipc10_n20_seed0_w1-2_step2.json"]
    metrics = fastddpm.evaluate(run, num_samples=20, device="cpu", log=quiet)  # at the run's W, as `eval`
    assert metrics["guidance"] == 2.0
    assert (metrics["sampling"]["sampler"], metrics["sampling"]["steps"]) == ("unipc", 10)
    with pytest.raises(ConfigError, match=r"guidance=\[1, 2\]: one scale, a number; for several, call once"):
        fastddpm.evaluate(run, num_samples=20, device="cpu", guidance=[1, 2], log=quiet)  # a TypeError before
    model = fastddpm.load(run, device="cpu")
    guided, plain = model.sample(2, class_=1), model.sample(2, class_=1, guidance=1.0)
    assert guided.shape == plain.shape == (2, 1, 28, 28)
    assert np.array_equal(guided, model.sample(2, class_=1, sampler="unipc", steps=10))
    assert np.array_equal(plain, model.sample(2, class_=1, guidance=1.0, sampler="heun", steps=10))


# ------------------------------------------------------------------------------------------------ evaluation
def test_per_class_fid_notes_name_the_side_that_is_short():
    from fastddpm.eval.cli import per_class_fid_notes

    names = ("cat", "dog", "bird")
    assert per_class_fid_notes(3 * 129, [500, 500, 500], 128, names) == []
    samples_short, = per_class_fid_notes(30, [500, 500, 500], 128, names)
    assert "from 10 samples a class" in samples_short and "--num-samples 387 or more" in samples_short
    # a class with few training images: more samples cannot fix it; one image gets no per-class FID at all
    real_short, = per_class_fid_notes(3 * 129, [500, 40, 1], 128, names)
    assert "1 class(es)" in real_short and "dog (40)" in real_short and "cat" not in real_short
    assert "at any --num-samples" in real_short
    assert len(per_class_fid_notes(30, [500, 40, 500], 128, names)) == 2


def test_eval_reports_class_accuracy_and_per_class_fid_per_guidance_scale(tmp_path, fmnist_splits, capsys):
    """`fastddpm eval --guidance 0,1,3` on a conditional checkpoint: one row per scale with FID, precision/recall,
    class accuracy by the dataset's classifier and per-class FID; --guidance on an unconditional model refused."""
    run = tmp_path / "run"
    train(tiny_cond_cfg(fmnist_splits, max_steps=3, sample_guidance=3.0), out_dir=run, log=quiet)
    args = ["eval", "--checkpoint", str(run), "--num-samples", "20", "--steps", "2", "--no-progress"]
    assert main([*args, "--guidance", "0,1,3"]) == 0
    out = capsys.readouterr().out
    assert "| guidance W | class accuracy | FID |" in out and "classifier" in out
    # 2 samples a class in 128-d features: the per-class FIDs are said to be unstable, with the count that is not
    assert "per-class FID from 2 samples a class" in out and "--num-samples 1,290 or more" in out
    assert "weak feature network" not in out  # 2,000 real images: 87%
    result = json.loads(next((run / "eval").glob("eval_dpmpp-2m-sde2_n20_seed0_w0-1-3_step3.json")).read_text())
    rows = result["guidance"]
    assert [r["guidance"] for r in rows] == [0.0, 1.0, 3.0]
    for r in rows:
        assert 0.0 <= r["class_accuracy"] <= 1.0 and r["fid"] > 0
        assert set(r["per_class_fid"]) == {str(i) for i in range(10)}
        assert set(r["class_accuracy_by_class"]) == {str(i) for i in range(10)}
    # the top-level numbers and the grid are the model's own scale's (3, what `fastddpm sample` draws at), not the
    # first listed (0: unconditional samples), and say so
    assert result["fid"] == rows[2]["fid"] != rows[0]["fid"] and result["headline_guidance"] == 3.0
    assert "(top-level numbers and grid: guidance 3)" in out
    plain = tmp_path / "plain"
    train(apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_splits), "train.progress": False,
                                               "train.max_steps": 1, "train.num_sample_images": 2,
                                               "train.sample_steps": 2}), out_dir=plain, log=quiet)
    assert main(["eval", "--checkpoint", str(plain), "--num-samples", "20", "--steps", "2", "--no-progress",
                 "--guidance", "2"]) == 2
    assert "--guidance needs a conditional model" in capsys.readouterr().err


def test_row_labels_with_accented_letters_are_drawn_not_boxes():
    """Pillow's default font has no accented letters: a class named "Ünïcode" was written as "□n□code"."""
    from fastddpm.grid import label_rows

    grid = np.zeros((30, 30, 3), dtype=np.uint8)

    def strip(text):
        return label_rows(grid, [text], row_pitch=30, first_row=0)

    assert not np.array_equal(strip("Ü"), strip("\uffff"))  # U+FFFF: no font has it, the missing-glyph box
    assert not np.array_equal(strip("ï"), strip("\uffff"))


def test_a_model_trained_without_label_dropout_draws_only_classes_at_guidance_1(tmp_path, fmnist_splits, capsys):
    """cond_drop_prob 0 leaves the null class untrained: guided (W != 1) and class-free samples drew from it without
    a word. Training asks for --sample-guidance 1; sample, eval and the API refuse the draws that would read it."""
    import fastddpm

    run = tmp_path / "run"
    base = ["train", "--data", str(fmnist_splits), "--out", str(run), "--preset", "tiny", "--conditional",
            "--cond-drop-prob", "0", "--max-steps", "1", "--no-progress", "--num-sample-images", "10",
            "--sample-steps", "2"]
    assert main(base) == 2
    assert "--cond-drop-prob 0 trains no unconditional prediction" in capsys.readouterr().err
    assert not run.exists()
    assert main([*base, "--sample-guidance", "1"]) == 0
    capsys.readouterr()  # a resume (of a run trained so before the refusal) goes on, told
    assert main([*base, "--sample-guidance", "2", "--resume", "latest", "--max-steps", "2"]) == 0
    assert "so they draw from an untrained embedding; resume with --sample-guidance 1" in capsys.readouterr().out
    assert main([*base, "--sample-guidance", "1", "--resume", "latest", "--max-steps", "3"]) == 0
    args = ["sample", "--checkpoint", str(run), "--num-images", "2", "--steps", "2", "--no-progress"]
    assert main([*args, "--class", "1"]) == 0  # the run's own W = 1
    for extra, says in ((["--class", "1", "--guidance", "2"], "guidance W = 2: this model was trained with "
                                                              "cond_drop_prob 0"),
                        ([], "samples without a class: this model was trained with cond_drop_prob 0")):
        capsys.readouterr()
        assert main([*args, *extra]) == 2
        assert says in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "10", "--guidance", "1,0", "--no-progress"]) == 2
    assert "guidance W = 0: this model was trained with cond_drop_prob 0" in capsys.readouterr().err
    model = fastddpm.load(run, device="cpu")
    assert model.sample(2, class_=1, steps=2).shape == (2, 1, 28, 28)
    with pytest.raises(ConfigError, match=r"draw a class_ at guidance=1 \(train with cond_drop_prob 0.1"):
        model.sample(2, class_=1, guidance=3.0, steps=2)


def test_guidance_on_an_unconditional_model_is_said_to_be_the_model_s_not_the_missing_class(tmp_path, fmnist_splits,
                                                                                            capsys):
    run = tmp_path / "plain"
    assert main(["train", "--data", str(fmnist_splits), "--out", str(run), "--preset", "tiny", "--max-steps", "1",
                 "--no-progress", "--num-sample-images", "4", "--sample-steps", "2"]) == 0
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(run), "--guidance", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err  # it said to give --class, which was then refused as unconditional
    assert "--guidance 2 steers toward a class; this model is unconditional" in err and "--class" not in err
