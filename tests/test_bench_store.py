"""bench/store.py: result files replaced atomically, and earlier rows reused only under an equal identity."""

import json
import os

import pytest

from fastddpm.bench import store

ENV = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0+cu128", "cuda_runtime": "12.8",
       "date_utc": "2026-11-22T10:00:00+00:00", "command_line": "fastddpm bench ladder", "git_commit": "a" * 40,
       "git_dirty": False}


def _write(path, rows):
    path.write_text(json.dumps({"schema": "s-1", "results": rows}))


def _previous(path, **kw):
    return store.Previous(path, schema="s-1", rows=lambda d: d["results"], remeasure=False, log=lambda m: None, **kw)


def test_rows_are_reused_only_under_an_equal_identity(tmp_path):
    identity = store.canonical({"batch": 64, "shape": (1, 28, 28), **store.device_identity(ENV)})
    ok = {"status": "ok", "identity": identity, "images_per_s": 1.0, "run": store.run_record(ENV)}
    failed = {"status": "failed", "identity": {**identity, "batch": 128}, "error_type": "out of memory"}
    path = tmp_path / "r.json"
    _write(path, [ok, failed])

    prev = _previous(path)
    assert prev.take({"batch": 64, "shape": (1, 28, 28), **store.device_identity(ENV)}) == ok  # tuples == lists
    assert prev.take(identity) is None  # each earlier row is taken once
    assert prev.failed_before({**identity, "batch": 128})["error_type"] == "out of memory"
    assert prev.take({**identity, "batch": 128}) is None  # failed rows are measured again, not reused

    for other in ({"torch": "2.12.0+cu126"}, {"device_name": "NVIDIA A100-SXM4-80GB"}, {"cuda_runtime": "12.6"}):
        prev = _previous(path)
        assert prev.take({"batch": 64, "shape": (1, 28, 28), **store.device_identity({**ENV, **other})}) is None, other
        prev.finish_matching()  # the unmatched ok row: the old file is kept aside, not silently lost
        assert (tmp_path / "r.replaced.json").is_file()
        os.replace(tmp_path / "r.replaced.json", path)
    # the device index does not matter (cuda and cuda:0 are one GPU)
    assert store.device_identity({**ENV, "device": "cuda"}) == store.device_identity(ENV)


def test_remeasure_and_foreign_files_start_afresh(tmp_path):
    path = tmp_path / "r.json"
    _write(path, [{"status": "ok", "identity": {"a": 1}}])
    prev = store.Previous(path, schema="s-1", rows=lambda d: d["results"], remeasure=True, log=lambda m: None)
    assert prev.take({"a": 1}) is None and (tmp_path / "r.replaced.json").is_file() and not path.exists()
    path.write_text('{"schema": "s-1", "results": [')  # cut short
    assert _previous(path).take({"a": 1}) is None
    path.write_text(json.dumps({"schema": "other", "results": [{"status": "ok", "identity": {"a": 1}}]}))
    assert _previous(path).take({"a": 1}) is None
    assert _previous(tmp_path / "missing.json").take({"a": 1}) is None


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    store.write_json(path, {"rows": [1], "x": float("nan")})
    assert json.loads(path.read_text()) == {"rows": [1], "x": None}  # strict JSON: NaN becomes null

    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        store.write_json(path, {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1], "x": None}


def test_a_new_optional_config_field_keeps_the_identity():
    before = {"train": {"lr": 1e-3, "batch_size": 16}, "model": {"attention": True}}
    after = {"train": {"lr": 1e-3, "batch_size": 16, "cpu_threads": None}, "model": {"attention": True}}
    assert store.config_identity(after) == store.config_identity(before)
    assert store.config_identity({**after, "train": {**after["train"], "cpu_threads": 4}}) != \
        store.config_identity(before)


def test_the_commit_a_caller_gives_is_the_records_commit(monkeypatch):
    """A tree copied to the GPU machine carried a stale .git: FASTDDPM_COMMIT (gpu_session.sh sets it) wins."""
    from fastddpm.measure import git_state

    monkeypatch.setenv("FASTDDPM_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    assert git_state() == {"git_commit": "0123456789abcdef0123456789abcdef01234567", "git_dirty": None,
                           "git_commit_source": "FASTDDPM_COMMIT"}
    monkeypatch.delenv("FASTDDPM_COMMIT")
    assert git_state()["git_commit"] != "0123456789abcdef0123456789abcdef01234567"
