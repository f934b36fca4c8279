"""Config files with a user's typical mistakes: a key written twice."""

from __future__ import annotations

import pytest
import yaml

from fastddpm.config import ConfigError, resolve_config
from fastddpm.config.overrides import _unique_keys_yaml_loader


@pytest.mark.parametrize("name, text, match", [
    ("c.yaml", "train:\n  max_steps: 3\nmodel:\n  attention: false\ntrain:\n  lr: 0.01\n",
     r"c.yaml: 'train' is written twice in one mapping \(lines 1 and 5\), and only the last would count: merge them"),
    ("c.yaml", "train:\n  lr: 0.01\n  max_steps: 3\n  lr: 0.02\n",
     r"c.yaml: 'lr' is written twice .*\(lines 2 and 4\)"),
    ("c.json", '{"train": {"max_steps": 3}, "train": {"lr": 0.01}}', r"c.json: 'train' is written twice"),
])
def test_a_key_written_twice_in_a_config_file_is_refused_not_dropped(tmp_path, name, text, match):
    """Two `train:` sections (or a field twice in one): the YAML and JSON parsers kept only the last, so the first
    one's max_steps was dropped without a word and the run trained the preset's length."""
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        resolve_config("tiny", file=f)


def test_a_yaml_merge_key_may_still_be_overridden(tmp_path):
    """YAML's merge key (<<) brings in an anchor's fields that the mapping may override: not a key written twice."""
    f = tmp_path / "c.yaml"
    f.write_text("train: &base\n  lr: 0.01\n  max_steps: 3\n")
    assert resolve_config("tiny", file=f).train.lr == 0.01
    text = "a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n"
    assert yaml.load(text, Loader=_unique_keys_yaml_loader(f)) == {"a": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}


def test_a_preset_on_the_command_line_over_a_config_files_own_is_said(tmp_path, capsys):
    """`--preset tiny` with a config file that says `preset: cpu-demo`: the command line wins, as its flags do, and
    the file's values went over tiny without a word."""
    import json

    from fastddpm.cli import main

    path = tmp_path / "run.yaml"
    path.write_text("preset: cpu-demo\ntrain:\n  lr: 0.001\n")
    assert main(["train", "--config", str(path), "--preset", "tiny", "--print-config"]) == 0
    out, err = capsys.readouterr()
    cfg = json.loads(out)
    assert cfg["preset"] == "tiny" and cfg["train"]["lr"] == 0.001
    assert f"note: --preset tiny replaces the preset {path} names (cpu-demo): the file's values go over tiny" in err
    assert main(["train", "--config", str(path), "--preset", "cpu-demo", "--print-config"]) == 0
    assert "replaces" not in capsys.readouterr().err  # the same preset: nothing to say
