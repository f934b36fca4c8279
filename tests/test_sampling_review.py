"""`fastddpm sample` as a user runs it: how many images `--class all` draws and how big its grid gets, an --out that
cannot hold the files refused before any sampling, flags that would be ignored refused, a file name for every
choice that changes the images, and what the seed and the batch size decide."""

import dataclasses
import re

import numpy as np
import pytest
from PIL import Image

import fastddpm.sampling as sampling
from fastddpm.cli import main
from fastddpm.config import API, ConfigError, ModelConfig, RunConfig, apply_overrides, get_preset
from fastddpm.sampling import class_labels
from fastddpm.trainer.loop import train


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fmnist_npz):
    """Two runs of the tiny preset, 2 steps each: an unconditional one and a conditional one (10 classes)."""
    root = tmp_path_factory.mktemp("review-runs")
    made = {}
    for name, over in (("plain", {}), ("cond", {"model.conditional": True})):
        cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                                   "train.max_steps": 2, "train.num_sample_images": 2,
                                                   "train.sample_steps": 2, **over})
        train(cfg, out_dir=root / name, log=quiet)
        made[name] = root / name
    return made


def conditional(num_classes: int = 10) -> ModelConfig:
    return dataclasses.replace(ModelConfig(), conditional=True, num_classes=num_classes,
                               class_names=tuple(f"c{i}" for i in range(num_classes)))


# ------------------------------------------------------------------------------------------------- --class all
def test_class_all_with_fewer_images_than_classes_draws_the_images_asked_for():
    """--num-images 3 --class all on 10 classes drew 10 images (one of each class); it draws 3, of classes spread
    over the ids, as the training grid does, and the grid's rows are then not classes."""
    m = conditional(10)
    labels, per_class = class_labels(m, "all", 3)
    assert labels.tolist() == [0, 3, 6] and labels.dtype == np.int64 and per_class is None
    labels, per_class = class_labels(m, "all", 1)
    assert labels.tolist() == [0] and per_class is None
    # at least one image per class: rows of num_images / classes
    labels, per_class = class_labels(m, " All ", 20)
    assert labels.tolist() == [c for c in range(10) for _ in range(2)] and per_class == 2
    assert class_labels(m, "all", 10)[0].tolist() == list(range(10))


def test_class_all_with_a_count_that_is_no_multiple_of_the_classes_is_refused_in_the_cli_and_the_api(runs, capsys):
    """--class all --num-images 13 (Model.sample(13, class_="all")) on 10 classes drew 10 images without a word:
    both refuse it, naming the counts that draw every class alike, before any sampling."""
    import fastddpm

    with pytest.raises(ConfigError, match=r"^class_='all' with n=13: 'all' draws the same number of images of each "
                                          r"of the model's 10 classes.*would draw 10\): give n 10 or 20, or below 10"):
        class_labels(conditional(10), "all", 13, said=API)
    assert main(["sample", "--checkpoint", str(runs["cond"]), "--class", "all", "--num-images", "13",
                 "--no-progress"]) == 2
    assert "--class all with --num-images 13: 'all' draws" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"class_='all' with n=13: .* give n 10 or 20"):
        fastddpm.load(runs["cond"]).sample(13, class_="all")


def test_class_all_on_the_command_line_writes_n_images(runs, tmp_path):
    out = tmp_path / "s"
    assert main(["sample", "--checkpoint", str(runs["cond"]), "--class", "all", "--num-images", "3", "--sampler",
                 "ddim", "--steps", "2", "--no-progress", "--out", str(out)]) == 0
    z = np.load(out / "ddim2_n3_seed0_all_w2_step2.npz")
    assert z["images"].shape == (3, 1, 28, 28) and z["labels"].tolist() == [0, 3, 6]
    assert (out / "ddim2_n3_seed0_all_w2_step2.png").is_file()


def test_a_class_all_grid_keeps_one_row_per_class_but_not_every_image(monkeypatch, tmp_path):
    """--class all --num-images 1000 over 10 classes put all 100 images of a class in its row (and 10,000 of them
    for --num-images 100000: a PNG over a million pixels wide); the rows now hold the first 25 of each class, a grid
    of 250 images like the unconditional one's 256, while the .npz keeps all of them."""
    cfg = RunConfig(model=dataclasses.replace(conditional(10), image_size=8, image_channels=1))
    labels, per_class = class_labels(cfg.model, "all", 1000)
    # each image's pixels are its class, so the grid shows which images it took
    images = np.repeat(labels.astype(np.uint8), 64).reshape(1000, 1, 8, 8) * 20
    monkeypatch.setattr(sampling, "sample_images", lambda *a, **k: images)
    grid = tmp_path / "grid.png"
    got = sampling.sample_to_files(None, cfg, num_images=1000, sampler="ddim", steps=2, eta=0.0, seed=0,
                                   batch_size=256, device="cpu", out_grid=grid, out_npz=tmp_path / "all.npz",
                                   labels=labels, per_class_row=per_class, progress=False)
    assert got.shape == (1000, 1, 8, 8) and np.load(tmp_path / "all.npz")["images"].shape == (1000, 1, 8, 8)
    scale = sampling.grid_scale(8)
    with Image.open(grid) as im:
        width, height = im.size
        pixels = np.asarray(im.convert("L"))
    assert height == (2 + 10 * (8 + 2)) * scale
    cells = 2 + 25 * (8 + 2)  # 25 images a row, after the strip of class names
    assert cells * scale < width < cells * scale + 200
    # row r holds class r: its first image's top-left pixel
    grid_part = pixels[:, width - cells * scale:]
    for r in range(10):
        y = (2 + r * 10) * scale
        assert grid_part[y, 2 * scale] == 20 * r


# ----------------------------------------------------------------------------------------------------- --out
def test_an_out_that_is_a_file_is_refused_before_any_sampling(runs, tmp_path, capsys, monkeypatch):
    """--out naming a file was a FileExistsError traceback from the PNG writer, after every image was drawn."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")

    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled before checking --out")

    monkeypatch.setattr(sampling, "sample_images", no_sampling)
    for out in (taken, taken / "inside"):
        assert main(["sample", "--checkpoint", str(runs["plain"]), "--num-images", "2", "--sampler", "ddim",
                     "--steps", "2", "--no-progress", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        said = "is a file, not a folder" if out == taken else "cannot create the folder"
        assert f"--out {out}: {said}" in err and "give one that can be created" in err
    assert taken.read_text() == "mine"


def test_an_existing_out_folder_is_written_into_and_the_same_command_replaces_its_own_files(runs, tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["sample", "--checkpoint", str(runs["plain"]), "--num-images", "1", "--sampler", "ddim", "--steps", "2",
            "--no-progress", "--out", str(out)]
    assert main(args) == 0 and main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ddim2_n1_seed0_step2.npz", "ddim2_n1_seed0_step2.png", "keep.txt"]


# ------------------------------------------------------------------------------------------- flags and file names
def test_spacing_with_ddpm_is_refused_not_ignored(runs, capsys):
    """DDPM's ancestral sampler walks all T timesteps: --spacing karras was ignored, and the files were named
    ddpm1000-karras all the same."""
    assert main(["sample", "--checkpoint", str(runs["plain"]), "--sampler", "ddpm", "--spacing", "karras",
                 "--num-images", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--spacing karras: --sampler ddpm walks every one of the 1000 timesteps" in err and "drop --spacing" in err


def test_steps_with_ddpm_are_refused_not_ignored(runs, capsys):
    """--sampler ddpm --steps 5 ran all 1000 timesteps and said nothing (the CLI, eval and the API alike)."""
    import fastddpm

    assert main(["sample", "--checkpoint", str(runs["plain"]), "--sampler", "ddpm", "--steps", "5",
                 "--num-images", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--steps 5: --sampler ddpm walks every one of the 1000 timesteps" in err and "drop --steps" in err
    with pytest.raises(ConfigError, match="steps=5: sampler='ddpm' walks every one"):
        fastddpm.load(runs["plain"], device="cpu").sample(1, sampler="ddpm", steps=5)


@pytest.mark.parametrize("flags, says", [
    (["--num-images", "0"], "error: --num-images 0: must be >= 1"),
    (["--batch-size", "-2"], "error: --batch-size -2: must be >= 1"),
    (["--num-images", "0", "--batch-size", "0"], "error: --num-images 0 and --batch-size 0: each must be >= 1")])
def test_a_count_below_1_is_named_alone_with_its_value(runs, capsys, flags, says):
    """`--num-images 0` was told "--num-images and --batch-size must be >= 1", naming a flag that was fine."""
    assert main(["sample", "--checkpoint", str(runs["plain"]), *flags, "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == says


def test_a_large_draw_says_what_it_holds_and_how_to_split_it(runs, tmp_path, monkeypatch, capsys):
    import fastddpm.cli as cli

    monkeypatch.setattr(cli, "LARGE_DRAW_GIB", 2 * 784 / 2**30)  # 2 images of 28x28 count as large here
    args = ["sample", "--checkpoint", str(runs["plain"]), "--sampler", "ddim", "--steps", "1", "--no-progress",
            "--out", str(tmp_path / "s")]
    assert main([*args, "--num-images", "1"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert main([*args, "--num-images", "2"]) == 0
    err = capsys.readouterr().err
    assert "note: 2 images are 0.0 GiB of uint8, held in memory" in err and "--first-image K" in err
    # --class all refuses --first-image: such a draw is split by class
    args[2] = str(runs["cond"])
    assert main([*args, "--class", "all", "--num-images", "20"]) == 0
    assert "split it by class (--class NAME" in capsys.readouterr().err


def test_a_bad_device_is_named_as_the_command_or_the_call_gave_it(runs, capsys):
    import fastddpm

    assert main(["sample", "--checkpoint", str(runs["plain"]), "--device", "cdua", "--no-progress"]) == 2
    assert "error: --device cdua is not a device: use auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"fastddpm.load: device='cdua' is not a device"):
        fastddpm.load(runs["plain"], device="cdua")
    # devices torch parses and fastddpm does not run on ended in a RuntimeError traceback
    for device in ("mps", "meta", "xpu"):
        assert main(["sample", "--checkpoint", str(runs["plain"]), "--device", device, "--no-progress"]) == 2
        assert (f"error: --device {device}: fastddpm runs on CUDA GPUs and on the CPU, not on {device} devices"
                in capsys.readouterr().err)
    from fastddpm.device import resolve_device

    with pytest.raises(ConfigError, match=r"train.device='cuda:7', but"):
        resolve_device("cuda:7")  # CUDA is not available here, or has fewer devices


def test_eta_and_the_raw_weights_get_their_own_files(runs, tmp_path):
    """DDIM at eta 0 and eta 1, and the EMA and raw weights, draw different images: they were written to one file
    name, each run replacing the one before."""
    out = tmp_path / "s"
    base = ["sample", "--checkpoint", str(runs["plain"]), "--num-images", "2", "--sampler", "ddim", "--steps", "2",
            "--no-progress", "--out", str(out)]
    # bf16 too: the suite runs as on a CPU without native bf16, where auto picks fp32 (fp32 named: auto's own)
    for extra in ([], ["--eta", "1"], ["--eta", "0.5"], ["--weights", "model"], ["--precision", "bf16"],
                  ["--precision", "fp32"]):
        assert main([*base, *extra]) == 0
    names = sorted(p.name for p in out.glob("*.npz"))
    assert names == ["ddim2-eta0.5_n2_seed0_step2.npz", "ddim2-eta1_n2_seed0_step2.npz", "ddim2_n2_seed0_step2.npz",
                     "ddim2_n2_seed0_step2_bf16.npz", "ddim2_n2_seed0_step2_model.npz"]
    assert not np.array_equal(*(np.load(out / n)["images"] for n in ("ddim2_n2_seed0_step2.npz",
                                                                     "ddim2_n2_seed0_step2_bf16.npz")))
    plain, eta1 = (np.load(out / n)["images"] for n in ("ddim2_n2_seed0_step2.npz", "ddim2-eta1_n2_seed0_step2.npz"))
    assert not np.array_equal(plain, eta1)
    # the Python API takes eta and spacing as the command line does, and draws the same images
    import fastddpm

    model = fastddpm.load(runs["plain"], device="cpu")
    assert np.array_equal(model.sample(2, sampler="ddim", steps=2, eta=1.0), eta1)
    assert main([*base, "--spacing", "karras"]) == 0
    assert np.array_equal(model.sample(2, sampler="ddim", steps=2, spacing="karras"),
                          np.load(out / "ddim2-karras_n2_seed0_step2.npz")["images"])
    with pytest.raises(ConfigError, match="spacing='linear' is not one of trailing, karras, logsnr"):
        model.sample(1, spacing="linear")
    with pytest.raises(ConfigError, match="eta is DDIM's: sampler='heun' is deterministic"):
        model.sample(1, sampler="heun", eta=0.5)


# ------------------------------------------------------------------------------------------ seeds and batches
def test_images_are_a_function_of_the_seed_not_of_the_batch_size_and_the_help_says_so(runs, tmp_path, capsys):
    """Image k draws its noise from (seed, k), the initial x_T and every later draw (DDIM at eta 1 draws at each
    step): one seed gives the same images whatever --batch-size, and a draw of more images begins with those of a
    draw of fewer; another seed gives others; --help says so. Another batch size runs the network on other batch
    shapes, whose float sums may round apart (a pixel level at most, in a few pixels); the same batches match bit
    for bit."""
    def draw(n, batch_size, seed=0):
        out = tmp_path / f"n{n}_b{batch_size}_s{seed}"
        assert main(["sample", "--checkpoint", str(runs["plain"]), "--num-images", str(n), "--sampler", "ddim",
                     "--eta", "1", "--steps", "3", "--batch-size", str(batch_size), "--seed", str(seed),
                     "--no-progress", "--out", str(out)]) == 0
        return np.load(next(out.glob("*.npz")))["images"].astype(int)

    five = draw(5, 2)
    assert np.array_equal(five, draw(5, 2))
    assert np.array_equal(draw(4, 2), five[:4])  # the same batches: bit for bit
    for other in (draw(6, 2)[:5], draw(5, 5), draw(5, 1), draw(7, 3)[:5]):
        assert np.abs(other - five).max() <= 1 and (other != five).mean() < 0.01
    another_seed = draw(5, 2, seed=1)
    assert (another_seed != five).mean() > 0.5
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "image k draws its noise from (seed, k), so --batch-size does not change it" in text
    assert "each image draws its own noise, so another batch size draws the same images" in text


def test_evals_samples_of_a_guided_model_do_not_depend_on_the_batch_size(runs):
    """eval draws sample k (class k % K, guided) from (seed, k) too: its samples, and so its FID, are the same at
    --batch-size 4 and 6 (up to a pixel level where the network's batched sums round apart)."""
    import torch

    from fastddpm.eval.evaluate import sample_uint8

    model, cfg = sampling.load_for_sampling(runs["cond"])
    kw = dict(num_samples=12, sampler="dpmpp-2m-sde", steps=3, eta=0.0, seed=5, device=torch.device("cpu"),
              autocast_dtype=None, guidance=2.0)
    a, _ = sample_uint8(model, cfg, batch_size=4, **kw)
    b, timing = sample_uint8(model, cfg, batch_size=5, **kw)
    assert timing["drawn"] == 15 and a.shape == b.shape == (12, 1, 28, 28)
    diff = (a.int() - b.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
    other, _ = sample_uint8(model, cfg, batch_size=4, **{**kw, "seed": 6})
    assert float((other != a).float().mean()) > 0.5


def test_a_split_draw_of_every_class_is_refused_naming_what_to_do(runs, capsys):
    """--class all lays its classes out over --num-images: ranges drawn with --first-image would not add up to the
    draw whole (image k would get another class), so the pair is refused, in the CLI and the API; one class splits."""
    import fastddpm
    from fastddpm.config import ConfigError

    assert main(["sample", "--checkpoint", str(runs["cond"]), "--class", "all", "--num-images", "10",
                 "--first-image", "10", "--no-progress"]) == 2
    assert "split it by class instead (--class NAME" in capsys.readouterr().err
    model = fastddpm.load(runs["cond"])
    with pytest.raises(ConfigError, match="first_image=10 with class_='all'"):
        model.sample(10, first_image=10, class_="all")
    one_class = model.sample(3, steps=2, first_image=2, class_=1)
    assert one_class.shape == (3, 1, 28, 28)


@pytest.mark.parametrize("kwargs, api_says, cli_flags, cli_says", [
    (dict(sampler="dpmpp-2m", eta=0.5), "eta is DDIM's: sampler='dpmpp-2m' is deterministic (use sampler='ddim' "
     "for eta)", ["--sampler", "dpmpp-2m", "--eta", "0.5"], "(use --sampler ddim for --eta)"),
    (dict(sampler="ddim", steps=0), "steps=0 must be between 1 and", ["--sampler", "ddim", "--steps", "0"],
     "--steps 0 must be between 1 and"),
    (dict(class_=3), "class_=3: this model is unconditional", ["--class", "3"], "--class 3: this model is uncond"),
])
def test_errors_name_the_arguments_as_the_caller_spelt_them(runs, capsys, kwargs, api_says, cli_flags, cli_says):
    """The same mistake is told in the API's parameter names to a Python caller (`steps=5`, `class_=3`) and in
    flags to a command's user: a Python user has no `--steps` to change."""
    import fastddpm

    model = fastddpm.load(runs["plain"])
    with pytest.raises(ConfigError) as caught:
        model.sample(2, **kwargs)
    assert api_says in str(caught.value) and "--" not in str(caught.value).replace("--conditional", "")
    assert main(["sample", "--checkpoint", str(runs["plain"]), "--no-progress", *cli_flags]) == 2
    assert cli_says in capsys.readouterr().err


def test_an_unknown_sampler_in_the_api_is_a_config_error_naming_the_choices(runs):
    import fastddpm

    with pytest.raises(ConfigError, match="sampler='dpm' is not one of auto, ddpm, ddim, euler"):
        fastddpm.load(runs["plain"]).sample(2, sampler="dpm")
    with pytest.raises(ConfigError, match="sampler='dpm' is not one of"):
        fastddpm.evaluate(runs["plain"], num_samples=10, sampler="dpm")


def test_the_samples_of_two_checkpoints_of_one_run_get_their_own_files(tmp_path, fmnist_npz):
    """Both write into the run's samples folder by default: the checkpoint's step in the name keeps the earlier
    one's images (they had been overwritten), as eval's names do."""
    from fastddpm.rundir.checkpoint import list_checkpoints

    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.max_steps": 2, "train.checkpoint_every": 1,
                                               "train.num_sample_images": 2, "train.sample_steps": 2})
    run = tmp_path / "run"
    train(cfg, out_dir=run, log=quiet)
    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == ["ckpt_000000001.pt", "ckpt_000000002.pt"]
    for ckpt in ckpts:
        assert main(["sample", "--checkpoint", str(ckpt), "--num-images", "1", "--sampler", "ddim", "--steps", "2",
                     "--no-progress"]) == 0
    names = sorted(p.name for p in (run / "samples").glob("ddim2_*.npz"))
    assert names == ["ddim2_n1_seed0_step1.npz", "ddim2_n1_seed0_step2.npz"]


def test_the_default_step_count_fits_a_short_schedule_and_an_explicit_one_is_told_its_limit():
    """A 15-timestep cosine model could not be sampled without --steps: the default 20 was refused as "--steps 20
    must be between 1 and 15", and --steps 15 then as "takes at most 14"."""
    from fastddpm.config import ConfigError, apply_overrides, get_preset
    from fastddpm.sampling import resolve_sampler_args

    cfg = apply_overrides(get_preset("tiny"), {"diffusion.num_timesteps": 15, "diffusion.schedule": "cosine"})
    assert resolve_sampler_args(cfg, "auto", None) == ("dpmpp-2m-sde", 14)
    assert resolve_sampler_args(cfg, "ddim", None) == ("ddim", 15)
    assert resolve_sampler_args(cfg, "dpmpp-2m", 5) == ("dpmpp-2m", 5)
    for sampler, steps, says in (("dpmpp-2m-sde", 20, "--steps 20: --sampler dpmpp-2m-sde takes at most 14 steps"),
                                 ("unipc", 15, "--steps 15: --sampler unipc takes at most 14 steps"),
                                 ("ddim", 20, "--steps 20 must be between 1 and 15, the model's timesteps")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            resolve_sampler_args(cfg, sampler, steps)


def test_a_conditional_model_sampled_without_a_class_says_its_images_are_unconditional(runs, tmp_path, capsys):
    """`fastddpm sample` of a class-conditional run without --class drew its null class (unconditional images) with
    no word, where its grids show rows of classes. It still draws them, legitimate for a classifier-free model,
    and says so in one line naming --class and the guidance it would draw at; Model.sample warns the same."""
    import warnings

    import fastddpm

    base = ["--num-images", "2", "--sampler", "ddim", "--steps", "2", "--no-progress", "--out"]
    assert main(["sample", "--checkpoint", str(runs["cond"]), *base, str(tmp_path)]) == 0
    note = ("note: no --class: these images are unconditional (the model's null class, unguided); --class NAME|ID|all "
            "draws its 10 classes with guidance at W = 2, the run's sample_guidance")
    assert note in capsys.readouterr().err.splitlines()
    assert (tmp_path / "ddim2_n2_seed0_step2.npz").is_file()  # drawn all the same
    for run, flags in ((runs["cond"], ["--class", "3"]), (runs["plain"], [])):  # a class asked for, or no classes
        assert main(["sample", "--checkpoint", str(run), *flags, *base, str(tmp_path / "others")]) == 0
        assert "unconditional" not in capsys.readouterr().err
    model = fastddpm.load(runs["cond"])
    with pytest.warns(UserWarning, match=r"^sample: no class_: these images are unconditional \(the model's null "
                                         r"class, unguided\); class_ \(a name, an id or 'all'\) draws its 10 classes "
                                         r"with guidance at W = 2"):
        unconditional = model.sample(2, sampler="ddim", steps=2)
    assert np.array_equal(unconditional, np.load(tmp_path / "ddim2_n2_seed0_step2.npz")["images"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.sample(1, sampler="ddim", steps=2, class_=3)
        fastddpm.load(runs["plain"]).sample(1, sampler="ddim", steps=2)
