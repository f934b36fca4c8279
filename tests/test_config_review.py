"""What a user meets around a run: config files layered like the other layers (a run length replacing the
preset's, YAML's on/off, a field or section out of place named with the fix), the loggers of a run started again
in a folder that an earlier, checkpoint-less run wrote to, and the plain progress lines' ETA."""

from __future__ import annotations

import sys
import types

import pytest

from fastddpm.cli import build_parser, resolve_train_config
from fastddpm.config import ConfigError, apply_overrides, get_preset, resolve_config


def _train_args(argv):
    parser, dests = build_parser()
    return parser.parse_args(["train", *argv]), dests


@pytest.mark.parametrize("text", ["preset: cpu-demo\ntrain: {max_steps: 100}\n",
                                  "preset: cpu-demo\ntrain: {max-steps: 100}\n",
                                  "preset: cpu-demo\ntrain.max_steps: 100\n"])
def test_a_config_files_run_length_replaces_the_presets(tmp_path, text):
    """cpu-demo plans max_images; a file asking for max_steps trains that many steps, as --max-steps does."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    args, dests = _train_args(["--out", str(tmp_path / "r"), "--config", str(f)])
    cfg = resolve_train_config(args, dests)
    assert (cfg.train.max_steps, cfg.train.max_images, cfg.train.max_epochs) == (100, None, None)
    assert cfg.train.lr == get_preset("cpu-demo").train.lr  # the rest of the preset stays


def test_a_config_file_still_gives_one_run_length_and_a_saved_config_loads(tmp_path):
    f = tmp_path / "two.yaml"
    f.write_text("preset: cpu-demo\ntrain: {max_steps: 100, max_images: 500}\n")
    with pytest.raises(ConfigError, match="give only one of"):
        resolve_config(file=f)
    saved = tmp_path / "config.json"  # a run's config.json names all three lengths, two of them null
    import json

    cfg = apply_overrides(get_preset("tiny"), {"train.max_epochs": 3, "train.max_steps": None})
    saved.write_text(json.dumps(cfg.to_dict()))
    assert resolve_config(file=saved) == cfg


def test_yaml_on_and_off_reach_the_on_off_fields(tmp_path):
    """YAML 1.1 reads unquoted off/on/no/yes as booleans: `compile: off` was refused as 'False' not being 'off'."""
    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\ntrain: {compile: off, cudnn_benchmark: on, channels_last: no}\n")
    cfg = resolve_config(file=f)
    assert (cfg.train.compile, cfg.train.cudnn_benchmark, cfg.train.channels_last) == ("off", "on", "off")
    f.write_text("preset: tiny\nmodel: {attention: off}\n")  # a boolean field keeps its boolean
    assert resolve_config(file=f).model.attention is False


def test_a_field_or_section_out_of_place_is_named_with_the_fix(tmp_path):
    f = tmp_path / "flat.yaml"
    f.write_text("preset: tiny\nlr: 0.01\n")  # a field written without its section
    with pytest.raises(ConfigError, match=r"flat.yaml: 'lr' is no config section: it is a field of train: put it "
                                          r"under `train:`"):
        resolve_config(file=f)
    f.write_text("preset: tiny\ntrian: {lr: 0.01}\n")
    with pytest.raises(ConfigError, match=r"flat.yaml: 'trian' is no config section: did you mean 'train'\?") as e:
        resolve_config(file=f)
    assert "flat.yaml.trian" not in str(e.value)  # no field of that name exists to blame
    with pytest.raises(ConfigError, match=r"--set: 'trian' is no config section: did you mean 'train'\?"):
        resolve_config("tiny", layers=[("--set", {"trian.lr": "0.01"})])


@pytest.mark.parametrize("text, match", [
    ("train: {lrr: 0.1}\n", r"config file .*bad.yaml: unknown config field train.lrr \(did you mean 'lr'\?\)"),
    ("train: {lr: abc}\n", r"config file .*bad.yaml: train.lr='abc' is not a valid float"),
    ("train: {lr: -1}\n", r"config file .*bad.yaml: train.lr=-1.0 must be > 0"),
])
def test_a_bad_field_or_value_in_a_config_file_names_the_file(tmp_path, text, match):
    """A misspelt field or a bad value inside a config file was named without the file it came from, which a run
    configured from a preset, a file and flags leaves the user to guess."""
    f = tmp_path / "bad.yaml"
    f.write_text("preset: tiny\n" + text)
    with pytest.raises(ConfigError, match=match):
        resolve_config(file=f)


def test_a_config_file_that_is_no_text_or_a_folder_is_named_not_a_traceback(tmp_path):
    """A config file saved as UTF-16 (a Windows editor's "Unicode") or a binary file given by mistake ended in a
    UnicodeDecodeError traceback; a folder was said not to exist."""
    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\n", encoding="utf-16")
    with pytest.raises(ConfigError, match=r"config file .*c.yaml is not UTF-8 text \(byte 0\): save it as UTF-8"):
        resolve_config(file=f)
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"config file .*d.yaml does not exist \(it is a folder\)"):
        resolve_config(file=tmp_path / "d.yaml")


def test_a_path_written_relative_to_the_config_files_folder_is_refused_naming_both_readings(tmp_path, monkeypatch):
    """A config file's relative data.source is read from the working directory, as the same path typed as a flag
    is. One written relative to the file's own folder (configs/run.yaml naming data/x.npz beside it) named a data
    set nowhere, and the data layer then said only that it was missing (or tried it as a data set's name)."""
    (tmp_path / "configs" / "data").mkdir(parents=True)
    (tmp_path / "configs" / "data" / "x.npz").write_bytes(b"")
    f = tmp_path / "configs" / "run.yaml"
    f.write_text("preset: tiny\ndata: {source: data/x.npz}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"run.yaml: data.source='data/x.npz' is read from the working directory "
                                          r"\(.*\), where it does not exist; beside the config file it is "
                                          r".*configs/data/x.npz: write that path"):
        resolve_config(file=f)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.npz").write_bytes(b"")  # there from the working directory too: that one is read
    assert resolve_config(file=f).data.source == "data/x.npz"
    monkeypatch.chdir(tmp_path / "configs")  # run from the file's folder: the two readings are one
    assert resolve_config(file=f).data.source == "data/x.npz"


def test_a_beta_given_with_the_cosine_schedule_is_refused_not_ignored():
    """The cosine schedule computes its own betas: ddpm-rgb64 is cosine, so `--beta-end 0.01` on it changed
    nothing. With --schedule linear (or set to none) it is a setting again."""
    with pytest.raises(ConfigError, match=r"diffusion.beta_end='0.01' \(command line\) sets the linear schedule's "
                                          r"betas, and this run's schedule is cosine.*add --schedule linear"):
        resolve_config("ddpm-rgb64", layers=[("command line", {"diffusion.beta_end": "0.01"})])
    with pytest.raises(ConfigError, match=r"diffusion.beta_start=0.001 \(fastddpm.train\)"):
        resolve_config("tiny", layers=[("fastddpm.train", {"schedule": "cosine", "beta_start": 0.001})])
    cfg = resolve_config("ddpm-rgb64", layers=[("command line", {"schedule": "linear", "beta_end": "0.01"})])
    assert cfg.diffusion.linear_beta_range() == (1e-4, 0.01)
    assert resolve_config("ddpm-rgb64", layers=[("--set", {"diffusion.beta_end": "none"})]).diffusion.beta_end is None
    assert resolve_config("ddpm-rgb64").diffusion.schedule == "cosine"  # the preset alone is no setting


@pytest.mark.parametrize("key, value, match", [
    ("diffusion.edm_p_mean", "nan", r"diffusion.edm_p_mean=nan must be a finite number \(EDM's: -1.2\)"),
    ("diffusion.edm_p_std", "inf", r"edm_p_std=inf must be finite and > 0"),
    ("diffusion.sigma_data", "inf", r"diffusion.sigma_data=inf and edm_p_std=1.2 must be finite and > 0"),
    ("diffusion.flow_shift", "inf", r"diffusion.flow_shift=inf must be finite and > 0 \(1 = no shift\)"),
    ("train.sample_guidance", "inf", r"train.sample_guidance=inf must be a finite number >= 0"),
    ("train.dist_timeout_s", "inf", r"train.dist_timeout_s=inf must be a finite number of seconds > 0"),
])
def test_a_float_field_refuses_inf_and_nan_naming_the_field(key, value, match):
    """These passed their `> 0` / `>= 0` checks (or had none): nan or inf noise levels train on NaN losses, an inf
    guidance scale samples NaN images, an inf timeout overflows torch's timedelta under torchrun."""
    with pytest.raises(ConfigError, match=match):
        apply_overrides(get_preset("tiny"), {key: value})


# ---------------------------------------------------------------------------------------------------------------
# Loggers of a new run in a folder an earlier run (stopped before its first checkpoint) logged to


def test_tensorboard_a_new_run_hides_what_an_earlier_run_logged_in_its_folder(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from fastddpm.trainer.loggers import RunLoggers

    cfg = apply_overrides(get_preset("tiny"), {"train.log_to": "tensorboard"})
    first = RunLoggers(tmp_path, cfg)
    for step in range(1, 11):
        first.record({"step": step, "loss": float(step)})
    first.close()
    # TensorBoard reads a folder's event files in name order, and a name holds the second it was opened in: the
    # first run's renamed to sort first, as a run minutes older does
    for path in (tmp_path / "tensorboard").iterdir():
        path.rename(path.with_name(path.name.replace("events.out.tfevents.", "events.out.tfevents.0")))
    second = RunLoggers(tmp_path, cfg)  # a new run (resumed_step None): the same command again, say
    for step in range(1, 4):
        second.record({"step": step, "loss": 100.0 + step})
    second.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 101.0), (2, 102.0), (3, 103.0)]


def test_wandb_a_new_run_gets_its_own_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    """W&B drops the steps of a resumed W&B run up to its last logged one: a new run that took over an earlier
    run's id (left in RUN_DIR/wandb_run_id) would lose its history up to where that one stopped."""
    from fastddpm.trainer.loggers import RunLoggers

    inits = []
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kw: kw
    fake.init = lambda **kw: inits.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = apply_overrides(get_preset("tiny"), {"train.log_to": "wandb"})
    RunLoggers(tmp_path, cfg)
    RunLoggers(tmp_path, cfg)  # a new run again: its own W&B run
    RunLoggers(tmp_path, cfg, resumed_step=8)  # resumed: the same W&B run as the run it resumes
    first, second, resumed = (kw["id"] for kw in inits)
    assert first != second and resumed == second
    assert (tmp_path / "wandb_run_id").read_text().strip() == second
