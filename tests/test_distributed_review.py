"""Distributed set-up and sharded checkpoints, without torchrun: a launcher set up half-way, a rendezvous that fails,
more ranks than visible GPUs, a process group the caller owns, and sharded saves around a re-save killed between
its two renames (a one-rank gloo group in this process)."""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist

from fastddpm.config import ConfigError
from fastddpm.rundir import sharded
from fastddpm.distributed import init_distributed, shutdown

from test_distributed import train_args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the launcher's environment
@pytest.mark.parametrize("given", [{"WORLD_SIZE": "2"}, {"RANK": "1"}])
def test_half_of_torchruns_environment_is_a_clear_error(tmp_path, fmnist_npz, capsys, monkeypatch, given):
    """WORLD_SIZE without RANK (or RANK without WORLD_SIZE): each process would train alone as rank 0 of 1, all
    into the same --out. It is refused, naming the variable that is missing."""
    from fastddpm.cli import main

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    code = main(["train", *train_args(fmnist_npz, tmp_path / "x", "--max-steps", "1")])
    err = capsys.readouterr().err
    assert code == 2, err
    (name, value), = given.items()
    missing = "RANK" if name == "WORLD_SIZE" else "WORLD_SIZE"
    assert f"{name}={value} is set but {missing} is not" in err and "torchrun" in err
    assert not (tmp_path / "x" / "checkpoints").exists()


@pytest.mark.parametrize("given", [{"WORLD_SIZE": "1"}, {"RANK": "0"}])
def test_rank_zero_of_one_stated_half_way_is_a_single_process(monkeypatch, given):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    info, device = init_distributed(torch.device("cpu"))
    assert not info.enabled and device == torch.device("cpu")


def _rank_env(monkeypatch, rank: int, world: int, port: int) -> None:
    for name, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, str(value))


def test_a_rank_that_cannot_reach_rank_0_names_the_address_and_the_timeout(tmp_path, fmnist_npz, capsys,
                                                                           monkeypatch):
    """Rank 1 of 2 with nobody listening at MASTER_ADDR:MASTER_PORT: within train.dist_timeout_s it ends with one
    error line that names the address, the port and the setting (torch's own says neither)."""
    from fastddpm.cli import main

    port = _free_port()
    _rank_env(monkeypatch, 1, 2, port)
    code = main(["train", *train_args(fmnist_npz, tmp_path / "x", "--max-steps", "1"),
                 "--set", "train.dist_timeout_s=2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"rank 1 of 2 could not join the process group (MASTER_ADDR=127.0.0.1, MASTER_PORT={port}, " \
           "train.dist_timeout_s=2)" in err
    assert not dist.is_initialized()


def test_a_port_in_use_names_it(tmp_path, fmnist_npz, capsys, monkeypatch):
    from fastddpm.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _rank_env(monkeypatch, 0, 1, port)
        code = main(["train", *train_args(fmnist_npz, tmp_path / "x", "--max-steps", "1"),
                     "--set", "train.dist_timeout_s=5"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"MASTER_PORT={port}" in err and "the port must be free" in err


def test_more_ranks_per_node_than_visible_gpus_names_cuda_visible_devices(monkeypatch):
    """torchrun --nproc-per-node 2 with CUDA_VISIBLE_DEVICES=0: rank 1 has no device of its own. A clear
    ConfigError (`error: ...`, exit 2 from the CLI) before any CUDA call, not a RuntimeError traceback."""
    _rank_env(monkeypatch, 1, 2, _free_port())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 but this process sees 1 CUDA device\(s\) "
                                          r"\(CUDA_VISIBLE_DEVICES=0\).*--nproc-per-node"):
        init_distributed(torch.device("cuda"))


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone (gloo, a file store), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_process_group_the_caller_made_outlives_the_run(one_rank_group, monkeypatch):
    """fastddpm.train inside a script that set up its own group (under torchrun): the run joins it, and the end of
    the run leaves it to its owner, who may still use it."""
    _rank_env(monkeypatch, 0, 1, _free_port())
    info, _ = init_distributed(torch.device("cpu"))
    assert info.enabled and not info.owns_group
    shutdown(info)
    assert dist.is_initialized()
    dist.barrier()  # still usable


# ---------------------------------------------------------------------- sharded checkpoints
def _parts(seed: int):
    torch.manual_seed(seed)
    model, ema = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, ema, opt


def _save(ckpt_dir, step, parts, keep=3):
    model, ema, opt = parts
    return sharded.save_sharded(ckpt_dir, step, model=model, ema_model=ema, optimizer=opt,
                                meta={"step": step, "config": {}}, is_main=True, keep=keep)


def _kill_a_resave_between_its_renames(ckpt_dir, step):
    """What a re-save of `step` killed after moving the old one aside and before renaming the new one leaves."""
    final = sharded.sharded_path(ckpt_dir, step)
    os.replace(final, final.with_name(f".{final.name}.old"))
    (final.with_name(f".{final.name}.tmp")).mkdir()


def test_a_save_keeps_the_checkpoint_a_killed_resave_moved_aside(one_rank_group, tmp_path, monkeypatch):
    """Step 4 exists only as .ckpt_000000004.dcp.old (listed, and what --resume latest loads). The next save must
    not delete it before its own checkpoint is in place: killed mid-save, step 4 still resumes, under its own name."""
    import torch.distributed.checkpoint as dcp

    ckpt_dir = tmp_path / "checkpoints"
    _save(ckpt_dir, 2, _parts(0))
    step4 = _parts(1)
    _save(ckpt_dir, 4, step4)
    _kill_a_resave_between_its_renames(ckpt_dir, 4)
    (ckpt_dir / "ckpt_000000004.dcp").mkdir()  # and an incomplete directory under the final name
    (ckpt_dir / "ckpt_000000004.dcp" / "__0_0.distcp").write_bytes(b"partial")
    assert sharded.list_sharded(ckpt_dir)[-1].name == ".ckpt_000000004.dcp.old"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the save of step 6 never finishes

    monkeypatch.setattr(dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(ckpt_dir, 6, _parts(2))
    monkeypatch.undo()
    path, meta = sharded.latest_sharded(ckpt_dir)
    assert path.name == "ckpt_000000004.dcp" and meta["step"] == 4
    weights = sharded.read_sharded_checkpoint(path)["model"]
    assert all(torch.equal(weights[k], v) for k, v in step4[0].state_dict().items())

    _save(ckpt_dir, 6, _parts(2), keep=2)  # retention counts the restored step like any other
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["ckpt_000000004.dcp", "ckpt_000000006.dcp"]


def test_resaving_the_step_only_its_moved_aside_copy_holds(one_rank_group, tmp_path):
    """A resume at the end of the run loads step 4 from its aside copy and saves step 4 again: one final
    ckpt_000000004.dcp with the new weights, nothing left aside."""
    ckpt_dir = tmp_path / "checkpoints"
    _save(ckpt_dir, 4, _parts(0))
    _kill_a_resave_between_its_renames(ckpt_dir, 4)
    again = _parts(1)
    _save(ckpt_dir, 4, again)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["ckpt_000000004.dcp"]
    weights = sharded.read_sharded_checkpoint(ckpt_dir / "ckpt_000000004.dcp")["model"]
    assert all(torch.equal(weights[k], v) for k, v in again[0].state_dict().items())


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_0_warns_about_the_checkpoint_folder(tmp_path, monkeypatch, rank):
    """Every rank reads the same folder: an interrupted save is reported once for the job, by rank 0."""
    ckpt = tmp_path / "ckpt_000000002.dcp"
    ckpt.mkdir()
    (ckpt / sharded.DCP_METADATA).write_bytes(b"x")
    torch.save({"format": sharded.META_FORMAT, "step": 2}, ckpt / sharded.META)
    (tmp_path / ".ckpt_000000004.dcp.tmp").mkdir()
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, _ = sharded.latest_sharded(tmp_path)
    assert path == ckpt
    said = [str(w.message) for w in caught if "incomplete sharded checkpoint" in str(w.message)]
    assert len(said) == (1 if rank == "0" else 0), said


@pytest.mark.parametrize("local_rank, prints", [("0", True), ("1", False)])
def test_an_error_every_rank_hits_before_the_group_forms_is_said_once_a_node(tmp_path, capsys, monkeypatch,
                                                                             local_rank, prints):
    """Until the process group forms, every process of a torchrun job runs alike on the same command line, config
    and folder. `train` without --out, what the trainer checks before it joins the group (the grids' sampler
    steps, the device), and `eval`'s --device, --checkpoint and --inception, were printed by each of a node's
    processes; now by its first alone, as a usage or config error is, every process ending with status 2. Errors
    of the group itself stay each rank's own (test_a_rank_that_cannot_reach_rank_0_names_the_address_and_the_timeout:
    rank 1, LOCAL_RANK 1, says it)."""
    from fastddpm.cli import main

    for name, value in {"RANK": str(8 + int(local_rank)), "WORLD_SIZE": "16", "LOCAL_RANK": local_rank}.items():
        monkeypatch.setenv(name, value)  # the first and the second process of a second node
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # none of these reaches the rendezvous
    out = tmp_path / "run"
    cases = [(["train", "--preset", "tiny"], "error: train needs --out RUN_DIR"),
             (["train", "--out", str(out), "--preset", "tiny", "--device", "cpu", "--sample-steps", "5000"],
              "error: --sample-steps 5000: the grids' sampler"),
             (["train", "--out", str(out), "--preset", "tiny", "--device", "tpu"],
              "error: train.device='tpu' is not a device"),
             (["eval", "--checkpoint", str(tmp_path), "--device", "tpu"], "error: --device tpu is not a device"),
             (["eval", "--checkpoint", str(tmp_path / "nowhere")],
              f"error: --checkpoint {tmp_path / 'nowhere'} does not exist"),
             (["eval", "--checkpoint", str(tmp_path), "--inception", str(tmp_path / "w.pth")],
              f"error: --inception {tmp_path / 'w.pth'}: no such file")]
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert (says in err) if prints else err == "", (argv, err)
    assert not out.exists()


def test_a_silent_process_under_torchrun_waits_for_the_first_to_say_why(tmp_path, capsys, monkeypatch):
    """torchrun's agent stops every process of a job once one has exited with an error: a later process of a node
    that exits in silence waits first, so that the node's first process, a moment behind on the same error, is not
    stopped before it has printed it. Only under the agent (TORCHELASTIC_RUN_ID); RANK set by hand waits for
    nothing."""
    import time

    import fastddpm.cli as cli

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert cli.main(["train", "--preset", "tiny"]) == 2  # no --out: the same error on every rank
    assert capsys.readouterr().err == "" and slept == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert cli.main(["train", "--preset", "tiny"]) == 2
    with pytest.raises(SystemExit):
        cli.build_parser()[0].parse_args(["train", "--no-such-flag"])
    assert capsys.readouterr().err == "" and slept == [cli.QUIET_EXIT_WAIT_S] * 2
