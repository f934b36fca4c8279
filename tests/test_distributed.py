"""Scale-out on torchrun, on the CPU: 2 processes on the gloo backend.

- the data: rank shards are disjoint, the epoch order is shared, noise streams are per rank, and world size 1
  is the single-process order exactly;
- DDP: after K steps the parameters match a single process that trains on the same global batches;
- checkpoints: written by 2 ranks, resumed on 1, and the reverse;
- FSDP2: the same parameters as one process after K steps, sharded checkpoints (DCP) that resume bit-exactly
  and reshard across world sizes, and a clear error for each mismatch;
- failure: a killed rank ends the job with a non-zero exit, in bounded time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastddpm.rundir.checkpoint import load_latest
from fastddpm.trainer.batches import ResidentBatches, StreamingBatches

from conftest import ONE_BLOCK_SEED, TINY_DDPM_28, flags, needs_bf16_gpu

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, args: list[str], *, timeout: float = 240, env_extra: dict | None = None,
             wait: bool = True, entry: list[str] | None = None):
    """`torchrun -m fastddpm train ARGS` (or `torchrun ENTRY ARGS`) on gloo, one intra-op thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(29500 + os.getpid() % 1000), *(entry or ["-m", "fastddpm", "train"]), *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


# Grids of 4 images in 2 sampler steps instead of the tiny preset's 16 in 10: no test here checks a grid's size or
# look. test_fsdp_grids_sample_the_current_ema compares a grid with one drawn from the checkpoint, and these small
# grids tell a stale EMA copy apart as well (without the reshard after a grid, 19% of their pixels moved, by up to
# 191). Every launch draws a final grid, and under FSDP every rank samples it.
SMALL_GRIDS = ("--num-sample-images", "4", "--sample-steps", "2")


def train_args(src, out, *extra, grids=SMALL_GRIDS) -> list[str]:
    return ["--preset", "tiny", "--data", str(src), "--out", str(out), "--device", "cpu", "--no-progress",
            "--batch-size", "8", "--log-every", "2", "--checkpoint-every", "2", *grids, *extra]


# ---------------------------------------------------------------------- data shards
def _images(n=40):
    return np.arange(n, dtype=np.uint8).reshape(n, 1, 1, 1).repeat(4, 2).repeat(4, 3)


@pytest.mark.parametrize("cls", [ResidentBatches, StreamingBatches])
def test_rank_shards_are_disjoint_and_cover_each_global_batch(cls):
    kw = dict(batch_size=4, num_timesteps=10, seed=3, device=torch.device("cpu"))
    ranks = [cls(_images(), rank=r, world_size=2, **kw) for r in range(2)]
    assert ranks[0].steps_per_epoch == 20 // 4
    for m in range(12):  # across an epoch boundary
        b0, b1 = (r.get(m) for r in ranks)
        i0, i1 = set(b0.indices.tolist()), set(b1.indices.tolist())
        assert not i0 & i1
        assert all(i % 2 == 0 for i in i0) and all(i % 2 == 1 for i in i1)
        # the pixels are the dataset rows the indices name
        assert torch.equal(torch.round((b0.x0[:, 0, 0, 0] + 1) * 127.5), b0.indices.float())
        assert not torch.equal(b0.noise, b1.noise)  # independent per-rank noise
        # same shard positions on every rank: the epoch order is shared
        assert torch.equal(b0.indices // 2, b1.indices // 2)


def test_world_size_one_is_the_single_process_order_and_noise():
    kw = dict(batch_size=4, num_timesteps=10, seed=3, device=torch.device("cpu"))
    single = ResidentBatches(_images(), **kw)
    one = ResidentBatches(_images(), rank=0, world_size=1, **kw)
    two = ResidentBatches(_images(), rank=0, world_size=2, **kw)
    for m in range(7):
        a, b = single.get(m), one.get(m)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.noise, b.noise) and torch.equal(a.t, b.t)
        assert torch.equal(a.noise, two.get(m).noise)  # rank 0 keeps the single-process noise stream


def test_too_few_images_per_rank_is_a_clear_error():
    from fastddpm.config import ConfigError

    with pytest.raises(ConfigError, match=r"2 ranks: 5 images each"):
        ResidentBatches(_images(10), batch_size=8, num_timesteps=10, seed=0, device=torch.device("cpu"), rank=1,
                        world_size=2)


# ---------------------------------------------------------------------- DDP on gloo
def _reference_params(src: Path, steps: int, per_rank_batch: int, world: int, overrides: dict | None = None) -> dict:
    """One process trains on the concatenation of the ranks' batches: the global batch, by construction."""
    from fastddpm.config import get_preset, apply_overrides
    from fastddpm.config import resolve_model_shape
    from fastddpm.data import prepare
    from fastddpm.device import resolve_precision
    from fastddpm.trainer.batches import Batch
    from fastddpm.trainer.build import Optimization, build_model
    from fastddpm.trainer.fast_path import resolve_fast_path

    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(src), "train.batch_size": per_rank_batch * world,
                                               "train.device": "cpu", **(overrides or {})}, source="test")
    data = prepare(cfg.data.source, progress=False)
    cfg = resolve_model_shape(cfg, data.images.shape)
    device = torch.device("cpu")
    precision = resolve_precision("auto", device)
    fast = resolve_fast_path(cfg.train, device, precision)
    model, schedule = build_model(cfg, device=device, fast=fast)
    step_fn = Optimization(cfg, model, schedule, device=device, precision=precision, fast=fast).build_step()
    ranks = [ResidentBatches(data.images, batch_size=per_rank_batch, num_timesteps=cfg.diffusion.num_timesteps,
                             seed=cfg.train.seed, device=device, rank=r, world_size=world) for r in range(world)]
    for step in range(steps):
        parts = [r.get(step) for r in ranks]
        batch = Batch(x0=torch.cat([p.x0 for p in parts]), t=torch.cat([p.t for p in parts]),
                      noise=torch.cat([p.noise for p in parts]), indices=torch.cat([p.indices for p in parts]))
        images_seen = (step + 1) * per_rank_batch * world
        t = cfg.train
        lr = t.lr * min(1.0, images_seen / t.warmup_images) if t.warmup_images else t.lr
        step_fn([batch], lr=lr, step=step)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process_on_the_same_global_batch(tmp_path, fmnist_npz):
    out = tmp_path / "ddp"
    r = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "4"))
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["world_size"] == 2 and run["global_batch"] == 16 and run["batch_fixed"] == "per device"
    _, state = load_latest(out / "checkpoints")
    assert state["step"] == 4 and state["images_seen"] == 64 and state["world_size"] == 2
    ref = _reference_params(fmnist_npz, 4, 8, 2)
    # Float tolerance: the all-reduce sums in another order. Adam turns gradients that are zero in exact
    # arithmetic (an attention key's bias) into +-lr steps of rounding noise, so allow 5e-5, still 20x below
    # the lr-sized differences (1e-3 per step) that a different batch would leave on every parameter.
    for k, v in ref.items():
        torch.testing.assert_close(state["model"][k], v, rtol=1e-4, atol=5e-5, msg=f"parameter {k}")
    diffs = [float((state["model"][k] - v).abs().max()) for k, v in ref.items()]
    assert sorted(diffs)[len(diffs) // 2] < 1e-6  # the typical parameter agrees to float precision
    # only rank 0 wrote: one metrics file, one set of checkpoints, logs from rank 0 only
    assert (r.stdout + r.stderr).count("training to step") == 1


@pytest.mark.slow
def test_checkpoint_moves_between_world_sizes(tmp_path, fmnist_npz, two_rank_runs):
    from fastddpm.cli import main

    # written by 2 ranks (the DDP run of test_no_process_group_thread_outlives_the_run, copied), resumed by 1
    out = tmp_path / "a"
    first, r = two_rank_runs("ddp")
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.copytree(first, out)
    assert main(["train", *train_args(fmnist_npz, out, "--max-steps", "4", "--resume", "latest")]) == 0
    _, state = load_latest(out / "checkpoints")
    assert state["step"] == 4 and state["world_size"] == 1 and state["images_seen"] == 2 * 16 + 2 * 8
    # written by 1, resumed by 2, with the global batch fixed so the recipe is the same
    out = tmp_path / "b"
    assert main(["train", *train_args(fmnist_npz, out, "--max-steps", "2", "--global-batch-size", "16")]) == 0
    r = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "4", "--global-batch-size", "16", "--resume",
                               "latest"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "written by 1 rank" in r.stdout + r.stderr
    _, state = load_latest(out / "checkpoints")
    assert state["step"] == 4 and state["images_seen"] == 64 and state["world_size"] == 2
    assert json.loads((out / "run.json").read_text())["batch_size"] == 8  # 16 global / 2 ranks


_EXIT_PROBE = """
import os, sys, time
from fastddpm.cli import main

code = main(["train", *sys.argv[1:]])
def backend_threads():  # what a process group runs: gloo's run loops and TCP loop (NCCL: its watchdog)
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n or "nccl" in n.lower())
deadline = time.time() + 5  # gloo's TCP loop ends a moment after its device is freed
while backend_threads() and time.time() < deadline:
    time.sleep(0.05)
print(f"rank {os.environ['RANK']} exits with backend threads {backend_threads()}", flush=True)
sys.exit(code)
"""


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory, fmnist_npz):
    """A 2-rank run of each parallel mode, launched once per session through the exit probe: a torchrun launch
    costs seconds of process start-up, and the tests that resume or compare a 2-rank run begin from these same
    runs (they resume copies). DDP's trains 2 steps. FSDP's is fsdp_run's: 4 steps (checkpoints at 2 and 4, grids
    after steps 1, 2 and 3), the global batch fixed (16, 8 per rank) as the resumes on 1 rank need. Returns
    (run dir, result)."""
    runs = {}

    def get(parallel: str):
        if parallel not in runs:
            root = tmp_path_factory.mktemp(f"two-ranks-{parallel}")
            probe = root / "exit_probe.py"
            probe.write_text(_EXIT_PROBE)
            steps = ("--max-steps", "4", "--global-batch-size", "16", "--sample-every-images", "16") \
                if parallel == "fsdp" else ("--max-steps", "2")
            out = root / "run"
            r = torchrun(2, train_args(fmnist_npz, out, *steps, "--parallel", parallel), entry=[str(probe)])
            runs[parallel] = out, r
        return runs[parallel]

    return get


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc (Linux)")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_no_process_group_thread_outlives_the_run(two_rank_runs, parallel):
    """When `train` returns under torchrun the process group is gone, its threads with it. A group that outlives
    the run tears its threads down during interpreter shutdown, which aborted rank 1 at random on exit
    ("terminate called without an active exception", SIGABRT). Three holders kept it alive: torch.distributed.nn,
    imported by torch._dynamo after init_process_group, binds the live group as a default argument; the DDP
    wrapper, caught in a reference cycle, waited for a cyclic GC that came only at interpreter shutdown; and
    FSDP's device meshes, kept for the life of the process by DTensor's caches, hold their groups."""
    _, r = two_rank_runs(parallel)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 exits with backend threads []" in r.stdout and "rank 1 exits with backend threads []" in r.stdout, \
        r.stdout + r.stderr


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_nonzero_in_bounded_time(tmp_path, fmnist_npz):
    out = tmp_path / "kill"
    proc = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "100000", "--checkpoint-every", "1000"),
                    wait=False)
    try:
        # wait until training runs (a metrics line exists), then kill rank 1's worker
        deadline = time.time() + 180
        while not (out / "metrics.jsonl").exists():
            assert time.time() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.5)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGKILL)
        t0 = time.time()
        code = proc.wait(timeout=120)
        assert code != 0
        assert time.time() - t0 < 120
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _worker_pids(agent_pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return [p for p in out if b"fastddpm" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_ddp_never_suggests_cudagraph_trees():
    """DDP + compile + CUDA graph trees (--cuda-graphs reduce-overhead) has an open PyTorch bug (pytorch#113809)
    and is unmeasured here: neither the auto reason nor the refusal of capture under DDP may suggest it."""
    from fastddpm.config import ConfigError, TrainConfig
    from fastddpm.device import Precision
    from fastddpm.trainer.fast_path import resolve_fast_path

    cuda, bf16 = torch.device("cuda", 0), Precision("bf16", torch.bfloat16, False, "test")
    fast = resolve_fast_path(TrainConfig(), cuda, bf16, world_size=2)
    assert fast.compile and fast.cuda_graphs == "off"
    assert "DDP" in fast.reasons["cuda_graphs"] and "reduce-overhead" not in fast.reasons["cuda_graphs"]
    with pytest.raises(ConfigError) as e:
        resolve_fast_path(TrainConfig(cuda_graphs="capture"), cuda, bf16, world_size=2)
    assert "DDP" in str(e.value) and "reduce-overhead" not in str(e.value)


def test_global_batch_that_does_not_divide_is_a_clear_error(tmp_path, fmnist_npz, capsys):
    from fastddpm.cli import main

    code = main(["train", *train_args(fmnist_npz, tmp_path / "x", "--max-steps", "1", "--global-batch-size", "10",
                           "--accum-steps", "4")])
    assert code == 2
    err = capsys.readouterr().err
    assert "global_batch_size=10" in err and "accum_steps=4" in err


_PEERS = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1))
    try:
        if rank == 0:
            time.sleep(4)  # rank 0 busy alone, past the group's timeout
        dist.all_reduce(torch.zeros(1))
        q.put((rank, None, ""))
    except BaseException as e:
        q.put((rank, type(e).__name__, str(e)))
    q.close(); q.join_thread(); os._exit(0)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, int(sys.argv[1]), q)) for r in range(2)]
    [p.start() for p in procs]
    print(json.dumps(sorted(q.get(timeout=60) for _ in procs)))
    [p.join() for p in procs]
"""


def test_a_resume_every_rank_refuses_alike_is_said_once_a_node(tmp_path, fmnist_npz, two_rank_runs):
    """Every rank checks the checkpoint the ranks agreed on against the data rank 0 prepared: a resume on other data
    was refused in the same lines by each rank (eight copies on a node of eight). The first process of the node
    says it; the other exits with the same status in silence."""
    run, _ = two_rank_runs("ddp")
    out = tmp_path / "run"
    shutil.copytree(run, out)
    with np.load(fmnist_npz) as given:
        other = tmp_path / "other.npz"
        np.savez(other, images=255 - given["images"], labels=given["labels"])
    r = torchrun(2, train_args(other, out, "--max-steps", "4", "--resume", "latest"))
    text = r.stdout + r.stderr
    assert r.returncode != 0 and text.count("error: cannot resume from") == 1, text
    assert "exitcode  : 2" in text  # a user error's status (torchrun may end the other rank first by SIGTERM)


def test_a_collective_that_failed_on_a_peer_is_said_in_one_line_per_rank(tmp_path, capsys, monkeypatch):
    """A rank that waits past --dist-timeout-s (rank 0 alone in an evaluation's set-up) and the rank whose peer then
    left end with one line each naming the setting or the other rank, not gloo's tracebacks. The errors are gloo's
    own, raised by two real processes."""
    from fastddpm.cli import main
    from fastddpm.distributed import collective_failure

    (tmp_path / "peers.py").write_text(_PEERS)
    out = subprocess.run([sys.executable, str(tmp_path / "peers.py"), str(29000 + os.getpid() % 400)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (_, kind0, busy), (_, kind1, waited) = json.loads(out.stdout.strip().splitlines()[-1])
    assert kind0 == kind1 == "RuntimeError", out.stderr
    timed_out = collective_failure(RuntimeError(waited), 1.0)
    assert timed_out.startswith("this rank waited longer than --dist-timeout-s=1 s for the other ranks (Timed out")
    assert "raise --dist-timeout-s" in timed_out and "pair.cc" not in timed_out and ".cc:" not in timed_out
    left = collective_failure(RuntimeError(busy), 1.0)
    assert left.startswith("another rank ended while this one waited for it") and "GLHF" not in left
    assert collective_failure(RuntimeError("CUDA error: out of memory"), 1.0) is None  # keeps its traceback
    assert collective_failure(ValueError(waited), 1.0) is None
    # `fastddpm train` under torchrun says it on the rank's one line, exit 1
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def fails(*args, **kwargs):
        raise RuntimeError(waited)

    monkeypatch.setattr("fastddpm.trainer.loop.train", fails)
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--dist-timeout-s", "1"]) == 1
    assert capsys.readouterr().err.startswith("error: rank 1: this rank waited longer than --dist-timeout-s=1 s")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match="Timed out"):  # one process: no peer to blame, the error as raised
        main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--dist-timeout-s", "1"])


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_newest_checkpoint(tmp_path, fmnist_npz):
    """What torchrun --max-restarts does after a failure, played by hand: a worker started with
    TORCHELASTIC_RESTART_COUNT > 0 resumes by itself. World size 1 under torchrun runs the DDP path."""
    from fastddpm.cli import main

    out = tmp_path / "r"
    assert main(["train", *train_args(fmnist_npz, out, "--max-steps", "2")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(30500 + os.getpid() % 1000),
           "TORCHELASTIC_RESTART_COUNT": "1"}
    r = subprocess.run([sys.executable, "-m", "fastddpm", "train", *train_args(fmnist_npz, out, "--max-steps", "4")],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from the newest complete checkpoint" in r.stdout
    assert "resumed from" in r.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["parallel"] == "ddp" and run["world_size"] == 1
    _, state = load_latest(out / "checkpoints")
    assert state["step"] == 4


# ---------------------------------------------------------------------- FSDP2 on gloo
@pytest.fixture(scope="session")
def fsdp_run(two_rank_runs):
    """2 ranks, --parallel fsdp, 4 steps uninterrupted (checkpoints at 2 and 4, grids after steps 1, 2 and 3):
    two_rank_runs' FSDP run. Returns (run dir, its output)."""
    out, r = two_rank_runs("fsdp")
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r.stdout + r.stderr


def _dcp(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"ckpt_{step:09d}.dcp"


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process_on_the_same_global_batch(fsdp_run, fmnist_npz, tmp_path):
    from fastddpm.rundir.files import load_safetensors
    from fastddpm.rundir.sharded import read_sharded_checkpoint
    from fastddpm.sampling import load_for_sampling

    out, log = fsdp_run
    run = json.loads((out / "run.json").read_text())
    assert run["parallel"] == "fsdp" and run["world_size"] == 2 and run["global_batch"] == 16
    assert "FSDP2 fully_shard" in log and log.count("training to step") == 1
    # one shard file per rank, DCP's index and the metadata, sealed under the final name
    ckpt = _dcp(out, 4)
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    state = read_sharded_checkpoint(ckpt)
    assert state["step"] == 4 and state["images_seen"] == 64 and state["world_size"] == 2
    ref = _reference_params(fmnist_npz, 4, 8, 2)
    for k, v in ref.items():  # the same tolerance as DDP's (reduce-scatter sums in another order)
        torch.testing.assert_close(state["model"][k], v, rtol=1e-4, atol=5e-5, msg=f"parameter {k}")
    diffs = [float((state["model"][k] - v).abs().max()) for k, v in ref.items()]
    assert sorted(diffs)[len(diffs) // 2] < 1e-6
    # the EMA export is the gathered EMA, and the sharded checkpoint samples in one process
    ema, meta = load_safetensors(out / "ema.safetensors")
    assert ema.keys() == state["ema"].keys() and all(torch.equal(ema[k], state["ema"][k]) for k in ema)
    assert json.loads(meta["step"]) == 4
    model, cfg = load_for_sampling(ckpt, weights="model")
    assert all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())
    assert (out / "samples" / "final.png").is_file()


@pytest.mark.slow
def test_fsdp_shards_the_ddpm_family_block_by_block_and_matches_one_process(fmnist_npz, tmp_path):
    """The DDPM U-Net's forward calls each ResBlock / Attention / Resample itself (its Levels' forward never
    runs): FSDP must shard those, or their parameters are never gathered (it failed so before)."""
    from fastddpm.rundir.sharded import read_sharded_checkpoint

    out = tmp_path / "fsdp-ddpm"
    r = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "2", "--parallel", "fsdp", *flags(TINY_DDPM_28)))
    assert r.returncode == 0, r.stdout + r.stderr
    state = read_sharded_checkpoint(_dcp(out, 2))
    ref = _reference_params(fmnist_npz, 2, 8, 2, TINY_DDPM_28)
    assert state["model"].keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(state["model"][k], v, rtol=1e-4, atol=5e-5, msg=f"parameter {k}")


@pytest.mark.slow
def test_fsdp_grids_sample_the_current_ema(fsdp_run, tmp_path):
    """Every rank samples the grid through the sharded EMA; the grid after step 2 (the second one) equals a grid
    drawn in one process from the step-2 checkpoint's EMA weights, not from a stale gathered copy."""
    from PIL import Image

    from fastddpm.config import from_dict
    from fastddpm.device import resolve_precision
    from fastddpm.diffusion import schedule_from_config
    from fastddpm.models import UNet
    from fastddpm.rundir.sharded import read_sharded_checkpoint
    from fastddpm.sampling import write_grid

    out, _ = fsdp_run
    state = read_sharded_checkpoint(_dcp(out, 2))
    cfg = from_dict(state["config"])
    ema = UNet(cfg.model).eval()
    ema.load_state_dict(state["ema"])
    cpu = torch.device("cpu")
    mine = write_grid(ema, schedule_from_config(cfg.diffusion), cfg, cpu, resolve_precision("fp32", cpu),
                      tmp_path / "step2.png")
    theirs = out / "samples" / "grid_000000032.png"
    a = np.asarray(Image.open(mine), dtype=np.int16)
    b = np.asarray(Image.open(theirs), dtype=np.int16)
    assert a.shape == b.shape
    # the same weights and noise: equal up to float rounding in a few pixels (a stale copy moves most of them)
    assert np.abs(a - b).max() <= 2 and (a != b).mean() < 0.01, (np.abs(a - b).max(), (a != b).mean())


@pytest.mark.slow
def test_fsdp_resume_is_exact_and_reshards_across_world_sizes(fsdp_run, fmnist_npz, tmp_path, capsys):
    from fastddpm.cli import main
    from fastddpm.rundir.sharded import read_sharded_checkpoint

    full, _ = fsdp_run
    # 2 ranks: 2 steps, then 2 more after a restart equal 4 uninterrupted (bit for bit); a half-written save
    # (what a SIGKILL mid-save leaves) is skipped
    # (the global batch fixed at the 2 x 8 it is, for the resume on 1 rank below). The 2 steps are the uninterrupted
    # run's, copied without its step-4 checkpoint (a run killed after step 2's save): the restart trains steps 3
    # and 4 again, and sets their log lines aside first. This test writes into the copy.
    out = tmp_path / "resumed"
    shutil.copytree(full, out)
    shutil.rmtree(_dcp(out, 4))
    (out / "checkpoints" / ".ckpt_000000003.dcp.tmp").mkdir()
    r = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "4", "--parallel", "fsdp", "--global-batch-size", "16",
                               "--resume", "latest"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from {_dcp(out, 2)}" in r.stdout and "incomplete sharded checkpoint" in r.stdout + r.stderr
    assert not (out / "checkpoints" / ".ckpt_000000003.dcp.tmp").exists()  # removed by the next save
    a, b = read_sharded_checkpoint(_dcp(full, 4)), read_sharded_checkpoint(_dcp(out, 4))
    for part in ("model", "ema"):
        for k, v in a[part].items():
            assert torch.equal(b[part][k], v), (part, k)
    la = [m["loss"] for m in map(json.loads, (full / "metrics.jsonl").read_text().splitlines())]
    lb = [m["loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert la == lb
    steps = [m["step"] for m in map(json.loads, (full / "metrics.jsonl").read_text().splitlines())]
    assert steps == sorted(set(steps))  # one line per logging step (every rank wrote its own copy)

    # written by 2 ranks, resumed by 1 (DCP reshards), with the global batch fixed; then back to 2
    r = torchrun(1, train_args(fmnist_npz, out, "--max-steps", "5", "--parallel", "fsdp", "--global-batch-size", "16",
                               "--resume", "latest"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "written by 2 ranks" in r.stdout
    r = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "6", "--parallel", "fsdp", "--global-batch-size", "16",
                               "--resume", "latest"))
    assert r.returncode == 0, r.stdout + r.stderr
    state = read_sharded_checkpoint(_dcp(out, 6))
    assert state["step"] == 6 and state["world_size"] == 2 and state["images_seen"] == 96
    assert sorted(p.name for p in _dcp(out, 5).iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]

    # a sharded checkpoint cannot be resumed by the DDP / single-process path: the error says how
    code = main(["train", *train_args(fmnist_npz, out, "--max-steps", "7", "--resume", "latest", "--parallel", "ddp")])
    assert code == 2
    assert "is a sharded checkpoint of an FSDP run: resume it under torchrun with --parallel fsdp" in \
        capsys.readouterr().err
    # without a preset the run's own config (parallel=fsdp) is used, and a plain process is told to use torchrun
    code = main(["train", "--out", str(out), "--resume", "latest", "--max-steps", "7", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err  # the setting is the run's own: nothing to drop
    assert "resume it with `torchrun --nproc-per-node N -m fastddpm train --parallel fsdp" in err
    assert "drop --parallel" not in err


def test_fsdp_outside_torchrun_is_a_clear_error(tmp_path, fmnist_npz, capsys):
    from fastddpm.cli import main

    code = main(["train", *train_args(fmnist_npz, tmp_path / "x", "--max-steps", "1", "--parallel", "fsdp")])
    assert code == 2
    assert "launch with `torchrun --nproc-per-node N -m fastddpm train --parallel fsdp" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_bf16_gpu
def test_fsdp_on_one_gpu_trains_in_bf16_and_resumes(tmp_path, fmnist_npz):
    """The GPU path of FSDP (NCCL, bf16 MixedPrecisionPolicy) on one device: trains, writes a sharded checkpoint,
    resumes from it."""
    from fastddpm.rundir.sharded import read_sharded_checkpoint

    out = tmp_path / "gpu"
    args = ["--preset", "tiny", "--data", str(fmnist_npz), "--out", str(out), "--device", "cuda", "--no-progress",
            "--batch-size", "32", "--log-every", "2", "--checkpoint-every", "4", "--parallel", "fsdp"]
    r = torchrun(1, [*args, "--max-steps", "4"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nccl, FSDP2 fully_shard" in r.stdout and "precision: bf16" in r.stdout
    r = torchrun(1, [*args, "--max-steps", "8", "--resume", "latest"])
    assert r.returncode == 0, r.stdout + r.stderr
    state = read_sharded_checkpoint(_dcp(out, 8))
    assert state["step"] == 8 and all(torch.isfinite(v).all() for v in state["model"].values())


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_conditional_model_trains_and_resumes_on_two_ranks(tmp_path, fmnist_npz, parallel):
    """Each rank's shard carries its labels (dropped per rank's own stream); the class embedding is sharded and
    checkpointed like every other weight, and a 2-rank resume goes on from it."""
    from fastddpm.rundir.sharded import read_sharded_checkpoint

    out = tmp_path / parallel
    # a U-Net with one block of each kind and no attention: the class embedding is what this test follows
    extra = ("--conditional", "--parallel", parallel, "--num-sample-images", "10", "--sample-steps", "2",
             *flags(ONE_BLOCK_SEED), "--no-attention")
    r = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "2", *extra))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "conditional on 10 classes" in r.stdout
    r = torchrun(2, train_args(fmnist_npz, out, "--max-steps", "4", "--resume", "latest", *extra))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout
    if parallel == "fsdp":
        state = read_sharded_checkpoint(_dcp(out, 4))
    else:
        _, state = load_latest(out / "checkpoints")
    assert state["step"] == 4 and state["model"]["class_emb.weight"].shape == (11, 32)
    assert (out / "samples" / "final.png").is_file()
