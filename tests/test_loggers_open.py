"""--log-to loggers that cannot open, refused before a run's set-up with the fix: a missing package, and a link to
nothing where the logger's folder goes."""

import importlib.util
import os

import pytest

from fastddpm.config import ConfigError, apply_overrides, get_preset
from fastddpm.trainer.loggers import check_loggers


def logging_to(name):
    return apply_overrides(get_preset("tiny"), {"train.log_to": (name,)})


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_missing_package_names_the_install_and_dropping_it_from_log_to(monkeypatch, logger):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == logger else real_find_spec(name, *a))
    with pytest.raises(ConfigError) as e:
        check_loggers(logging_to(logger), None)
    assert f"pip install {logger}" in str(e.value) and f"or drop {logger} from --log-to" in str(e.value)


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_link_to_nothing_where_the_folder_goes_is_said_as_such_naming_its_target(tmp_path, monkeypatch, logger):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == logger else real_find_spec(name, *a))
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "gone" / "logs"
    os.symlink(target, run / logger)
    with pytest.raises(ConfigError) as e:
        check_loggers(logging_to(logger), run)
    said = str(e.value)
    assert f"{run / logger}, which is a link to nothing here (its target {target} does not exist)" in said
    assert "a file" not in said and f"drop {logger} from --log-to" in said
    assert os.readlink(run / logger) == str(target)  # the link is left as it was
    # a real file is still said to be one
    (run / logger).unlink()
    (run / logger).write_text("notes\n")
    with pytest.raises(ConfigError, match="which is a file here: move or delete"):
        check_loggers(logging_to(logger), run)
