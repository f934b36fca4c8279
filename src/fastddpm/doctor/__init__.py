"""`fastddpm doctor`: profile a training loop, name its bottleneck with evidence, prescribe the fix.

Where things are:
- session.py       the bounded run: warm-up, watched steps (cheap timers), profiled steps (torch.profiler)
- marks.py         the ranges the session records in the trace (a step, a wait for data)
- trace.py         the exported Chrome/Perfetto trace -> GPU idle, host-wait vs kernel-wait, syncs, copies, ...
  trace_optree.py, trace_flops.py, trace_intervals.py: where each op's time goes, matmul FLOPs by dtype, intervals
- system.py        CPU load of the process and its loader workers, GPU clocks/temperature, device memory
- measurements.py  what the run measured, as typed records; `to_dict()` is the JSON report's measurements
- rules.py         RULES (docs/DOCTOR.md's rules, in order), evaluate and the verdict; the rules themselves, one
                   function each, in rules_input.py, rules_gpu.py, rules_compute.py and rules_run.py; their
                   thresholds in thresholds.py; a finding and its fixes in findings.py
- report.py        terminal text, JSON and self-contained HTML
- api.py           `watch(loader)` for your own loop; `diagnose(session)`
- runners.py       `doctor run script.py` (hooks DataLoader iteration and optimizer steps) and `doctor train`
"""


# Imported on first use (PEP 562), so that `fastddpm doctor --help`, which builds its parser from doctor/cli.py,
# answers without importing torch.
_EXPORTS = {"watch": "api", "Watch": "api", "diagnose": "api", "Report": "report", "DoctorConfig": "session",
            "Session": "session"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastddpm.doctor' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"fastddpm.doctor.{_EXPORTS[name]}"), name)
