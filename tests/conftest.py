"""Shared fixtures: a private dataset cache per test session, and real Fashion-MNIST slices."""

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fastddpm.device import CPU_BF16_FLAGS, cpu_flags

# The same choices on every machine: `--precision auto` picks bf16 on a CPU with native bf16 (amx_bf16,
# avx512_bf16) and fp32 elsewhere, so the suite runs as on a CPU without them (this process and the ones its tests
# start). Tests of the bf16 choice set FASTDDPM_CPU_FLAGS themselves.
os.environ.setdefault("FASTDDPM_CPU_FLAGS", " ".join(sorted((cpu_flags() or frozenset()) - set(CPU_BF16_FLAGS))))

# The DDPM / improved-diffusion U-Net family (model.family ddpm) at a test's size, every optional block on
# (scale-shift conditioning): TINY_DDPM for 32x32 images (attention at 16), TINY_DDPM_28 for 28x28 ones (at 14; an
# attention resolution that is no level of the U-Net is refused); the fast-path tests run it beside the seed's.
TINY_DDPM = {"model.family": "ddpm", "model.base_channels": 16, "model.channel_mult": (1, 2),
             "model.num_res_blocks": 1, "model.attention_resolutions": (16,), "model.norm_groups": 8,
             "model.num_heads": 2, "model.scale_shift_norm": True}
TINY_DDPM_28 = {**TINY_DDPM, "model.attention_resolutions": (14,)}
# The seed family's U-Net (the tiny preset's) with one block of each kind: a down block that halves the resolution,
# a mid block, an up block, every one with attention. For the tests whose cost grows with the blocks while what they
# check does not: torch.compile (CPU Inductor compiles each distinct kernel with its own C++ compiler call: 58
# kernels against the tiny preset's 70 for a step's forward and backward, in about two thirds of the time), the
# exporters, and runs whose model is incidental (those add "model.attention": False where the attention at 28x28,
# over 784 positions, would take most of their time).
ONE_BLOCK_SEED = {"model.down_channels": (16, 32), "model.mid_channels": (32, 16), "model.down_sample": (True,)}


def flags(over: dict) -> list[str]:
    """Config overrides ({"model.num_heads": 2, ...}) as `fastddpm train` flags (--num-heads 2 ...)."""
    out = []
    for key, value in over.items():
        name = "--" + key.split(".", 1)[1].replace("_", "-")
        if isinstance(value, bool):
            out += [name] if value else []
        else:
            out += [name, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return out


# Debian's dataset-fashion-mnist; FASTDDPM_FMNIST_DIR points elsewhere (e.g. a copy carried to a GPU machine).
FMNIST_DIR = Path(os.environ.get("FASTDDPM_FMNIST_DIR", "/usr/share/datasets/fashion-mnist"))


def _native_bf16_gpu() -> bool:
    # Not torch.cuda.is_bf16_supported(): it also says True on a T4 (sm75), which only emulates bf16.
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


# For the GPU tests that run in bf16: a T4 or V100 runs the seed's recipe in fp16 instead.
needs_bf16_gpu = pytest.mark.skipif(not _native_bf16_gpu(),
                                    reason="needs a CUDA GPU with native bf16 (compute capability >= 8.0)")


def _set_by_the_tools(name: str) -> bool:
    """Environment variables that pytest and torch set for themselves (torch's inductor caches, on first use)."""
    return name in ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") or name.startswith(
        "_TORCHINDUCTOR")


def restore_env_after(monkeypatch, *names: str) -> None:
    """Have monkeypatch put these environment variables back as they are now (set or absent) after the test: for
    a third-party import that sets them (opencv, Lightning), which _leaves_the_process_as_it_found_it would flag."""
    for name in names:
        was = os.environ.get(name)
        monkeypatch.setenv(name, was or "")  # records the value, or its absence
        if was is None:
            monkeypatch.delenv(name)


def _process_state() -> dict:
    """What one test can change for every later test in this process (they share it): torch's global switches,
    the environment, the working directory and the signal handlers."""
    import signal

    return {
        "torch intra-op threads": torch.get_num_threads(),
        "grad mode": torch.is_grad_enabled(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "environment": {k: v for k, v in os.environ.items() if not _set_by_the_tools(k)},
        "working directory": os.getcwd(),
        "SIGTERM handler": signal.getsignal(signal.SIGTERM),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        **_hooks_state(),
    }


def _hooks_state() -> dict:
    """The process-wide hooks the doctor installs around a loop (and must remove): a hook left behind runs inside
    every later test's optimizer steps, module calls or autograd saves, and is timed as theirs."""
    import torch.nn.modules.module as module_mod
    import torch.optim.optimizer as optim_mod
    from torch.utils.data import DataLoader

    module_hooks = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                    "_global_backward_hooks", "_global_module_registration_hooks",
                    "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")
    return {
        "torch.optim's global step hooks": (len(optim_mod._global_optimizer_pre_hooks),
                                            len(optim_mod._global_optimizer_post_hooks)),
        "torch.nn's global module hooks": tuple(len(getattr(module_mod, name, ())) for name in module_hooks),
        "default saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
        "the autograd profiler": torch._C._autograd._profiler_enabled(),
        "DataLoader.__iter__": DataLoader.__iter__,
        "Tensor.__iter__": torch.Tensor.__iter__,
    }


@pytest.fixture(autouse=True)
def _leaves_the_process_as_it_found_it():
    """The suite must pass in any order: a test (or the library code it calls) that changes process-wide state and
    does not put it back fails here, naming what it changed, instead of changing the tests that run after it."""
    before = _process_state()
    yield
    after = _process_state()
    changed = [k for k in before if before[k] != after[k]]
    if "environment" in changed:
        env_b, env_a = before["environment"], after["environment"]
        keys = sorted(k for k in env_b.keys() | env_a.keys() if env_b.get(k) != env_a.get(k))
        changed[changed.index("environment")] = f"environment ({', '.join(keys)})"
    if changed:
        pytest.fail(f"the test left process-wide state changed: {'; '.join(changed)}", pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Never touch the user's ~/.cache/fastddpm from tests."""
    old = os.environ.get("FASTDDPM_CACHE")
    os.environ["FASTDDPM_CACHE"] = str(tmp_path_factory.mktemp("fastddpm-cache"))
    yield
    if old is None:
        os.environ.pop("FASTDDPM_CACHE", None)
    else:
        os.environ["FASTDDPM_CACHE"] = old


def read_fmnist(n: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The first n real Fashion-MNIST images (N, 1, 28, 28) uint8 and labels, straight from the IDX files."""
    prefix = "train" if split == "train" else "t10k"
    images_path = FMNIST_DIR / f"{prefix}-images-idx3-ubyte.gz"
    if not images_path.is_file():
        pytest.skip("Fashion-MNIST files are missing: run `apt-get install dataset-fashion-mnist`")
    with gzip.open(images_path) as f:
        images = np.frombuffer(f.read(16 + n * 784), np.uint8, offset=16).reshape(n, 1, 28, 28)
    with gzip.open(FMNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(8 + n), np.uint8, offset=8).astype(np.int64)
    return images.copy(), labels


@pytest.fixture(scope="session")
def rgb_npz(tmp_path_factory) -> Path:
    """16 random RGB 32x32 images with labels 0-1: the DDPM family's CIFAR-10 shape, for runs whose loss is not read
    (test_ddpm_family.py has its own, smooth images whose loss can fall)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("rgb") / "rgb32.npz"
    np.savez(path, images=rng.integers(0, 256, (16, 3, 32, 32), dtype=np.uint8), labels=rng.integers(0, 2, 16))
    return path


@pytest.fixture(scope="session")
def fmnist_npz(tmp_path_factory) -> Path:
    """256 real Fashion-MNIST training images as an .npz source."""
    images, labels = read_fmnist(256)
    path = tmp_path_factory.mktemp("fmnist") / "fmnist256.npz"
    np.savez(path, images=images, labels=labels)
    return path


def interrupt_training(src: Path, run: Path, sig: int, *, after_log_lines: int):
    """Start `fastddpm train` (tiny, endless) in a new process, send `sig` once it has logged
    `after_log_lines` steps, and return (returncode, stdout, stderr)."""
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "fastddpm", "train", "--data", str(src), "--out", str(run), "--preset",
           "tiny", "--max-steps", "100000", "--log-every", "1", "--checkpoint-every", "100000", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < after_log_lines):
        time.sleep(0.1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err
