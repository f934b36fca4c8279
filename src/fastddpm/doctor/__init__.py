"""`fastddpm doctor`: profile a training loop, name its bottleneck with evidence, prescribe the fix.

Where things are:
- session.py       the bounded run: warm-up, watched steps (cheap timers), profiled steps (torch.profiler)
- trace.py         the exported Chrome/Perfetto trace -> GPU idle, host-wait vs kernel-wait, syncs, copies, ...
- system.py        CPU load of the process and its loader workers, GPU clocks/temperature, device memory
- measurements.py  what the run measured, as typed records; `to_dict()` is the JSON report's measurements
- rules.py         docs/DOCTOR.md's rules as code, one function each: findings with cost and evidence, the verdict
- report.py        terminal text, JSON and self-contained HTML
- api.py           `watch(loader)` for your own loop; `diagnose(session)`
- runners.py       `doctor run script.py` (hooks DataLoader iteration and optimizer steps) and `doctor train`
"""

from fastddpm.doctor.api import Watch, diagnose, watch
from fastddpm.doctor.report import Report
from fastddpm.doctor.session import DoctorConfig, Session

__all__ = ["watch", "Watch", "diagnose", "Report", "DoctorConfig", "Session"]
