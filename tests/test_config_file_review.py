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
