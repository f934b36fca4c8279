"""Writes tests/golden/legacy/: checkpoints as fastddpm wrote them before its run files moved to fastddpm.rundir
(commit 3203729, 2026-11-25), so that tests/test_legacy_checkpoints.py can check that they still load and resume.

Driven only through the command line, which did not change: run it at a commit to see what that commit writes.
    .venv/bin/python tests/golden/make_legacy_runs.py

- pt/: a conditional tiny U-Net trained 4 steps in fp16 (so the loss scaler's state is saved) on the first 256
  Fashion-MNIST images; kept: ckpt_000000002.pt (+ .sha256), ema.safetensors of step 4, config.json, and
  metrics.jsonl with the uninterrupted run's losses of steps 3 and 4 (what a resume from step 2 must reproduce).
- dcp/: the same model unconditional, 2 steps under `torchrun --nproc-per-node 2 ... --parallel fsdp` (gloo):
  the sharded checkpoint directory ckpt_000000002.dcp.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import read_fmnist  # noqa: E402

SMALL = ["--preset", "tiny", "--down-channels", "8,16,16", "--mid-channels", "16,16", "--time-emb-dim", "16",
         "--out-block-channels", "8", "--num-heads", "2", "--batch-size", "8", "--device", "cpu", "--no-progress",
         "--log-every", "1", "--checkpoint-every", "2", "--num-sample-images", "4", "--sample-steps", "2",
         "--cpu-threads", "1"]


def main() -> None:
    out = HERE / "legacy"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        images, labels = read_fmnist(256)
        src = tmp / "fmnist256.npz"
        np.savez(src, images=images, labels=labels)

        run = tmp / "pt"
        subprocess.run([sys.executable, "-m", "fastddpm", "train", *SMALL, "--data", str(src), "--out", str(run),
                        "--conditional", "--precision", "fp16", "--max-steps", "4"], env=env, check=True)
        dst = out / "pt"
        (dst / "checkpoints").mkdir(parents=True)
        for name in ("ckpt_000000002.pt", "ckpt_000000002.sha256"):
            shutil.copy(run / "checkpoints" / name, dst / "checkpoints" / name)
        for name in ("ema.safetensors", "config.json", "metrics.jsonl"):
            shutil.copy(run / name, dst / name)

        run = tmp / "dcp"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(29500 + os.getpid() % 1000), "-m", "fastddpm", "train", *SMALL, "--data", str(src),
                        "--out", str(run), "--parallel", "fsdp", "--precision", "fp32", "--max-steps", "2"],
                       env=env, check=True)
        shutil.copytree(run / "checkpoints" / "ckpt_000000002.dcp", out / "dcp" / "ckpt_000000002.dcp")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
