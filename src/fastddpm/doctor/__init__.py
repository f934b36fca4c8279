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

from fastddpm.doctor.api import Watch, diagnose, watch
from fastddpm.doctor.report import Report
from fastddpm.doctor.session import DoctorConfig, Session

__all__ = ["watch", "Watch", "diagnose", "Report", "DoctorConfig", "Session"]
