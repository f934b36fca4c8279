"""`fastddpm bench ladder`: seed 000's DDPM optimisation ladder (and past it), then seed 002's MLP ladder.

One process, one model (a preset), the same images for every rung; each rung adds one change to the previous
one (the rungs are spelled out in bench/ladder_rungs.py). Per rung: images/s (median over repeats, with the
[min-max] spread), the time one epoch of the dataset would take, speedup over the baseline and over the
previous ok rung, warm-up / compile time (timed on its own, never in the steady state), GPU busy share, peak
memory and recompiles. A rung that fails is recorded with its reason and the ladder goes on.
Writes ladder.json, ladder.md, ladder.csv and mlp.csv in the run folder after every rung (so a run killed by a
time limit keeps what it measured), and ladder.png at the end. A re-run into the same
folder reuses the rungs measured there with the same settings, data, device and torch (bench/store.py), and
`rungs` measures only some: a ladder can be split over several runs into one folder.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import gc
import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastddpm.bench import ladder_rungs, store
from fastddpm.bench.ladder_report import mlp_table_markdown, progress_line, table_markdown, write_results
from fastddpm.bench.mlp import BATCH_SIZE as MLP_BATCH
from fastddpm.config import ConfigError, get_preset, resolve_model_shape
from fastddpm.data import DataError
from fastddpm.device import resolve_device
from fastddpm.measure import (Peaks, environment_record, free_device_memory, model_roofline, peak_memory_bytes,
                              reset_peak_memory, share_warning, summarize, time_steps, time_wall_s)
from fastddpm.rundir.files import make_writable_dir
from fastddpm.trainer.batch_finder import is_oom
from fastddpm.trainer.compile_counters import CompileCounters

SCHEMA = "fastddpm-bench-ladder-2"  # 2: rows carry identity and run; written after every rung
QUICK = dict(preset="tiny", num_images=96, steps=2, warmup_steps=1, repeats=2, mlp_epochs=1, mlp_train_images=2000,
             mlp_test_images=1000, auto_batch_limit=32, batch_divisor=4)


@dataclass(kw_only=True)
class LadderSettings:
    """Every field is a flag of `fastddpm bench ladder`."""

    data: str = "fashion-mnist"  # any fastddpm data source; exported once to PNGs for rungs 0-2
    preset: str = "seed-1layer"  # the model (the seed notebook's one-layer U-Net)
    num_images: int | None = None  # cap the dataset (None: all of it); epoch time uses this count
    steps: int = 50  # steady-state steps per timed repeat
    warmup_steps: int = 10  # steps timed as warm-up / compile, before the steady state
    repeats: int = 3  # timed repeats: median and [min-max]
    workers: int | None = None  # DataLoader workers for rung 1 on (None: min(8, os.cpu_count()))
    device: str = "auto"
    seed: int = 0
    mlp: bool = True  # run the MLP ladder (seed 002)
    mlp_data: str = "fashion-mnist"  # MNIST-format (1x28x28, 10 classes) with a test split
    mlp_epochs: int = 5
    mlp_train_images: int | None = None  # None: the whole train split
    mlp_test_images: int | None = None
    auto_batch_limit: int = 8192  # rung 9's search stops here
    batch_divisor: int = 1  # every rung's batch is divided by this (--quick: 4, so 64 -> 16, 192 -> 48)
    quick: bool = False  # recorded: the caller applied QUICK's values
    rungs: tuple[str, ...] | None = None  # measure only these rung keys (None: all); the rest are reused or not run
    remeasure: bool = False  # measure rungs already in OUT/ladder.json again (else they are reused)

    def __post_init__(self) -> None:
        get_preset(self.preset)
        if self.rungs is not None:
            self.rungs = tuple(self.rungs)
            keys = [r.key for r in ladder_rungs.DDPM_RUNGS]
            unknown = [k for k in self.rungs if k not in keys]
            if unknown or not self.rungs:
                raise ConfigError(f"bench ladder: --rungs {','.join(self.rungs)}: unknown rung(s) "
                                  f"{', '.join(unknown) or '(none given)'}; the rungs are {','.join(keys)}")
        for name in ("steps", "warmup_steps", "repeats", "mlp_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench ladder: --{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"bench ladder: --workers={self.workers} must be >= 0")
        if self.num_images is not None and self.num_images < 192 // self.batch_divisor:
            raise ConfigError(f"bench ladder: --num-images={self.num_images} must be >= "
                              f"{192 // self.batch_divisor} (rung 4's batch)")
        if self.mlp and self.mlp_train_images is not None and self.mlp_train_images < MLP_BATCH:
            raise ConfigError(f"bench ladder: mlp_train_images={self.mlp_train_images} must be >= {MLP_BATCH} "
                              f"(the MLP ladder's batch), or mlp=False (--skip-mlp)")
        if self.mlp and self.mlp_test_images is not None and self.mlp_test_images < 1:
            raise ConfigError(f"bench ladder: mlp_test_images={self.mlp_test_images} must be >= 1, "
                              f"or mlp=False (--skip-mlp)")

    def resolved_workers(self) -> int:
        return min(8, os.cpu_count() or 1) if self.workers is None else self.workers


# ----------------------------------------------------------------------------------------------------------------
# Measuring one rung


def gpu_busy_us(events: list[dict]) -> float:
    """Microseconds with GPU work running, from a Chrome trace's events: the union of kernel, memcpy and memset
    intervals on all streams, classified as the doctor classifies them (fastddpm.doctor.trace.GPU_CATS). Other
    events on the GPU's timeline are not work: a `gpu_user_annotation` (a record_function range mirrored onto
    the GPU) spans the idle gaps between its kernels."""
    from fastddpm.doctor.trace import GPU_CATS

    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                       if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    busy_us, end = 0.0, -math.inf
    for s, e in intervals:  # union: overlapping work (several streams) counts once
        if e > end:
            busy_us += e - max(s, end)
            end = e
    return busy_us


def gpu_busy_share(step: Callable[[int], object], first: int, steps: int, device: torch.device) -> float | None:
    """Share of wall time with GPU work running (gpu_busy_us) over `steps` steps recorded by torch.profiler /
    the wall time of those steps. None on the CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from fastddpm.doctor.trace import load_trace

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = time_wall_s(lambda: [step(first + i) for i in range(steps)], device)
    with tempfile.TemporaryDirectory(prefix="fastddpm-ladder-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))  # the doctor's input: its event categories say what is GPU work
        busy_us = gpu_busy_us(load_trace(path))
    return min(1.0, busy_us / 1e6 / wall_s) if wall_s > 0 else None


def measure_rung(prepared: ladder_rungs.Prepared, settings: LadderSettings, device: torch.device) -> dict:
    counters = CompileCounters(enabled=prepared.compiled)
    warmup_s = time_wall_s(lambda: [prepared.step(i) for i in range(settings.warmup_steps)], device)
    counters.mark_warm()
    step_ms, images_per_s = [], []
    for r in range(settings.repeats):
        first = settings.warmup_steps + r * settings.steps
        seen_before = prepared.images_seen() if prepared.images_seen else 0
        elapsed_ms = time_steps(lambda i: prepared.step(first + i), settings.steps, device)
        # A DataLoader without drop_last yields a short batch at each epoch's end: count the images it trained.
        images = (prepared.images_seen() - seen_before if prepared.images_seen
                  else prepared.batch_size * settings.steps)
        step_ms.append(elapsed_ms / settings.steps)
        images_per_s.append(images / (elapsed_ms / 1000))
    compile_report = counters.report()
    busy = gpu_busy_share(prepared.step, settings.warmup_steps + settings.repeats * settings.steps,
                          min(settings.steps, 20), device)
    s = summarize(step_ms)
    s["per_repeat"] = step_ms
    ips = summarize(images_per_s)
    return {"step_ms": s, "images_per_s": ips["median"], "images_per_s_range": [ips["min"], ips["max"]],
            "warmup_s": warmup_s, "gpu_busy": busy, "peak_memory_bytes": peak_memory_bytes(device),
            "recompiles_after_warmup": compile_report.get("recompiles_after_warmup"),
            "graph_breaks": compile_report.get("graph_breaks"), "cuda_graphs_failed": prepared.graph_failed()}


def _row(rung: ladder_rungs.Rung, sw: ladder_rungs.Switches) -> dict:
    return {"rung": rung.key, "title": rung.title, "change": rung.change, "status": None, "reason": None,
            "switches": dataclasses.asdict(sw), "batch_size": None, "precision": None, "images_per_s": None,
            "images_per_s_range": None, "step_ms": None, "epoch_s": None, "speedup_vs_baseline": None,
            "speedup_vs_previous": None, "previous_rung": None, "warmup_s": None, "setup_s": None,
            "gpu_busy": None, "peak_memory_bytes": None, "peak_memory_gib": None, "recompiles_after_warmup": None,
            "graph_breaks": None, "cuda_graphs_failed": None, "mfu_pct": None, "mfu_dtype": None,
            "roofline_pct": None, "roofline_binds": None, "notes": []}


def run_rung(rung, sw, ctx, settings) -> dict:
    row = _row(rung, sw)
    device = ctx.device
    try:
        import torch._dynamo as dynamo

        dynamo.reset()  # a fresh compile per rung: honest compile time
        free_device_memory(device)
        reset_peak_memory(device)
        prepared = ladder_rungs.prepare_rung(rung, sw, ctx)
        row.update(batch_size=prepared.batch_size, precision=prepared.precision, setup_s=prepared.setup_s,
                   notes=list(prepared.notes))
        row.update(measure_rung(prepared, settings, device))
        row["status"] = "ok"
        if row["peak_memory_bytes"] is not None:
            row["peak_memory_gib"] = row["peak_memory_bytes"] / 2**30
        model, autocast_dtype = prepared.model, prepared.autocast_dtype
        del prepared  # the rung's step, optimizer and graphs go before the roofline's probes and peaks
        gc.collect()
        free_device_memory(device)
        if model is not None and ctx.peaks is not None:
            try:  # a failure here leaves the rung's measurement standing
                row.update(model_roofline(model, tuple(ctx.images_NCHW.shape[1:]),
                                          images_per_step=row["batch_size"], device=device,
                                          autocast_dtype=autocast_dtype, images_per_s=row["images_per_s"],
                                          peaks=ctx.peaks))
            except Exception as e:  # noqa: BLE001 - OOM or anything: the rung was measured
                row["notes"].append(f"MFU and roofline not measured: {type(e).__name__}: {e}".strip())
            warning = share_warning(row["mfu_pct"], row["roofline_pct"], row["roofline_binds"])
            if warning:
                row["notes"].append(warning)
    except Exception as e:  # noqa: BLE001 - OOM, compile errors, anything: the ladder goes on
        oom = is_oom(e)
        row.update(status="failed", reason=("out of memory: " if oom else "") + f"{type(e).__name__}: {e}".strip())
    finally:
        gc.collect()
        free_device_memory(device)
    return row


# ----------------------------------------------------------------------------------------------------------------
# The run


def default_out_dir() -> Path:
    return Path("runs") / f"bench-ladder-{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def _fingerprint(*arrays: np.ndarray) -> str:
    """sha256 of the arrays' bytes: the data a rung measured on, whatever path it was read from."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(str((a.dtype, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _load_ddpm_data(settings: LadderSettings, log) -> tuple[np.ndarray, np.ndarray, dict]:
    from fastddpm.data.prepare import prepare

    prepared = prepare(settings.data, progress=False)
    n = prepared.num_images if settings.num_images is None else min(settings.num_images, prepared.num_images)
    images = np.array(prepared.images[:n], dtype=np.uint8)
    labels = np.asarray(prepared.labels[:n])
    # Rungs 0-2 read PNGs in (label, index) order: keep the array in that same order, so all rungs see one set.
    order = np.lexsort((np.arange(n), labels))
    images, labels = images[order], labels[order]
    log(f"data: {n:,} images {'x'.join(map(str, images.shape[1:]))} from {settings.data}")
    return images, labels, {"source": settings.data, "cache": str(prepared.cache_path), "num_images": n,
                            "png_root": None, "shape_CHW": list(images.shape[1:]),
                            "fingerprint": _fingerprint(images, labels)}


def _export_pngs(images: np.ndarray, labels: np.ndarray, data_info: dict, log) -> Path:
    """The images as one PNG file each (the seed's layout, ROOT/<label>/*.png), for the rungs that decode files."""
    from fastddpm.data.cache import default_cache_dir
    from fastddpm.data.export import export_images

    root = default_cache_dir() / "png-export" / f"{Path(data_info['cache']).name}-n{data_info['num_images']}"
    res = export_images(images, labels, root, identity={"cache": data_info["cache"],
                                                        "num_images": data_info["num_images"]}, overwrite=True)
    log(f"data: PNG folder {root} ({'reused' if res.reused else 'written'})")
    return root


def _load_mlp_data(settings: LadderSettings, log):
    from fastddpm.bench.mlp import MlpData
    from fastddpm.data.prepare import prepare

    train = prepare(settings.mlp_data, split="train", progress=False)
    test = prepare(settings.mlp_data, split="test", progress=False)
    if train.images.shape[1:] != (1, 28, 28):
        raise ConfigError(f"bench ladder: the MLP ladder needs MNIST-format 1x28x28 images; {settings.mlp_data} "
                          f"has {tuple(train.images.shape[1:])}. Use mlp_data='mnist' or 'fashion-mnist'")
    ntr = train.num_images if settings.mlp_train_images is None else min(settings.mlp_train_images, train.num_images)
    if ntr < MLP_BATCH:
        raise ConfigError(f"bench ladder: the MLP ladder trains batches of {MLP_BATCH}; {settings.mlp_data} has "
                          f"{ntr} training images. Use a larger source or --skip-mlp")
    nte = test.num_images if settings.mlp_test_images is None else min(settings.mlp_test_images, test.num_images)
    return MlpData(train_x=np.array(train.images[:ntr]), train_y=np.asarray(train.labels[:ntr]),
                   test_x=np.array(test.images[:nte]), test_y=np.asarray(test.labels[:nte]))


def _uses_pngs(sw: ladder_rungs.Switches) -> bool:
    return not (sw.resident or sw.fused or sw.cuda_graphs or sw.auto_batch)


def rung_identity(rung: ladder_rungs.Rung, sw: ladder_rungs.Switches, settings: LadderSettings, cfg, data_info: dict,
                  env: dict) -> dict:
    """Everything that changes a rung's numbers: a row measured under an equal identity is reused."""
    return store.canonical({
        "rung": rung.key, "switches": dataclasses.asdict(sw), "config": store.config_identity(cfg.to_dict()),
        "data": {k: data_info[k] for k in ("fingerprint", "num_images")},
        "timing": {k: getattr(settings, k) for k in ("steps", "warmup_steps", "repeats", "seed", "batch_divisor",
                                                      "auto_batch_limit")},
        **store.device_identity(env),
        # fp32 rungs on a GPU run TF32 matmuls since the ladder sets it as the trainer: rows from before differ
        **({"tf32": True} if str(env["device"]).startswith("cuda") else {}),
    })


def mlp_identity(key: str, settings: LadderSettings, workers: int, fingerprint: str, env: dict) -> dict:
    return store.canonical({"mlp_rung": key, "data": fingerprint, "epochs": settings.mlp_epochs, "workers": workers,
                            "seed": settings.seed, **store.device_identity(env)})


def _all_rows(data: dict) -> list[dict]:
    return list(data.get("rungs") or []) + list((data.get("mlp") or {}).get("rows") or [])


def run_ladder(settings: LadderSettings, out_dir: str | Path | None = None, *, argv: list[str] | None = None,
               log: Callable[[str], None] = print) -> dict:
    from fastddpm.bench.mlp import MLP_RUNGS, fill_mlp_speedups, run_mlp_rung

    device, device_reason = resolve_device(settings.device, setting="--device")
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir()
    make_writable_dir(out_dir, flag="bench ladder --out", fix=store.OUT_FIX)
    env = environment_record(device, argv)
    workers = settings.resolved_workers()
    log(f"bench ladder: {settings.preset} on {env['device_name']} ({device}; {device_reason}); torch {env['torch']}; "
        f"commit {str(env['git_commit'])[:12]}; {workers} DataLoader workers")
    if device.type != "cuda":
        log("note: CPU run: timings (perf_counter) describe this CPU only; CUDA rungs are skipped")
    else:
        # As the trainer and bench throughput: the fp32 rungs' matmuls in TF32 like their convolutions (cuDNN's
        # default), so that their MFU divides by the TF32 peak they run at, not by true fp32's (several times lower)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    json_path = out_dir / "ladder.json"
    previous = store.Previous(json_path, schema=SCHEMA, rows=_all_rows, remeasure=settings.remeasure, log=log)

    images, labels, data_info = _load_ddpm_data(settings, log)
    cfg = resolve_model_shape(get_preset(settings.preset), images.shape)

    # ---- the plan: each rung's switches, skip reason and identity, before anything is measured
    plan = []
    for rung, candidate, skip in ladder_rungs.plan(device, workers, settings.quick):
        identity = rung_identity(rung, candidate, settings, cfg, data_info, env)
        plan.append((rung, candidate, skip, identity, None if skip else previous.take(identity)))
    selected = set(settings.rungs or [r.key for r in ladder_rungs.DDPM_RUNGS])

    mlp_data, mlp_info, mlp_plan = None, None, []
    if not settings.mlp and any("mlp_rung" in r["identity"] for r in previous.rows):
        # --skip-mlp keeps the MLP rows already in OUT, once the data they were measured on is checked
        try:
            mlp_data = _load_mlp_data(settings, log)
        except (ConfigError, DataError, OSError) as e:
            log(f"--skip-mlp: cannot read {settings.mlp_data} to check the MLP rows in {json_path} ({e}): not kept")
    elif settings.mlp:
        mlp_data = _load_mlp_data(settings, log)
    if mlp_data is not None:
        mlp_info = {"source": settings.mlp_data, "train_images": int(len(mlp_data.train_y)),
                    "test_images": int(len(mlp_data.test_y)), "epochs": settings.mlp_epochs, "workers": workers}
        fingerprint = _fingerprint(mlp_data.train_x, mlp_data.train_y, mlp_data.test_x, mlp_data.test_y)
        for key, _ in MLP_RUNGS:
            identity = mlp_identity(key, settings, workers, fingerprint, env)
            mlp_plan.append((key, identity, previous.take(identity)))
    previous.finish_matching()

    to_measure = [rung for rung, _, skip, _, old in plan if skip is None and old is None and rung.key in selected]
    png_root = None
    if any(_uses_pngs(sw) for rung, sw, *_ in plan if rung in to_measure):
        png_root = _export_pngs(images, labels, data_info, log)
        data_info["png_root"] = str(png_root)
    ctx = ladder_rungs.Context(cfg=cfg, device=device, png_root=png_root, images_NCHW=images, seed=settings.seed,
                               quick=settings.quick, auto_batch_limit=settings.auto_batch_limit,
                               batch_divisor=settings.batch_divisor, log=log, peaks=Peaks(device, log))

    rows: list[dict] = []
    mlp_rows: list[dict] = []

    def result(complete: bool) -> dict:
        fill_speedups(rows, data_info["num_images"], device.type)
        fill_mlp_speedups(mlp_rows)
        return {"schema": SCHEMA, "benchmark": "ladder", "complete": complete,
                "environment": {**env, "device_reason": device_reason},
                "settings": {**dataclasses.asdict(settings), "workers_resolved": workers}, "data": data_info,
                "notes": notes(device, settings, data_info), "runs": store.distinct_runs(rows + mlp_rows),
                "rungs": rows, "mlp": {"info": mlp_info, "rows": mlp_rows or None}}

    # ---- the DDPM ladder, one rung at a time; the files are rewritten after each
    for i, (rung, candidate, skip, identity, old) in enumerate(plan):
        tag = f"[{i + 1}/{len(plan)}] rung {rung.key} {rung.title}"
        if skip:
            row = _row(rung, candidate)
            row.update(status="skipped", reason=skip)
            log(f"{tag}: {skip}")
        elif old is not None:
            row = old
            log(f"{tag}: already measured in {json_path} ({row['run']['date_utc']}, commit "
                f"{str(row['run']['git_commit'])[:12]}): skipped (--remeasure measures it again): {progress_line(row)}")
        elif rung.key not in selected:
            row = _row(rung, candidate)
            row.update(status="not run", reason=f"not in --rungs {','.join(settings.rungs)}, and not yet in "
                                                f"{json_path.name}")
            log(f"{tag}: not run ({row['reason']})")
        else:
            before = previous.failed_before(identity)
            if before is not None:
                log(f"{tag}: failed in the earlier run ({before['reason']}): measuring it again")
            log(f"{tag}: {rung.change}; warm-up {settings.warmup_steps} steps, then {settings.repeats} x "
                f"{settings.steps} timed steps")
            row = run_rung(rung, candidate, ctx, settings)
            row.update(identity=identity, run=store.run_record(env))
            log(f"{tag}: {progress_line(row)}")
        rows.append(row)
        write_results(result(complete=False), out_dir)  # a killed run keeps every rung so far

    # ---- the MLP ladder (seed 002)
    if mlp_plan:
        if settings.mlp:
            log("MLP ladder (seed 002): 784-128-64-10, batch 64, Adam 1e-3")
        for key, identity, old in mlp_plan:
            if old is not None:
                mlp_rows.append(old)
                log(f"  mlp rung {key}: already measured in {json_path}: skipped")
            elif settings.mlp:
                row = run_mlp_rung(key, mlp_data, device, epochs=settings.mlp_epochs, workers=workers,
                                   seed=settings.seed, log=log)
                row.update(identity=identity, run=store.run_record(env))
                mlp_rows.append(row)
            write_results(result(complete=False), out_dir)

    final = result(complete=True)
    chart = write_results(final, out_dir, log=log, chart=True)
    final["chart"] = chart
    log("")
    log(table_markdown(rows))
    if mlp_rows:
        log("")
        log(mlp_table_markdown(mlp_rows))
    log(f"\nwrote {out_dir}/ladder.json, ladder.md, ladder.csv" + (", mlp.csv" if mlp_rows else "")
        + (", ladder.png" if chart else ""))
    final["out_dir"] = str(out_dir)
    return final


def fill_speedups(rows: list[dict], num_images: int, device_type: str) -> None:
    base = rows[0]["images_per_s"] if rows and rows[0]["status"] == "ok" else None
    prev = None  # the previous ok rung on the main line (a branch is compared, not carried; see ladder_rungs.carried)
    branch_keys = {r.key for r in ladder_rungs.DDPM_RUNGS if not ladder_rungs.carried(r, device_type)}
    for r in rows:
        if r["status"] != "ok":
            continue
        r.update(epoch_s=num_images / r["images_per_s"], speedup_vs_baseline=None, speedup_vs_previous=None,
                 previous_rung=None)  # a reused row's old ratios are recomputed against this run's rows
        if base:
            r["speedup_vs_baseline"] = r["images_per_s"] / base
        if prev is not None:
            r["speedup_vs_previous"] = r["images_per_s"] / prev["images_per_s"]
            r["previous_rung"] = prev["rung"]
        if r["rung"] not in branch_keys:
            prev = r


def notes(device: torch.device, s: LadderSettings, data_info: dict) -> list[str]:
    clock = "CUDA events" if device.type == "cuda" else "time.perf_counter"
    out = [
        f"images/s: the median over {s.repeats} repeats of {s.steps} steps of the images trained / the repeat's time "
        f"({clock}); each step draws its own batch (DataLoader for rungs 0-5, with the short batch at each epoch's "
        "end counted as it is; ResidentBatches from rung 6), so input time counts.",
        f"warm-up s: the first {s.warmup_steps} steps (worker start-up, compile, CUDA graph capture), timed on their "
        "own; setup s: work before them (RAM preload, batch-size search).",
        f"epoch s: {data_info['num_images']:,} images / images/s" + (" (extrapolated from a few --quick steps)"
                                                                    if s.quick else "") + ".",
        "speedup vs previous: over the previous ok rung of the main line (3b, bf16, is a branch on a GPU, not "
        "carried; on a CPU it is the main line: bf16 is a CPU's fast precision, and rung 4 builds on it).",
        *(["fp32 rungs on a GPU run their matmuls and convolutions in TF32 (as the trainer), and their MFU divides "
           "by the TF32 peak."] if device.type == "cuda" else []),
        "GPU busy: union of the kernel, memcpy and memset intervals (as the doctor counts them; annotation ranges "
        "on the GPU timeline are not work) from torch.profiler over up to 20 steps / their wall time (n/a on the "
        "CPU). The profiler's own host overhead slows host-bound rungs a little during those steps.",
        "recompiles: graphs compiled after the warm-up (torch._dynamo counters), for compiled rungs.",
        "A skipped rung's change is not carried forward; a failed (or not run) rung's change is.",
    ]
    if s.batch_divisor != 1:
        out.append(f"--quick: every rung's batch is divided by {s.batch_divisor} (64 -> {64 // s.batch_divisor}, "
                   f"192 -> {192 // s.batch_divisor}) so the ladder fits a CPU in minutes.")
    if device.type != "cuda":
        out.insert(0, "CPU run: timings describe this CPU; rungs that need CUDA are skipped with the reason.")
    return out
