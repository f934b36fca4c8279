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


@pytest.mark.parametrize("code, said", [(130, "Ctrl-C"), (143, "SIGTERM")])
def test_a_signal_that_stops_bench_qualitys_training_run_is_said_as_the_bench_not_as_train(tmp_path, monkeypatch,
                                                                                             capsys, code, said):
    """A signal during one of bench quality's training runs ended in the trainer's TrainingInterrupted traceback
    and exit 1, after the run's line had said "resume with --resume latest", which bench quality does not take (the
    same command trains that run again from its start)."""
    import fastddpm.bench.quality as quality
    from fastddpm.trainer.loop import TrainingInterrupted

    def stopped(*args, **kwargs):
        raise TrainingInterrupted(code, tmp_path / "q" / "reference" / "checkpoints" / "ckpt_000000001.pt")

    monkeypatch.setattr(quality, "run_quality", stopped)
    assert main(["bench", "quality", "--quick", "--out", str(tmp_path / "q")]) == code
    err = capsys.readouterr().err
    assert (f"bench quality: stopped by {said}; what was measured before it is kept in --out {tmp_path / 'q'}, and "
            "the same command with that --out goes on from there, reusing it (the training run it stopped is trained "
            "again from its start)") in err, err
    assert "Traceback" not in err
