"""Progress where there is no terminal: whole lines every few seconds (no carriage returns), the notebook bar
in Jupyter, tqdm's bar on a terminal; `fastddpm train` under a log file writes such lines."""

from __future__ import annotations

import io
import subprocess
import sys

from fastddpm.progress import PlainProgress, progress_bar


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_every_interval_with_rate_and_eta():
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress(100, unit="step", every_s=30.0, file=out, clock=clock)
    for _ in range(10):  # 10 steps in 20 s: no line before 30 s
        clock.t += 2.0
        bar.update()
    assert out.getvalue() == ""
    bar.set_postfix(loss="0.0829", img_s="460")
    for _ in range(5):
        clock.t += 2.0
        bar.update()
    # 15 steps in 30 s: 0.5 steps/s, 85 steps left: 170 s = 2:50
    assert out.getvalue() == "step 15/100 (15%) | loss=0.0829, img_s=460 | 0:30 elapsed, ETA 2:50\n"
    clock.t += 1.0
    bar.update(85)
    bar.close()
    bar.close()  # once
    lines = out.getvalue().splitlines()
    assert lines[-1] == "step 100/100 (100%) | loss=0.0829, img_s=460 | 0:31 elapsed, ETA 0:00" and len(lines) == 2
    assert "\r" not in out.getvalue()


def test_the_display_follows_where_it_is_written(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress_bar(10, file=io.StringIO()), PlainProgress)
    from tqdm import tqdm

    bar = progress_bar(10, file=Terminal())
    assert isinstance(bar, tqdm) and not isinstance(bar, PlainProgress)
    bar.close()
    # a Jupyter kernel: the notebook bar (where ipywidgets is there to draw it), else plain lines
    import fastddpm.progress as progress

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        assert isinstance(progress_bar(10, file=io.StringIO()), PlainProgress)
    else:
        from tqdm.notebook import tqdm as notebook_tqdm

        assert isinstance(progress_bar(10, file=io.StringIO()), notebook_tqdm)


def test_train_into_a_log_file_writes_whole_lines(tmp_path, fmnist_npz):
    """`fastddpm train ... 2> log`: stderr is a file, so the progress is plain lines, one at the end at least."""
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        # without attention and with a small final grid: the run's lines are what is read, not its model or samples
        r = subprocess.run([sys.executable, "-m", "fastddpm", "train", "--preset", "tiny", "--data", str(fmnist_npz),
                            "--out", str(tmp_path / "run"), "--max-steps", "3", "--checkpoint-every", "3",
                            "--no-attention", "--num-sample-images", "4", "--sample-steps", "2"],
                           stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert r.returncode == 0, text[-3000:]
    assert "\r" not in text
    assert any(line.startswith("step 3/3 (100%) | loss=") for line in text.splitlines()), text[-3000:]


def test_plain_progress_eta_leaves_the_set_up_out():
    """The first steps of a run compile (here 60 s for the first step); then 1 step/s. After the first line the
    ETA comes from the steps since that line, not a mean that still holds the compile, nor the last interval's
    rate alone, which jumps with every slow patch."""
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress(200, every_s=30.0, file=out, clock=clock)
    clock.t = 60.0
    bar.update()  # the compiled first step: a line at 60 s with the mean so far
    for _ in range(30):
        clock.t += 1.0
        bar.update()
    for _ in range(15):  # a slow patch (another process on the machine): 2 s a step for 30 s
        clock.t += 2.0
        bar.update()
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/200 (0%) | 1:00 elapsed, ETA 3:19:00"
    # 31 steps at 90 s: 169 steps left at 1 step/s since the first line is 2:49 (the mean since the start: 8:10)
    assert lines[1] == "step 31/200 (16%) | 1:30 elapsed, ETA 2:49"
    # 46 steps at 120 s: 45 steps in 60 s since the first line, 154 left is 3:25 (the last 30 s alone: 5:08)
    assert lines[2] == "step 46/200 (23%) | 2:00 elapsed, ETA 3:25"
