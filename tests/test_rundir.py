"""fastddpm.rundir: the one owner of what a run leaves on disk. `locate` turns every path a user can pass into a
Checkpoint or one clear error; the Checkpointer alone writes and reads a checkpoint's keys, in the layout every
fastddpm version has written (tests/test_legacy_checkpoints.py loads files an older version wrote)."""

import io
import json
from pathlib import Path

import pytest
import torch

from fastddpm.config import get_preset, resolve_model_shape
from fastddpm.models import build_unet
from fastddpm.rundir import metrics
from fastddpm.rundir.checkpoint import list_checkpoints
from fastddpm.rundir.checkpointer import Checkpointer
from fastddpm.rundir.files import CheckpointError, save_safetensors
from fastddpm.rundir.layout import RunDir
from fastddpm.rundir.locate import find_resume, locate
from fastddpm.trainer.ema import EMA
from fastddpm.trainer.state import TrainState

# The keys of a .pt checkpoint, as every fastddpm version has written them (ema_off_grid since the EMA's last-step
# update; older checkpoints lack it): loaders elsewhere rely on them.
PT_KEYS = {"format", "model", "ema", "optimizer", "scaler", "step", "images_seen", "config", "world_size",
           "global_batch", "micro_split", "cpu_threads", "train_s", "data", "ema_off_grid", "rng"}


def _checkpointer(run_dir: Path, *, seed: int = 0, scaler: bool = False):
    torch.manual_seed(seed)
    cfg = resolve_model_shape(get_preset("tiny"), (16, 1, 28, 28))
    model = build_unet(cfg.model)
    ema = EMA(model, 0.9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    state = TrainState(device=torch.device("cpu"), world_size=1, global_batch=16, cpu_threads=2)
    return Checkpointer(run_dir, model=model, ema=ema, optimizer=optimizer, scaler=grad_scaler, train_state=state,
                        config=cfg.to_dict(), keep=2), model, optimizer, state


def _train_once(model, optimizer):
    loss = model(torch.randn(2, 1, 28, 28), torch.tensor([3, 700])).square().mean()
    loss.backward()
    optimizer.step()


def test_save_then_load_restores_every_object_and_keeps_the_key_layout(tmp_path):
    saver, model, optimizer, state = _checkpointer(tmp_path / "run")
    _train_once(model, optimizer)
    state.step, state.images_seen, state.micro_split, state.train_s = 7, 112, 2, 12.5
    rng_at_save = torch.get_rng_state()
    path = saver.save()
    assert path == tmp_path / "run" / "checkpoints" / "ckpt_000000007.pt"
    assert set(torch.load(path, weights_only=True)) == PT_KEYS
    assert (tmp_path / "run" / "ema.safetensors").is_file()

    loader, model2, optimizer2, state2 = _checkpointer(tmp_path / "run", seed=1)
    assert not torch.equal(next(model2.parameters()), next(model.parameters()))
    torch.manual_seed(123)  # the loaded RNG must replace whatever the process drew since
    loader.load(loader.latest())
    assert (state2.step, state2.images_seen, state2.micro_split, state2.train_s) == (7, 112, 2, 12.5)
    assert state2.saved_by == {"world_size": 1, "global_batch": 16, "cpu_threads": 2}
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)


def test_retention_keeps_the_newest_and_saved_lists_them_oldest_first(tmp_path):
    saver, _, _, state = _checkpointer(tmp_path / "run")
    for step in (1, 2, 3):
        state.step = step
        saver.save()
    assert [p.name for p in saver.saved()] == ["ckpt_000000002.pt", "ckpt_000000003.pt"]
    assert saver.latest().step == 3


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside_and_deletes_nothing(tmp_path):
    saver, _, _, state = _checkpointer(tmp_path / "run")
    saver.keep = 3
    for step in (10, 20, 30):
        state.step = step
        saver.save()
    digests = {p.name: p.with_suffix(".sha256").read_bytes() for p in saver.saved()}
    assert saver.set_aside_after(30) is None  # nothing later than the newest
    folder, steps = saver.set_aside_after(10)
    assert steps == [20, 30] and folder.parent == saver.dir and folder.name.startswith("abandoned-after-000000010-")
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_000000020.pt", "ckpt_000000020.sha256",
                                                        "ckpt_000000030.pt", "ckpt_000000030.sha256"]
    assert {p.name: p.with_suffix(".sha256").read_bytes() for p in folder.glob("*.pt")} == {
        k: v for k, v in digests.items() if k != "ckpt_000000010.pt"}
    assert [p.name for p in saver.saved()] == ["ckpt_000000010.pt"] and saver.latest().step == 10
    state.step = 20  # the new branch's step 20 is written beside, not over, the abandoned one's
    saver.save()
    assert [p.name for p in saver.saved()] == ["ckpt_000000010.pt", "ckpt_000000020.pt"]
    assert (folder / "ckpt_000000020.pt").is_file()


def test_a_resume_moves_the_metrics_of_steps_it_trains_again_aside(tmp_path):
    log = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "images_seen": 16 * s, "loss": 1.0 / s}) for s in (5, 10, 15, 20)]
    log.write_text("\n".join(lines) + "\n" + '{"step": 25, "ima')  # the last line cut short by a kill
    assert metrics.set_aside_after(log, 20) == 1  # only the cut line
    assert metrics.set_aside_after(log, 10) == 2
    assert [r["step"] for r in metrics.read_metrics(log)] == [5, 10]
    aside = (tmp_path / "metrics.abandoned.jsonl").read_text().splitlines()
    assert aside == ['{"step": 25, "ima', lines[2], lines[3]]
    assert metrics.set_aside_after(log, 10) == 0 and metrics.set_aside_after(tmp_path / "none.jsonl", 0) == 0


def test_a_torchrun_restart_resumes_the_newest_checkpoint_not_the_one_first_given(tmp_path, monkeypatch):
    """Under torchrun --max-restarts, a run started with --resume ckpt_X that failed later restarts from its own
    newest checkpoint: X again would go back, setting aside every step trained since. Before its first save,
    the given checkpoint is still the one."""
    from fastddpm.distributed import DistInfo
    from fastddpm.trainer.setup import _join_ranks

    cfg, dist = get_preset("tiny"), DistInfo(rank=0, world_size=2, backend="gloo")
    given = tmp_path / "elsewhere" / "ckpt_000000010.pt"
    run = RunDir(tmp_path / "run")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    join = lambda resume: _join_ranks(cfg, dist, torch.device("cpu"), "", resume, lambda *a: None, run)[2]  # noqa
    assert join(given) == given and join(None) == "latest"  # no checkpoint of its own yet
    saver, _, _, state = _checkpointer(run.path)
    state.step = 12
    saver.save()
    assert join(given) == "latest"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert join(given) == given  # the first start: as given


def test_resume_notes_name_what_cannot_stay_bit_exact():
    state = TrainState(device=torch.device("cpu"), world_size=2, global_batch=32, cpu_threads=4)
    state.saved_by = {"world_size": 1, "global_batch": 16, "cpu_threads": 2}
    notes = state.resume_notes("global")
    assert len(notes) == 2
    assert "2 CPU thread(s), this run has 4" in notes[0] and "--cpu-threads 2" in notes[0]
    assert "written by 1 rank, this run has 2" in notes[1] and "kept, --global-batch-size is fixed" in notes[1]
    state.saved_by = {"world_size": 2, "global_batch": 32, "cpu_threads": 4}
    assert state.resume_notes("per device") == []
    # the same world, another batch (--batch-size or --accum-steps changed): said too
    state.saved_by = {"world_size": 2, "global_batch": 64, "cpu_threads": 4}
    (note,) = state.resume_notes("per device")
    assert "global batch of 64, this run has 32" in note and "data order" in note


def test_run_dir_of_any_path_a_run_leaves(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "ckpt_000000002.dcp").mkdir(parents=True)
    (run / "checkpoints" / "ckpt_000000001.pt").write_bytes(b"x")
    (run / "ema.safetensors").write_bytes(b"x")
    for path in (run, run / "checkpoints" / "ckpt_000000001.pt", run / "checkpoints" / "ckpt_000000002.dcp",
                 run / "ema.safetensors"):
        assert RunDir.of(path).path == run, path
    assert RunDir.of(tmp_path / "elsewhere" / "weights.safetensors").path == tmp_path / "elsewhere"


def test_locate_names_each_bad_path_and_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match=r"does not exist\. Pass a run directory"):
        locate(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint and no ema.safetensors"):
        locate(tmp_path / "empty")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01")
    with pytest.raises(CheckpointError, match="not a readable safetensors file.*truncated"):
        locate(junk)
    foreign = tmp_path / "foreign.safetensors"
    save_safetensors({"w": torch.ones(2)}, foreign, {"note": "not ours"})
    with pytest.raises(CheckpointError, match="no fastddpm config in its metadata"):
        locate(foreign)
    image = tmp_path / "picture.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 32)
    with pytest.raises(CheckpointError, match=r"picture.png is not a PyTorch checkpoint file \(it starts with"):
        locate(image)
    truncated = tmp_path / "truncated.pt"
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(1000)}, buffer)
    truncated.write_bytes(buffer.getvalue()[:2000])
    with pytest.raises(CheckpointError, match="could not load checkpoint .*truncated.pt.*if the file is truncated"):
        locate(truncated)
    dcp = tmp_path / "ckpt_000000001.dcp"
    dcp.mkdir()
    with pytest.raises(CheckpointError, match="could not load .*meta.pt"):
        locate(dcp)


def test_a_bit_flip_is_caught_and_latest_falls_back(tmp_path):
    saver, _, _, state = _checkpointer(tmp_path / "run")
    for step in (1, 2):
        state.step = step
        saver.save()
    newest = list_checkpoints(saver.dir)[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted.*SHA-256.*use an earlier checkpoint of the same folder, or "
                                              "pass the run directory"):
        locate(newest)
    # the run directory given, the warning says what was wrong and not the fix ("pass the run directory"): the
    # fallback to an earlier checkpoint is the fix
    with pytest.warns(UserWarning, match=r"skipping unusable checkpoint: checkpoint .*ckpt_000000002.pt is corrupted "
                                         r"\(its SHA-256 does not match ckpt_000000002.sha256\)$"):
        assert locate(tmp_path / "run").step == 1
    # every checkpoint broken: the folder holds checkpoints, none usable (not "holds no checkpoint"), and the fix
    oldest = list_checkpoints(saver.dir)[0]
    oldest.write_bytes(oldest.read_bytes()[:-10])
    with pytest.warns(UserWarning, match="skipping unusable checkpoint"):
        assert locate(tmp_path / "run").kind == "safetensors"  # the EMA weights are still there to sample
    (tmp_path / "run" / "ema.safetensors").unlink()
    with pytest.warns(UserWarning, match="skipping unusable checkpoint"):
        with pytest.raises(CheckpointError, match=r"none of its 2 checkpoint\(s\) loads \(ckpt_000000001.pt, "
                                                  r"ckpt_000000002.pt: .*Restore a checkpoint"):
            locate(tmp_path / "run")


def test_fastddpms_own_warnings_print_as_one_line_and_others_as_python_does():
    import warnings

    import fastddpm.rundir.locate as ours
    from fastddpm.cli import _plain_warnings

    original = warnings.formatwarning
    with _plain_warnings():
        assert warnings.formatwarning("skipping unusable checkpoint: x", UserWarning, ours.__file__, 101) == (
            "warning: skipping unusable checkpoint: x\n")
        assert warnings.formatwarning("torch.load is changing", FutureWarning, ours.__file__, 9) == (
            "warning (FutureWarning): torch.load is changing\n")  # a deprecation keeps its kind
        theirs = warnings.formatwarning("deprecated", FutureWarning, "/elsewhere/train.py", 7, "x = 1")
        assert theirs == original("deprecated", FutureWarning, "/elsewhere/train.py", 7, "x = 1")
    assert warnings.formatwarning is original


def test_find_resume_reads_latest_a_run_and_refuses_weights_only(tmp_path):
    assert find_resume(tmp_path / "new", None) is None
    assert find_resume(tmp_path / "new", "latest") is None  # a new run: nothing to resume yet
    (tmp_path / "bare").mkdir()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        find_resume(tmp_path / "x", tmp_path / "bare")
    saver, _, _, state = _checkpointer(tmp_path / "run")
    state.step = 5
    saver.save()
    assert find_resume(tmp_path / "run", "latest").step == 5
    assert find_resume(tmp_path / "other", tmp_path / "run").step == 5
    export = locate(tmp_path / "run" / "ema.safetensors")
    with pytest.raises(CheckpointError, match="holds only the EMA weights"):
        export.check_resumable(sharded_run=False)
    with pytest.raises(CheckpointError, match="--parallel fsdp reads sharded"):
        find_resume(tmp_path / "run", "latest").check_resumable(sharded_run=True)


def _full_disk_on(monkeypatch, hit, code: int | None = None) -> None:
    """Checkpoint writes of the paths `hit` picks fail as a full disk does (ENOSPC, or `code`); the others go
    through."""
    import errno
    import os

    from fastddpm.rundir import checkpoint

    real_write = checkpoint.atomic_write_bytes
    code = errno.ENOSPC if code is None else code

    def write(path, data):
        if hit(path):
            raise OSError(code, os.strerror(code))
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "atomic_write_bytes", write)


def test_a_full_disk_while_writing_the_checkpoint_leaves_no_digest_that_fails_a_good_one(tmp_path, monkeypatch):
    """The digest is written first, then the checkpoint, the large write where a full disk strikes. The new digest
    must not stay: beside no file, or beside this step's earlier checkpoint (saved again by a resume at the end),
    where it failed that whole file as corrupted and `--resume latest` fell back to an older one."""
    from fastddpm.rundir import checkpoint

    d = tmp_path / "checkpoints"
    for step in (1, 2):
        checkpoint.save_checkpoint(d, step, {"step": step, "w": torch.ones(3)}, keep=3)
    before = sorted((p.name, p.read_bytes()) for p in d.iterdir())
    _full_disk_on(monkeypatch, lambda path: path.suffix == ".pt")
    for step, value in ((3, 1.0), (2, 2.0)):  # a new step; step 2 again, with other contents
        with pytest.raises(OSError, match="No space left"):
            checkpoint.save_checkpoint(d, step, {"step": step, "w": torch.full((3,), value)}, keep=3)
    assert sorted((p.name, p.read_bytes()) for p in d.iterdir()) == before
    path, state = checkpoint.load_latest(d)
    assert path.name == "ckpt_000000002.pt" and torch.equal(state["w"], torch.ones(3))


def test_out_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    """`train --out` a file, or a folder under one, was a FileExistsError / NotADirectoryError traceback from mkdir."""
    from fastddpm.cli import main
    from fastddpm.config import ConfigError

    afile = tmp_path / "notes.txt"
    afile.write_text("not a run")
    for out in (afile, afile / "run"):
        for resume in (None, "latest"):
            with pytest.raises(ConfigError, match=rf"--out {out}: {afile} is a file, and a run directory is a folder"):
                find_resume(out, resume)
    assert main(["train", "--preset", "tiny", "--max-steps", "1", "--out", str(afile), "--device", "cpu"]) == 2
    assert f"{afile} is a file" in capsys.readouterr().err and afile.read_text() == "not a run"


def test_a_checkpoint_set_aside_with_an_abandoned_branch_belongs_to_its_run(tmp_path):
    """`sample`, `eval` and `export` of such a checkpoint wrote their default output (and looked for the run's
    metrics) inside checkpoints/abandoned-after-*/."""
    run = tmp_path / "run"
    aside = run / "checkpoints" / "abandoned-after-000000010-20260101T000000Z"
    (aside / "ckpt_000000030.dcp").mkdir(parents=True)
    (aside / "ckpt_000000020.pt").write_bytes(b"x")
    for path in (aside / "ckpt_000000020.pt", aside / "ckpt_000000030.dcp"):
        assert RunDir.of(path).path == run, path
    assert RunDir.of(tmp_path / "abandoned-after-x" / "ema.safetensors").path == tmp_path / "abandoned-after-x"


@pytest.mark.parametrize("errname", ["ENOSPC", "EFBIG"])  # EFBIG: a file past FAT32's 4 GiB or `ulimit -f`
def test_a_full_disk_ends_the_run_with_what_is_intact_and_how_to_go_on(tmp_path, fmnist_npz, capsys, monkeypatch,
                                                                       errname):
    """ENOSPC while writing step 2's checkpoint: `fastddpm train` stops with one error line naming the folder, the
    checkpoint that is intact (step 1) and the way on, not an OSError traceback; step 1 still resumes."""
    import errno
    import os

    from fastddpm.cli import main

    _full_disk_on(monkeypatch, lambda path: path.name == "ckpt_000000002.pt", getattr(errno, errname))
    run = tmp_path / "run"
    code = main(["train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny", "--no-progress",
                 "--set", "train.max_steps=3", "--set", "train.checkpoint_every=1",
                 "--set", "train.num_sample_images=4", "--set", "train.sample_steps=2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    said = os.strerror(getattr(errno, errname))
    assert f"could not write the checkpoint of step 2 in {run / 'checkpoints'}: {said} ({errname})" in err
    assert "ckpt_000000001.pt (step 1), is intact" in err and "--resume latest" in err
    assert ("ulimit -f" in err) == (errname == "EFBIG") and ("free space" in err) == (errname == "ENOSPC")
    assert find_resume(run, "latest").step == 1


def test_a_sharded_checkpoint_moved_aside_by_a_killed_resave_still_counts(tmp_path):
    """Re-saving step 2 moves its checkpoint aside (.ckpt_000000002.dcp.old), then renames the new one into place:
    killed between the two, step 2's whole checkpoint is only under the aside name, and must not be lost."""
    from fastddpm.rundir import sharded

    def complete(name):
        (tmp_path / name).mkdir()
        for f in (sharded.DCP_METADATA, sharded.META):
            (tmp_path / name / f).write_bytes(b"x")

    complete("ckpt_000000001.dcp")
    complete(".ckpt_000000002.dcp.old")
    (tmp_path / ".ckpt_000000003.dcp.tmp").mkdir()  # a save in flight is never listed
    assert [p.name for p in sharded.list_sharded(tmp_path)] == ["ckpt_000000001.dcp", ".ckpt_000000002.dcp.old"]
    (tmp_path / "ckpt_000000002.dcp").mkdir()  # renamed into place but incomplete: the aside one still stands
    assert sharded.list_sharded(tmp_path)[-1].name == ".ckpt_000000002.dcp.old"
    for f in (sharded.DCP_METADATA, sharded.META):
        (tmp_path / "ckpt_000000002.dcp" / f).write_bytes(b"x")
    assert [p.name for p in sharded.list_sharded(tmp_path)] == ["ckpt_000000001.dcp", "ckpt_000000002.dcp"]


def test_a_metrics_line_cut_short_by_a_kill_neither_breaks_the_reader_nor_swallows_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = metrics.MetricsLog(path)
    log.write({"step": 1, "loss": 0.5})
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')  # killed mid-write
    assert metrics.read_metrics(path) == [{"step": 1, "loss": 0.5}]
    log.write({"step": 2, "loss": 0.4})  # the run resumed: its record starts a line of its own
    assert metrics.read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]


@pytest.mark.parametrize("rank, warns", [("0", True), ("1", False)])
def test_only_rank_0_warns_that_it_skips_an_unusable_checkpoint(tmp_path, monkeypatch, rank, warns):
    """Every rank of a torchrun job looks for the newest checkpoint and skips the same broken one: one warning."""
    import warnings

    from fastddpm.rundir import checkpoint

    d = tmp_path / "checkpoints"
    for step in (1, 2):
        checkpoint.save_checkpoint(d, step, {"step": step}, keep=3)
    (d / "ckpt_000000002.pt").write_bytes(b"PK\x03\x04 truncated")
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, _ = checkpoint.load_latest(d)
    assert path.name == "ckpt_000000001.pt"
    assert any("skipping unusable checkpoint" in str(w.message) for w in caught) == warns


@pytest.mark.parametrize("check", ["make_writable_dir", "check_writable_dir"])
@pytest.mark.parametrize("below", [False, True])
def test_an_out_folder_through_a_link_to_nothing_is_refused_naming_the_link(tmp_path, check, below):
    """A link whose target is gone exists() as False, so an output folder at or below it passed the early check
    and failed after the work (an evaluation's sampling and scoring) with FileExistsError."""
    from fastddpm.config import ConfigError
    from fastddpm.rundir import files

    link = tmp_path / "results"
    link.symlink_to(tmp_path / "gone")
    out = link / "eval" if below else link
    with pytest.raises(ConfigError) as e:
        getattr(files, check)(out, flag="--out", fix="give a folder that can be created")
    assert str(e.value) == (f"--out {out}: {link} is a link to {tmp_path / 'gone'}, which does not exist (make that "
                            "folder): give a folder that can be created")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"] and not (tmp_path / "gone").exists()


def test_a_link_loop_is_said_to_be_one(tmp_path):
    from fastddpm.config import ConfigError
    from fastddpm.rundir.files import make_writable_dir

    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ConfigError, match=r"loop is a link that leads back to itself \(a loop\): give"):
        make_writable_dir(tmp_path / "loop" / "run", flag="--out", fix="give another")


def test_a_run_directory_through_a_link_to_nothing_is_refused_before_the_run_starts(tmp_path):
    from fastddpm.config import ConfigError

    (tmp_path / "runs").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=r"runs is a link to .*gone, which does not exist \(make that folder\)"):
        find_resume(tmp_path / "runs" / "a", None)


def test_the_folders_made_for_a_refused_command_are_removed_only_while_empty(tmp_path):
    from fastddpm.rundir.files import make_writable_dir, remove_if_empty

    (tmp_path / "kept").mkdir()
    created = make_writable_dir(tmp_path / "kept" / "a" / "b", flag="--out", fix="give another")
    assert created == [tmp_path / "kept" / "a", tmp_path / "kept" / "a" / "b"]  # the outermost new one first
    (tmp_path / "kept" / "a" / "note.txt").write_text("written meanwhile")
    remove_if_empty(created)
    assert not (tmp_path / "kept" / "a" / "b").exists() and (tmp_path / "kept" / "a" / "note.txt").is_file()
    assert make_writable_dir(tmp_path / "kept", flag="--out", fix="give another") == []


def test_a_second_trainer_into_a_run_folder_in_use_is_refused_and_a_run_leaves_no_lock_file(tmp_path, fmnist_npz,
                                                                                            capsys):
    """`fastddpm train` started again into the folder of a run still training (another terminal, `--resume latest`,
    or before the first checkpoint) is refused before it writes there, naming the process that holds it: both had
    trained, overwriting each other's checkpoints and interleaving one metrics.jsonl. The holder here is this
    process's own lock on another open file, which flock treats as another holder; the run that ends, or is
    refused in set-up, leaves no lock file."""
    from fastddpm.cli import main
    from fastddpm.rundir.lock import RunFolderLock

    run = tmp_path / "run"
    run.mkdir()
    # (a final grid of 4 images in 2 steps, not the preset's 16 in 10: the run's folder and lock are what is read)
    argv = ["train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny", "--max-steps", "1",
            "--device", "cpu", "--no-progress", "--num-sample-images", "4", "--sample-steps", "2"]
    with RunFolderLock(run) as held:
        assert held.file is not None
        for extra in ([], ["--resume", "latest"]):
            assert main([*argv, *extra]) == 2
            err = capsys.readouterr().err
            assert f"error: --out {run}: another fastddpm train is writing this run folder (pid " in err
            assert "wait for it to end, or stop it" in err and "--resume latest; or give another --out" in err
            assert sorted(p.name for p in run.iterdir()) == [".train.lock"]  # nothing of a run written
    assert not (run / ".train.lock").exists()
    assert main(argv) == 0
    assert not (run / ".train.lock").exists() and (run / "checkpoints").is_dir()
    # refused in set-up (a batch larger than the data): no folder, no lock file left
    assert main([*argv[:4], str(tmp_path / "new"), *argv[5:], "--batch-size", "1000"]) == 2
    assert not (tmp_path / "new").exists()


def test_a_trainer_that_locks_the_file_its_holder_removed_as_it_let_go_takes_the_new_one(tmp_path, monkeypatch):
    """Three trainers into one folder: B opens the lock file while A holds it; A ends (removing the file, then
    closing it); C opens the path, creating a new file, and locks it; B's lock on the removed file then succeeds.
    Without a check B and C would both train there: B must see its file is no longer the one at the path, open the
    path again, and be refused by C's lock."""
    import fcntl
    import os

    from fastddpm.config import ConfigError
    from fastddpm.rundir.lock import RunFolderLock

    run = tmp_path / "run"
    run.mkdir()
    a = RunFolderLock(run)
    real_flock, held = fcntl.flock, {}

    def flock_after_a_lets_go_and_c_locks(file, op):
        if not held:  # B's first try, after opening the file A holds
            held["b"] = True
            a.release()
            held["c"] = RunFolderLock(run)
        return real_flock(file, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_lets_go_and_c_locks)
    with pytest.raises(ConfigError, match=f"--out {run}: another fastddpm train is writing this run folder "
                                          f"\\(pid {os.getpid()} on "):
        RunFolderLock(run)  # B
    monkeypatch.setattr(fcntl, "flock", real_flock)
    c = held["c"]
    assert c.file is not None and (run / ".train.lock").exists()
    c.release()
    assert not (run / ".train.lock").exists()
