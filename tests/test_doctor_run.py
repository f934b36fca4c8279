"""`fastddpm doctor run` on scripts shaped as people write them: a validation pass before training (its loader is
not the training loader), slow set-up before the first step (not a step), prints on stdout (not in the JSON
report), the optimizer's range around the doctor's step boundary (not charged to the optimizer), a loop that ends
before the profile window (said so), and a device this machine does not have (refused before the script runs)."""

from __future__ import annotations

import json
import statistics
import textwrap

import pytest
import torch

from fastddpm.cli import main
from fastddpm.doctor import DoctorConfig
from fastddpm.doctor.runners import run_script

VAL_FIRST_SCRIPT = textwrap.dedent("""
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):  # file-read latency
        def __init__(self, n):
            self.n = n
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            time.sleep(0.0005)
            return torch.randn(16), i % 4

    val_loader = DataLoader(Slow(64), batch_size=64)
    train_loader = DataLoader(Slow(4096), batch_size=8, shuffle=True)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def evaluate():
        with torch.no_grad():
            return sum(torch.nn.functional.cross_entropy(model(x), y).item() for x, y in val_loader)

    print("initial val loss", evaluate())
    for x, y in train_loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def _line(source: str, text: str) -> int:
    return 1 + next(i for i, s in enumerate(source.splitlines()) if text in s)


def test_the_training_loader_is_the_one_fetched_before_the_step_not_the_validation_one(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(VAL_FIRST_SCRIPT)
    cfg = DoctorConfig(warmup_steps=2, steps=8, profile_steps=0, loader_probe_s=0.2, out_dir=tmp_path / "rep",
                       time_budget_s=None)
    report = run_script(script, [], cfg)
    m = report.measurements
    assert m["batch_size"] == 8  # the training loader's batch, not the validation loader's 64
    assert m["loader_probe"]["batches_per_s"] > 0  # the probe timed the training loader
    assert report.bottleneck == "data-bound", report.text()
    fix = next(f for f in report.finding("data-bound").fixes if f.trial)
    train_line = _line(VAL_FIRST_SCRIPT, "train_loader = DataLoader")
    assert f"at train.py:{train_line} " in fix.code, fix.code


STARTUP_SCRIPT = textwrap.dedent("""
    import time
    import torch
    from torch.utils.data import DataLoader

    time.sleep(1.0)  # set-up: a dataset read, a model built
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(4096, 16)
    batches = LOADER
    for x in batches:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


@pytest.mark.parametrize("loader", ["DataLoader(data, batch_size=8)", "data.split(8)"],
                         ids=["first-fetch", "first-optimizer-step"])
def test_the_scripts_set_up_is_not_its_first_step(tmp_path, loader):
    # a 3 s budget gives the warm-up 0.75 s: the second of set-up before the first step must not spend it
    script = tmp_path / "train.py"
    script.write_text(STARTUP_SCRIPT.replace("LOADER", loader))
    cfg = DoctorConfig(warmup_steps=4, steps=4, profile_steps=0, loader_probe_s=0, out_dir=None, time_budget_s=3.0)
    report = run_script(script, [], cfg)
    warmup = report.measurements["windows"]["warmup"]
    assert warmup["taken"] == 4 and not warmup["cut_by_time"] and warmup["seconds"] < 0.75, warmup
    assert not any("warm-up window" in n for n in report.measurements["notes"])


PRINTING_SCRIPT = textwrap.dedent("""
    import os
    import torch
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        loss = model(torch.randn(4, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("step", step, "loss", loss.item())
        os.write(1, b"RAW LINE\\n")  # past sys.stdout: as C code and child processes write
""")


def test_json_on_stdout_is_the_report_alone_and_the_scripts_output_goes_to_stderr(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text(PRINTING_SCRIPT)
    code = main(["doctor", "run", "--warmup", "2", "--steps", "4", "--profile-steps", "0", "--loader-probe-s", "0",
                 "--report-dir", str(tmp_path / "rep"), "--json", str(script)])
    out, err = capfd.readouterr()
    assert code == 0
    assert json.loads(out)["format"] == "fastddpm-doctor-1"
    assert "step 0 loss" in err and "RAW LINE" in err
    print("after")  # stdout is stdout again
    assert capfd.readouterr().out == "after\n"


OPTIMIZER_SCRIPT = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(64, 256)
    for step in range(10_000):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def test_the_breakdown_adds_up_and_the_optimizer_is_not_charged_the_profilers_stop(tmp_path):
    # doctor run ends each step in torch.optim's post-hook, inside the `Optimizer.step#` range: that range
    # outlasts the step, and in the last profiled step covers the profiler's stop
    script = tmp_path / "train.py"
    script.write_text(OPTIMIZER_SCRIPT)
    cfg = DoctorConfig(warmup_steps=2, steps=6, profile_steps=1, loader_probe_s=0, out_dir=None, time_budget_s=None)
    # One thread: on a machine busy with other work, each parallel op of a step waits for its threads, and the one
    # profiled step's small optimizer updates took 16-20 ms each (a share of 0.6-0.8 against 0.05 watched), where
    # one thread loses a time slice once at most. What is tested, the cut at the step's end, is the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_script(script, [], cfg)
    finally:
        torch.set_num_threads(threads)
    m = report.measurements
    breakdown = m["trace"]["breakdown"]
    assert sum(breakdown.values()) <= 1 + 1e-9, breakdown
    # the step() calls timed in the watched steps: the optimizer's true share (the profiler adds a little)
    watched = statistics.median(s["optimizer_ms"] / s["host_ms"] for s in m["steps"])
    assert breakdown["optimizer"] < 2 * watched + 0.05, (watched, m["trace"]["profiled_step_ms"], breakdown)


def test_a_loop_that_ends_before_the_profile_window_says_so(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STARTUP_SCRIPT.replace("time.sleep(1.0)", "pass").replace("LOADER", "data[:80].split(8)"))
    cfg = DoctorConfig(warmup_steps=2, steps=20, profile_steps=10, loader_probe_s=0, out_dir=None,
                       time_budget_s=None)
    report = run_script(script, [], cfg)
    why = ("no profile: the loop ended after 10 steps, in the watch window, before the profile window "
           "(profile_steps=10) began")
    assert report.measurements["trace_unavailable"] == why
    assert report.verdict["title"] == f"HEALTHY by the host-side rules; the compute rules were not checked: {why}"
    assert "profile_steps=0" not in report.text()


def test_a_device_this_machine_lacks_is_refused_before_the_script_runs(tmp_path, capsys):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n" + OPTIMIZER_SCRIPT)
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    assert main(["doctor", "run", "--device", missing, "--report-dir", str(tmp_path / "rep"), str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --device {missing}: ")
    assert ("CUDA device(s), cuda:0 to" if torch.cuda.is_available() else "sees no CUDA device") in err, err
    assert "train.py raised" not in err and not marker.exists()
    assert main(["doctor", "run", "--device", "cdua", "--report-dir", str(tmp_path / "rep"), str(script)]) == 2
    assert "'cdua' is not a device torch knows" in capsys.readouterr().err and not marker.exists()


STALLING_SCRIPT = textwrap.dedent("""
    import time
    import torch

    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        loss = model(torch.randn(8, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 5:
            time.sleep(100000)  # a deadlocked loader worker, a collective waiting for a peer
""")


def test_a_script_that_stops_making_steps_is_ended_and_reported_with_where_it_was_stuck(tmp_path):
    """The time budget was checked only as a step ended: a loop stuck between two steps held the doctor forever
    (killed after minutes, no report). Once no step ends for the longer of the budget and 10 of the slowest steps,
    it is ended where it stands, and the report says so, naming the line."""
    import time

    script = tmp_path / "train.py"
    script.write_text(STALLING_SCRIPT)
    cfg = DoctorConfig(warmup_steps=2, steps=20, profile_steps=1, loader_probe_s=0, out_dir=tmp_path / "rep",
                       time_budget_s=2.0)
    t0 = time.perf_counter()
    report = run_script(script, [], cfg, log=lambda *a: None)
    assert time.perf_counter() - t0 < 30
    said = report.text()
    assert "the doctor ended it: no step ended for" in said, said
    # the script's top level is worded as every place is (watchers.place_of): no ` in <module>`, the code uncommented
    where = f"train.py:{_line(STALLING_SCRIPT, 'time.sleep')} (time.sleep(100000))"
    assert f"stuck at {where}" in said, said
    assert report.findings[0].evidence[-1] == f"the script was stuck at {where}"
    assert report.verdict["id"] == "stalled" and report.verdict["title"].startswith("STALLED: no step for") and \
        report.verdict["title"].endswith("s after step 6, the process idle")
    assert "look at train.py:" in report.findings[0].fixes[0].code


def test_work_between_steps_and_a_signal_from_outside_are_no_stall(tmp_path):
    """A validation pass between steps (the CPU busy, the lines moving) outlasts the limit and is no stall; a
    SIGUSR1 sent from outside goes to the script's own handler, and a faulthandler registered for it stays."""
    import faulthandler
    import signal
    import time

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        import torch

        got = []
        signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
        model = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(30):
            loss = model(torch.randn(8, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
                assert got == [1], got
                t0 = time.time()
                while time.time() - t0 < 5:  # a validation pass: 5 s of work, longer than the 2 s limit
                    with torch.no_grad():
                        model(torch.randn(256, 16))
    """))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cfg = DoctorConfig(warmup_steps=2, steps=20, profile_steps=1, loader_probe_s=0, out_dir=None,
                           time_budget_s=2.0)
        t0 = time.perf_counter()
        report = run_script(script, [], cfg, log=lambda *a: None)
        assert report.verdict["id"] != "stalled" and "doctor ended it" not in report.text()
        assert time.perf_counter() - t0 > 5
    finally:
        assert faulthandler.unregister(signal.SIGUSR1)  # still registered after the doctor


def test_a_busy_child_process_is_no_stall_and_a_faulthandler_taken_signal_still_ends_a_stuck_script(tmp_path):
    """A validation run in a subprocess (the child busy, the script waiting on it) was ended as STALLED, its CPU not
    counted; a script that registered faulthandler for SIGUSR1 took the doctor's signal below Python and was never
    ended, its stack dumped at every limit."""
    import time

    loop = textwrap.dedent("""
        import faulthandler, signal, subprocess, sys, time
        import torch

        model = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(30):
            loss = model(torch.randn(8, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                {}
    """)
    child = "subprocess.run([sys.executable, '-c', 'import time\\nt = time.time()\\nwhile time.time() - t < 5: pass'])"
    cfg = DoctorConfig(warmup_steps=2, steps=20, profile_steps=1, loader_probe_s=0, out_dir=None, time_budget_s=2.0)
    script = tmp_path / "train.py"
    script.write_text(loop.format(child + "  # 5 s of a child's work: longer than the limit"))
    t0 = time.perf_counter()
    report = run_script(script, [], cfg, log=lambda *a: None)
    assert report.verdict["id"] != "stalled" and "doctor ended it" not in report.text()
    assert time.perf_counter() - t0 > 5
    dump = tmp_path / "dump.txt"  # where faulthandler writes the stack at each signal
    script.write_text(loop.format(f"faulthandler.register(signal.SIGUSR1, file=open({str(dump)!r}, 'w'))\n"
                                  "        time.sleep(100000)"))
    t0 = time.perf_counter()
    report = run_script(script, [], cfg, log=lambda *a: None)
    assert time.perf_counter() - t0 < 40
    assert report.verdict["id"] == "stalled" and report.verdict["title"].endswith("after step 4, the process idle")
    assert f"train.py:{_line(script.read_text(), 'time.sleep(100000)')}" in report.text()
    # ended without the script's faulthandler dumping the threads' stacks: its C handler walked this process's
    # threads while they ran on, and crashed it (a segmentation fault) about one stall in ten
    assert dump.read_text() == ""
    import faulthandler
    import signal

    assert not faulthandler.unregister(signal.SIGUSR1)  # the script's registration did not outlive it


def test_a_folder_given_as_the_script_is_said_to_be_a_folder(tmp_path, capsys):
    assert main(["doctor", "run", str(tmp_path)]) == 2
    assert f"doctor run: {tmp_path} is a folder; give the path of the .py file in it that trains" in \
        capsys.readouterr().err
