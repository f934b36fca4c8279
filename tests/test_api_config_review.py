"""fastddpm.train's first argument given a path that is no config file."""

import pytest

import fastddpm
from fastddpm.config import ConfigError


def test_a_run_folder_or_another_file_given_as_the_config_is_named_as_such_not_as_an_unknown_preset(tmp_path):
    """fastddpm.train(RUN_DIR, out=...) (to train like a run, or to go on with it) was told "unknown preset
    '/path/to/run'"; nothing is written to `out`."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    out = tmp_path / "new"
    with pytest.raises(ConfigError, match=rf"^fastddpm.train: config='{run}' is a folder: pass a preset's name \(tiny, "
                                          rf".*a YAML or JSON config file \(a run's own is RUN/config.json\), or a "
                                          rf"RunConfig; to continue the run in it, fastddpm.train\(out='{run}', "
                                          r"resume='latest'\)$"):
        fastddpm.train(run, out=out, log=None)
    (tmp_path / "notes.txt").write_text("lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"notes.txt' is a file that does not end in .yaml, .yml or .json"):
        fastddpm.train(str(tmp_path / "notes.txt"), out=out, log=None)
    with pytest.raises(ConfigError, match=r"gone' is no file or folder"):
        fastddpm.train(tmp_path / "gone", out=out, log=None)
    with pytest.raises(ConfigError, match=r"^unknown preset 'tiny2' \(did you mean 'tiny'\?\)"):
        fastddpm.train("tiny2", out=out, log=None)
    assert not out.exists()


def test_evaluate_takes_features_as_fastddpm_eval_does(monkeypatch):
    """The README says fastddpm.evaluate takes `fastddpm eval`'s choices by the same names; features="inception"
    (`fastddpm eval --features inception`) was a TypeError. It finds the weights as inception="auto" does, and
    contradicting inception= is refused as the command refuses --features fastddpm --inception FILE."""
    import fastddpm.api as api

    seen = {}

    class Stop(Exception):
        pass

    def load(path, **kwargs):  # the point past the feature choice, before any model or weights are read
        raise Stop

    monkeypatch.setattr(api, "_load", load)
    monkeypatch.setattr("fastddpm.eval.inception.inception_file", lambda f, **k: seen.setdefault("file", f))
    with pytest.raises(Stop):
        fastddpm.evaluate("runs/x", features="inception", log=None)
    with pytest.raises(ConfigError, match=r"^evaluate: features='inceptoin' is not one of 'fastddpm', 'inception'$"):
        fastddpm.evaluate("runs/x", features="inceptoin", log=None)
    with pytest.raises(ConfigError, match=r"^evaluate: features='fastddpm' and inception='w.pt' contradict each "
                                          r"other: drop inception"):
        fastddpm.evaluate("runs/x", features="fastddpm", inception="w.pt", log=None)
    assert "file" not in seen  # "auto" is found later, with the model: no file was named
