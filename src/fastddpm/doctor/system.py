"""What the machine is doing around the loop: CPU load of this process and its DataLoader workers, GPU clocks,
temperature and power, device memory. Each reader returns None when its source is absent (no /proc, no CUDA,
no NVML), and the report says "unavailable" rather than guess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch

from fastddpm.doctor.measurements import CpuLoad, DeviceMemory, Telemetry

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of one process, seconds (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out.extend(int(c) for c in text)
    except OSError:
        return out
    return out


def _is_helper(pid: int) -> bool:
    """multiprocessing's resource tracker (started with spawn) is a child but not a loader worker."""
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    seen, todo = [], _children(pid)
    while todo:
        c = todo.pop()
        if c not in seen and not _is_helper(c):
            seen.append(c)
            todo.extend(_children(c))
    return seen


def _cores_busy_s(cpus: set[int]) -> float | None:
    """Seconds the cores `cpus` have spent busy since boot, whoever ran on them (Linux /proc/stat: user, nice,
    system, irq, softirq and the hypervisor's steal; not idle nor I/O wait), or None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks, seen = 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        v = [int(x) for x in rest.split()[:8]]
        if len(v) < 8:
            return None
        ticks += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        seen += 1
    return ticks / _CLK_TCK if seen else None


def _usable_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (a container or `taskset` limits
    it below os.cpu_count()), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device, once it is known to exist here; ValueError naming the fix where it does not
    (a CUDA device asked for on a machine without one would fail later, inside the user's script, on the doctor's
    own CUDA events)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {device!r} is not a device torch knows ({e}); give cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA device on this machine; "
                             f"leave --device out (or give --device cpu) to diagnose the run on the CPU")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}; give one of those")
    return dev


class CpuSampler:
    """Samples the CPU time of this process and all its descendants (DataLoader workers) every `period_s`
    on a background thread (a few /proc reads: ~0.1 ms a sample). Workers that come and go between
    samples (respawned each epoch) are counted from their first sample, so short-lived ones are undercounted
    by at most one period each."""

    def __init__(self, period_s: float = 0.25):
        self.period_s = period_s
        self.available = Path("/proc/self/stat").exists()
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._seen_late: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = self.t1 = 0.0
        self.max_workers = 0
        self._cpus = _usable_cpus()
        self._cores_busy0: float | None = None

    def _sample(self, first: bool = False) -> None:
        me = os.getpid()
        kids = _descendants(me)
        self.max_workers = max(self.max_workers, len(kids))
        for pid in [me, *kids]:
            cpu = _proc_cpu_s(pid)
            if cpu is None:
                continue
            if pid not in self._first:
                # a worker born after the start: its whole CPU time belongs to the window
                self._first[pid] = cpu if first or pid == me else 0.0
            self._last[pid] = cpu

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def start(self) -> None:
        if not self.available:
            return
        self.t0 = time.perf_counter()
        self._sample(first=True)
        self._cores_busy0 = _cores_busy_s(self._cpus)
        self._thread = threading.Thread(target=self._run, name="fastddpm-doctor-cpu", daemon=True)
        self._thread.start()

    def rebase(self) -> None:
        """Count from now: the window it measures began later than the sampler (a loop's first fetch)."""
        if not self.available or self._thread is None:
            return
        self._first.clear()
        self.t0 = time.perf_counter()
        self._sample(first=True)
        self._cores_busy0 = _cores_busy_s(self._cpus)

    def stop(self) -> CpuLoad | None:
        if not self.available or self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._sample()
        busy1 = _cores_busy_s(self._cpus)
        self.t1 = time.perf_counter()
        wall = max(self.t1 - self.t0, 1e-9)
        me = os.getpid()
        main = (self._last[me] - self._first[me]) / wall
        workers = sum(self._last[p] - self._first[p] for p in self._last if p != me) / wall
        # the cores' busy time less this process tree's (/proc counts both in clock ticks: a tick's rounding)
        others = (None if busy1 is None or self._cores_busy0 is None else
                  max(0.0, (busy1 - self._cores_busy0) / wall - main - workers))
        return CpuLoad(main_cores=main, workers_cores=workers, workers_seen=self.max_workers,
                       cpu_count=usable_cores(), wall_s=wall, others_cores=others)


def gpu_telemetry(device: torch.device) -> Telemetry | None:
    """SM clock (MHz), temperature (C) and power (W) now, from NVML (pynvml) or nvidia-smi; None without."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        import pynvml  # optional: the nvidia-ml-py package

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return Telemetry(sm_clock_mhz=float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                         temperature_c=float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                         power_w=pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, source="nvml")
    except Exception:  # noqa: BLE001 - any NVML failure means: try nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--id={index}", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        clock, temp, power = (v.strip() for v in out.stdout.strip().split(","))
        return Telemetry(sm_clock_mhz=float(clock), temperature_c=float(temp),
                         power_w=float(power) if power not in ("[N/A]", "N/A") else None, source="nvidia-smi")
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def device_memory(device: torch.device) -> DeviceMemory | None:
    """Peak allocated by torch's allocator vs the device's total, for rule 14."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    return DeviceMemory(peak_allocated_bytes=int(peak), total_bytes=int(total), free_bytes=int(free),
                        peak_share=peak / total)


EVENT_POOL_MAX = 2001  # CUDA events made before a watch window: its planned steps + 1, up to this


class StepEvents:
    """CUDA events on a watch window's step boundaries, made before its first step and created there too (an
    event's first record creates it), on a stream looked up once: a boundary then only records one. Making an
    event at each boundary had put a Python object, a stream lookup and the event's creation into every watched
    step. Read after the run's sync (elapsed_ms); never synced here."""

    def __init__(self):
        self._pool: list[torch.cuda.Event] = []
        self._recorded: list[torch.cuda.Event] = []
        self._stream = None

    def open(self, device: torch.device, planned_steps: int) -> None:
        """Make the window's events (unless this window made them already: a watch without warm-up opens at the
        session's start, then again at the loop's first fetch) and record its first boundary."""
        wanted = min(planned_steps + 1, EVENT_POOL_MAX)
        if len(self._pool) != wanted:
            self._stream = torch.cuda.current_stream(device)
            self._pool = [torch.cuda.Event(enable_timing=True) for _ in range(wanted)]
            for ev in self._pool:
                ev.record(self._stream)
        self._recorded = []
        self.record()

    def record(self) -> None:
        """A step boundary: the next made event (a boundary past the plan makes its own)."""
        i = len(self._recorded)
        ev = self._pool[i] if i < len(self._pool) else torch.cuda.Event(enable_timing=True)
        ev.record(self._stream)
        self._recorded.append(ev)

    def elapsed_ms(self) -> list[float]:
        """Each step's GPU time, boundary to boundary (after a sync)."""
        evs = self._recorded
        return [a.elapsed_time(b) for a, b in zip(evs, evs[1:])]
