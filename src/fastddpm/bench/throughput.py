"""`fastddpm bench throughput`: how fast does the trainer's own step run, and how close is it to the GPU's limit?

For each preset x batch size the model, optimizer, EMA, batch source and TrainStep are built exactly as
fastddpm.trainer.loop.train builds them (same resolve_* functions, same make_optimizer flags, same TrainStep),
on synthetic uint8 images of the data's shape (1x28x28). Each variant then reports:

  compile s      wall time of the first `warmup_steps` steps (compile, autotune, CUDA graph capture, cuDNN
                 search), synchronised on both sides; never mixed into the steady state
  step ms        `repeats` x `steps` steady-state steps, each repeat timed with CUDA events (perf_counter on
                 the CPU): the median over repeats and the [min-max] spread
  images/s       images per step / median step time; and its ratio to the first variant of the run (comparing
                 choices: to the first choice of the same preset and batch, the choices timed alternating)
  MFU %          FlopCounterMode FLOPs of one step / median step time / the matmul peak measured in this run in
                 the step's own dtype (bf16 or fp16 under autocast; fp32 runs: TF32 on CUDA, as training runs it,
                 fp32 on the CPU; there the faster of a matmul and a 3x3 convolution), one peak per dtype,
                 measured once; the dtype is printed next to the MFU
  peak mem GiB   torch.cuda.max_memory_allocated over the variant (n/a on the CPU)
  recompiles     graphs compiled after the warm-up, and graph breaks (torch._dynamo's counters)
  input wait %   batches.get(...) alone, timed the same way for `steps` steps, as a share of the step time

A variant that fails (out of memory, a compile error) is recorded with its reason and the run goes on.
throughput.json / .md are rewritten after every variant (choices timed alternating: after their group), and a
re-run into the same folder skips the variants already measured there with the same settings, device and torch
(bench/store.py; --remeasure measures again).
The data is random uniform uint8: the step has no data-dependent control flow, so its speed does not depend
on what the images show.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastddpm.bench import store
from fastddpm.bench.throughput_report import progress_line, table_markdown, write_results
from fastddpm.bench.variant_timer import Variant, VariantTimer, failed_row, measure_alternating, peak_dtype
from fastddpm.config import ConfigError, apply_overrides, get_preset, resolve_model_shape
from fastddpm.config.schema import ATTENTION_HEAD_PADS
from fastddpm.device import resolve_device, resolve_precision
from fastddpm.measure import Peaks, environment_record, free_device_memory
from fastddpm.rng import derive_seed
from fastddpm.rundir.files import make_writable_dir
from fastddpm.trainer.fast_path import resolve_fast_path

SCHEMA = "fastddpm-bench-throughput-2"  # 2: per-row MFU peak dtype, identity and run; written after every variant

# --quick: what CI runs. Well under a minute on a 2-core CPU.
QUICK = dict(presets=("tiny",), batch_sizes=(8, 16), warmup_steps=2, steps=3, repeats=2, choices=())

# A CPU run's default: every precision / compile / layout choice side by side, on the CPU quickstart's
# preset and batch. Each is PRECISION-MODE[-cl][-lo][-gc][-ma][-apN]: PRECISION auto|fp32|bf16|fp16, MODE
# eager|compile|auto, -cl for channels_last, -lo for Inductor's layout optimization forced (train.inductor_layout),
# -gc for gradient checkpointing (peak memory against step time), -ma for Inductor's max-autotune (-lo and -ma:
# compiled modes only), -apN for attention heads padded to N.
CPU_CHOICES = ("fp32-eager", "bf16-eager", "bf16-compile", "fp32-compile", "bf16-eager-cl")
CPU_PRESETS, CPU_BATCH_SIZES = ("cpu-demo",), (64,)
GPU_PRESETS, GPU_BATCH_SIZES = ("seed-1layer", "seed-2layer"), (64, 192, 512, 1024)


def preset_image_shape(preset: str) -> tuple[int, int, int]:
    """(C, H, W) of the images a preset trains on: CIFAR-10's 3x32x32, an RGB preset's resize, else MNIST's."""
    cfg = get_preset(preset)
    if cfg.data.source == "cifar10":
        return (3, 32, 32)
    if cfg.data.resize:
        return (3, cfg.data.resize, cfg.data.resize)
    return (1, 28, 28)


def parse_choice(name: str) -> dict:
    """'bf16-compile-cl' -> the train.* settings it stands for (-cl channels_last, -lo Inductor's layout
    optimization forced, -gc gradient checkpointing, -ma max-autotune, -apN attention heads padded to N)."""
    parts = name.split("-")
    flags = parts[2:]
    pads = {f"ap{n}": n for n in ATTENTION_HEAD_PADS if n}
    ok = (len(parts) >= 2 and parts[0] in ("auto", "fp32", "bf16", "fp16")
          and parts[1] in ("eager", "compile", "auto") and set(flags) <= {"cl", "lo", "gc", "ma", *pads}
          and sum(f in pads for f in flags) <= 1
          and len(set(flags)) == len(flags) and not ({"ma", "lo"} & set(flags) and parts[1] == "eager"))
    if not ok:
        raise ConfigError(f"bench throughput: choice {name!r} is not PRECISION-MODE[-cl][-lo][-gc][-ma][-apN] "
                          f"(PRECISION "
                          f"auto, fp32, bf16 or fp16; MODE eager, compile or auto; -cl channels_last, -lo Inductor's "
                          f"layout optimization forced, -gc gradient checkpointing, -ma max-autotune (-lo and -ma "
                          f"not with eager); -apN attention heads padded to N, "
                          f"one of {', '.join(pads)}), e.g. {','.join(CPU_CHOICES)}")
    return {"train.precision": parts[0], "train.compile": {"eager": "off", "compile": "on", "auto": "auto"}[parts[1]],
            "train.channels_last": "on" if "cl" in flags else "off", "train.grad_checkpointing": "gc" in flags,
            "train.compile_mode": "max-autotune" if "ma" in flags else "default",
            # a choice names every setting it stands for, so a row means the same whatever auto picks today
            "train.inductor_layout": "auto" if parts[1] == "eager" else "channels-last" if "lo" in flags
            else "heuristic",
            "train.attention_head_pad": next((pads[f] for f in flags if f in pads), 0)}


@dataclass(kw_only=True)
class ThroughputSettings:
    """What to benchmark and how long to time it. Every field is a flag of `fastddpm bench throughput`."""

    # None: by device (GPU: seed-1layer, seed-2layer at 64-1024; CPU: cpu-demo at 64 with every CPU_CHOICES choice)
    presets: tuple[str, ...] | None = None  # fastddpm.config presets (the model + recipe)
    batch_sizes: tuple[int, ...] | None = None  # images per micro-batch; each preset runs at each one
    # PRECISION-MODE[-cl][-lo][-gc][-ma][-apN] each; () = one variant, flags below
    choices: tuple[str, ...] | None = None
    warmup_steps: int = 10  # steps timed as compile / warm-up (capture happens in the first, reduce-overhead
    #                         records in the second and third), never part of the steady state
    steps: int = 50  # steps per timed repeat: long enough that the two event records are noise
    repeats: int = 5  # timed repeats; the median is reported, min/max and IQR are the spread
    precision: str = "auto"  # as train.precision: auto = bf16 where native (GPU sm80+, CPU bf16 flags), else fp32
    compile: str = "auto"  # as train.compile: auto = on for CUDA
    cuda_graphs: str = "auto"  # as train.cuda_graphs: auto = capture the whole step on CUDA
    data_placement: str = "device"  # device = resident uint8 dataset; stream = pinned copies from a memmap file
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    num_images: int = 60_000  # synthetic dataset size (MNIST's), so epochs and permutations are realistic
    image_shape: tuple[int, int, int] | None = None  # (C, H, W) of the synthetic images; None: the presets' data
    seed: int = 0  # seeds the synthetic data, the model init and the (seed, step) batch draws
    quick: bool = False  # recorded only: the caller has already applied QUICK's values
    remeasure: bool = False  # measure every variant, even those already in OUT/throughput.json (else reused)

    def __post_init__(self) -> None:
        if self.image_shape is not None:
            self.image_shape = tuple(int(s) for s in self.image_shape)
        if self.presets is not None:
            self.presets = tuple(self.presets)
            if not self.presets:
                raise ConfigError("bench throughput: --presets is empty; give at least one, e.g. seed-1layer")
            for name in self.presets:
                get_preset(name)  # raises ConfigError naming the valid presets
        if self.batch_sizes is not None:
            self.batch_sizes = tuple(int(b) for b in self.batch_sizes)
            if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
                raise ConfigError(f"bench throughput: --batch-sizes {self.batch_sizes} must be positive integers")
            too_big = [b for b in self.batch_sizes if b > self.num_images]
            if too_big:
                raise ConfigError(f"bench throughput: batch sizes {too_big} exceed the {self.num_images:,} "
                                  "synthetic images: lower them")
        if self.choices is not None:
            self.choices = tuple(self.choices)
            for name in self.choices:
                parse_choice(name)
        for name in ("warmup_steps", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench throughput: {name}={getattr(self, name)} must be >= 1")
        for name, choices in (("precision", ("auto", "bf16", "fp16", "fp32")), ("compile", ("auto", "on", "off")),
                              ("cuda_graphs", ("auto", "off", "capture", "reduce-overhead")),
                              ("data_placement", ("device", "stream"))):
            if getattr(self, name) not in choices:
                raise ConfigError(f"bench throughput: {name}={getattr(self, name)!r} is not one of "
                                  f"{', '.join(choices)}")


    def for_device(self, device: torch.device) -> ThroughputSettings:
        """The settings with each None filled in for `device`. On a CPU with no presets named: cpu-demo at 64 with
        every CPU choice; named presets run one variant each unless choices are given too."""
        cpu = device.type == "cpu"
        default_choices = CPU_CHOICES if cpu and self.presets is None else ()
        presets = self.presets or (CPU_PRESETS if cpu else GPU_PRESETS)
        shape = self.image_shape
        if shape is None:
            shapes = {p: preset_image_shape(p) for p in presets}
            if len(set(shapes.values())) > 1:
                raise ConfigError(f"bench throughput: the presets train on differently shaped images ({shapes}): "
                                  "benchmark them in separate runs, or give --image-shape C,H,W")
            shape = next(iter(shapes.values()))
        return dataclasses.replace(
            self, presets=presets, image_shape=shape,
            batch_sizes=self.batch_sizes or (CPU_BATCH_SIZES if cpu else GPU_BATCH_SIZES),
            choices=self.choices if self.choices is not None else default_choices)


def plan_variants(settings: ThroughputSettings) -> list[Variant]:
    """One resolved RunConfig per preset x batch size (x choice): the preset, with the benchmark's flags layered
    on top as `fastddpm train` would layer them. Config errors surface here, before anything is timed. Call with
    settings.for_device(...)."""
    overrides = {"train.precision": settings.precision, "train.compile": settings.compile,
                 "train.cuda_graphs": settings.cuda_graphs, "train.data_placement": settings.data_placement,
                 "train.device": settings.device, "train.seed": settings.seed}
    variants = []
    for preset in settings.presets:
        for batch_size in settings.batch_sizes:
            for choice in settings.choices or (None,):
                over = {**overrides, "train.batch_size": batch_size, **(parse_choice(choice) if choice else {})}
                cfg = apply_overrides(get_preset(preset), over, source="bench throughput")
                cfg = resolve_model_shape(cfg, (settings.num_images, *settings.image_shape))
                variants.append(Variant(preset=preset, batch_size=batch_size, cfg=cfg, choice=choice))
    return variants


def plan_groups(variants: list[Variant]) -> list[list[int]]:
    """Indices of `variants` in runs of one preset and batch size: the choices that are timed side by side."""
    groups: list[list[int]] = []
    for i, v in enumerate(variants):
        same = groups and (variants[groups[-1][0]].preset, variants[groups[-1][0]].batch_size) == (v.preset,
                                                                                                  v.batch_size)
        if same and v.choice is not None:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def synthetic_images(num_images: int, image_shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """(N, C, H, W) uniform random uint8, a function of the seed."""
    rng = np.random.default_rng(derive_seed(seed, "bench-synthetic-images"))
    return rng.integers(0, 256, size=(num_images, *image_shape), dtype=np.uint8)


def as_memmap(images_NCHW: np.ndarray, folder: Path) -> np.ndarray:
    """Write the images to an .npy file and map it read-only, as the trainer maps its dataset cache."""
    path = folder / "bench-images.npy"
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=images_NCHW.shape)
    out[:] = images_NCHW
    out.flush()
    del out
    return np.load(path, mmap_mode="r")


# ----------------------------------------------------------------------------------------------------------------
# One variant


def measure_variant(v: Variant, images_NCHW: np.ndarray, *, device: torch.device, settings: ThroughputSettings,
                    peak: dict, bandwidth: dict) -> dict:
    """Build the trainer's step for one variant, warm it up, time it. Raises whatever the step raises."""
    if resolve_fast_path(v.cfg.train, device, v.precision).compile:
        import torch._dynamo as dynamo

        # A fresh compile per variant: honest compile time, and no variant falls back to eager because the
        # earlier ones filled the recompile limit of TrainStep._loss's code object.
        dynamo.reset()
    free_device_memory(device)
    timer = VariantTimer(v, images_NCHW, device=device, settings=settings, peak=peak, bandwidth=bandwidth)
    for _ in range(settings.repeats):
        timer.time_repeat()
    return timer.finish()


def run_variant(v: Variant, images_NCHW: np.ndarray, **kwargs) -> dict:
    """measure_variant, with any exception recorded as a failed row (the run goes on) and memory released."""
    try:
        return measure_variant(v, images_NCHW, **kwargs)
    except Exception as e:  # noqa: BLE001 - OOM, compile errors, anything: the other variants must still run
        return failed_row(v, e)
    finally:
        gc.collect()  # the failed variant's model, optimizer state and activations, before the next one
        free_device_memory(kwargs["device"])


# ----------------------------------------------------------------------------------------------------------------
# The run


def default_out_dir(now: _dt.datetime | None = None) -> Path:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return Path("runs") / f"bench-throughput-{now.strftime('%Y%m%dT%H%M%SZ')}"


def variant_identity(v: Variant, settings: ThroughputSettings, env: dict) -> dict:
    """Everything that changes a variant's numbers: a row measured under an equal identity is reused."""
    return store.canonical({
        "config": store.config_identity(v.cfg.to_dict()), "precision": v.precision.name,
        "timing": {k: getattr(settings, k) for k in ("warmup_steps", "steps", "repeats", "num_images", "image_shape",
                                                      "data_placement", "seed")},
        **store.device_identity(env),
    })


def run_throughput(settings: ThroughputSettings, out_dir: str | Path | None = None, *, argv: list[str] | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """Benchmark every preset x batch size; write throughput.json and throughput.md under `out_dir` after every
    variant; return the result. Variants already measured in `out_dir` with the same identity are reused
    (unless settings.remeasure). Config errors (a bad preset, graphs without CUDA) raise ConfigError before
    any timing."""
    device, device_reason = resolve_device(settings.device, setting="--device")
    settings = settings.for_device(device)
    precision = resolve_precision(settings.precision, device)  # the flags' own; a choice sets each variant's
    variants = plan_variants(settings)
    for v in variants:
        v.precision = resolve_precision(v.cfg.train.precision, device)
        v.fast_reasons = resolve_fast_path(v.cfg.train, device, v.precision, model_family=v.cfg.model.family).reasons
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir()
    make_writable_dir(out_dir, flag="bench throughput --out", fix=store.OUT_FIX)

    env = environment_record(device, argv)
    if device.type == "cuda":
        # As the trainer: TF32 for the fp32 matmuls/convs left outside autocast (and for an fp32 run's peak).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    what = (f"choices {', '.join(settings.choices)}" if settings.choices
            else f"precision {precision.name} ({precision.reason})")
    log(f"bench throughput: {len(variants)} variants on {env['device_name']} ({device}; {device_reason}); "
        f"{what}; torch {env['torch']}; commit {str(env['git_commit'])[:12]}")
    if device.type != "cuda":
        log("note: CPU timings (perf_counter) describe this CPU only; they are not GPU claims")

    json_path = out_dir / "throughput.json"
    previous = store.Previous(json_path, schema=SCHEMA, rows=lambda data: data.get("results") or [],
                              remeasure=settings.remeasure, log=log)
    identities = [variant_identity(v, settings, env) for v in variants]
    reused = [previous.take(identity) for identity in identities]
    previous.finish_matching()
    peaks = Peaks(device, log)

    def result(rows: list[dict], complete: bool) -> dict:
        # x first: against the first row that ran; comparing choices, the first choice of the same preset and batch
        for r in rows:
            group = [o for o in rows if o["status"] == "ok"
                     and (not settings.choices or (o["preset"], o["batch_size"]) == (r["preset"], r["batch_size"]))]
            r["ratio_to_first"] = r["images_per_s"] / group[0]["images_per_s"] if r["status"] == "ok" else None
        return {
            "schema": SCHEMA,
            "benchmark": "throughput",
            "complete": complete,  # False while variants are still to be measured (or the run was killed)
            "planned_variants": len(variants),
            "environment": {**env, "device_reason": device_reason},
            "settings": {**dataclasses.asdict(settings), "precision_resolved": precision.name,
                         "precision_reason": precision.reason, "data": "synthetic uniform uint8"},
            "peaks": dict(peaks.measured),  # measured by this run; each row names the peak its MFU used
            "runs": store.distinct_runs(rows),
            "notes": notes(device, settings),
            "results": rows,
        }

    images = synthetic_images(settings.num_images, settings.image_shape, settings.seed)
    with tempfile.TemporaryDirectory(prefix="fastddpm-bench-") as tmp:
        source = as_memmap(images, Path(tmp)) if settings.data_placement == "stream" else images
        done: dict[int, dict] = {}

        def record(i: int, row: dict, fresh: bool = True) -> None:
            if fresh:
                row.update(identity=identities[i], run=store.run_record(env))
                log(f"{tag(i)}: {progress_line(row)}")
            done[i] = row
            write_results(result([done[k] for k in sorted(done)], complete=False), out_dir)  # a killed run keeps
            #                                                                                   every variant so far

        def tag(i: int) -> str:
            v = variants[i]
            return f"[{i + 1}/{len(variants)}] {v.preset} batch {v.batch_size}" + (f" {v.choice}" if v.choice else "")

        for group in plan_groups(variants):
            new = [i for i in group if reused[i] is None and previous.failed_before(identities[i]) is None]
            if settings.choices and len(group) > 1 and new and any(reused[i] is not None for i in group):
                # a choice's ratio to the first is taken within its group: rows of one group from two runs (another
                # hour, clocks, neighbour, or machine) would compare a run's noise, so a group with a choice never
                # measured is timed again whole. A choice that failed before is tried again alone: a failure that
                # repeats (a kernel that does not compile here) must not cost the whole group on every call.
                log(f"{tag(group[0])}: {len(new)} of the group's {len(group)} choices never measured: measuring the "
                    "whole group again, alternating, so that its ratios come from one run")
                for i in group:
                    reused[i] = None
            todo = []
            for i in group:
                if reused[i] is not None:
                    run = reused[i]["run"]
                    log(f"{tag(i)}: already measured in {json_path} ({run['date_utc']}, commit "
                        f"{str(run['git_commit'])[:12]}): skipped (--remeasure measures it again): "
                        f"{progress_line(reused[i])}")
                    record(i, reused[i], fresh=False)
                    continue
                before = previous.failed_before(identities[i])
                if before is not None:
                    log(f"{tag(i)}: failed in the earlier run ({before['error_type']}): measuring it again")
                todo.append(i)
            if len(todo) > 1 and settings.cuda_graphs != "reduce-overhead":  # Inductor's graph trees: one at a time
                log(f"{tag(todo[0])} ... {variants[todo[-1]].choice}: {len(todo)} choices, each warmed up "
                    f"({settings.warmup_steps} steps: compiling and capturing where on), then {settings.repeats} "
                    f"rounds of {settings.steps} timed steps each, alternating")
                got, left = measure_alternating([variants[i] for i in todo], source, device=device,
                                                settings=settings, peaks=peaks)
                for k, row in got.items():
                    record(todo[k], row)
                if left:
                    log(f"{', '.join(variants[todo[k]].choice for k in left)}: timed one by one after the others "
                        f"(not resident beside them: GPU memory, or dynamo's recompile limit)")
                todo = [todo[k] for k in left]
            for i in todo:
                v = variants[i]
                log(f"{tag(i)}: warming up ({settings.warmup_steps} steps: compiling and capturing where on), then "
                    f"{settings.repeats} x {settings.steps} timed steps")
                record(i, run_variant(v, source, device=device, settings=settings,
                                      peak=peaks.matmul(peak_dtype(v.precision)), bandwidth=peaks.bandwidth()))
        rows = [done[k] for k in sorted(done)]
        del source

    final = result(rows, complete=True)
    write_results(final, out_dir)
    log("")
    log(table_markdown(rows))
    failed = [r for r in rows if r["status"] != "ok"]
    log(f"\n{len(rows) - len(failed)}/{len(rows)} variants ok; wrote {json_path} and {out_dir / 'throughput.md'}")
    final["out_dir"] = str(out_dir)
    return final


def notes(device: torch.device, s: ThroughputSettings) -> list[str]:
    clock = "CUDA events" if device.type == "cuda" else "time.perf_counter"
    out = [
        f"step ms: median over {s.repeats} repeats of {s.steps} steps each ({clock}, from a drained queue to the "
        "last kernel); [min-max] across repeats. Each step draws its batch (batches.get), as the training loop does.",
        f"compile s: wall time of the first {s.warmup_steps} steps (compile, autotune, CUDA graph capture, cuDNN "
        "search), synchronised; it is not part of the steady state. Each variant (each group of choices) compiles "
        "afresh in process (torch._dynamo.reset), but Inductor's on-disk caches persist: a first run on a fresh "
        "machine is slower.",
        "MFU: FLOPs of one training step (FlopCounterMode over one uncompiled forward+backward of the U-Net, "
        "attention via SDPA's math backend = model FLOPs, no recompute) / median step time / the matmul peak "
        "measured in the step's own dtype (named next to each MFU: bf16 or fp16 under autocast; tf32 for fp32 on "
        "CUDA, where training allows TF32; fp32 on the CPU). A bf16 peak under an fp32 step would read ~2x low, "
        "and under fp16 on a pre-Ampere GPU over 100%.",
        f"input wait %: batches.get(...) alone for {s.steps} steps ({clock}) as a share of the median step time; "
        "an upper bound on the wait, since on a GPU the next batch's kernels can overlap the step.",
        "peak mem: torch.cuda.max_memory_allocated over the variant (model, AdamW state, EMA, the resident dataset, "
        "activations, compile/graph pools), reset before each variant.",
        "recompiles: graphs compiled after the warm-up steps (should be 0: static shapes, tensor learning rate).",
        f"data: {s.num_images:,} synthetic uniform uint8 images {'x'.join(map(str, s.image_shape))}, "
        f"placement {s.data_placement}" + (" (streamed from a temporary .npy memmap)"
                                           if s.data_placement == "stream" else " (resident)") + ".",
    ]
    if s.choices and len(s.choices) > 1:
        out.insert(1, "choices: the choices of one preset and batch are all built and warmed up, then timed "
                      "alternating, one repeat of each in turn with the order rotated every round, so that drift "
                      "falls on all of them alike and `x first` compares like with like (each row's `timing`; a "
                      "choice that did not fit in GPU memory beside the others is timed alone afterwards).")
    if device.type != "cuda":
        out.insert(0, "CPU run: timings describe this CPU (perf_counter) and are not GPU claims; the MFU peak is "
                      "the faster of a matmul and a 3x3 channels_last convolution (oneDNN, the U-Nets' own "
                      "kernel) in the step's dtype.")
    return out
