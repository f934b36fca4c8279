"""examples/seed_ddpm/train.py, the seed-style user script that `fastddpm doctor run` is tested and measured on:
it trains end to end on a PNG folder, each fix flag takes effect, and its model is the seed's ~10M-parameter U-Net.

The runs are shrunk (base channels 8, 16x16, batch 8, 4 steps): at the defaults one CPU step takes tens of seconds,
most of it in the 784-token attention at full resolution."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "seed_ddpm" / "train.py"
TINY = ["--base-channels", "8", "--image-size", "16", "--batch-size", "8", "--max-steps", "4", "--log-every", "2"]


@pytest.fixture(scope="module")
def train_module():
    """The script imported as a module: its `if __name__ == "__main__"` guard keeps training from starting."""
    spec = importlib.util.spec_from_file_location("seed_ddpm_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def png_dir(tmp_path_factory) -> Path:
    """64 random 28x28 grayscale PNGs, spread over subfolders (the script searches recursively)."""
    root = tmp_path_factory.mktemp("pngs")
    rng = np.random.default_rng(0)
    for i in range(64):
        folder = root / str(i % 4)
        folder.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def run_script(png_dir: Path, *extra: str, timeout: float = 120) -> str:
    # One intra-op thread: on a busy 2-core machine two OpenMP threads spin against each other and the tiny run
    # goes ~20x slower (measured: 4.8 s a step instead of 0.25 s).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(png_dir), *TINY, *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def assert_trained(out: str) -> None:
    assert "model: 645,345 parameters (0.65M), base channels 8" in out, out
    assert "data: 64 PNGs from" in out and "1x16x16, batch 8" in out, out
    # 4 steps, the first 3 untimed: one steady step, on one line a benchmark can parse.
    steady = [line for line in out.splitlines() if line.startswith("steady:")]
    assert len(steady) == 1 and re.fullmatch(r"steady: \d+\.\d images/s over 1 steps \(.*4 steps in all\)",
                                             steady[0]), out
    assert re.search(r"^epoch \d+ step 4 loss \d+\.\d{4}$", out, re.M), out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_trains_on_a_png_folder(png_dir, num_workers):
    out = run_script(png_dir, "--num-workers", str(num_workers))
    assert_trained(out)
    assert f"{num_workers} workers" in out
    assert "settings: device=cpu bf16=False sdpa_attention=False compile=False adamw=default" in out, out
    assert "first step: prediction dtype torch.float32" in out, out


@pytest.mark.parametrize("flag, effects", [
    ("--bf16", ["bf16=True", "first step: prediction dtype torch.bfloat16"]),
    ("--sdpa-attention", ["sdpa_attention=True"]),  # read back from the model's attention blocks
    ("--fused-adam", ["adamw=fused"]),  # torch >= 2.4 has a fused AdamW on CPU too
])
def test_each_fix_flag_takes_effect(png_dir, flag, effects):
    out = run_script(png_dir, "--num-workers", "0", flag)
    assert_trained(out)
    for effect in effects:
        assert effect in out, out


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTDDPM_TEST_COMPILE") != "1",
                    reason="--compile took 5.5 min on a shared 2-core CPU (inductor compiles forward and backward "
                           "from a cold cache); set FASTDDPM_TEST_COMPILE=1 to run it")
def test_compile_flag(png_dir):
    start = time.perf_counter()
    out = run_script(png_dir, "--num-workers", "0", "--compile", timeout=900)
    assert_trained(out)
    assert "compile=True" in out, out
    print(f"--compile run: {time.perf_counter() - start:.0f} s")


@pytest.fixture
def one_thread():
    """In-process model runs on one intra-op thread (see run_script), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def attention_calls(model, monkeypatch) -> list[dict]:
    """One forward pass in training mode; the keyword arguments each nn.MultiheadAttention call received."""
    calls = []
    original = torch.nn.MultiheadAttention.forward

    def recording_forward(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.MultiheadAttention, "forward", recording_forward)
    model(torch.randn(2, 1, 16, 16), torch.tensor([0, 999]))
    monkeypatch.undo()
    return calls


def test_sdpa_attention_calls_mha_without_weights(train_module, monkeypatch, one_thread):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        baseline = train_module.UNet(1, 8)
        fixed = train_module.UNet(1, 8, sdpa_attention=True)
        num_attention = sum(isinstance(m, torch.nn.MultiheadAttention) for m in baseline.modules())
        assert num_attention == 16  # 3 down x 2, 2 mid, 3 up x 2: attention at every level, as in the seed

        # The baseline calls attn(x, x, x): torch's default need_weights=True, the unfused path.
        baseline_calls = attention_calls(baseline, monkeypatch)
        assert len(baseline_calls) == num_attention
        assert all("need_weights" not in kw for kw in baseline_calls), baseline_calls
        assert torch.nn.MultiheadAttention.forward.__defaults__[1] is True  # (key_padding_mask, need_weights, ...)

        fixed_calls = attention_calls(fixed, monkeypatch)
        assert len(fixed_calls) == num_attention
        assert all(kw.get("need_weights") is False for kw in fixed_calls), fixed_calls

        # The fix changes how attention runs, not what it computes.
        fixed.load_state_dict(baseline.state_dict())
        x, t = torch.randn(2, 1, 16, 16), torch.tensor([3, 500])
        torch.testing.assert_close(fixed(x, t), baseline(x, t), rtol=1e-4, atol=1e-5)


def test_default_model_is_the_seeds_10m_unet(train_module, one_thread):
    args = train_module.parse_args(["--data", "unused"])
    assert (args.base_channels, args.image_size, args.batch_size, args.num_workers, args.lr) == (32, 28, 64, 4, 1e-4)
    with torch.random.fork_rng():
        model = train_module.UNet(1, args.base_channels)
    num_params = sum(p.numel() for p in model.parameters())
    assert 9e6 <= num_params <= 11e6
    assert num_params == 10_230_657  # pinned: a change to the architecture must show up here
    assert model(torch.randn(1, 1, 28, 28), torch.tensor([7])).shape == (1, 1, 28, 28)


def test_png_folder_converts_to_the_first_files_mode_and_resizes(train_module, tmp_path):
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "sub").mkdir()
    Image.fromarray(np.full((28, 28), 255, np.uint8)).save(tmp_path / "sub" / "b.png")
    ds = train_module.PngFolder(str(tmp_path), 16)
    assert len(ds) == 2 and ds.channels == 3
    a, b = ds[0], ds[1]
    assert a.shape == b.shape == (3, 16, 16) and a.dtype == torch.float32
    assert a.min() >= -1 and a.max() <= 1
    assert torch.equal(b, torch.ones(3, 16, 16))  # white grayscale -> RGB 255 -> +1


def test_an_empty_folder_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "no .png files under" in proc.stderr and "--data" in proc.stderr, proc.stderr
