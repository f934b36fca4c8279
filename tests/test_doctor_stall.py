"""`doctor run` on a script stuck in C code that no signal interrupts (fastddpm.doctor.stall)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zeroed buffers are glibc's pthread initializers")
def test_a_script_stuck_in_c_code_no_signal_interrupts_is_said_to_be_with_the_way_to_end_it(tmp_path):
    """A wait in C (a C++ condition variable: glibc's pthread_cond_wait waits on after a signal) never runs the
    doctor's Python handler. The watch signalled again at every limit, each time starting its wait for the handler
    afresh, so with a limit under UNHEARD_S it never said so and the doctor hung without a word. Now it says where
    the script stands, that Ctrl-C may not stop it either, and how to end it (Ctrl-\\ or kill -9 with the pid)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import ctypes
        import torch

        model = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        libc = ctypes.CDLL(None)  # a CDLL call releases the GIL: the doctor's watch thread runs on
        mutex, cond = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)  # zeroed: initialized
        for step in range(30):
            loss = model(torch.randn(8, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                libc.pthread_mutex_lock(mutex)
                libc.pthread_cond_wait(cond, mutex)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "fastddpm", "doctor", "run", "--max-seconds", "2", "--warmup", "2",
                             "--steps", "20", "--profile-steps", "1", "--loader-probe-s", "0", str(script)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    said, deadline = b"", time.monotonic() + 60  # start-up, 4 steps, the 2 s limit, then UNHEARD_S
    try:
        while b"did not stop" not in said and time.monotonic() < deadline:
            if select.select([proc.stderr], [], [], 1.0)[0]:
                chunk = os.read(proc.stderr.fileno(), 4096)
                if not chunk:
                    break
                said += chunk
        time.sleep(0.5)  # the rest of the line
        if select.select([proc.stderr], [], [], 0)[0]:
            said += os.read(proc.stderr.fileno(), 4096)
        assert proc.poll() is None, said.decode()  # stuck: only a signal Python does not handle ends it
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    text = said.decode()
    assert ("doctor run: train.py did not stop when the doctor signalled it: it stands at train.py:16 "
            "(libc.pthread_cond_wait(cond, mutex)), in C code that no signal interrupts") in text, text
    assert f"end it with Ctrl-\\ (SIGQUIT) or `kill -9 {proc.pid}`" in text, text
