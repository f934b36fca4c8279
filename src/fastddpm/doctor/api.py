"""The doctor for your own loop, with a few lines of change:

    import fastddpm.doctor

    with fastddpm.doctor.watch(loader, out="doctor/") as dr:
        for x, y in dr.batches():      # the loader, epoch after epoch, until the bounded run is over
            loss = train_step(x, y)
            dr.step()                  # one call per optimizer step
    dr.report.print()                  # verdict, evidence, ranked fixes; also report.html/json + the trace

`diagnose(session)` turns a finished fastddpm.doctor.session.Session into a Report; `doctor run` and
`doctor train` (fastddpm.doctor.runners) drive the same session without the user editing anything.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import sys
from pathlib import Path

import torch

from fastddpm.doctor.report import Report
from fastddpm.doctor.rules import evaluate, verdict
from fastddpm.doctor.session import DoctorConfig, DoctorError, Session, _dynamo_graphs
from fastddpm.doctor.trace import analyze, load_trace


def measurements(session: Session, *, flops_per_step: float | None = None, peak: dict | None = None,
                 measure_peak: bool = True) -> dict:
    """Everything measured in the run, as plain data (the JSON report's `measurements`)."""
    s = session
    steps = [dataclasses.asdict(r) for r in s.records]
    m: dict = {"device": str(s.device), "steps": steps, "step_stats": s.step_stats(), "cpu_load": s.cpu_load,
               "memory": s.memory, "telemetry_start": s.telemetry_start, "telemetry_end": s.telemetry_end,
               "profiled_steps": 0, "notes": list(s.notes)}
    warm, end = s.compile_warm, s.compile_end or _dynamo_graphs()
    total = _dynamo_graphs()
    if total[0] or total[1] or total[2]:
        w = warm or (0, 0, 0)
        m["compile"] = {"compiled_graphs": total[0], "recompiles_after_warmup": end[0] - w[0],
                        "graph_breaks": total[1], "graph_breaks_after_warmup": end[1] - w[1],
                        "cudagraph_skips": end[2] - w[2]}
    if s.trace_path is not None:
        ts = analyze(load_trace(s.trace_path))
        m["trace"] = ts.to_dict()
        m["trace_timeline"] = ts.timeline
        m["profiled_steps"] = len(ts.steps)
        m["trace_file"] = str(s.trace_path)
        if flops_per_step is None and ts.gemm_flops_per_step:
            flops_per_step = sum(ts.gemm_flops_per_step.values())
            m["flops_source"] = "counted from the trace's matmul/conv/attention shapes (fwd + bwd)"
    else:
        m["trace"] = None
    if flops_per_step is not None and s.records:
        m.setdefault("flops_source", "given by the caller")
        if peak is None and measure_peak:
            from fastddpm.bench.timing import measure_matmul_peak

            peak = measure_matmul_peak(s.device)
        if peak is not None:
            ss = m["step_stats"]
            step_ms = ss.get("gpu_median_ms") or ss["median_ms"]
            m["mfu"] = {"mfu": flops_per_step / (step_ms / 1e3) / (peak["tflops"] * 1e12),
                        "flops_per_step": flops_per_step, "step_ms": step_ms, "peak_tflops": peak["tflops"],
                        "peak_label": peak["label"]}
    if "mfu" not in m:
        m["mfu_unavailable"] = ("no FLOPs counted (no profile window, or no matmul/conv ops seen)"
                                if flops_per_step is None else "peak not measured")
    return m


def diagnose(session: Session, *, context: str = "user", command: list[str] | None = None,
             flops_per_step: float | None = None, peak: dict | None = None, measure_peak: bool = True) -> Report:
    """Measurements -> rules -> verdict -> Report (saved under the session's out_dir when it has one)."""
    if not session.done:
        session.finish_early("diagnosed before the planned steps were done")
    ss = session.step_stats()
    probe = None
    if session.loader is not None and ss:
        compute_ms = statistics.median(r.host_ms - r.data_wait_ms for r in session.records)
        probe = session.probe_loader(compute_ms)
    m = measurements(session, flops_per_step=flops_per_step, peak=peak, measure_peak=measure_peak)
    m["loader_probe"] = probe
    m["loader_workers"] = getattr(session.loader, "num_workers", None) if session.loader is not None else None
    if not m["steps"]:
        raise DoctorError(
            f"the doctor saw no step after the {session.config.warmup_steps} warm-up steps "
            f"({session.step_index} steps in all): call dr.step() once per optimizer step, or lower warmup_steps")
    found, unavailable = evaluate(m)
    dev = session.device
    env = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
           f"CPU ({torch.get_num_threads()} threads)", "torch": torch.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command or sys.argv,
           "wall_s": session.wall_s or 0.0, "profile_wall_s": session.profile_wall_s,
           "config": dataclasses.asdict(session.config) | {"out_dir": str(session.config.out_dir)}}
    try:
        from fastddpm.bench.timing import git_state

        env["git"] = git_state(Path(__file__).resolve().parent)
    except Exception:  # noqa: BLE001 - provenance is best effort outside a checkout
        pass
    report = Report(verdict=verdict(found, m), findings=found, measurements=m, unavailable=unavailable,
                    environment=env, context=context)
    if session.trace_path is not None:
        report.files["trace"] = str(session.trace_path)
    if session.config.out_dir is not None:
        report.save(session.config.out_dir)
    return report


class Watch:
    """`with watch(loader) as dr:` -- see the module docstring. After the block, `dr.report` holds the Report."""

    def __init__(self, loader, *, warmup_steps: int = 5, steps: int = 40, profile_steps: int = 10,
                 out: str | Path | None = None, device: torch.device | str | None = None,
                 loader_probe_s: float = 2.0, print_report: bool = True, flops_per_step: float | None = None):
        self.loader = loader
        self.config = DoctorConfig(warmup_steps=warmup_steps, steps=steps, profile_steps=profile_steps,
                                   out_dir=out, loader_probe_s=loader_probe_s)
        self.session = Session(self.config, device=device)
        self.session.loader = loader if hasattr(loader, "__iter__") else None
        self.print_report = print_report
        self.flops_per_step = flops_per_step
        self.report: Report | None = None

    def batches(self):
        """The loader's batches, epoch after epoch, until the planned steps are done."""
        s = self.session
        while not s.done:
            it = s.new_iterator(lambda: iter(self.loader))
            got_any = False
            while not s.done:
                try:
                    batch = s.wait_for_data(lambda: next(it))
                except StopIteration:
                    break
                got_any = True
                yield batch
            if not got_any:
                s.finish_early("the loader yielded no batch")
                return

    def step(self) -> None:
        self.session.step()

    @property
    def done(self) -> bool:
        return self.session.done

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and not issubclass(exc_type, (StopIteration, GeneratorExit)):
            self.session._stop_profiler()
            self.session.cpu.stop()
            return False
        if not self.session.done:
            self.session.finish_early("the loop ended")
        self.report = diagnose(self.session, context="user", flops_per_step=self.flops_per_step)
        if self.print_report:
            self.report.print()
        return False


def watch(loader, **kwargs) -> Watch:
    """Diagnose a training loop over `loader`: warm-up, watched and profiled steps (see Watch)."""
    return Watch(loader, **kwargs)
