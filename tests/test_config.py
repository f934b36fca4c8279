"""Config layering (preset < file < --set < flags), validation messages that name the field, and --help."""

import dataclasses
import json

import pytest

from fastddpm.cli import build_parser, main, resolve_train_config
from fastddpm.config import ConfigError, RunConfig, TrainConfig, apply_overrides, from_dict, get_preset, qualify


def _args(argv):
    parser, dests = build_parser()
    return parser.parse_args(["train", *argv]), dests


def test_layers_preset_file_set_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\ntrain:\n  lr: 0.005\n  batch_size: 8\ndiffusion: {schedule: cosine}\n")
    args, dests = _args(["--out", str(tmp_path / "r"), "--config", str(f), "--set", "train.lr=0.002",
                         "--batch-size", "4", "--down-channels", "16,32,32", "--no-attention"])
    cfg = resolve_train_config(args, dests)
    assert cfg.preset == "tiny"
    assert cfg.train.lr == 0.002           # --set beats the file
    assert cfg.train.batch_size == 4       # a flag beats the file
    assert cfg.diffusion.schedule == "cosine"
    assert cfg.model.down_channels == (16, 32, 32) and cfg.model.attention is False
    assert cfg.train.max_steps == 20       # from the preset


def test_json_config_and_length_flags_replace_each_other(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"train": {"max_epochs": 2}}))
    args, dests = _args(["--out", "r", "--preset", "seed-1layer", "--config", str(f), "--max-images", "1000"])
    cfg = resolve_train_config(args, dests)
    assert cfg.train.max_images == 1000 and cfg.train.max_epochs is None and cfg.train.max_steps is None


def test_the_api_and_the_command_line_resolve_alike():
    """One resolver (fastddpm.config.resolve_config): keyword arguments of fastddpm.train layer over a preset as
    flags do, a run length replacing the preset's (cpu-demo plans max_images), bare field names placed in their
    section; --set takes bare names too."""
    from fastddpm.api import _config

    api = _config("cpu-demo", {"max_steps": 3, "lr": 1e-3, "diffusion.schedule": "linear", "objective": "ddpm"})
    args, dests = _args(["--out", "r", "--preset", "cpu-demo", "--max-steps", "3", "--set", "lr=1e-3",
                         "--set", "diffusion.schedule=linear", "--objective", "ddpm"])
    assert api == resolve_train_config(args, dests)
    assert api.diffusion.schedule == "linear" and api.diffusion.objective == "ddpm"
    assert api.train.max_steps == 3 and api.train.max_images is None and api.train.lr == 1e-3
    with pytest.raises(ConfigError, match=r"'max_stepz' is in no config section: did you mean max_steps"):
        _config("cpu-demo", {"max_stepz": 3})
    with pytest.raises(ConfigError, match=r"'eval_every' is in no config section: did you mean eval_every_images "
                                          r"\(train.eval_every_images\)"):
        qualify("eval_every", "--set")
    with pytest.raises(ConfigError, match=r"give only one of"):  # one layer cannot ask for two lengths
        _config("cpu-demo", {"max_steps": 3, "max_images": 100})


def test_a_setting_of_another_objective_is_refused_not_ignored(tmp_path):
    """cpu-demo trains flow matching: `--schedule linear` on it (a command from when it trained a DDPM) would be
    ignored without a word; it is refused with the fix. The preset's own carried schedule and a saved config file
    with every field are not refused."""
    from fastddpm.api import _config
    from fastddpm.config import save_config

    for given in (["--schedule", "linear"], ["--set", "diffusion.beta_end=0.03"]):
        args, dests = _args(["--out", "r", "--preset", "cpu-demo", *given])
        with pytest.raises(ConfigError, match=r"\(command line\)|\(--set\)") as err:
            resolve_train_config(args, dests)
        assert "objective is flow" in str(err.value) and "--objective ddpm" in str(err.value)
    with pytest.raises(ConfigError, match=r"diffusion.schedule='cosine' \(fastddpm.train\).*objective is edm"):
        _config("cpu-demo", {"objective": "edm", "schedule": "cosine"})
    # T is DDPM's too: the continuous processes have no discrete timesteps
    with pytest.raises(ConfigError, match=r"diffusion.num_timesteps='500' \(--set\) is a DDPM setting"):
        resolve_train_config(*_args(["--out", "r", "--preset", "cpu-demo", "--set", "diffusion.num_timesteps=500"]))
    # and the other way round: each continuous objective's own knobs on another objective
    with pytest.raises(ConfigError, match=r"flow_shift=3.0 \(fastddpm.train\) is a flow-matching setting, and this "
                                          r"run's objective is ddpm.*add objective='flow'"):
        _config("cpu-demo", {"objective": "ddpm", "flow_shift": 3.0})
    with pytest.raises(ConfigError, match=r"edm_p_mean=-0.4 \(fastddpm.train\) is an EDM setting.*objective is flow"):
        _config("cpu-demo", {"edm_p_mean": -0.4})
    assert _config("cpu-demo", {"objective": "edm", "edm_p_mean": -0.4}).diffusion.edm_p_mean == -0.4
    assert _config("cpu-demo", {"flow_shift": 3.0}).diffusion.flow_shift == 3.0
    assert _config("cpu-demo", {"objective": "ddpm", "schedule": "linear"}).diffusion.schedule == "linear"
    flow = _config("cpu-demo", {})
    assert flow.diffusion.objective == "flow"  # its carried schedule passes
    saved = tmp_path / "config.json"
    save_config(flow, saved)
    assert _config(saved, {"lr": 1e-3}).diffusion == flow.diffusion  # a run's saved config, every field in it


def test_set_with_a_hyphenated_field_is_the_same_field():
    """--set takes a field spelt as its flag (train.max-images, or bare max-images): the run length it gives
    replaces the preset's, and another objective's setting is refused, exactly as with the field's own name."""
    for key in ("train.max-images", "max-images", "train.max_images"):
        args, dests = _args(["--out", "r", "--preset", "tiny", "--set", f"{key}=64"])
        cfg = resolve_train_config(args, dests)
        assert cfg.train.max_images == 64 and cfg.train.max_steps is None, key
    for key in ("diffusion.flow-shift", "flow-shift"):
        args, dests = _args(["--out", "r", "--preset", "tiny", "--set", f"{key}=3"])
        with pytest.raises(ConfigError, match=r"diffusion.flow_shift='3' \(--set\) is a flow-matching setting"):
            resolve_train_config(args, dests)


def test_a_setting_of_the_other_model_family_is_refused_not_ignored(tmp_path):
    """`--preset seed-2layer --dropout 0.1` trained the seed's U-Net, which has no dropout, without a word: a model
    field only the other family's U-Net reads, given as a flag, with --set or as an API keyword, is refused naming
    the family that reads it. Defaults, a preset's own values and a saved config file (every field in it) are not;
    with --family the field is read and kept."""
    from fastddpm.api import _config
    from fastddpm.config import PRESETS, save_config

    cases = [("seed-2layer", ["--dropout", "0.1"], r"model.dropout='0.1' \(command line\) is read only by the ddpm "
                                                   r"family's U-Net, and this run's model.family is seed"),
             ("tiny", ["--set", "model.attention_resolutions=8"], r"model.attention_resolutions='8' \(--set\)"),
             ("ddpm-cifar10", ["--no-attention"], r"model.attention=False \(command line\) is read only by the seed "
                                                  r"family's U-Net, and this run's model.family is ddpm"),
             ("ddpm-cifar10", ["--set", "num_down_layers=1"], r"model.num_down_layers='1' \(--set\)")]
    for preset, given, match in cases:
        with pytest.raises(ConfigError, match=match) as err:
            resolve_train_config(*_args(["--out", "r", "--preset", preset, *given]))
        owner = "ddpm" if preset != "ddpm-cifar10" else "seed"
        presets = " / ".join(p for p in PRESETS if get_preset(p).model.family == owner)
        assert f"(--family {owner}, or --preset {presets}), or leave it out" in str(err.value)
    with pytest.raises(ConfigError, match=r"model.out_block_channels=8 \(fastddpm.train\) is read only by the seed"):
        _config("ddpm-cifar10", {"out_block_channels": 8})

    # the family that reads it keeps it: given with --family, or for a preset of that family
    args = _args(["--out", "r", "--preset", "seed-2layer", "--family", "ddpm", "--dropout", "0.1"])
    assert resolve_train_config(*args).model.dropout == 0.1
    assert _config("ddpm-cifar10", {"dropout": 0.2, "attention_resolutions": (8,)}).model.dropout == 0.2
    assert _config("cpu-demo", {"attention": True, "num_down_layers": 2}).model.num_down_layers == 2
    for name in PRESETS:  # every preset carries every field of both families, and resolves
        assert _config(name, {}).model == get_preset(name).model
    saved = tmp_path / "config.json"
    save_config(_config("ddpm-cifar10", {}), saved)  # a ddpm run's config holds the seed family's fields too
    assert _config(saved, {"lr": 1e-3}).model == get_preset("ddpm-cifar10").model
    # --help says which family reads each of these flags
    from fastddpm.config.model_checks import FAMILY_ONLY

    for f in dataclasses.fields(get_preset("tiny").model):
        if f.name in FAMILY_ONLY:
            assert f.metadata["help"].startswith(f"{FAMILY_ONLY[f.name]} family: "), f.name


@pytest.mark.parametrize("overrides,match", [
    ({"train.lr": -1}, r"train.lr=-1.0 must be > 0"),
    ({"train.batch_sise": 3}, r"unknown config field train.batch_sise \(did you mean 'batch_size'\?\)"),
    ({"train.log_every": "lots"}, r"train.log_every='lots' is not a valid int"),
    ({"train.batch_size": "lots"}, r"train.batch_size='lots' must be a positive integer or auto"),
    ({"train.cuda_graphs": "always"}, r"train.cuda_graphs='always' is not one of"),
    ({"diffusion.schedule": "sigmoid"}, r"diffusion.schedule='sigmoid' is not one of"),
    ({"train.max_steps": 5, "train.max_images": 10}, r"give only one of"),
    ({"modle.attention": False}, r"did you mean 'model'"),
    # a field spelt as its flag (--eval-every): the field, not the closest spelling (ema_every)
    ({"train.eval_every": 100}, r"unknown config field train.eval_every \(did you mean 'eval_every_images'\?\)"),
    # checked before the channel counts are divided by them
    ({"model.norm_groups": 0}, r"model.norm_groups=0 must be >= 1"),
    ({"model.num_heads": 0}, r"model.num_heads=0 must be >= 1"),
    ({"model.family": "ddpm", "model.norm_groups": 0}, r"model.norm_groups=0 must be >= 1"),
    ({"model.family": "ddpm", "model.num_heads": 0}, r"model.num_heads=0 must be >= 1"),
    # channel counts below 1, which the divisibility checks pass (0 % 8 == 0) and torch's layers do not
    ({"model.down_channels": (16, 0, 32), "model.mid_channels": (32, 0)},
     r"model.down_channels=\(16, 0, 32\): every level needs at least 1 channel"),
    ({"model.down_channels": (16, -16, 32), "model.mid_channels": (32, -16)}, r"model.down_channels=\(16, -16, 32\)"),
    ({"model.mid_channels": (32, 0, 32)}, r"model.mid_channels=\(32, 0, 32\): every mid block needs at least 1"),
    ({"model.out_block_channels": 0}, r"model.out_block_channels=0 must be >= 1"),
    ({"model.out_block_channels": -8}, r"model.out_block_channels=-8 must be >= 1"),
    ({"model.family": "ddpm", "model.base_channels": -32}, r"model.base_channels=-32 must be >= 1"),
    ({"model.family": "ddpm", "model.base_channels": 0}, r"model.base_channels=0 must be >= 1"),
    ({"model.family": "ddpm", "model.base_channels": 2, "model.norm_groups": 1, "model.time_freq_shift": 1},
     r"model.time_freq_shift=1 needs base_channels >= 4 \(it is 2\)"),
    # values torch would take and train on with NaN weights, or that never end the run
    ({"train.lr": "inf"}, r"train.lr=inf must be > 0 and finite"),
    ({"train.weight_decay": -1}, r"train.weight_decay=-1.0: must be a finite number >= 0 \(0 turns it off\)"),
    ({"train.weight_decay": "nan"}, r"train.weight_decay=nan: must be a finite number >= 0"),
    ({"train.weight_decay": "inf"}, r"train.weight_decay=inf: must be a finite number >= 0"),
    ({"train.max_steps": None, "train.max_epochs": "inf"}, r"train.max_epochs=inf must be a finite number"),
])
def test_validation_names_field_and_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(get_preset("tiny"), overrides)


def test_auto_sampler_is_the_objectives_own_and_given_steps_win():
    """`auto` (the default of the grids, --eval-every, `sample` and `eval`) is Heun 10 steps for a flow model and
    SDE-DPM-Solver++(2M) 20 steps for DDPM and EDM; given steps replace auto's, a named sampler runs 20 unless told;
    a config saved with a named sampler keeps it."""
    from fastddpm.config import resolve_sampling

    assert TrainConfig().sampler == "auto" and TrainConfig().eval_sampler == "auto"
    expect = {"ddpm": ("dpmpp-2m-sde", 20), "edm": ("dpmpp-2m-sde", 20), "flow": ("heun", 10)}
    for objective, pair in expect.items():
        cfg = apply_overrides(get_preset("cpu-demo"), {"diffusion.objective": objective})
        assert cfg.grid_sampling() == pair and cfg.eval_sampling() == pair
        assert resolve_sampling("auto", 4, objective) == (pair[0], 4)
        assert resolve_sampling("unipc", None, objective) == ("unipc", 20)
    flow = apply_overrides(get_preset("tiny"), {"diffusion.objective": "flow"})  # tiny's grids take 10 steps
    assert flow.grid_sampling() == ("heun", 10) and flow.eval_sampling() == ("heun", 10)
    named = apply_overrides(flow, {"train.sampler": "euler", "train.eval_steps": 3})
    assert named.grid_sampling() == ("euler", 10) and named.eval_sampling() == ("heun", 3)
    old = get_preset("cpu-demo").to_dict()
    old["train"].update(sampler="unipc", sample_steps=15)  # a run's config.json from before `auto`
    old["diffusion"]["objective"] = "flow"
    assert from_dict(old).grid_sampling() == ("unipc", 15)
    assert apply_overrides(named, {"train.eval_steps": "none"}).eval_sampling() == ("heun", 10)  # --eval-steps none
    with pytest.raises(ConfigError, match=r"train.sample_steps=0 must be >= 1 \(or none"):
        apply_overrides(flow, {"train.sample_steps": 0})
    with pytest.raises(ConfigError, match="train.sampler='heunn' is not one of 'auto', 'ddpm'"):
        apply_overrides(flow, {"train.sampler": "heunn"})


def test_auto_samples_a_guided_flow_model_with_unipc_and_the_rest_as_unguided():
    """A conditional flow model guided at W > 1 samples with UniPC 10 steps (on the conditional CPU demo at W = 2 it
    beat Heun 10 at both training seeds measured, in about half the network calls); unguided (W <= 1, or no
    labels) it keeps Heun; DDPM and EDM keep the SDE solver guided or not; given steps and named samplers win."""
    from fastddpm.config import resolve_sampling

    assert resolve_sampling("auto", None, "flow", guided=True) == ("unipc", 10)
    assert resolve_sampling("auto", 4, "flow", guided=True) == ("unipc", 4)
    assert resolve_sampling("heun", None, "flow", guided=True) == ("heun", 20)
    for objective in ("ddpm", "edm"):
        assert resolve_sampling("auto", None, objective, guided=True) == ("dpmpp-2m-sde", 20)
    flow = apply_overrides(get_preset("cpu-demo-cond"), {"diffusion.objective": "flow"})
    assert flow.train.sample_guidance == 2 and flow.grid_sampling() == ("unipc", 10) == flow.eval_sampling()
    assert [flow.guided(w) for w in (None, 0.0, 1.0, 1.5, 2.0)] == [False, False, False, True, True]
    plain = apply_overrides(flow, {"train.sample_guidance": 1.0})
    assert plain.grid_sampling() == ("heun", 10) == plain.eval_sampling()
    unconditional = get_preset("cpu-demo")  # a flow model without classes is never guided
    assert not unconditional.guided(2.0) and unconditional.grid_sampling() == ("heun", 10)


def test_the_cpu_demos_objectives_follow_the_measurements():
    """Both CPU demos train flow matching (benchmarks/RESULTS.md, "Objectives on the CPU demo"). Unconditional, it led
    the cosine epsilon DDPM that cpu-demo trained before beyond the seed spread, and every other objective at every
    seed measured; sampled by auto's Heun 10. Conditional (cpu-demo-cond, the CPU quickstart), guided at W = 2, it led
    that DDPM by 0.6 FID at 10 network calls at both training seeds measured (the seeds' own spread: 0.15), and with
    auto's UniPC 10 it matched or beat the DDPM's SDE-DPM-Solver++ 20 in half the calls."""
    demo, cond = get_preset("cpu-demo"), get_preset("cpu-demo-cond")
    assert demo.diffusion.objective == "flow" and demo.grid_sampling() == ("heun", 10)
    assert cond.diffusion == demo.diffusion and cond.train.sample_guidance == 2.0
    assert cond.model.conditional and cond.grid_sampling() == ("unipc", 10)
    assert dataclasses.replace(cond.model, conditional=False) == demo.model and cond.train.max_images == 150_000


def test_the_training_grids_sample_with_the_resolved_sampler(monkeypatch):
    """write_grid hands the sampler `auto` resolves to (not the config's "auto") to the sampling loop."""
    import types

    import torch

    import fastddpm.sampling as sampling

    seen = []

    def fake_sample(model, schedule, shape, *, sampler, steps, **kw):
        seen.append((sampler, steps))
        return torch.zeros(shape)

    monkeypatch.setattr(sampling, "sample", fake_sample)
    for objective, pair in (("flow", ("heun", 10)), ("ddpm", ("dpmpp-2m-sde", 10))):  # tiny's grids: 10 steps
        cfg = apply_overrides(get_preset("tiny"), {"diffusion.objective": objective, "model.image_size": 28,
                                                   "model.image_channels": 1})
        sampling.write_grid(None, None, cfg, "cpu", types.SimpleNamespace(autocast_dtype=None), None, save=False)
        assert seen[-1] == pair


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match="did you mean 'cpu-demo'"):
        get_preset("cpu_demo")


def test_round_trip_through_dict():
    cfg = get_preset("seed-2layer")
    assert from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_keyword_only():
    with pytest.raises(TypeError):
        TrainConfig(16)  # noqa
    assert isinstance(RunConfig(), RunConfig)


def test_train_help_lists_every_field(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    from fastddpm.config import SECTIONS
    import dataclasses

    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            flag = "--" + (f.metadata.get("cli") or f.name).replace("_", "-")
            assert flag in out, flag
    # a default of None is shown as it is typed on the command line
    assert "(default none;" in " ".join(out.split()) and "default None" not in out
    for word in ("--preset", "--resume", "--config", "--out", "cpu-demo", "seed-1layer", "Examples"):
        assert word in out


def test_print_config(capsys, tmp_path):
    assert main(["train", "--out", str(tmp_path), "--preset", "tiny", "--lr", "0.01", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train"]["lr"] == 0.01 and cfg["preset"] == "tiny"


def test_print_config_needs_no_run_directory_and_training_does(capsys, tmp_path, monkeypatch):
    """--print-config only shows the config, and was refused without --out; a run still needs one, as does
    `--print-config --resume latest`, which reads the run in it."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--preset", "tiny", "--lr", "0.01", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["lr"] == 0.01
    assert main(["train", "--preset", "tiny", "--max-steps", "1"]) == 2
    assert "train needs --out RUN_DIR" in capsys.readouterr().err
    assert main(["train", "--print-config", "--resume", "latest"]) == 2
    assert "--print-config --resume latest reads the run in --out: give --out RUN_DIR" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written where it was run
    assert main(["train", "--data", "fashion-mnist", "--print-config"]) == 0  # the preset picked is said on stderr
    printed = capsys.readouterr()
    assert json.loads(printed.out)["data"]["source"] == "fashion-mnist" and "no --preset given" in printed.err


def test_cli_config_error_exit_code(capsys, tmp_path):
    assert main(["train", "--out", str(tmp_path), "--preset", "tiny", "--ema-decay", "1.5"]) == 2
    assert "train.ema_decay=1.5 must be in [0, 1)" in capsys.readouterr().err


def test_flags_are_spelt_whole_not_abbreviated(capsys, tmp_path):
    """With 80 config flags a prefix silently picks a neighbour (`doctor train --out X` once became
    --out-block-channels=X): every parser, subcommands included, refuses an abbreviation."""
    parser, _ = build_parser()
    for argv in (["train", "--out", str(tmp_path), "--out-b", "32"], ["train", "--out", str(tmp_path), "--sched",
                                                                       "cosine"],
                 ["doctor", "train", "--report", str(tmp_path)], ["bench", "throughput", "--quic"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err
    args = parser.parse_args(["doctor", "train", "--out", str(tmp_path / "d"), "--preset", "tiny"])
    assert args.report_dir == str(tmp_path / "d")  # --out names the report folder, as for train and eval
    assert parser.parse_args(["train", "--out", str(tmp_path), "--out-block-channels", "32"]).out == str(tmp_path)


@pytest.mark.parametrize("rank, local_rank, prints", [("0", None, True), ("1", None, False), (None, None, True),
                                                      ("", None, True), ("8", "0", True), ("9", "1", False)])
def test_under_torchrun_one_process_a_node_prints_a_usage_or_config_error(capsys, monkeypatch, tmp_path, rank,
                                                                          local_rank, prints):
    # every rank parses the same command line: eight copies of one error help nobody; the status is every rank's.
    # The first process of each node prints it (rank 8 of a second node: LOCAL_RANK 0); an empty RANK is rank 0.
    for name, value in (("RANK", rank), ("WORLD_SIZE", None if rank is None else "16"), ("LOCAL_RANK", local_rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    parser, _ = build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["eval", "--checkpoint", str(tmp_path), "--num-sample", "10"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    if prints:
        assert "unrecognized arguments: --num-sample" in err
    else:
        assert err == ""
    # so is an error in the config the command line resolves to, before the process group begins
    assert main(["train", "--out", str(tmp_path / "run"), "--preset", "tiny", "--lr", "-1"]) == 2
    err = capsys.readouterr().err
    assert ("error: " in err and "lr" in err) if prints else err == ""
    assert not (tmp_path / "run").exists()


def test_docs_config_reference_is_current():
    from pathlib import Path

    from fastddpm.config import reference_markdown

    doc = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    assert doc.read_text() == reference_markdown(), "regenerate: python -m fastddpm.config > docs/config.md"


def test_preset_help_states_the_real_parameter_counts():
    """`train --help` and the README's preset table give each preset's parameter count: both must match the
    model the preset builds (the help text is generated from the presets' docstrings, the README is checked)."""
    import re
    from pathlib import Path

    from fastddpm.cli import _train_epilog
    import numpy as np

    from fastddpm.bench.throughput import preset_image_shape
    from fastddpm.config import preset_summaries, resolve_classes, resolve_model_shape
    from fastddpm.models import build_unet, count_parameters

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    help_text = " ".join(_train_epilog().split())
    for name, summary in preset_summaries().items():
        shape = (1, *preset_image_shape(name))  # the data the preset trains on: 1x28x28, CIFAR's 3x32x32, ...
        cfg = resolve_classes(resolve_model_shape(get_preset(name), shape), np.arange(10), [], "ten labels")
        n = count_parameters(build_unet(cfg.model))
        stated = re.search(r"~?([\d.]+)(k|M)[- ]param", summary)
        assert stated, f"preset {name}'s docstring summary names no parameter count: {summary!r}"
        value = float(stated.group(1)) * (1e3 if stated.group(2) == "k" else 1e6)
        assert abs(value - n) <= 0.05 * n, f"preset {name}: docstring says {stated.group(0)}, the model has {n:,}"
        assert f"{name} {summary}" in help_text
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"README's preset table has no row for {name}"
        in_readme = re.search(r"~?([\d.]+)(k|M) params", row)
        value = float(in_readme.group(1)) * (1e3 if in_readme.group(2) == "k" else 1e6)
        assert abs(value - n) <= 0.05 * n, f"README says {in_readme.group(0)} for {name}, the model has {n:,}"


def test_help_answers_without_importing_torch():
    """`fastddpm --help` and every command's --help build their parsers only: torch (~2 s to import) stays out."""
    import subprocess
    import sys

    commands = [[], ["train"], ["sample"], ["eval"], ["export"], ["data"], ["bench"], ["bench", "throughput"],
                ["doctor"], ["doctor", "run"]]
    code = ("import sys\nfrom fastddpm.cli import main\nfor argv in eval(sys.argv[1]):\n"
            "    try:\n        main([*argv, '--help'])\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code, repr(commands)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("usage: fastddpm") == len(commands)


def test_a_conditional_setting_on_an_unconditional_run_is_refused_not_ignored():
    """`--cond-drop-prob 0.3` or `--sample-guidance 4` without --conditional trained an unconditional model without
    a word (a user who forgot --conditional); with --conditional, or on a conditional preset, they are kept."""
    from fastddpm.api import _config

    for given, match in ((["--cond-drop-prob", "0.3"], r"train.cond_drop_prob='0.3' \(command line\) is a "
                                                         r"conditional model's setting"),
                         (["--set", "train.sample_guidance=4"], r"train.sample_guidance='4' \(--set\)")):
        with pytest.raises(ConfigError, match=match) as err:
            resolve_train_config(*_args(["--out", "r", "--preset", "tiny", *given]))
        assert "add --conditional (on labelled data)" in str(err.value)
    with pytest.raises(ConfigError, match=r"train.sample_guidance=3 \(fastddpm.train\) is a conditional model's"):
        _config("cpu-demo", {"sample_guidance": 3})
    args = _args(["--out", "r", "--preset", "tiny", "--conditional", "--cond-drop-prob", "0.3"])
    assert resolve_train_config(*args).train.cond_drop_prob == 0.3
    assert _config("tiny", {"cond_drop_prob": 0.1}).model.conditional is False  # the default: no setting
    for zero in (["--cond-drop-prob", "0"], ["--set", "train.sample_guidance=0"]):  # what unconditional does anyway
        assert resolve_train_config(*_args(["--out", "r", "--preset", "tiny", *zero])).model.conditional is False
    assert _config("cpu-demo-cond", {"sample_guidance": 3}).train.sample_guidance == 3


def test_a_conditional_setting_in_a_config_file_of_an_unconditional_run_is_refused(tmp_path):
    """The refusal saw flags, --set and API keywords, not a config file; a saved config.json of an unconditional
    run (every field, at its default) still loads."""
    from fastddpm.config import resolve_config

    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\ntrain: {cond_drop_prob: 0.3}\n")
    with pytest.raises(ConfigError, match=r"train.cond_drop_prob=0.3 \(config file .*c.yaml\) is a conditional "
                                          r"model's setting"):
        resolve_config(file=f)
    f.write_text("preset: tiny\ntrain.sample_guidance: 4\n")
    with pytest.raises(ConfigError, match=r"train.sample_guidance=4 \(config file"):
        resolve_config(file=f)
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(get_preset("tiny").to_dict()))
    assert resolve_config(file=saved) == get_preset("tiny")
    f.write_text("preset: tiny\nmodel: {conditional: true}\ntrain: {cond_drop_prob: 0.3}\n")
    assert resolve_config(file=f).train.cond_drop_prob == 0.3


def test_a_conditional_setting_in_the_apis_config_dict_of_an_unconditional_run_is_refused():
    """fastddpm.train({...}) takes a RunConfig's dict form, nested or dotted: label dropout in it was ignored on an
    unconditional model; a whole saved config (every field at its default) and a conditional one still load."""
    from fastddpm.api import _config

    for given in ({"train": {"cond_drop_prob": 0.2}}, {"train.sample_guidance": 4.0},
                  {"train": {"cond-drop-prob": 0.2}}, {"train.cond-drop-prob": 0.2}):  # hyphens as flags spell them
        with pytest.raises(ConfigError, match=r"\(config dict\) is a conditional model's setting"):
            _config(given, {})
    assert _config(get_preset("tiny").to_dict(), {}) == get_preset("tiny")
    cond = {"model": {"conditional": True, "num_classes": 10}, "train": {"cond_drop_prob": 0.2}}
    assert _config(cond, {}).train.cond_drop_prob == 0.2


def test_class_names_given_to_an_unconditional_run_are_refused(tmp_path):
    """--class-names without --conditional named classes the model never has: refused as the other conditional
    settings are, from a flag, a config file or the API's dict; a conditional run keeps them."""
    from fastddpm.api import _config
    from fastddpm.config import resolve_config

    with pytest.raises(ConfigError, match=r"model.class_names='a,b' \(command line\) names a conditional model's "
                                          r"classes.*add --conditional"):
        resolve_config("tiny", layers=[("command line", {"model.class_names": "a,b"})])
    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\nmodel: {class_names: [a, b]}\n")
    with pytest.raises(ConfigError, match=r"\(config file .*c.yaml\) names a conditional model's classes"):
        resolve_config(file=f)
    with pytest.raises(ConfigError, match=r"\(config dict\) names a conditional model's classes"):
        _config({"model": {"class_names": ["a", "b"]}}, {})
    cond = resolve_config("cpu-demo-cond", layers=[("command line", {"model.class_names": "a,b"})])
    assert cond.model.class_names == ("a", "b")


def test_a_config_dict_that_names_a_preset_starts_from_it_as_a_config_file_does():
    """{"preset": "cpu-demo-cond", ...} was the defaults labelled cpu-demo-cond: an unconditional model, whose
    guidance setting was then refused as a conditional model's."""
    from fastddpm.api import _config

    cfg = _config({"preset": "cpu-demo-cond", "train": {"sample_guidance": 3.0}}, {})
    want = apply_overrides(get_preset("cpu-demo-cond"), {"train.sample_guidance": 3.0})
    assert cfg == want and cfg.model.conditional
    assert _config({"preset": "tiny"}, {}) == get_preset("tiny")
    with pytest.raises(ConfigError, match="no-such"):
        _config({"preset": "no-such"}, {})
    # a whole saved config of a preset this version no longer has: its own values, as before
    saved = {**get_preset("tiny").to_dict(), "preset": "renamed-since"}
    assert _config(saved, {}).train == get_preset("tiny").train
    # its run length replaces the preset's, as a file's does (both lengths were refused as two)
    for length, value in (("max_steps", 100), ("max_epochs", 2.0)):
        cfg = _config({"preset": "cpu-demo", "train": {length: value}}, {})
        assert getattr(cfg.train, length) == value and cfg.train.max_images is None
