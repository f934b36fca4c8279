"""The doctor's windows bounded by wall time (DoctorConfig.time_budget_s, --max-seconds), and the profiler's own
log lines kept off the user's terminal."""

from __future__ import annotations

import io
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

import fastddpm.doctor
import fastddpm.doctor.session as session_module
from fastddpm.cli import main
from fastddpm.doctor import DoctorConfig
from fastddpm.doctor.session import (MIN_PROFILE_STEPS, MIN_WARMUP_STEPS, MIN_WATCH_STEPS, PROFILE_SHARE,
                                     WARMUP_SHARE, WATCH_SHARE, Session, profiler_logs_muted)

SHARES = {"warmup": WARMUP_SHARE, "watch": WATCH_SHARE, "profile": PROFILE_SHARE}
STEP_S = 0.25  # the fake loop's step: a sleep, no model


def _sleepy_run(tmp_path, **window):
    """A loop of STEP_S-second steps over a list, through fastddpm.doctor.watch; returns the Watch."""
    with fastddpm.doctor.watch(list(range(1000)), out=tmp_path / "rep", print_report=False, loader_probe_s=0,
                               device="cpu", **window) as dr:
        for _ in dr.batches():
            time.sleep(STEP_S)
            dr.step()
    return dr


def _time_notes(notes: list[str]) -> list[str]:
    return [n for n in notes if "time budget" in n]


def test_slow_steps_get_the_fewest_steps_per_window_and_a_note_says_why(tmp_path):
    # every window's share (0.125, 0.225, 0.15 s) is spent by its first step: each ends at its minimum
    dr = _sleepy_run(tmp_path, warmup_steps=5, steps=40, profile_steps=10, time_budget_s=0.5)
    s = dr.session
    taken = {w: s.windows[w]["taken"] for w in ("warmup", "watch", "profile")}
    assert taken == {"warmup": MIN_WARMUP_STEPS, "watch": MIN_WATCH_STEPS, "profile": MIN_PROFILE_STEPS}
    assert s.step_index == 6 and len(s.records) == 3 and s.phase == "done" and s.done
    assert all(s.windows[w]["cut_by_time"] for w in taken)
    assert s.windows["watch"]["budget_s"] == pytest.approx(0.45 * 0.5)
    assert s.windows["watch"]["seconds"] >= 3 * STEP_S
    notes = _time_notes(s.notes)
    assert len(notes) == 3
    assert any(n.startswith("warmed up for 2 of 5 planned steps: the warm-up window is bounded at 0.125 s "
                            "(25% of the 0.5 s time budget") for n in notes), notes
    watched = next(n for n in notes if n.startswith("watched"))
    assert watched.startswith("watched 3 of 40 planned steps: the watch window is bounded at 0.225 s "
                              "(45% of the 0.5 s time budget"), watched
    median_s = float(re.search(r"its median step took ([\d.]+) s", watched).group(1))
    assert STEP_S <= median_s < 10 * STEP_S
    assert any(n.startswith("profiled 1 of 10 planned steps") for n in notes), notes
    # the notes reach the report, and the trace of the one profiled step was read into it (then deleted: not
    # asked to keep it)
    assert dr.report.measurements["notes"] == s.notes
    assert dr.report.measurements["profiled_steps"] == 1 and dr.report.measurements["trace"]["steps_measured"] == 1
    assert s.trace_path is None and not list((tmp_path / "rep").glob("*trace*"))


def test_a_window_cut_by_time_ends_at_the_first_boundary_past_its_share(tmp_path):
    # 3 s: shares of 0.75, 1.35 and 0.9 s, each a few 0.25-s steps: cut by time, above the minimum
    budget = 3.0
    dr = _sleepy_run(tmp_path, warmup_steps=5, steps=40, profile_steps=10, time_budget_s=budget)
    s = dr.session
    fewest = {"warmup": MIN_WARMUP_STEPS, "watch": MIN_WATCH_STEPS, "profile": MIN_PROFILE_STEPS}
    for name, w in s.windows.items():
        share_s = SHARES[name] * budget
        # every step sleeps STEP_S, so the window's time passed its share no later than after this many steps
        most = math.floor(share_s / STEP_S) + 1
        assert fewest[name] <= w["taken"] <= most, (name, w)
        assert w["cut_by_time"] and w["seconds"] >= share_s, (name, w)
    assert s.step_index == sum(w["taken"] for w in s.windows.values()) < 5 + 40 + 10
    assert len(_time_notes(s.notes)) == 3
    assert f"watched {len(s.records)} of 40 planned steps" in " ".join(s.notes)


def test_fast_steps_take_exactly_the_planned_steps_and_no_time_note(tmp_path):
    with fastddpm.doctor.watch(list(range(100)), out=tmp_path / "rep", print_report=False, loader_probe_s=0,
                               device="cpu", warmup_steps=3, steps=6, profile_steps=2, time_budget_s=600) as dr:
        for _ in dr.batches():
            dr.step()
    s = dr.session
    assert {w: (v["planned"], v["taken"], v["cut_by_time"]) for w, v in s.windows.items()} == {
        "warmup": (3, 3, False), "watch": (6, 6, False), "profile": (2, 2, False)}
    assert s.step_index == 11 and len(s.records) == 6
    assert dr.report.measurements["profiled_steps"] == 2
    assert _time_notes(s.notes) == [] and not any("planned steps" in n for n in s.notes)


@pytest.mark.parametrize("bad", [0, -5.0, float("nan")])
def test_time_budget_must_be_positive(bad):
    with pytest.raises(ValueError, match=r"time_budget_s=.* must be > 0 seconds"):
        DoctorConfig(time_budget_s=bad)


class _Clock:
    """Stands in for the `time` module inside fastddpm.doctor.session: perf_counter reads a hand-moved clock."""

    def __init__(self):
        self.t = 1000.0

    def perf_counter(self) -> float:
        return self.t

    def __getattr__(self, name):
        return getattr(time, name)


def _drive(config: DoctorConfig, clock: _Clock, step_s: float) -> Session:
    s = Session(config, device="cpu")
    while not s.done:
        clock.t += step_s
        s.step()
    return s


def test_ten_second_steps_are_diagnosed_in_about_a_minute(monkeypatch):
    # the default 60 s budget against 10-s steps, on a clock moved by hand: 2 + 3 + 0 steps, not 45
    clock = _Clock()
    monkeypatch.setattr(session_module, "time", clock)
    s = _drive(DoctorConfig(warmup_steps=5, steps=40, profile_steps=0), clock, 10.0)
    assert {w: v["taken"] for w, v in s.windows.items()} == {"warmup": 2, "watch": 3}
    assert s.windows["warmup"]["seconds"] == 20.0 and s.windows["watch"]["seconds"] == 30.0
    assert _time_notes(s.notes) == [
        "warmed up for 2 of 5 planned steps: the warm-up window is bounded at 15 s (25% of the 60 s time budget, "
        "--max-seconds / time_budget_s) and its steps took 10 s and 10 s",
        "watched 3 of 40 planned steps: the watch window is bounded at 27 s (45% of the 60 s time budget, "
        "--max-seconds / time_budget_s) and its median step took 10 s"]
    assert [r.host_ms for r in s.records] == [10_000.0] * 3


def test_a_compiling_first_step_is_named_not_averaged_into_a_median(monkeypatch):
    # two warm-up steps, a compile (71 s) and a replay (10 ms): their median, 35.5 s, described neither
    clock = _Clock()
    monkeypatch.setattr(session_module, "time", clock)
    s = Session(DoctorConfig(warmup_steps=5, steps=40, profile_steps=0), device="cpu")
    try:
        for step_s in (71.0, 0.01):
            clock.t += step_s
            s.step()
    finally:  # the watch window it opened holds process-wide optimizer hooks
        s.release_hooks()
    import torch.optim.optimizer as optim_mod
    assert not optim_mod._global_optimizer_pre_hooks
    note = _time_notes(s.notes)[0]
    assert note.endswith("and its steps took 71 s and 0.01 s"), note


def test_no_time_budget_means_steps_only(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(session_module, "time", clock)
    s = _drive(DoctorConfig(warmup_steps=5, steps=10, profile_steps=0, time_budget_s=None), clock, 100.0)
    assert {w: (v["taken"], v["cut_by_time"], v["budget_s"]) for w, v in s.windows.items()} == {
        "warmup": (5, False, None), "watch": (10, False, None)}
    assert s.step_index == 15 and s.notes == []


def test_a_loop_that_ends_early_is_not_said_to_be_cut_by_time(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(session_module, "time", clock)
    s = Session(DoctorConfig(warmup_steps=1, steps=10, profile_steps=0), device="cpu")
    for _ in range(4):
        clock.t += 1.0
        s.step()
    s.finish_early("the data ran out")
    assert s.windows["watch"] == {"planned": 10, "taken": 3, "seconds": 3.0, "budget_s": 27.0, "cut_by_time": False}
    assert _time_notes(s.notes) == [] and "the loop ended after 4 steps" in s.notes[0]


# ---------------------------------------------------------------- the profiler's own log lines
def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _is_profiler_log(line: str) -> bool:
    return session_module._PROFILER_LOG_LINE.match(line.encode()) is not None


def test_the_pattern_matches_what_this_torch_profiler_prints(capfd):
    # unmuted, this torch's profiler writes its log lines to fd 2 (on torch 2.13: USDT ... profiler_start/stop);
    # whatever it writes there, the pattern must recognise all of it
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.ones(4, 4).sum()
    prof.export_chrome_trace(os.devnull)
    printed = _lines(capfd.readouterr().err)
    assert all(_is_profiler_log(line) for line in printed), printed


def test_a_profiled_run_prints_no_profiler_log_but_the_loops_own_lines(tmp_path, capfd):
    with fastddpm.doctor.watch(list(range(100)), out=tmp_path / "rep", print_report=False, loader_probe_s=0,
                               device="cpu", warmup_steps=1, steps=3, profile_steps=2) as dr:
        for i in dr.batches():
            if dr.session.phase == "profile":
                os.write(2, f"loop's own line {i}\n".encode())
            torch.ones(8, 8).sum()
            dr.step()
    assert dr.session.windows["profile"]["taken"] == 2 and dr.report.measurements["profiled_steps"] == 2
    err = _lines(capfd.readouterr().err)
    assert err == ["loop's own line 4", "loop's own line 5"], err


def test_the_muted_region_passes_real_lines_through_and_restores_fd2(capfd, monkeypatch):
    # sys.stderr as in a terminal session: buffered, on fd 2 (capfd's own sys.stderr bypasses fd 2)
    stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)))
    monkeypatch.setattr(sys, "stderr", stderr)
    before = os.fstat(2)
    usdt = b"USDT:2026-11-22 22:45:39 28823:28823 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    info = b"INFO:2026-11-22 22:45:48 28875:28875 output_json.cpp:981] Chrome Trace written to /tmp/x.json\n"
    warning = b"WARNING:2026-11-22 22:45:48 28875:28875 CuptiActivityProfiler.cpp:1] CUPTI: no permission\n"
    print("Python, before", file=sys.stderr)  # still in the buffer: must come out before, not be filtered
    with profiler_logs_muted():
        os.write(2, usdt + b"a real error from C++\n" + info + warning)
        print("Python, inside", file=sys.stderr)
    os.write(2, b"after\n")
    stderr.flush()
    after = os.fstat(2)
    assert (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino)
    assert _lines(capfd.readouterr().err) == ["Python, before", "a real error from C++", warning.decode().strip(),
                                              "Python, inside", "after"]


# ---------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv, expected", [([], 60.0), (["--max-seconds", "7.5"], 7.5),
                                            (["--max-seconds", "0"], None)])
def test_max_seconds_reaches_the_config(tmp_path, monkeypatch, argv, expected):
    seen = {}

    class _Report:
        def print(self):
            pass

    def fake_run_script(script, args, config, *, device=None, **trials):
        seen["config"] = config
        return _Report()

    import fastddpm.doctor.runners

    monkeypatch.setattr(fastddpm.doctor.runners, "run_script", fake_run_script)
    assert main(["doctor", "run", *argv, "--report-dir", str(tmp_path), "x.py"]) == 0
    assert seen["config"].time_budget_s == expected


def test_a_negative_max_seconds_is_a_clear_error(tmp_path, capsys):
    assert main(["doctor", "run", "--max-seconds", "-3", "--report-dir", str(tmp_path), "x.py"]) == 2
    err = capsys.readouterr().err
    assert "time_budget_s=-3.0 must be > 0 seconds" in err and "--max-seconds 0" in err


def test_a_watched_step_on_a_gpu_records_a_made_event_and_makes_none(monkeypatch):
    """The watch's CUDA events are made (and created, by a first record) before its first step: a step boundary
    records one on a stream looked up once. Making one per step had put a new event, its creation and a stream
    lookup into every watched step, a cost on a GPU's ~1 ms steps that an empty-loop floor never saw."""
    made, streams, recorded = [], [], []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            made.append(self)

        def record(self, stream=None):
            recorded.append((self, stream))

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.append(device) or "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(session_module, "gpu_telemetry", lambda device: None)
    monkeypatch.setattr(session_module, "device_memory", lambda device: None)
    s = Session(DoctorConfig(warmup_steps=1, steps=6, profile_steps=0, loader_probe_s=0, time_budget_s=None),
                device="cpu")
    s.cuda = True  # the CUDA branch, driven on the CPU with the fakes above
    s.wait_for_data(lambda: 0)
    s.step()  # the warm-up's step; the watch window opens here and makes its events
    assert len(made) == 7 and len(streams) == 1 and all(stream == "stream" for _, stream in recorded)
    before = len(made), len(streams), len(recorded)
    for i in range(5):
        s.wait_for_data(lambda: i)
        s.step()
    assert (len(made), len(streams)) == before[:2] and len(recorded) == before[2] + 5  # one record a step
    s.wait_for_data(lambda: 5)
    s.step()  # the last watched step ends the session
    assert s.done and [r.gpu_ms for r in s.records] == [1.0] * 6 and len(made) == 7
    # a watch without warm-up opens its window at the session's start and again at the first fetch: one set made
    from fastddpm.doctor.system import StepEvents
    events, made[:] = StepEvents(), []
    events.open(torch.device("cpu"), 5)
    events.open(torch.device("cpu"), 5)
    assert len(made) == 6 and events.elapsed_ms() == []


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_the_cpu_sampler_tells_other_processes_work_from_this_process_trees(tmp_path):
    """A process that is no descendant of this one (its parent exits, so it is re-parented) burns a core while
    the sampler watches an idle process: its time is other work's, not this process's nor its loader workers'."""
    import subprocess

    from fastddpm.doctor.system import CpuSampler

    started = tmp_path / "burning"
    burner = (f"import os, time\nif os.fork() == 0:\n    open({str(started)!r}, 'w').close()\n"
              "    end = time.time() + 3.0\n    while time.time() < end: pass\n    os._exit(0)\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", burner], check=True, timeout=30)
    deadline = time.time() + 10
    while not started.exists() and time.time() < deadline:
        time.sleep(0.01)
    sampler = CpuSampler(period_s=0.05)
    sampler.start()
    time.sleep(1.0)
    load = sampler.stop()
    assert load.others_cores is not None and load.others_cores > 0.6, load  # about one core, burning
    assert load.main_cores < 0.3 and load.workers_cores < 0.1 and load.workers_seen == 0, load
