"""What one bounded run measured, as typed records: the rules (fastddpm.doctor.rules) read these attributes.

    Measurements
      steps            list[StepRecord]   the watch window, one record a step (session.py times them)
      step_stats       StepStats          medians and totals of those steps
      cpu_load         CpuLoad            this process and its loader workers (system.py)
      memory           DeviceMemory       peak allocated vs the device's total (CUDA only)
      telemetry_start  Telemetry          SM clock, temperature, power at both ends of the watch (CUDA only)
      telemetry_end
      compile          CompileCounts      torch._dynamo's counters (only when something was compiled)
      trace            TraceStats         the profile window's trace (trace.py)
      mfu              Mfu                FLOPs per step against the measured matmul peak (api.py)
      roofline         Roofline           the step against max(FLOPs / peak, bytes / bandwidth) (api.py)
      loader_probe     LoaderProbe        the DataLoader alone, after the run
      low_precision    LowPrecision       what bf16/fp16 would give this device's matmuls (measured; api.py)
      attention_calls  AttentionCalls     nn.MultiheadAttention.forward calls seen (doctor run, watch())
      attention_sites  list[dict]         the modules that built L x L attention weights (the counted step)
      optimizer        OptimizerInfo      the optimizer whose steps are the boundaries (doctor run)
      update_site      dict               the line of the loop's in-place updates after the step (doctor run)
      item_sites       list[dict]         the lines that index a tensor item by item (doctor run)
      conv_layout      str                the convolution weights' memory format (nchw, channels_last, mixed)

A part that was not measured is None. `Measurements.to_dict()` is the JSON report's `measurements` (users and
tests read its keys); `Measurements.from_dict` reads that dict back, or one made by hand, where keys left out
take their defaults.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from fastddpm.doctor.trace import TraceStats


@dataclass
class StepRecord:
    index: int  # 0-based step number of the run
    host_ms: float  # boundary to boundary, host clock
    data_wait_ms: float
    data_cpu_ms: float  # of the wait: this thread running (work done in-process)
    epoch_start: bool
    data_queued_ms: float = 0.0  # of the wait: this thread runnable but waiting for a core (crowded CPU)
    gpu_ms: float | None = None  # boundary to boundary on the GPU (CUDA events)
    recompiles: int = 0  # graphs compiled during this step
    optimizer_ms: float | None = None  # of the step: inside torch.optim step() calls, host clock (watched steps)
    batches: int = 0  # training batches fetched in the step: more than one where gradients accumulate


@dataclass(kw_only=True)
class StepStats:
    """The watched steps' host times (Session.step_stats); on a GPU the fifths are CUDA-event times and the GPU
    median is added. A field left out of a hand-made dict reads 0."""

    steps: int = 0
    median_ms: float = 0.0
    mean_ms: float = 0.0
    p10_ms: float = 0.0
    p90_ms: float = 0.0
    max_ms: float = 0.0
    data_wait_ms_total: float = 0.0
    host_ms_total: float = 0.0
    epoch_starts: int = 0
    first_fifth_median_ms: float = 0.0  # rule 15 compares the first and the last fifth of the watch
    last_fifth_median_ms: float = 0.0
    fifths_basis: str = "host"  # or "CUDA events": what the fifths time (GPU steps, where every step has both)
    gpu_median_ms: float | None = None  # from CUDA events; absent from the dict when None
    gpu_p10_ms: float | None = None  # likewise: a loop that never syncs has host times far below the GPU's
    gpu_p90_ms: float | None = None

    def to_dict(self) -> dict:
        return _without_none(dataclasses.asdict(self), keep=())


@dataclass(kw_only=True)
class CpuLoad:
    """Cores busy on average over the watch (system.CpuSampler)."""

    main_cores: float
    workers_cores: float  # all descendants of this process: DataLoader workers
    workers_seen: int  # the most descendants seen at once
    cpu_count: int | None
    wall_s: float
    # every other process's busy time on this process's cores (Linux /proc/stat, the hypervisor's steal included);
    # None where it cannot be read
    others_cores: float | None = None


@dataclass(kw_only=True)
class DeviceMemory:
    """Rule 14: torch's allocator peak against the device's total."""

    peak_allocated_bytes: int
    total_bytes: int
    free_bytes: int
    peak_share: float


@dataclass(kw_only=True)
class Telemetry:
    """Rule 15: the GPU's state at one moment, from NVML or nvidia-smi."""

    sm_clock_mhz: float
    temperature_c: float
    power_w: float | None
    source: str  # "nvml" or "nvidia-smi"


@dataclass(kw_only=True)
class CompileCounts:
    """Rule 10: torch._dynamo's counters, over the whole run and after the warm-up."""

    compiled_graphs: int = 0
    recompiles_after_warmup: int = 0
    graph_breaks: int = 0
    graph_breaks_after_warmup: int = 0
    cudagraph_skips: int = 0  # after the warm-up


@dataclass(kw_only=True)
class Mfu:
    """Rule 13: model FLOPs utilisation, against a matmul peak measured in the run's own dtype."""

    mfu: float  # a share of the peak
    flops_per_step: float
    step_ms: float
    peak_tflops: float
    peak_label: str
    peak_dtype: str  # bf16, fp16, fp32 or tf32: the report prints it next to MFU
    peak_dtype_basis: str  # why that dtype: counted from the trace, configured, or assumed


@dataclass(kw_only=True)
class Roofline:
    """The least time the step needs: its FLOPs at the matmul peak (MFU's) or its bytes at the measured memory
    bandwidth, whichever is longer (the side that binds), against the step time measured."""

    step_ms: float
    bound_ms: float  # max(compute_ms, memory_ms)
    compute_ms: float
    memory_ms: float
    binds: str  # "compute" or "memory"
    share: float  # bound_ms / step_ms: the share of the roofline the step reaches
    activation_mb_per_step: float  # saved for the backward: written once, read once (twice this moved)
    update_mb_per_step: float  # weights, gradients, optimizer state (and EMA) read and written
    bandwidth_gbps: float
    bandwidth_label: str
    bytes_basis: str  # how the bytes were counted


@dataclass(kw_only=True)
class LoaderProbe:
    """Rule 1: the DataLoader alone after the run (Session.probe_loader); None fields are left out of the dict."""

    batches_per_s: float | None  # None: no batch came within the probe's time (see note)
    batches: int | None = None
    seconds: float | None = None
    train_steps_per_s: float | None = None  # the optimizer steps per second the training alone could take
    # the batches each step fetches (gradient accumulation's micro-batches); None: one
    batches_per_step: float | None = None
    ratio: float | None = None  # batches_per_s / the batches per second training could take
    note: str | None = None

    def to_dict(self) -> dict:
        return _without_none(dataclasses.asdict(self), keep=("batches_per_s",))


@dataclass(kw_only=True)
class LowPrecision:
    """Rule 16: the reduced-precision dtype this device would train in, whether it computes it natively, and
    the matmul rate it measured in it against fp32's: the gain bf16/fp16 autocast can give the matmuls."""

    dtype: str  # "bf16" or "fp16"
    native: bool
    reason: str  # the CPU flag or the GPU's compute capability
    peak_ratio: float | None = None  # measured matmul rate in `dtype` / in fp32 (TF32 where on)
    peak_tflops: float | None = None
    fp32_peak_tflops: float | None = None
    # the same ratio for this model's own matmuls and convolutions, replayed from the trace's shapes
    # (fastddpm.doctor.replay): what autocast gives it; None where the trace hides the ops (CUDA graphs)
    model_ratio: float | None = None
    model_basis: str | None = None


@dataclass(kw_only=True)
class AttentionCalls:
    """Rule 17: nn.MultiheadAttention.forward calls per step, and how many asked for the weights (the default
    need_weights=True, which keeps it off the fused scaled_dot_product_attention kernels)."""

    calls_per_step: float
    need_weights_per_step: float
    modules: int  # distinct nn.MultiheadAttention modules seen
    call_sites: list[str] = field(default_factory=list)  # where the loop's own code calls those
    # with need_weights=True (up to 3)
    call_code: list[str] = field(default_factory=list)  # each call site's line of source, as written there


@dataclass(kw_only=True)
class OptimizerInfo:
    """Rule 19: the optimizer whose step() marks the step boundaries, as configured."""

    name: str
    param_tensors: int
    foreach: bool | None
    fused: bool | None
    conv_weights: int = 0  # 4-D parameters (2-D convolutions): channels_last is a candidate
    param_count: int = 0  # elements in all: a few big tensors' update is memory passes, a few small ones' overhead


@dataclass(kw_only=True)
class Measurements:
    device: str  # "cpu", "cuda:0", ...
    steps: list[StepRecord]
    step_stats: StepStats | None = None
    cpu_load: CpuLoad | None = None
    memory: DeviceMemory | None = None
    telemetry_start: Telemetry | None = None
    telemetry_end: Telemetry | None = None
    profiled_steps: int = 0  # steps in the trace
    notes: list[str] = field(default_factory=list)
    compile: CompileCounts | None = None
    trace: TraceStats | None = None
    trace_unavailable: str | None = None  # why trace is None (no profile window, or the loop ended before it)
    trace_file: str | None = None
    flops_source: str | None = None  # where mfu's FLOPs came from
    mfu: Mfu | None = None
    mfu_unavailable: str | None = None  # why mfu is None
    roofline: Roofline | None = None
    roofline_unavailable: str | None = None  # why roofline is None
    loader_probe: LoaderProbe | None = None
    loader_workers: int | None = None  # the DataLoader's own num_workers, when the doctor saw the loader
    loader_per_epoch: bool = False  # the loop builds a new DataLoader over its dataset every epoch
    batch_size: int | None = None  # the leading dimension of the first batch seen, or the trainer's setting
    low_precision: LowPrecision | None = None
    attention_calls: AttentionCalls | None = None
    # modules that built L x L attention weights in the counted step: module (its name under the model), cls,
    # defined_at and forward_at (file:line of the class and of its forward), tokens (L)
    attention_sites: list[dict] = field(default_factory=list)
    optimizer: OptimizerInfo | None = None
    # where the loop's own code updates tensors in place after the optimizer step (rule 23's place): {"place":
    # "train.py:57" (or "train.py:57 in main" inside a function), "code": that line, "updates": the calls counted}
    update_site: dict | None = None
    # where it indexes a tensor item by item (rule 22's place): [{"place", "code", "items": x[i] calls in one step,
    # "length": the indexed tensor's first dimension}], most calls first
    item_sites: list[dict] = field(default_factory=list)
    # the memory format of the 2-D convolutions' weights: "nchw", "channels_last" or "mixed" (rule 11's cause)
    conv_layout: str | None = None
    # "channels-last": the loop compiles with Inductor's layout optimization forced (fastddpm's --inductor-layout);
    # None: not forced, or not known (a foreign script)
    inductor_layout: str | None = None
    windows: dict = field(default_factory=dict)  # per window: planned and taken steps, seconds, cut by time

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def no_trace(self) -> str:
        """Why the run has no trace, for the rules that read one (a hand-made record without the reason: no
        profile window)."""
        return self.trace_unavailable or "no profile window (profile_steps=0)"

    @property
    def gpu_trace(self) -> TraceStats | None:
        """The trace when it holds a GPU timeline (rules 4-9, 11)."""
        return self.trace if self.trace is not None and self.trace.has_gpu else None

    def batches_per_step(self) -> float:
        """The training batches each watched step fetched (median over the steps that fetched any): more than one
        where the loop accumulates gradients over micro-batches; 1 where nothing was counted."""
        fetched = [s.batches for s in self.steps if s.batches]
        return statistics.median(fetched) if fetched else 1.0

    def unprofiled_share(self, category: str, part: float | None = None) -> float:
        """The share of a watched (unprofiled) step that a breakdown `category` takes (or `part` of it: a share of
        the profiled step inside that category, e.g. its fp32 matmuls). The profiler slows the host by about a
        fixed cost for every op it records, the profiled step's excess over the watched median spread over its
        ops: on a CPU trace each category's time is taken less that cost for its own ops, and the shares are of
        what remains, so a category of many small ops (a per-tensor optimizer) shrinks and one of few large ops
        (the convolutions) grows. A GPU trace's shares are kernel time over the kernel span: kept as they are
        (the kernels' own times are not stretched, though a host-bound step's idle time may be).
        On a CPU the optimizer's share is not taken from the trace where the watched steps timed its step()
        calls: the profiler's cost is not the same for every op (an autograd node's evaluation costs it far more
        than an optimizer's small op), and a per-tensor optimizer's thousands of ops made the spread-out estimate
        of its share several times too small. The other categories then share what the optimizer leaves."""
        t = self.trace
        share = t.breakdown.get(category, 0.0) if t is not None else 0.0
        part = share if part is None else part
        measured = self.optimizer_share() if t is not None and not t.has_gpu else None
        if measured is not None and category == "optimizer":
            return measured if not share else part / share * measured
        ops = (t.breakdown_ops_per_step or {}) if t is not None else {}
        if (t is None or t.has_gpu or not share or not t.profiled_step_ms or not sum(ops.values())
                or self.step_stats is None or not self.step_stats.median_ms):
            return part if measured is None else part * (1 - measured) / (1 - t.breakdown.get("optimizer", 0.0)
                                                                             or 1.0)
        profiled = t.profiled_step_ms
        per_op_ms = max(0.0, profiled - self.step_stats.median_ms) / sum(ops.values())  # the training thread's
        left = {c: max(0.0, s * profiled - ops.get(c, 0.0) * per_op_ms) for c, s in t.breakdown.items()}
        if measured is not None:
            left.pop("optimizer", None)
            return part / share * left[category] / (sum(left.values()) or 1.0) * (1 - measured)
        return part / share * left[category] / (sum(left.values()) or 1.0)

    def optimizer_share(self) -> float | None:
        """The median watched step's share inside torch.optim step() calls, or None where they were not timed."""
        timed = [s.optimizer_ms for s in self.steps if s.optimizer_ms is not None]
        if not timed or len(timed) < len(self.steps) or self.step_stats is None or not self.step_stats.median_ms:
            return None
        median = statistics.median(timed)
        # none timed: no torch.optim step ran where hooks fire (a compiled or graph-replayed step): the trace says
        return min(1.0, median / self.step_stats.median_ms) if median > 0 else None

    def to_dict(self) -> dict:
        """The JSON report's `measurements`: the keys, their order and their presence as users read them."""
        d = {"device": self.device, "steps": [dataclasses.asdict(s) for s in self.steps],
             "step_stats": self.step_stats.to_dict() if self.step_stats is not None else {},
             "cpu_load": _asdict(self.cpu_load), "memory": _asdict(self.memory),
             "telemetry_start": _asdict(self.telemetry_start), "telemetry_end": _asdict(self.telemetry_end),
             "profiled_steps": self.profiled_steps, "notes": self.notes}
        if self.compile is not None:
            d["compile"] = dataclasses.asdict(self.compile)
        d["trace"] = self.trace.to_dict() if self.trace is not None else None
        if self.trace is None and self.trace_unavailable is not None:
            d["trace_unavailable"] = self.trace_unavailable
        if self.trace is not None:
            d["trace_timeline"] = self.trace.timeline
        if self.trace_file is not None:
            d["trace_file"] = self.trace_file
        if self.flops_source is not None:
            d["flops_source"] = self.flops_source
        if self.mfu is not None:
            d["mfu"] = dataclasses.asdict(self.mfu)
        if self.mfu_unavailable is not None:
            d["mfu_unavailable"] = self.mfu_unavailable
        if self.roofline is not None:
            d["roofline"] = dataclasses.asdict(self.roofline)
        if self.roofline_unavailable is not None:
            d["roofline_unavailable"] = self.roofline_unavailable
        d["loader_probe"] = self.loader_probe.to_dict() if self.loader_probe is not None else None
        d["loader_workers"] = self.loader_workers
        if self.loader_per_epoch:
            d["loader_per_epoch"] = True
        d["batch_size"] = self.batch_size
        for key in ("low_precision", "attention_calls", "optimizer"):
            if getattr(self, key) is not None:
                d[key] = dataclasses.asdict(getattr(self, key))
        if self.attention_sites:
            d["attention_sites"] = [dict(site) for site in self.attention_sites]
        if self.update_site is not None:
            d["update_site"] = dict(self.update_site)
        if self.item_sites:
            d["item_sites"] = [dict(site) for site in self.item_sites]
        if self.conv_layout is not None:
            d["conv_layout"] = self.conv_layout
        if self.inductor_layout is not None:
            d["inductor_layout"] = self.inductor_layout
        if self.windows:
            d["windows"] = self.windows
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Measurements:
        """Read `to_dict()`'s form back (a saved report.json's `measurements`, or a test's hand-made dict: keys
        left out take their defaults). The trace's per-step list is not in the dict: its `steps` stay empty."""
        trace = d.get("trace")
        if trace is not None:
            trace = TraceStats(steps=[], timeline=d.get("trace_timeline") or {},
                               **{k: v for k, v in trace.items() if k != "steps_measured"})
        return cls(device=d["device"], steps=[StepRecord(**s) for s in d["steps"]],
                   step_stats=_typed(StepStats, d.get("step_stats")), cpu_load=_typed(CpuLoad, d.get("cpu_load")),
                   memory=_typed(DeviceMemory, d.get("memory")),
                   telemetry_start=_typed(Telemetry, d.get("telemetry_start")),
                   telemetry_end=_typed(Telemetry, d.get("telemetry_end")),
                   profiled_steps=d.get("profiled_steps", 0), notes=list(d.get("notes", [])),
                   compile=_typed(CompileCounts, d.get("compile")), trace=trace,
                   trace_unavailable=d.get("trace_unavailable"), trace_file=d.get("trace_file"),
                   flops_source=d.get("flops_source"), mfu=_typed(Mfu, d.get("mfu")),
                   mfu_unavailable=d.get("mfu_unavailable"), roofline=_typed(Roofline, d.get("roofline")),
                   roofline_unavailable=d.get("roofline_unavailable"),
                   loader_probe=_typed(LoaderProbe, d.get("loader_probe")),
                   loader_workers=d.get("loader_workers"), loader_per_epoch=d.get("loader_per_epoch", False),
                   batch_size=d.get("batch_size"),
                   low_precision=_typed(LowPrecision, d.get("low_precision")),
                   attention_calls=_typed(AttentionCalls, d.get("attention_calls")),
                   attention_sites=[dict(site) for site in d.get("attention_sites") or []],
                   optimizer=_typed(OptimizerInfo, d.get("optimizer")), update_site=d.get("update_site"),
                   item_sites=[dict(site) for site in d.get("item_sites") or []],
                   conv_layout=d.get("conv_layout"),
                   inductor_layout=d.get("inductor_layout"), windows=dict(d.get("windows") or {}))


def _typed(cls, d: dict | None):
    """`cls(**d)`, or None for a part not measured (None, or an empty dict)."""
    return cls(**d) if d else None


def _asdict(record) -> dict | None:
    return dataclasses.asdict(record) if record is not None else None


def _without_none(d: dict, keep: tuple[str, ...]) -> dict:
    return {k: v for k, v in d.items() if v is not None or k in keep}
