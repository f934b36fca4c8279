"""Ctrl-C during a `fastddpm bench` command: what the user is told."""

import re

import pytest

from fastddpm.cli import main


@pytest.mark.parametrize("command, module", [("throughput", "throughput"), ("ladder", "ladder"),
                                             ("quality", "quality")])
def test_ctrl_c_in_a_bench_names_the_folder_its_results_are_kept_in_and_exits_130(tmp_path, monkeypatch, capsys,
                                                                                   command, module):
    """Ctrl-C ended the bench in Python's KeyboardInterrupt traceback: nothing said that the variants measured
    were kept, nor in which folder (the default --out is named by the time it started, so the same command again
    started a new one)."""
    import importlib

    runner = importlib.import_module(f"fastddpm.bench.{module}")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, f"run_{module}", interrupted)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", command, "--quick"]) == 130
    err = capsys.readouterr().err
    said = re.search(rf"bench {command}: stopped by Ctrl-C; what was measured before it is kept in --out "
                     rf"(runs/bench-{command}-\d{{8}}T\d{{6}}Z), and the same command with that --out goes on from "
                     "there, reusing it", err)
    assert said, err
    assert main(["bench", command, "--quick", "--out", "mine"]) == 130
    assert "kept in --out mine," in capsys.readouterr().err
