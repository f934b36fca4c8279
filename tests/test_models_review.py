"""The U-Nets' inputs a user may pass that the samplers never do (a conditional model's labels checked by the model
itself, a timestep for the whole batch), and --init-from a diffusers folder whose weights are the older .bin."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY_DDPM
from fastddpm.config import ConfigError, DiffusionConfig, ModelConfig, RunConfig, get_preset, resolve_model_shape
from fastddpm.models import build_unet


def _conditional(family: str) -> ModelConfig:
    if family == "seed":
        cfg = resolve_model_shape(get_preset("tiny"), (4, 1, 8, 8)).model
    else:
        cfg = ModelConfig(**{k.split(".", 1)[1]: v for k, v in TINY_DDPM.items()}, image_channels=1, image_size=16)
    return dataclasses.replace(cfg, conditional=True, num_classes=3, class_names=("a", "b", "c"))


@pytest.mark.parametrize("family", ["seed", "ddpm"])
def test_a_conditional_models_bad_labels_are_refused_naming_the_label(family):
    """An id past the embedding table (or below 0) was torch's IndexError 'index out of range in self', a (B, 1)
    label tensor a broadcasting error deep in a ResBlock; the model names the label and the valid ids instead.
    The null class (id num_classes) and no labels at all are both the unconditional prediction."""
    cfg = _conditional(family)
    torch.manual_seed(0)
    model = build_unet(cfg).eval()
    x, t = torch.randn(2, 1, cfg.image_size, cfg.image_size), torch.tensor([3, 700])
    with torch.no_grad():
        for bad in (torch.tensor([4, 0]), torch.tensor([0, -1])):
            with pytest.raises(ValueError, match=rf"class label {int(bad[bad != 0][0])} is out of range: this model "
                                                 r"has classes 0-2 and 3 for its null class"):
                model(x, t, bad)
        with pytest.raises(ValueError, match=r"class labels of shape \(2, 1\) for a batch of 2"):
            model(x, t, torch.tensor([[1], [0]]))
        with pytest.raises(ValueError, match="integer tensor of class ids, got torch.float32"):
            model(x, t, torch.tensor([1.0, 0.0]))
        assert torch.equal(model(x, t, torch.tensor([3, 3])), model(x, t))  # the null class is the default
        assert model(x, t, torch.tensor([0, 2], dtype=torch.int32)).shape == x.shape
        # one timestep for the batch, as (1,), with a label per image: broadcast, as before the checks
        assert torch.allclose(model(x, torch.tensor([5]), torch.tensor([0, 1])),
                              model(x, torch.tensor([5, 5]), torch.tensor([0, 1])), atol=1e-6)


@pytest.mark.parametrize("family", ["seed", "ddpm"])
def test_one_timestep_for_the_whole_batch_is_the_same_as_one_per_image(family):
    """A 0-dim timestep (diffusers' scheduler.timesteps yields them; UNet2DModel takes them) was IndexError 'too many
    indices for tensor of dimension 0'; it is that timestep for every image, integer or a continuous noise level."""
    cfg = dataclasses.replace(_conditional(family), conditional=False, num_classes=0, class_names=())
    torch.manual_seed(0)
    model = build_unet(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # the ddpm family's zero output layer would make every output 0
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(3, 1, cfg.image_size, cfg.image_size)
    with torch.no_grad():
        for t in (torch.tensor(517), torch.tensor(-212.5)):  # DDPM's step; EDM's 250 ln(sigma) is negative below 1
            assert torch.equal(model(x, t), model(x, t.expand(3)))


# --- --init-from a folder with diffusion_pytorch_model.bin only ------------------------------------------------------


def _run_config() -> RunConfig:
    over = {k.split(".", 1)[1]: v for k, v in TINY_DDPM.items()}
    return RunConfig(model=ModelConfig(**over, image_channels=3, image_size=32), diffusion=DiffusionConfig())


def test_init_from_a_folder_with_only_bin_weights_loads_them_as_diffusers_does(tmp_path):
    """diffusers wrote diffusion_pytorch_model.bin before safetensors became save_pretrained's default, and reads it
    still; --init-from refused such a folder ('no diffusers UNet2DModel there'). It reads it with
    torch.load(weights_only=True), and the model then computes diffusers' function."""
    diffusers = pytest.importorskip("diffusers")
    from fastddpm.config.diffusers_unet import folder_fields
    from fastddpm.diffusers_io import load_init, write_folder

    cfg = _run_config()
    torch.manual_seed(0)
    source = build_unet(cfg.model)
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    write_folder(source, cfg, tmp_path / "export")
    unet = diffusers.UNet2DModel.from_pretrained(str(tmp_path / "export" / "unet")).eval()
    unet.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["config.json", "diffusion_pytorch_model.bin"]

    assert folder_fields(tmp_path / "bin")["model.base_channels"] == 16
    model = build_unet(cfg.model).eval()
    assert "init: weights of the diffusers UNet2DModel" in load_init(model, cfg, tmp_path / "bin")
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 3, 32, 32, generator=g), torch.tensor([5, 900])
    with torch.no_grad():
        want = unet(x, t).sample
        assert want.abs().max() > 0.1
        assert float((model(x, t) - want).abs().max() / want.abs().max()) < 1e-5


class _Payload:
    """A pickled object whose unpickling would run code: torch.load(weights_only=True) refuses it."""

    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_a_bin_that_carries_code_or_is_a_git_lfs_pointer_is_refused_naming_the_file(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from fastddpm.diffusers_io import load_init, write_folder

    cfg = _run_config()
    model = build_unet(cfg.model)
    write_folder(model, cfg, tmp_path / "export")
    unet = tmp_path / "export" / "unet"
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    torch.save({"conv_in.weight": _Payload()}, unet / "diffusion_pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"diffusion_pytorch_model\.bin: cannot read the weights .*weights_only=True"):
        load_init(model, cfg, tmp_path / "export")
    assert "code ran" not in capsys.readouterr().out
    (unet / "diffusion_pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\n")
    with pytest.raises(ConfigError, match="git-lfs pointer, not the weights: run `git lfs pull`"):
        load_init(model, cfg, tmp_path / "export")


# --- a conditional diffusers folder and the run's data ----------------------------------------------------------------


@pytest.fixture
def conditional_folder(tmp_path):
    """A fastddpm export of a model conditional on 3 classes (num_class_embeds 4: the last, the null class)."""
    pytest.importorskip("diffusers")
    from fastddpm.diffusers_io import write_folder

    cfg = _run_config()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, conditional=True, num_classes=3,
                                                             class_names=("a", "b", "c")))
    write_folder(build_unet(cfg.model), cfg, tmp_path / "cond")
    return tmp_path / "cond"


def _train_from(folder, tmp_path, name, labels) -> int:
    import numpy as np

    from fastddpm.cli import main

    images = np.random.default_rng(0).integers(0, 255, (16, 3, 32, 32)).astype(np.uint8)
    data = tmp_path / f"{name}.npz"
    np.savez(data, images=images, **({} if labels is None else {"labels": labels}))
    return main(["train", "--data", str(data), "--out", str(tmp_path / name), "--preset", "tiny", "--init-from",
                 str(folder), "--max-steps", "1", "--no-progress"])


def test_a_conditional_folders_classes_against_the_data_name_the_folder_and_the_counts(conditional_folder, tmp_path,
                                                                                      capsys):
    """--init-from a class-conditional folder makes the run conditional without --conditional: unlabelled data was
    told to 'drop --conditional', a flag never given, and data of another number of classes to 'leave the model
    options out of the command line', none given either. The messages name the folder and the class counts."""
    import numpy as np

    assert _train_from(conditional_folder, tmp_path, "unlabelled", None) == 2
    err = capsys.readouterr().err
    assert f"here --init-from {conditional_folder} made it conditional: its UNet2DModel has a class embedding" in err
    assert _train_from(conditional_folder, tmp_path, "five", np.arange(16) % 5) == 2
    err = capsys.readouterr().err
    assert "num_class_embeds is 4 there and 6 in this run's model" in err
    assert "the folder's model has 3 classes and this run's data 5; train on data of 3 classes" in err
    assert "leave the model options out" not in err
    assert _train_from(conditional_folder, tmp_path, "three", np.arange(16) % 3) == 0


@pytest.mark.parametrize("preset, params", [("tiny", 137_249), ("cpu-demo", 616_129), ("cpu-demo-cond", 616_833)])
def test_the_cpu_presets_have_the_parameter_counts_their_help_gives(preset, params):
    """tiny: '~140k parameters'; cpu-demo: '0.6M'; cpu-demo-cond: the same plus 11 x 64 for Fashion-MNIST's ten classes
    and the null class."""
    cfg = resolve_model_shape(get_preset(preset), (2, 1, 28, 28)).model
    if cfg.conditional:
        cfg = dataclasses.replace(cfg, num_classes=10, class_names=tuple("0123456789"))
    from fastddpm.models import count_parameters

    model = build_unet(cfg)
    assert count_parameters(model) == params
    x = torch.randn(1, 1, 28, 28)  # batch 1
    with torch.no_grad():
        assert model(x, torch.tensor([999])).shape == x.shape
