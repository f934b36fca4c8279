"""`bench quality --fast-from`: the options train against an earlier run's fast result (so a GPU session can
spread the options over several calls); the reference and fast run are not trained again."""

import dataclasses
import json
from pathlib import Path

import pytest

from fastddpm.bench import quality
from fastddpm.bench.quality import QUICK, QualitySettings, run_quality
from fastddpm.config import ConfigError


def _evals(fids, every):
    return [{"fid": f, "wall_s": 1.0 + i, "images_seen": every * (i + 1), "step": i + 1, "features_label": "test"}
            for i, f in enumerate(fids)]


def _fake_train_run(trained: list):
    def fake(name, cfg, out_dir, log):
        trained.append((name, cfg.train.max_images, cfg.train.lr))
        evals = _evals([3.0], cfg.train.max_images)
        return {"name": name, "run_dir": str(out_dir / name), "config": cfg.to_dict(), "evals": evals,
                "final_fid": 3.0, "images_seen": cfg.train.max_images, "train_wall_s": 1.0, "process_s": 2.0,
                "images_per_s_last": 100.0}

    return fake


def _earlier(tmp_path, settings: QualitySettings) -> str:
    """A quality.json as a fast run writes it: target 4.0, reached at the second evaluation (512 images)."""

    every = settings.fast_eval_every_images
    fast = {"name": "fast", "evals": _evals([6.0, 3.9, 3.5], every), "final_fid": 3.5, "images_seen": 3 * every,
            "train_wall_s": 3.0, "process_s": 4.0, "images_per_s_last": 100.0, "run_dir": "x", "config": {},
            "time_to_target": {"wall_s": 2.0, "images_seen": 2 * every, "fid": 3.9, "step": 2}}
    reference = {"name": "reference", "evals": _evals([4.0], 256), "final_fid": 4.0, "images_seen": 256,
                 "train_wall_s": 10.0}
    data = {"schema": quality.SCHEMA, "settings": dataclasses.asdict(settings), "target_fid": 4.0,
            "reference": reference, "fast": fast, "options": [], "features": "test",
            "environment": {"device_name": "cpu", "device": "cpu", "torch": "t", "git_commit": "c", "date_utc": "d"}}
    path = tmp_path / "fast" / "quality.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return str(path)


def test_fast_from_trains_only_the_options_at_the_fast_runs_images(tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(quality, "_train_run", _fake_train_run(trained))
    base = dict(QUICK, device="cpu", quick=True)
    earlier = _earlier(tmp_path, QualitySettings(**base, reference_from="ref.json"))
    result = run_quality(QualitySettings(**base, fast_from=earlier, options=("lr-x2", "cosine")), tmp_path / "opt",
                         argv=["test"], log=lambda m: None)
    images = 2 * QUICK["fast_eval_every_images"]  # the fast run's images to the target
    assert trained == [("option-lr-x2", images, 8e-4), ("option-cosine", images, 2e-3)]
    assert result["target_fid"] == 4.0 and result["fast"]["reused_from"] == earlier
    assert result["speedup_vs_reference"] == pytest.approx(10.0 / 2.0)
    saved = json.loads((tmp_path / "opt" / "quality.json").read_text())
    assert [o["name"] for o in saved["options"]] == ["option-lr-x2", "option-cosine"]
    assert "reused from" in (tmp_path / "opt" / "quality.md").read_text()


def test_a_call_cut_off_keeps_its_finished_runs_and_the_same_command_trains_only_the_rest(tmp_path, monkeypatch):
    """A GPU call killed by its time limit during the second option: the first option was written as it finished
    (quality.partial.json), and the same command again trains the second alone. quality.json then holds both, and
    the partial file is gone."""
    trained = []
    fake = _fake_train_run(trained)

    def cut_off_at_cosine(name, cfg, out_dir, log):
        if name == "option-cosine":
            raise KeyboardInterrupt  # the time limit's kill, as far as this process knows
        return fake(name, cfg, out_dir, log)

    base = dict(QUICK, device="cpu", quick=True)
    earlier = _earlier(tmp_path, QualitySettings(**base, reference_from="ref.json"))
    settings = QualitySettings(**base, fast_from=earlier, options=("lr-x2", "cosine"))
    monkeypatch.setattr(quality, "_train_run", cut_off_at_cosine)
    with pytest.raises(KeyboardInterrupt):
        run_quality(settings, tmp_path / "opt", argv=["test"], log=lambda m: None)
    partial = json.loads((tmp_path / "opt" / "quality.partial.json").read_text())
    assert [o["name"] for o in partial["options"]] == ["option-lr-x2"]
    assert not (tmp_path / "opt" / "quality.json").exists()
    monkeypatch.setattr(quality, "_train_run", fake)
    lines = []
    result = run_quality(settings, tmp_path / "opt", argv=["test"], log=lines.append)
    assert [name for name, *_ in trained] == ["option-lr-x2", "option-cosine"]  # lr-x2 trained once, in the first call
    assert any("[option-lr-x2] reused" in line for line in lines)
    assert [o["name"] for o in result["options"]] == ["option-lr-x2", "option-cosine"]
    assert not (tmp_path / "opt" / "quality.partial.json").exists()
    run_quality(settings, tmp_path / "opt", argv=["test"], log=lambda m: None)  # complete: nothing trained again
    assert len(trained) == 2
    run_quality(dataclasses.replace(settings, remeasure=True), tmp_path / "opt", argv=["test"], log=lambda m: None)
    assert len(trained) == 4  # --remeasure: both trained again


def test_fast_from_refuses_other_settings_and_needs_options(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "_train_run", _fake_train_run([]))
    base = dict(QUICK, device="cpu", quick=True)
    earlier = _earlier(tmp_path, QualitySettings(**base, reference_from="ref.json"))
    with pytest.raises(ConfigError, match="fast_max_images"):
        run_quality(QualitySettings(**{**base, "fast_max_images": 1024}, fast_from=earlier, options=("lr-x2",)),
                    tmp_path / "x", log=lambda m: None)
    # a result that recorded no data identity (written before it was): compared by the dataset's name
    monkeypatch.setattr(quality, "_data_source", lambda s, cache_root, log: (s.data, None))  # (no data is read here)
    with pytest.raises(ConfigError, match=r"measured on --data fashion-mnist, this run has --data mnist"):
        run_quality(QualitySettings(**{**base, "data": "mnist"}, fast_from=earlier, options=("lr-x2",)),
                    tmp_path / "y", log=lambda m: None)
    run_quality(QualitySettings(**{**base, "data": ".data/fashion-mnist"}, fast_from=earlier, options=("lr-x2",)),
                tmp_path / "z", log=lambda m: None)  # the same dataset through a local copy
    with pytest.raises(ConfigError, match="--options"):
        QualitySettings(**base, fast_from=earlier)
    with pytest.raises(ConfigError, match="--fast-from"):
        QualitySettings(**base, fast_from=earlier, options=("lr-x2",), target_fid=3.0)


def test_the_evaluation_sampler_is_a_setting_the_runs_use_and_the_report_names(tmp_path, monkeypatch):
    """The report once said DDIM while the runs evaluated with the training default (UniPC): the sampler is now
    a setting, passed to every run and written in quality.md; a file from before names it only in its reference's
    config, and a reference evaluated with another sampler is refused."""
    trained = []

    def fake(name, cfg, out_dir, log):
        trained.append(cfg.train.eval_sampler)
        return _fake_train_run([])(name, cfg, out_dir, log)

    monkeypatch.setattr(quality, "_train_run", fake)
    base = dict(QUICK, device="cpu", quick=True)
    earlier = _earlier(tmp_path, QualitySettings(**base, reference_from="ref.json", eval_sampler="dpmpp-2m"))
    run_quality(QualitySettings(**base, eval_sampler="dpmpp-2m", fast_from=earlier, options=("lr-x2",)),
                tmp_path / "opt", argv=["test"], log=lambda m: None)
    assert trained == ["dpmpp-2m"]
    assert f"dpmpp-2m {QUICK['eval_steps']} steps" in (tmp_path / "opt" / "quality.md").read_text()

    # an older file: no eval_sampler in its settings; its reference's config says what its evaluations used
    data = json.loads(open(earlier).read())
    del data["settings"]["eval_sampler"]
    data["reference"]["config"] = {"train": {"eval_sampler": "ddim"}}
    open(earlier, "w").write(json.dumps(data))
    with pytest.raises(ConfigError, match="eval_sampler='ddim'"):
        run_quality(QualitySettings(**base, fast_from=earlier, options=("lr-x2",)), tmp_path / "y",
                    log=lambda m: None)
    run_quality(QualitySettings(**base, eval_sampler="ddim", fast_from=earlier, options=("lr-x2",)), tmp_path / "z",
                argv=["test"], log=lambda m: None)
    assert trained[-1] == "ddim"


def test_an_objective_is_scored_again_only_where_auto_samples_it_with_another_sampler():
    """Flow matching samples best with Heun (UniPC when guided), where the fast recipe's DDPM uses the SDE solver:
    a flow option is scored at its own pair too; EDM, which `auto` samples like DDPM, and DDPM options are not, nor
    a flow option whose evaluations already used its own sampler (--eval-sampler heun)."""
    from fastddpm.config import apply_overrides, get_preset

    def option(base, sampler="dpmpp-2m-sde", steps=50, **over):  # as bench quality's runs: one shared sampler
        shared = {"train.eval_sampler": sampler, "train.eval_steps": steps}
        return quality.own_sampling(apply_overrides(base, {**shared, **over}), apply_overrides(base, shared))

    base = get_preset("seed-1layer")
    assert option(base, **{"diffusion.objective": "flow"}) == ("heun", 10)
    assert option(base, **{"diffusion.objective": "edm"}) is None
    assert option(base, **{"diffusion.schedule": "cosine"}) is None
    cond = apply_overrides(base, {"model.conditional": "true", "train.sample_guidance": "2"})
    assert option(cond, **{"diffusion.objective": "flow"}) == ("unipc", 10)
    assert option(cond, **{"diffusion.objective": "flow", "train.sample_guidance": "1"}) == ("heun", 10)
    assert option(base, "heun", 10, **{"diffusion.objective": "flow"}) is None
    assert option(base, "ddim", 50, **{"diffusion.objective": "flow"}) == ("heun", 10)
    assert option(base, "ddim", 50, **{"diffusion.objective": "edm"}) is None  # sampled as the fast recipe is


def test_a_reused_result_is_compared_by_its_images_not_its_folder_name(tmp_path, monkeypatch):
    """Two folders both named train/ (as absolute paths now keep them) compared as one dataset by name; the same
    images under another name were refused. Results record the images' identity, and are compared by it."""
    import numpy as np

    monkeypatch.setattr(quality, "_train_run", _fake_train_run([]))
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / "train.npz", x_train=rng.integers(0, 256, (80, 1, 16, 16), dtype=np.uint8),
                 y_train=rng.integers(0, 2, 80).astype(np.int64))
    base = dict(QUICK, device="cpu", quick=True, num_images=None)
    a, b = str(tmp_path / "a" / "train.npz"), str(tmp_path / "b" / "train.npz")
    earlier = run_quality(QualitySettings(**{**base, "data": a}, reference_from=_earlier(tmp_path, QualitySettings(
        **{**base, "data": a}))), tmp_path / "ref", log=lambda m: None)  # (its reference has no identity: by name)
    assert earlier["data_identity"]["num_images"] == 80
    reference = str(tmp_path / "ref" / "quality.json")
    with pytest.raises(ConfigError, match=r"measured on --data .*a/train.npz \(80 images \(1, 16, 16\), classes 0, "
                                          r"1\), this run's --data .*b/train.npz holds other images"):
        run_quality(QualitySettings(**{**base, "data": b}, reference_from=reference), tmp_path / "x",
                    log=lambda m: None)
    copy = tmp_path / "copy-of-a.npz"
    copy.write_bytes((tmp_path / "a" / "train.npz").read_bytes())
    result = run_quality(QualitySettings(**{**base, "data": str(copy)}, reference_from=reference), tmp_path / "y",
                         log=lambda m: None)  # the same images under another name: one dataset
    assert result["data_identity"] == earlier["data_identity"]


def _sorted_by_class(tmp_path, fmnist_npz, *, names: bool = True):
    """fmnist_npz as class folders read: class by class, with its class names."""
    import numpy as np

    data = np.load(fmnist_npz)
    order = np.argsort(data["labels"], kind="stable")
    path = tmp_path / "by-class.npz"
    extra = {"class_names": np.array([f"c{i}" for i in range(10)])} if names else {}
    np.savez(path, images=data["images"][order], labels=data["labels"][order], **extra)
    return path, len(np.unique(data["labels"]))


def test_a_capped_dataset_is_drawn_across_it_with_its_class_names(tmp_path, fmnist_npz):
    """--num-images took the first N: of data read class by class (folders), all one class, on which the feature
    network cannot train (an error about an internal .npz followed)."""
    import numpy as np

    source, classes = _sorted_by_class(tmp_path, fmnist_npz)
    s = QualitySettings(**dict(QUICK, num_images=64), data=str(source), device="cpu", quick=True)
    path, identity = quality._data_source(s, tmp_path / "cache", log=lambda m: None)
    subset = np.load(path)
    assert len(subset["y_train"]) == 64 and len(np.unique(subset["y_train"])) >= classes - 2
    assert list(subset["class_names"]) == [f"c{i}" for i in range(10)]
    assert identity["num_images"] == 256
    again, _ = quality._data_source(s, tmp_path / "cache", log=lambda m: None)
    assert again == path  # the same draw: a rerun reuses its finished runs
    # a quality.json of another draw of the same data (an earlier version took the first N) does not compare
    earlier = {"settings": {"data": str(source)}, "data_identity": identity,
               "data_source": "x/data-n64-0123456789ab.npz"}
    with pytest.raises(ConfigError, match=r"ref.json trained on data-n64-0123456789ab.npz .*other images, so its FIDs "
                                          r"do not compare"):
        quality._check_same_data(earlier, s, "ref.json", identity, path)
    quality._check_same_data({**earlier, "data_source": "elsewhere/" + Path(path).name}, s, "ref.json", identity, path)


def test_bad_settings_are_refused_before_any_run_trains(tmp_path, fmnist_npz, monkeypatch):
    import numpy as np

    trained = []
    monkeypatch.setattr(quality, "_train_run", _fake_train_run(trained))
    base = dict(QUICK, device="cpu", quick=True, data=str(fmnist_npz))
    with pytest.raises(ConfigError, match=r"train.lr='abc' is not a valid float"):
        run_quality(QualitySettings(**{**base, "fast_overrides": ("train.lr=abc",)}), tmp_path / "a",
                    log=lambda m: None)
    for bad in ({"target_fid": -1.0}, {"target_fid": 0.0}, {"reference_epochs": 0.0}):
        with pytest.raises(ConfigError, match=r"must be > 0"):
            QualitySettings(**{**base, **bad})
    unlabelled = tmp_path / "unlabelled.npz"
    np.savez(unlabelled, images=np.load(fmnist_npz)["images"])
    with pytest.raises(ConfigError, match=rf"--data {unlabelled}: its images have no labels, and FID here"):
        run_quality(QualitySettings(**{**base, "data": str(unlabelled)}), tmp_path / "b", log=lambda m: None)
    assert trained == [] and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("bench", ["throughput", "ladder", "quality"])
def test_an_out_that_is_a_file_is_one_error_line(tmp_path, capsys, bench):
    from fastddpm.cli import main

    (tmp_path / "taken").write_text("mine")
    assert main(["bench", bench, "--quick", "--device", "cpu", "--out", str(tmp_path / "taken")]) == 2
    assert f"bench {bench} --out {tmp_path / 'taken'}: is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "taken").read_text() == "mine"


def test_set_reaches_every_run_and_an_inception_file_is_named_as_set_before_any_run_trains(tmp_path, fmnist_npz,
                                                                                            monkeypatch, capsys):
    """`--set train.eval_inception=PATH` (the epilog's way to Inception FID) is every run's, the reference's
    included, so the target and the fast run's FIDs are in one feature space; a bad file is refused before any run
    trains, naming `--set train.eval_inception=...` as typed (it had been named as train's --eval-inception, after
    the reference had trained); given to --fast alone, it would score the fast run in other features than its
    target, and is refused naming --set."""
    from fastddpm.cli import main

    trained = []

    def fake(name, cfg, out_dir, log):
        trained.append((name, cfg.train.eval_inception))
        return {"name": name, "run_dir": str(out_dir / name), "config": cfg.to_dict(), "evals": _evals([3.0], 256),
                "final_fid": 3.0, "images_seen": 256, "train_wall_s": 1.0, "process_s": 2.0,
                "images_per_s_last": 100.0}

    monkeypatch.setattr(quality, "_train_run", fake)
    argv = ["bench", "quality", "--quick", "--device", "cpu", "--data", str(fmnist_npz)]
    missing = tmp_path / "no-such.pth"
    assert main([*argv, "--set", f"train.eval_inception={missing}", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"error: --set train.eval_inception={missing}: no such file" in err
    assert "(--set train.eval_inception=auto instead finds" in err and "--eval-inception" not in err
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"no weights")
    assert main([*argv, "--set", f"train.eval_inception={junk}", "--out", str(tmp_path / "a")]) == 2
    assert f"error: --set train.eval_inception={junk}: not a TorchScript file" in capsys.readouterr().err
    assert main([*argv, "--fast", f"train.eval_inception={junk}", "--out", str(tmp_path / "a")]) == 2
    assert (f"--fast train.eval_inception={junk} would score the fast run and the options in other features than "
            f"the reference, whose FID is their target: give it to every run with --set train.eval_inception={junk}"
            ) in capsys.readouterr().err
    assert trained == [] and not (tmp_path / "a").exists()

    monkeypatch.setattr(quality, "_check_features", lambda cfg, log: None)  # a real Inception file is 100 MB
    assert main([*argv, "--set", f"train.eval_inception={junk}", "--set", "train.ema_decay=0.99",
                 "--out", str(tmp_path / "b")]) == 0
    assert trained == [("reference", str(junk)), ("fast", str(junk))]
    settings = json.loads((tmp_path / "b" / "quality.json").read_text())["settings"]
    assert settings["sets"] == [f"train.eval_inception={junk}", "train.ema_decay=0.99"]
    # a reference measured in other features is no target for this call
    with pytest.raises(ConfigError, match=r"was measured with sets=.*FIDs compare only at equal settings; pass "
                                          rf"--set train.eval_inception={junk} --set train.ema_decay=0.99$"):
        run_quality(QualitySettings(**{**QUICK, "quick": True, "device": "cpu", "data": str(fmnist_npz),
                                       "reference_from": str(tmp_path / "b" / "quality.json")}),
                    tmp_path / "c", log=lambda m: None)


def test_the_feature_network_is_trained_once_per_dataset_whatever_the_out_folder(tmp_path, fmnist_npz, monkeypatch):
    """A --num-images draw was written into --out, so its cache, and the feature network keyed by it, were new for
    every --out (each timestamped default): the network trained again (~130 s on a CPU) and each call scored its
    FIDs in a network of its own. The draw is named by its content in the cache folder: the same images reuse the
    network whatever the --out, other images train their own."""
    import numpy as np
    import torch

    from fastddpm.eval import classifier
    from fastddpm.eval.features import build_feature_net

    monkeypatch.setenv("FASTDDPM_CACHE", str(tmp_path / "cache"))  # no network another test trained
    trainings, nets = [], []
    real = classifier.train_classifier

    def counted(*args, **kwargs):
        trainings.append(args[0].cache_path.name)
        return real(*args, **kwargs)

    def fake(name, cfg, out_dir, log):  # what a run's --eval-every builds, without training the run
        net = build_feature_net(cfg.data, device=torch.device("cpu"), inception=None,
                                cache_root=Path(cfg.data.cache_dir) if cfg.data.cache_dir else None,
                                log=lambda m: None)
        nets.append(net.identity)
        return {"name": name, "run_dir": str(out_dir / name), "config": cfg.to_dict(), "evals": _evals([3.0], 256),
                "final_fid": 3.0, "images_seen": 256, "train_wall_s": 1.0, "process_s": 2.0,
                "images_per_s_last": 100.0}

    monkeypatch.setattr(classifier, "train_classifier", counted)
    monkeypatch.setattr(quality, "_train_run", fake)
    base = dict(QUICK, device="cpu", quick=True, data=str(fmnist_npz), reference_only=True)
    first = run_quality(QualitySettings(**base), tmp_path / "a", log=lambda m: None)
    second = run_quality(QualitySettings(**base), tmp_path / "b", log=lambda m: None)
    assert len(trainings) == 1 and nets[0] == nets[1]
    assert first["data_source"] == second["data_source"]
    assert not any(Path(first["data_source"]).is_relative_to(tmp_path / out) for out in ("a", "b"))
    # the same command into the same --out reuses the draw as it is (rewritten, its new mtime retrained it)
    run_quality(QualitySettings(**base, remeasure=True), tmp_path / "a", log=lambda m: None)
    assert len(trainings) == 1 and nets[2] == nets[0]

    data = np.load(fmnist_npz)
    images = data["images"].copy()
    images[::2] = 255 - images[::2]  # other pixels, the same labels
    changed = tmp_path / "changed.npz"
    np.savez(changed, images=images, labels=data["labels"])
    third = run_quality(QualitySettings(**{**base, "data": str(changed)}), tmp_path / "c", log=lambda m: None)
    assert len(trainings) == 2 and nets[3] != nets[0] and third["data_source"] != first["data_source"]
