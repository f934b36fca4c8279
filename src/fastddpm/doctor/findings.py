"""What a rule returns: a Finding, and the small helpers the rules share to word and cost one.

A Finding has
- `cost`: the share of step time the problem is estimated to take (what fixing it could give back); the
  verdict (fastddpm.doctor.rules) is the triggered finding with the largest cost;
- `evidence`: the numbers that drove it, as sentences a user can check against the trace;
- `fixes`: ranked, each both as a fastddpm setting (for `doctor train`) and as a code change (for a user's
  own loop): the report shows the kind that fits what was diagnosed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from fastddpm.doctor.measurements import StepRecord
from fastddpm.doctor.thresholds import NEGLIGIBLE_SHARE


@dataclass
class Fix:
    fastddpm: str | None  # a setting of the built-in trainer
    code: str  # a change to a user's own loop (rewritten in the script's own terms where the doctor saw them)
    # how `doctor run --try` applies it from outside the script (fastddpm.doctor.trials): "autocast-bf16",
    # "compile", "fused-optimizer", "loader-workers:N", ...; None: it cannot be applied from outside
    trial: str | None = None
    args: tuple[str, ...] | None = None  # a fix that is one of the script's own flags: its arguments with it
    # the step-rate gain this fix can give at most, where that is less than its finding's (the finding's cost is
    # what removing the problem gives back; more loader workers cannot outrun the loader): `--try`'s prediction
    gain: float | None = None
    # no estimate at all: the finding's cost is measured, but what this fix gives back is not predictable from it
    # (channels_last under torch.compile), so `--try` reports the fix measured against no prediction
    unpredicted: bool = False


@dataclass
class Finding:
    id: str
    rules: tuple[int, ...]
    title: str
    cost: float
    evidence: list[str]
    cause: str
    fixes: list[Fix] = field(default_factory=list)
    kind: str = "bottleneck"  # or "opportunity" (never a verdict) / "note"
    group: str = "pipeline"  # or "compute": the model's own arithmetic is slow (rules 12, 13, 16-20)

    @property
    def negligible(self) -> bool:
        """A compute fix that would give back under NEGLIGIBLE_SHARE of the step: checked, but not ranked, tried
        or listed as a finding (the report names it in one line)."""
        return self.kind == "bottleneck" and self.group == "compute" and self.cost < NEGLIGIBLE_SHARE

    @property
    def speedup(self) -> float:
        """The step-rate gain the cost estimate promises: 1 / (1 - cost)."""
        return 1.0 / max(1e-9, 1.0 - self.cost)

    def to_dict(self) -> dict:
        return {"id": self.id, "rules": list(self.rules), "title": self.title, "cost": self.cost,
                "expected_speedup": self.speedup, "evidence": self.evidence, "cause": self.cause,
                "kind": self.kind, "group": self.group, **({"negligible": True} if self.negligible else {}),
                "fixes": [{"fastddpm": f.fastddpm, "code": f.code, **({"trial": f.trial} if f.trial else {}),
                           **({"args": list(f.args)} if f.args else {}),
                           **({"expected_speedup": f.gain} if f.gain is not None else {}),
                           **({"unpredicted": True} if f.unpredicted else {})} for f in self.fixes]}


def pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.1f}%"


def math_words(breakdown: dict[str, float]) -> str:
    """What the step's math is, named by what the trace holds: "matmuls and convolutions", "... and attention"."""
    return "matmuls, convolutions and attention" if breakdown.get("attention") else "matmuls and convolutions"


def watched_time(steps: list[StepRecord]) -> tuple[float, float]:
    """(the watched steps' total host time, their median), ms."""
    return sum(s.host_ms for s in steps) or 1e-9, statistics.median(s.host_ms for s in steps)
