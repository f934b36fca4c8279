"""Export folders as a user samples them: sample_onnx.py's arguments."""

import pytest


def test_the_onnx_sampler_refuses_a_negative_seed_before_loading_or_writing_anything(tmp_path):
    """`python sample_onnx.py . --seed -1` (fastddpm sample takes any integer seed) ended in numpy's ValueError
    traceback after the model had loaded and --out's folder had been made."""
    pytest.importorskip("onnxruntime", reason="onnx export is an extra: pip install 'fastddpm[onnx]'")
    from fastddpm.sample_onnx import main as sample_onnx

    out = tmp_path / "grids" / "g.png"
    with pytest.raises(SystemExit, match=r"^--seed -1: the noise's seed is a whole number >= 0, e.g. --seed 1$"):
        sample_onnx([str(tmp_path), "--seed", "-1", "--out", str(out)])
    assert not out.parent.exists()


def test_an_incomplete_diffusers_folder_given_to_sample_is_named_with_the_file_it_lacks(tmp_path):
    """`fastddpm sample --checkpoint` (fastddpm.load) of a diffusers folder was told it "holds an export (unet)",
    a folder's name; a whole one now loads (tests/test_diffusers_checkpoint.py), one without unet/config.json is
    named as a diffusers folder with the file it lacks."""
    import fastddpm
    from fastddpm.rundir.files import CheckpointError

    (tmp_path / "unet").mkdir()
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds no checkpoint and no ema.safetensors. It looks like a "
                                              r"diffusers folder \(unet/\), but unet/config.json is missing"):
        fastddpm.load(tmp_path)
