"""Recompiles and graph breaks, counted from torch._dynamo's counters and reported in the metrics log.

After warm-up nothing should compile again: the shapes are static (drop_last) and the learning rate is a
tensor. Any graph compiled after the warm-up mark is a recompile worth a look (`TORCH_LOGS=recompiles`).
"""

from __future__ import annotations


def _snapshot() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"].get("unique_graphs", 0))
    breaks = int(sum(counters["graph_break"].values()))
    return graphs, breaks


class CompileCounters:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = _snapshot() if enabled else (0, 0)
        self.warm: tuple[int, int] | None = None

    def mark_warm(self) -> None:
        if self.enabled:
            self.warm = _snapshot()

    def report(self) -> dict[str, int]:
        if not self.enabled:
            return {}
        graphs, breaks = _snapshot()
        out = {"compiled_graphs": graphs - self.start[0], "graph_breaks": breaks - self.start[1]}
        if self.warm is not None:
            out["recompiles_after_warmup"] = graphs - self.warm[0]
        return out
