"""The verdict: docs/DOCTOR.md's rules applied to one bounded run.

Each rule is one function: the typed measurements (fastddpm.doctor.measurements) in, its Finding
(fastddpm.doctor.findings) or None out. The functions live by kind: rules_input.py (the input pipeline),
rules_gpu.py (the GPU timeline), rules_run.py (compiles, memory, drift) and rules_compute.py (the model's own
arithmetic), their thresholds in thresholds.py. RULES lists them in docs/DOCTOR.md's order and `evaluate` walks
it: adding a rule is one function in the module of its kind, one entry in RULES, and one test in
tests/test_doctor_rules.py. The verdict is the triggered finding with the largest cost; a run whose findings all
cost < HEALTHY_FLOOR is healthy.
A measurement that could not be taken (no CUDA, no NVML, no trace) is recorded as unavailable with the reason;
a rule that needs it does not fire, and the report says which rules could not be checked.
"""

from __future__ import annotations

from collections.abc import Callable

from fastddpm.doctor.findings import Finding, math_words, pct
from fastddpm.doctor.measurements import Measurements
from fastddpm.doctor.rules_compute import (attention_weights, eager_elementwise, item_loop, low_mfu, param_loop,
                                           per_tensor_optimizer, precision, small_batch)
from fastddpm.doctor.rules_gpu import host_bound, kernel_gaps, layout_thrash, sync_bound, transfer_bound
from fastddpm.doctor.rules_input import data_bound, epoch_spikes
from fastddpm.doctor.rules_run import busy_machine, drift, memory_headroom, recompiles
from fastddpm.doctor.thresholds import HEALTHY_FLOOR


# Each rule reads the typed measurements and returns its Finding, or None; where a measurement it needs was not
# taken, it writes {"the rules": "why"} into `unavailable` (the report lists those as not checked).
Rule = Callable[[Measurements, dict[str, str]], Finding | None]


# docs/DOCTOR.md's rules in the order they are checked: findings of equal cost, and the report's list of
# rules not checked, keep this order. Rule 9 (launch-queue depth) has no function: it is evidence in rules 4-6
# and in the healthy verdict.
RULES: list[Rule] = [data_bound, epoch_spikes, host_bound, kernel_gaps, sync_bound, transfer_bound, recompiles,
                     layout_thrash, precision, low_mfu, memory_headroom, drift, attention_weights,
                     eager_elementwise, per_tensor_optimizer, small_batch, item_loop, param_loop, busy_machine]


# ---------------------------------------------------------------------------------------------- the verdict
def evaluate(m: Measurements | dict) -> tuple[list[Finding], dict[str, str]]:
    """All rules over the measurements `m` (fastddpm.doctor.api.measurements; or their dict form, as in a saved
    report.json). Returns (triggered findings sorted by cost, {rules: why they could not be checked})."""
    if isinstance(m, dict):
        m = Measurements.from_dict(m)
    found: list[Finding] = []
    unavailable: dict[str, str] = {}
    for rule in RULES:
        finding = rule(m, unavailable)
        if finding is not None:
            found.append(finding)
    found.sort(key=lambda f: (f.kind != "bottleneck", -f.cost))
    return found, unavailable


def verdict(found: list[Finding], m: Measurements | dict) -> dict:
    """The one dominant bottleneck, or healthy."""
    if isinstance(m, dict):
        m = Measurements.from_dict(m)
    cands = [f for f in found if f.kind == "bottleneck" and f.cost >= HEALTHY_FLOOR]
    if cands:
        top = max(cands, key=lambda f: f.cost)
        if top.group != "compute":
            return {"healthy": False, "id": top.id, "title": top.title, "cost": top.cost}
        # the model's own arithmetic is the bottleneck: every compute fix, ranked by the gain it promises
        ranked = [f for f in found if f.group == "compute" and f.kind == "bottleneck" and not f.negligible]
        return {"healthy": False, "id": top.id, "kind": "compute", "cost": top.cost,
                "title": f"COMPUTE-BOUND: {top.title}", "ranked": [f.id for f in ranked]}
    t = m.gpu_trace
    if t is not None:
        text = (f"HEALTHY (GPU-bound): the GPU is busy {pct(1 - t.idle_share)} of the kernel span, launch "
                f"queue depth median {t.queue_depth_median:.0f}; no input, sync, transfer or compile "
                "problem costs 5% or more. Further gains are compute: fusion, precision, batch (rules 12, 13, 16-20)")
    elif m.trace is None:  # only the rules that need no trace were checked: the verdict says so, and why
        unchecked = "the GPU timeline and the compute rules were" if m.cuda else "the compute rules were"
        text = f"HEALTHY by the host-side rules; {unchecked} not checked: {m.no_trace}"
    elif m.cuda:
        text = "HEALTHY by the host-side rules; the trace holds no GPU activity, so the GPU timeline was not checked"
    else:
        math = ""
        if m.trace is not None and m.trace.breakdown:  # unprofiled shares, as the rules read them
            share = m.unprofiled_share("matmul") + m.unprofiled_share("attention")
            math = f" ({pct(share)} of the step in {math_words(m.trace.breakdown)})"
        text = ("HEALTHY for a CPU run: the step is the model's math" + math + ", with no data, epoch, compile, "
                "precision or overhead problem costing 5% or more; the GPU-level rules need a CUDA device")
    return {"healthy": True, "id": "healthy", "title": text, "cost": 0.0}
