"""The doctor for your own loop, with a few lines of change:

    import fastddpm.doctor

    with fastddpm.doctor.watch(loader, out="doctor/") as dr:
        for x, y in dr.batches():      # the loader, epoch after epoch, until the bounded run is over
            loss = train_step(x, y)
            dr.step()                  # one call per optimizer step
    dr.report.print()                  # verdict, evidence, ranked fixes; also report.txt/html/json in out

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

from fastddpm.doctor.measurements import CompileCounts, LowPrecision, Measurements, Mfu, Roofline
from fastddpm.doctor.report import Report
from fastddpm.doctor.rules import evaluate, verdict
from fastddpm.doctor.session import DoctorConfig, DoctorError, Session
from fastddpm.doctor.trace import TraceStats, analyze, load_trace
from fastddpm.doctor.watchers import AttentionWatch, SitesWindow, batch_size, dynamo_graphs

# the trace's names for matmul input dtypes -> the dtype a peak can be measured in
_PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def measurements(session: Session, *, flops_per_step: float | None = None, peak: dict | None = None,
                 measure_peak: bool = True, matmul_dtype: str | None = None, step_bytes: dict | None = None,
                 params: list[torch.Tensor] | None = None, bandwidth: dict | None = None) -> Measurements:
    """Everything measured in the run (its `to_dict()` is the JSON report's `measurements`). `step_bytes`,
    `params`, `bandwidth`: the roofline's, when the caller knows them (see roofline_measurements)."""
    s = session
    stats = s.step_stats()
    compiled = _compile_counts(s)
    events = load_trace(s.trace_path) if s.trace_path is not None else None
    trace = analyze(events, getattr(s, "profiled_epoch_starts", [])) if events is not None else None
    notes = list(s.notes)
    if trace is not None and trace.epoch_starts_left_out:
        k = trace.epoch_starts_left_out
        notes.append(f"the profile is read from {len(trace.steps)} of its {len(trace.steps) + k} steps: the {k} that "
                     f"began an epoch {'is' if k == 1 else 'are'} left out (a loader's start-up would take most of "
                     "it; rule 2 judges the epoch starts from the watched steps)")
    no_trace = why_no_trace(s) if trace is None else None
    mfu = mfu_measurements(trace, stats.to_dict() if stats is not None else {}, s.device,
                           flops_per_step=flops_per_step, peak=peak, measure_peak=measure_peak,
                           matmul_dtype=matmul_dtype, no_trace=no_trace)
    mf = mfu.get("mfu") or {}
    roof, roof_why = roofline_measurements(session, mf, mfu.get("mfu_unavailable"), step_bytes=step_bytes,
                                           params=params, bandwidth=bandwidth,
                                           measure=measure_peak and peak is None)
    low = None
    if measure_peak and peak is None and _fp32_matmuls_only(trace):
        fp32_peak = {"tflops": mf["peak_tflops"]} if mf.get("peak_dtype") == "fp32" else None
        low = low_precision(s.device, fp32_peak=fp32_peak, events=events)
    elif measure_peak and peak is None and torch.device(s.device).type == "cpu" and _bf16_matmuls(trace):
        # a CPU loop under bf16 autocast: whether this CPU computes bf16 natively, and what fp32 would give it
        low = low_precision(s.device, events=events, of="bf16")
    return Measurements(
        low_precision=low, windows=dict(getattr(s, "windows", {}) or {}),
        device=str(s.device), steps=list(s.records), step_stats=stats, cpu_load=s.cpu_load, memory=s.memory,
        telemetry_start=s.telemetry_start, telemetry_end=s.telemetry_end,
        profiled_steps=len(trace.steps) + trace.epoch_starts_left_out if trace is not None else 0, notes=notes,
        compile=compiled,
        trace=trace, trace_unavailable=no_trace,
        trace_file=str(s.trace_path) if s.trace_path is not None and s.config.save_trace else None,
        flops_source=mfu.get("flops_source"), mfu=Mfu(**mfu["mfu"]) if "mfu" in mfu else None,
        mfu_unavailable=mfu.get("mfu_unavailable"), roofline=roof, roofline_unavailable=roof_why,
        attention_sites=s.attention_sites.found() if getattr(s, "attention_sites", None) is not None else [])


def why_no_trace(session: Session) -> str:
    """Why a finished session has no trace: no profile window was planned, or the loop ended before it."""
    planned = session.config.profile_steps
    if planned == 0:
        return "no profile window (profile_steps=0)"
    window = {"warmup": "warm-up"}.get(session.phase, session.phase)
    return (f"no profile: the loop ended after {session.step_index} steps, in the {window} window, before the "
            f"profile window (profile_steps={planned}) began")


def roofline_measurements(session: Session, mfu: dict, mfu_unavailable: str | None, *,
                          step_bytes: dict | None = None, params: list[torch.Tensor] | None = None,
                          bandwidth: dict | None = None, measure: bool = True) -> tuple[Roofline | None, str | None]:
    """The step against its roofline (measure.roofline): MFU's FLOPs and peak on the compute side; on the memory
    side the bytes a step must move, at the device's bandwidth (`bandwidth`: measure_memory_bandwidth's dict,
    measured here when None and `measure`).
    The bytes: `step_bytes` ({"activation_bytes", "update_bytes", "basis"} per step) when the caller counted
    them (fastddpm's trainer, on its model); else what autograd saved in the second warm-up step (twice: written,
    then read), less the parameters (`params`, the optimizer's, when known), and AdamW's update over the
    parameters. (Roofline, None), or (None, why)."""
    from fastddpm.measure import ADAMW_UPDATE_TENSORS, measure_memory_bandwidth, roofline

    if not mfu:
        return None, f"the roofline's compute side is MFU's FLOPs and peak: {mfu_unavailable or 'not measured'}"
    if step_bytes is None:
        saved = session.saved
        if saved is None:
            return None, session.saved_unavailable or ("the bytes are counted in the second warm-up step: run with "
                                                        "warmup_steps >= 2")
        if not saved.saved:
            return None, ("autograd saved nothing in the counted step (a step replayed from a CUDA graph, or run "
                          "without grad): no bytes to count")
        if saved.stepped:
            entries = list(saved.stepped.values())
            whose = f"the parameters {', '.join(sorted(saved.optimizers))} stepped"
        elif params:
            entries = [(p.numel(), p.element_size(), ADAMW_UPDATE_TENSORS - 3) for p in params]
            whose = "the optimizer's (its step unseen: Adam's 7 passes taken)"
        else:  # no torch.optim step seen: the weights that autograd saved are all that is known
            entries = [(n, 4, ADAMW_UPDATE_TENSORS - 3) for n in saved.leaf_numel.values()]
            whose = "the weights autograd saved, no optimizer step seen: fp32 and Adam's 7 passes taken"
        numel = sum(n for n, _, _ in entries)
        casts = saved.cast_bytes()
        step_bytes = {"activation_bytes": saved.activation_bytes(params or ()),
                      # forward and backward read each weight, the backward writes its gradient, then the optimizer;
                      # autocast's saved casts of the weights are written by the forward and read by the backward
                      "update_bytes": sum((3 + passes) * n * size for n, size, passes in entries) + 2 * casts,
                      "basis": f"what autograd saved in the second warm-up step, each storage once, less the "
                               f"parameters ({whose}: {numel / 1e6:.3g} M)"
                               + (f" and autocast's casts of them ({casts / 1e6:.3g} MB)" if casts else "")
                               + ", written and read once; the update: weights read twice, gradients written, the "
                                 "optimizer's reads and writes" + (", the casts written and read" if casts else "")}
    if bandwidth is None:
        if not measure:
            return None, "the memory bandwidth was not measured (measure_peak=False, or the caller's peak)"
        bandwidth = measure_memory_bandwidth(session.device)
    moved = 2 * step_bytes["activation_bytes"] + step_bytes["update_bytes"]
    roof = roofline(flops_per_image=mfu["flops_per_step"], bytes_per_image=moved, peak_tflops=mfu["peak_tflops"],
                    bandwidth_gbps=bandwidth["gbps"])
    bound_ms = roof["bound_us_per_image"] / 1e3
    return Roofline(step_ms=mfu["step_ms"], bound_ms=bound_ms, compute_ms=roof["compute_us_per_image"] / 1e3,
                    memory_ms=roof["memory_us_per_image"] / 1e3, binds=roof["binds"],
                    share=bound_ms / mfu["step_ms"], activation_mb_per_step=step_bytes["activation_bytes"] / 1e6,
                    update_mb_per_step=step_bytes["update_bytes"] / 1e6, bandwidth_gbps=bandwidth["gbps"],
                    bandwidth_label=bandwidth["label"], bytes_basis=step_bytes["basis"]), None


def _fp32_matmuls_only(trace: TraceStats | None) -> bool:
    """The trace's matmuls all take fp32 inputs: the case where autocast is the question (rule 16)."""
    flops = trace.gemm_flops_per_step if trace is not None else {}
    return bool(flops) and flops.get("fp32", 0.0) > 0 and not any(
        flops.get(k, 0.0) for k in ("bf16", "fp16", "fp8"))


def _bf16_matmuls(trace: TraceStats | None) -> bool:
    """Some of the trace's matmuls take bf16 inputs: on a CPU, rule 12 asks whether bf16 is emulated there."""
    return trace is not None and trace.gemm_flops_per_step.get("bf16", 0.0) > 0


def low_precision(device: torch.device | str, *, fp32_peak: dict | None = None,
                  events: list[dict] | None = None, of: str = "fp32") -> LowPrecision:
    """Rule 16's measurement: the reduced-precision dtype this device would train in (bf16 where it is native,
    fp16 on a pre-Ampere GPU), whether it is native and why, and its matmul rate measured now against fp32's
    (`fp32_peak`: the MFU peak already measured in fp32, reused). A CPU without amx_bf16/avx512_bf16 emulates
    bf16 slower than fp32: the ratio shows it, whatever the flags say. With the trace's `events`, the model's own
    matmuls and convolutions are replayed in both dtypes too (fastddpm.doctor.replay): small ones gain far less
    than the peak's square matmul, or lose. `of`: which of the trace's ops are replayed, by input dtype: the fp32
    ones (what autocast would give), or a loop's bf16/fp16 ones (what dropping autocast would give)."""
    from fastddpm.doctor.replay import replay
    from fastddpm.device import cpu_native_bf16, cuda_native_bf16
    from fastddpm.measure import measure_matmul_peak

    device = torch.device(device)
    if device.type == "cuda":
        native_bf16, reason = cuda_native_bf16(device)
        major, _ = torch.cuda.get_device_capability(device)
        dtype, native = ("bf16", True) if native_bf16 else ("fp16", major >= 7)  # fp16 tensor cores from sm70
        if not native_bf16:
            reason += "; fp16 with a GradScaler instead" + ("" if native else " (no tensor cores before sm70)")
    else:
        dtype, (native, reason) = "bf16", cpu_native_bf16()
    fp32 = fp32_peak or measure_matmul_peak(device, dtype=torch.float32)
    low = measure_matmul_peak(device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16,
                              emulated=device.type == "cpu" and not native)  # emulated: measured small, seconds not 25
    own = replay(events, torch.bfloat16 if dtype == "bf16" else torch.float16, device, of=of) if events else None
    return LowPrecision(dtype=dtype, native=native, reason=reason, peak_ratio=low["tflops"] / fp32["tflops"],
                        peak_tflops=low["tflops"], fp32_peak_tflops=fp32["tflops"],
                        model_ratio=own.ratio if own is not None else None,
                        model_basis=own.basis(dtype) if own is not None else None)


def _compile_counts(s: Session) -> CompileCounts | None:
    """Rule 10's counters; None when nothing was compiled in the whole run."""
    warm, end = s.compile_warm, s.compile_end or dynamo_graphs()
    # this run's own graphs: the counters are the process's, and an earlier run (a notebook, a test) counted too
    total = tuple(a - b for a, b in zip(dynamo_graphs(), s.compile_start))
    if not any(total):
        return None
    w = warm or (0, 0, 0)
    return CompileCounts(compiled_graphs=total[0], recompiles_after_warmup=end[0] - w[0], graph_breaks=total[1],
                         graph_breaks_after_warmup=end[1] - w[1], cudagraph_skips=end[2] - w[2])


def run_matmul_dtype(flops_by_dtype: dict[str, float], device: torch.device | str) -> tuple[torch.dtype | None, str]:
    """(dtype, label) of the run's own matmuls: the input dtype that carries most matmul/conv FLOPs, so that MFU
    is measured against the peak of the arithmetic the run actually does (an fp32 run against a bf16 peak
    reads ~2x low). fp32 on CUDA is labelled tf32 when torch.backends.cuda.matmul.allow_tf32 is on: read now,
    in the run's own process, it is the setting the run had, and measure_matmul_peak's fp32 matmul obeys it.
    (None, why) when no peak can be measured in that dtype."""
    name = max(flops_by_dtype, key=flops_by_dtype.get)
    if name not in _PEAK_DTYPES:
        return None, (f"most matmul/conv FLOPs have input dtype {name}, and torch.matmul has no peak to measure "
                      f"in it: MFU needs a peak in the run's own dtype")
    if name == "fp32" and torch.device(device).type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return torch.float32, "tf32"
    return _PEAK_DTYPES[name], name


def mfu_measurements(trace: TraceStats | None, step_stats: dict, device: torch.device | str, *,
                     flops_per_step: float | None = None, peak: dict | None = None,
                     measure_peak: bool = True, matmul_dtype: str | None = None, no_trace: str | None = None) -> dict:
    """MFU = FLOPs per step / step time / the matmul peak measured in the run's dtype (rule 13), as entries of
    the measurements' dict form: {"flops_source": ..., "mfu": {...}}, or {"mfu_unavailable": why}, with or
    without flops_source. `step_stats` is StepStats' dict form (its step time: gpu_median_ms, else median_ms).
    `matmul_dtype` ("bf16", "fp16", "fp32"): the run's dtype when the caller knows it (fastddpm's trainer: its
    precision), used when the trace cannot show it (no profile window, or a step replayed from a CUDA graph).
    `no_trace`: why `trace` is None (default: no profile window was planned)."""
    by_dtype = trace.gemm_flops_per_step if trace is not None else {}
    out: dict = {}
    if flops_per_step is not None:
        out["flops_source"] = "given by the caller"
    elif by_dtype:
        flops_per_step = sum(by_dtype.values())
        out["flops_source"] = "counted from the trace's matmul/conv/attention shapes (fwd + bwd)"
    else:
        why = (no_trace or "no profile window (profile_steps=0)" if trace is None else
               trace.gemm_unavailable or "the trace shows no matmul/conv/attention op")
        return {"mfu_unavailable": f"no FLOPs counted: {why}; pass flops_per_step (e.g. from FlopCounterMode on one "
                                   "eager step) to measure MFU"}
    if not step_stats:
        return {**out, "mfu_unavailable": "no watched steps to time"}
    if by_dtype:
        dtype, dtype_name = run_matmul_dtype(by_dtype, device)
        if dtype is None:
            return {**out, "mfu_unavailable": dtype_name}
        share = by_dtype.get("fp32" if dtype_name == "tf32" else dtype_name, 0.0) / sum(by_dtype.values())
        basis = f"the input dtype of {100 * share:.0f}% of the matmul/conv FLOPs"
    elif matmul_dtype is not None:  # dtypes unseen in the trace, but the caller knows the run's precision
        dtype, dtype_name = run_matmul_dtype({matmul_dtype: 1.0}, device)
        if dtype is None:
            return {**out, "mfu_unavailable": dtype_name}
        basis = "the run's configured precision (its matmul dtypes are not visible in the trace)"
    else:
        # FLOPs from the caller, dtypes unseen (no trace, or the ops hidden in CUDA graphs): the usual training
        # dtype of the device, said to be assumed
        dtype, dtype_name = run_matmul_dtype({"bf16" if torch.device(device).type == "cuda" else "fp32": 1.0}, device)
        unseen = (no_trace or "no profile window" if trace is None else
                  trace.gemm_unavailable or "no matmul op in the trace")
        basis = f"assumed, the device's usual training dtype: the run's matmul dtypes are unseen ({unseen})"
    if peak is None:
        if not measure_peak:
            return {**out, "mfu_unavailable": "peak not measured (measure_peak=False)"}
        from fastddpm.device import cpu_native_bf16
        from fastddpm.measure import measure_matmul_peak

        emulated = torch.device(device).type == "cpu" and dtype == torch.bfloat16 and not cpu_native_bf16()[0]
        peak = measure_matmul_peak(device, dtype=dtype, emulated=emulated)
    else:
        dtype_name, basis = peak.get("dtype", "?"), "the caller's peak"
    step_ms = step_stats.get("gpu_median_ms") or step_stats["median_ms"]
    out["mfu"] = {"mfu": flops_per_step / (step_ms / 1e3) / (peak["tflops"] * 1e12),
                  "flops_per_step": flops_per_step, "step_ms": step_ms, "peak_tflops": peak["tflops"],
                  "peak_label": peak["label"], "peak_dtype": dtype_name, "peak_dtype_basis": basis}
    return out


def diagnose(session: Session, *, context: str = "user", command: list[str] | None = None,
             flops_per_step: float | None = None, peak: dict | None = None, measure_peak: bool = True,
             matmul_dtype: str | None = None, seen: dict | None = None, step_bytes: dict | None = None,
             params: list[torch.Tensor] | None = None) -> Report:
    """Measurements -> rules -> verdict -> Report (saved under the session's out_dir when it has one).
    `seen`: what the caller watched from outside the steps, as Measurements fields (attention_calls,
    optimizer, batch_size: fastddpm.doctor.watchers)."""
    if not session.done:
        session.finish_early("diagnosed before the planned steps were done")
    probe = None
    if session.loader is not None and session.records:
        compute_ms = statistics.median(r.host_ms - r.data_wait_ms for r in session.records)
        # a loop that accumulates gradients fetches several batches per optimizer step: the loader must keep up
        # with all of them
        fetched = [r.batches for r in session.records if r.batches]
        probe = session.probe_loader(compute_ms, statistics.median(fetched) if fetched else 1.0)
    try:
        m = measurements(session, flops_per_step=flops_per_step, peak=peak, measure_peak=measure_peak,
                         matmul_dtype=matmul_dtype, step_bytes=step_bytes, params=params)
    finally:
        session.discard_trace()  # read into `m`; kept only with save_trace
    m.loader_probe = probe
    m.loader_workers = getattr(session.loader, "num_workers", None) if session.loader is not None else None
    for key, value in (seen or {}).items():
        setattr(m, key, value)
    if not m.steps:
        raise DoctorError(
            f"the doctor saw no step after the {session.config.warmup_steps} warm-up steps "
            f"({session.step_index} steps in all): call dr.step() once per optimizer step, or lower warmup_steps")
    found, unavailable = evaluate(m)
    dev = session.device
    env = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
           f"CPU ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''})",
           "torch": torch.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command or sys.argv,
           "wall_s": session.wall_s or 0.0, "profile_wall_s": session.profile_wall_s,
           "config": dataclasses.asdict(session.config) | {"out_dir": str(session.config.out_dir)}}
    try:
        from fastddpm.measure import git_state

        env["git"] = git_state(Path(__file__).resolve().parent)
    except Exception:  # noqa: BLE001 - provenance is best effort outside a checkout
        pass
    report = Report(verdict=verdict(found, m), findings=found, measurements=m.to_dict(), unavailable=unavailable,
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
                 loader_probe_s: float = 2.0, print_report: bool = True, flops_per_step: float | None = None,
                 time_budget_s: float | None = 60.0, save_trace: bool = False):
        """time_budget_s: the warm-up, watch and profile windows together end in about this many seconds
        (DoctorConfig.time_budget_s); None: bounded by steps only. save_trace: keep the profiler trace in `out`."""
        self.loader = loader
        self.config = DoctorConfig(warmup_steps=warmup_steps, steps=steps, profile_steps=profile_steps,
                                   out_dir=out, loader_probe_s=loader_probe_s, time_budget_s=time_budget_s,
                                   save_trace=save_trace)
        self.session = Session(self.config, device=device)
        self.session.loader = loader if hasattr(loader, "__iter__") else None
        self.print_report = print_report
        self.flops_per_step = flops_per_step
        self.report: Report | None = None
        self.batch_size: int | None = None
        self.attention = AttentionWatch(lambda: self.session.phase == "watch")
        self.sites = SitesWindow()  # from a warm-up step's dr.step() to the next one's

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
                if self.batch_size is None:
                    self.batch_size = batch_size(batch)
                yield batch
            if not got_any:
                s.finish_early("the loader yielded no batch")
                return

    def step(self) -> None:
        self.sites.close()
        self.session.step()
        if self.session.phase == "warmup" and not self.session.done:  # the next step is a warm-up one too
            self.sites.open(after_optimizer_step=False)

    @property
    def done(self) -> bool:
        return self.session.done

    def __enter__(self) -> "Watch":
        self.attention.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.attention.__exit__()
        self.sites.close()
        if exc_type is not None and not issubclass(exc_type, (StopIteration, GeneratorExit)):
            self.session._stop_profiler()
            self.session.release_hooks()
            self.session.cpu.stop()
            return False
        if not self.session.done:
            self.session.finish_early("the loop ended")
        seen = {"batch_size": self.batch_size,
                "attention_calls": self.attention.measured(len(self.session.records)), **self.sites.seen()}
        self.report = diagnose(self.session, context="user", flops_per_step=self.flops_per_step, seen=seen)
        if self.print_report:
            self.report.print()
        return False


def watch(loader, **kwargs) -> Watch:
    """Diagnose a training loop over `loader`: warm-up, watched and profiled steps (see Watch)."""
    return Watch(loader, **kwargs)
