"""Ctrl-C in a command without a stop of its own: one line and exit 130."""

import pytest

import fastddpm.cli as cli


def test_ctrl_c_during_sample_ends_in_one_line_and_130_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C during `fastddpm sample` (or eval, export, data) ended in Python's KeyboardInterrupt traceback of
    wherever the signal landed (F.scaled_dot_product_attention, ...)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_sample", interrupted)
    assert cli.main(["sample", "--checkpoint", "runs/x"]) == 130
    assert capsys.readouterr().err == "\nfastddpm sample: stopped by Ctrl-C\n"


def test_ctrl_c_under_the_doctor_keeps_its_traceback(monkeypatch):
    """The doctor runs the user's own script: the traceback points into it."""
    import fastddpm.doctor.cli as doctor_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(doctor_cli, "run_doctor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["doctor", "run", "train.py"])
