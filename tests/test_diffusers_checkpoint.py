"""A diffusers folder (a DDPMPipeline's, or a UNet2DModel's alone) given where fastddpm takes a checkpoint: sampled
with fastddpm's samplers, loaded by fastddpm.load computing diffusers' function, evaluated against --data, and
refused by name where it cannot be used (a resume, raw weights, a class-conditional model, eval without data)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from eval_fixtures import fmnist_splits  # noqa: F401  (a fixture)
from fastddpm.cli import main

diffusers = pytest.importorskip("diffusers")

# 28x28 grey, as Fashion-MNIST: one attention level, diffusers' UNet2DModel defaults otherwise (flip_sin_to_cos
# True, freq_shift 0, heads of attention_head_dim 8), as diffusers' train_unconditional.py builds its models
UNET = dict(sample_size=28, in_channels=1, out_channels=1, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8)


def _unet(seed: int = 0, **over):
    torch.manual_seed(seed)
    unet = diffusers.UNet2DModel(**{**UNET, **over})
    with torch.no_grad():  # every weight random: diffusers zero-initialises none, but a mapping error must show
        for p in unet.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return unet.eval()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A DDPMPipeline folder, cosine schedule predicting v, as diffusers' save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("diffusers") / "pipeline"
    unet = _unet()
    scheduler = diffusers.DDPMScheduler(beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction")
    diffusers.DDPMPipeline(unet=unet, scheduler=scheduler).save_pretrained(str(folder))
    return folder, unet


def _relative_error(net, unet, channels: int = 1, size: int = 28) -> float:
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(3, channels, size, size, generator=g), torch.tensor([0, 517, 999])
    with torch.no_grad():
        want, got = unet(x, t).sample, net(x, t)
    assert want.abs().max() > 0.1  # not two zeros compared
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("flip", [True, False])
def test_fastddpm_load_of_a_diffusers_folder_computes_its_function_and_reads_its_schedule(tmp_path, flip):
    """diffusers' default time embedding is [cos, sin] (flip_sin_to_cos), fastddpm's [sin, cos]: the weights'
    renaming reorders the first time layer's inputs, and the two networks agree either way."""
    import fastddpm

    unet = _unet(seed=2, flip_sin_to_cos=flip)
    scheduler = diffusers.DDPMScheduler(beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction")
    diffusers.DDPMPipeline(unet=unet, scheduler=scheduler).save_pretrained(str(tmp_path / "p"))
    model = fastddpm.load(tmp_path / "p", device="cpu")
    assert _relative_error(model.net, unet) < 1e-5
    d = model.cfg.diffusion
    assert (d.schedule, d.prediction, d.num_timesteps) == ("cosine", "v", 1000)
    assert model.cfg.model.family == "ddpm" and model.cfg.preset is None


def test_init_from_a_folder_with_diffusers_default_embedding_order_starts_a_run_computing_its_function(tmp_path):
    """`train --init-from` reads the same table: a UNet2DModel with flip_sin_to_cos (diffusers' default, refused
    before) gives a run its architecture and weights, the run's network computing diffusers' function."""
    from fastddpm.config import resolve_config
    from fastddpm.diffusers_io import load_init
    from fastddpm.models import build_unet

    unet = _unet(seed=4)
    unet.save_pretrained(str(tmp_path / "u"))
    cfg = resolve_config("tiny", layers=[("test", {"train.init_from": str(tmp_path / "u"),
                                                   "model.image_size": 28, "model.image_channels": 1})])
    net = build_unet(cfg.model).eval()
    load_init(net, cfg, tmp_path / "u")
    assert _relative_error(net, unet) < 1e-5


def test_the_time_embeddings_order_matters_so_the_check_above_can_fail(tmp_path):
    """The same weights read without the reordering compute another function: the test above can fail."""
    from fastddpm.config import from_dict
    from fastddpm.models import build_unet
    from fastddpm.models.diffusers_names import from_diffusers_state_dict
    from fastddpm.rundir.diffusers_folder import diffusers_meta

    unet = _unet(seed=2)
    unet.save_pretrained(str(tmp_path / "u"))
    with pytest.warns(UserWarning, match="no scheduler/scheduler_config.json"):
        meta = diffusers_meta(tmp_path / "u", "--checkpoint")
    net = build_unet(from_dict(meta["config"]).model).eval()
    net.load_state_dict(from_diffusers_state_dict(net, unet.state_dict(), flip_sin_to_cos=False))
    assert _relative_error(net, unet) > 1e-3


def test_fastddpm_sample_draws_a_diffusers_pipeline_with_its_few_step_samplers(pipeline, tmp_path):
    folder, _ = pipeline
    out = tmp_path / "grid.png"
    assert main(["sample", "--checkpoint", str(folder), "--sampler", "unipc", "--steps", "3", "--num-images", "4",
                 "--out", str(out)]) == 0
    images = np.load(tmp_path / "grid.npz")["images"]
    assert images.shape == (4, 1, 28, 28) and images.dtype == np.uint8 and images.std() > 0
    assert out.stat().st_size > 100


def test_an_export_of_a_diffusers_folder_says_its_training_was_not_recorded(pipeline, tmp_path):
    folder, _ = pipeline
    out = tmp_path / "export"
    assert main(["export", str(folder), "--format", "safetensors", "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "- trained on: `(not recorded: a diffusers folder)` (1x28x28 images)" in card
    assert "- images seen: not recorded (weights read from a diffusers folder); weights: EMA" in card
    assert "step None" not in card


def test_a_unet_folder_alone_takes_ddpm_schedulers_defaults_and_says_so(pipeline, capsys):
    folder, unet = pipeline
    import fastddpm

    with pytest.warns(UserWarning, match="DDPMScheduler's default: linear betas over 1000 steps"):
        model = fastddpm.load(folder / "unet", device="cpu")
    from fastddpm.diffusion import schedule_from_config

    d = model.cfg.diffusion
    assert (d.schedule, d.prediction) == ("linear", "epsilon")
    ours = schedule_from_config(d).betas.double()
    assert torch.allclose(ours, diffusers.DDPMScheduler().betas.double(), atol=1e-7)
    assert _relative_error(model.net, unet) < 1e-5


def test_fastddpm_eval_scores_a_diffusers_folder_against_the_data_it_is_given(pipeline, fmnist_splits, tmp_path,
                                                                              capsys):
    folder, _ = pipeline
    assert main(["eval", "--checkpoint", str(folder), "--num-samples", "20"]) == 2
    assert "is a diffusers folder, which records no dataset: pass --data SOURCE" in capsys.readouterr().err
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(folder), "--data", str(fmnist_splits), "--num-samples", "40",
                 "--sampler", "ddim", "--steps", "2", "--out", str(out)]) == 0
    results = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert len(results) == 1 and np.isfinite(results[0]["fid"]) and results[0]["fid"] > 0
    assert results[0]["checkpoint"]["file"] == str(folder.absolute())


def test_fastddpm_evaluate_of_a_diffusers_folder_needs_data_and_says_nothing_of_other_data(pipeline,
                                                                                          fmnist_splits):
    """As `fastddpm eval`: data= is the data the model learned (the folder records none), so no UserWarning says
    the reference images are not the run's."""
    import warnings

    import fastddpm
    from fastddpm.config import ConfigError

    folder, _ = pipeline
    with pytest.raises(ConfigError, match=r"^evaluate: .* is a diffusers folder, which records no dataset: pass "
                                          r"data=SOURCE"):
        fastddpm.evaluate(folder, num_samples=20, device="cpu", log=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a note about other data would be a UserWarning
        metrics = fastddpm.evaluate(folder, data=str(fmnist_splits), num_samples=40, sampler="ddim", steps=2,
                                    device="cpu", log=None)
    assert np.isfinite(metrics["fid"]) and metrics["fid"] > 0


def test_what_a_diffusers_folder_cannot_be_is_refused_by_name(pipeline, tmp_path, capsys):
    folder, _ = pipeline
    assert main(["sample", "--checkpoint", str(folder), "--weights", "model", "--num-images", "4",
                 "--out", str(tmp_path / "g.png")]) == 2
    assert "holds one weight set (served as the EMA weights): leave out --weights model" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--resume", str(folder)]) == 2
    assert "start a new run with --init-from, not a resume" in capsys.readouterr().err

    assert main(["bench", "samplers", str(folder), "--num-samples", "20", "--out", str(tmp_path / "b")]) == 2
    assert "is a diffusers folder, which records no dataset to score against" in capsys.readouterr().err

    conditional = tmp_path / "conditional"
    shutil.copytree(folder, conditional)
    config = json.loads((conditional / "unet" / "config.json").read_text())
    (conditional / "unet" / "config.json").write_text(json.dumps({**config, "num_class_embeds": 10}))
    assert main(["sample", "--checkpoint", str(conditional), "--num-images", "4",
                 "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {conditional}: a class-conditional UNet2DModel (num_class_embeds 10)" in err
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "g.png").exists()

    other = tmp_path / "flipped-order"  # a switch fastddpm's U-Net has no equivalent for: named for this command
    shutil.copytree(folder, other)
    (other / "unet" / "config.json").write_text(json.dumps({**config, "act_fn": "gelu"}))
    assert main(["sample", "--checkpoint", str(other), "--num-images", "4", "--out", str(tmp_path / "o.png")]) == 2
    assert f"--checkpoint {other / 'unet' / 'config.json'}: act_fn='gelu'" in capsys.readouterr().err
