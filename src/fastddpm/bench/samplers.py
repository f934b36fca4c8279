"""`fastddpm bench samplers CHECKPOINT`: image quality against sampling cost, for every sampler.

For each sampler x step count (and DDPM over all T steps as the reference point) it draws `num_samples` images
from the checkpoint's EMA weights and scores them like `fastddpm eval`: FID, precision / recall and, for a
conditional model, class accuracy (class-balanced, at one guidance scale). Every point uses the same noise for
the same seed (eval's: sample k's noise from (seed, k)), so samplers differ only by their steps. The cost is the
network calls per image (NFE) and the wall time. FID at a few thousand samples has a seed-to-seed spread
comparable to the differences between good samplers: `spread_points` are drawn again with `spread_seeds`, and
the report gives each of them as mean and min-max, beside the single-seed points. Unless given, the spread points
are the default ones (SPREAD_POINTS, --quick's QUICK_SPREAD_POINTS) that lie in the grid asked for: a run narrowed
to `--samplers dpmpp-2m --steps 8,10,12` draws those points and no others.

Rows are written after every point (OUT/samplers.json, .csv, .md) and a run into the same folder reuses every
point measured there with the same checkpoint, settings, device and torch (fastddpm.bench.store): a killed
run loses at most the point it was drawing. Points of other samplers or step counts measured there with the same
checkpoint and settings are kept, so one table can be built over several runs (`--samplers`, `--steps`).
OUT/samplers.png plots FID against NFE (matplotlib).
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fastddpm.bench import store
from fastddpm.config import SAMPLERS, SPACINGS, ConfigError
from fastddpm.measure import environment_record
from fastddpm.rundir.files import make_writable_dir

SCHEMA = "fastddpm-bench-samplers-1"


@dataclass(kw_only=True)
class SamplerBenchSettings:
    checkpoint: str
    samplers: tuple[str, ...] = field(default=("ddim", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun"),
                                      metadata={"help": "samplers to measure at every step count"})
    steps: tuple[int, ...] = field(default=(5, 10, 20, 50, 100), metadata={"help": "step counts"})
    ddpm: bool = field(default=True, metadata={"help": "also DDPM over all T steps (the reference point)"})
    spacing: str | None = None  # None: each sampler's own (config.default_spacing: karras for heun and on EDM)
    num_samples: int = 2000
    seed: int = 0
    # None: the default ones that lie in the grid (spread_points_of)
    spread_points: tuple[str, ...] | None = field(default=None, metadata={
        "help": "SAMPLER-STEPS points drawn with every spread seed (default: those of ddim-50, ddim-100, "
                "dpmpp-2m-10, dpmpp-2m-20 in the grid)"})
    spread_seeds: tuple[int, ...] = (1, 2)
    guidance: float | None = None  # a conditional model's W (default: its training grids' train.sample_guidance)
    batch_size: int | None = None  # default: 1000 on a GPU, 250 on a CPU
    precision: str = "auto"
    compile: str = "auto"  # auto: on for CUDA
    device: str = "auto"
    remeasure: bool = False
    quick: bool = False

    def __post_init__(self):
        if not self.samplers:
            raise ConfigError("--samplers: give at least one sampler")
        for s in self.samplers:
            if s not in SAMPLERS:
                raise ConfigError(f"--samplers: unknown sampler {s!r}; choose from {', '.join(SAMPLERS)}")
        if self.spacing is not None and self.spacing not in SPACINGS:
            raise ConfigError(f"--spacing {self.spacing!r}: choose from {', '.join(SPACINGS)}")
        if not self.steps or min(self.steps) < 1:
            raise ConfigError(f"--steps {self.steps}: give step counts >= 1")
        if self.num_samples < 10:
            raise ConfigError(f"--num-samples {self.num_samples}: at least 10 (2,000 for the table in RESULTS.md)")
        for p in self.spread_points or ():
            name, _, k = p.rpartition("-")
            if name not in SAMPLERS or not k.isdigit():
                raise ConfigError(f"--spread-points: {p!r} is not SAMPLER-STEPS (e.g. ddim-50, dpmpp-2m-10)")


SPREAD_POINTS = ("ddim-50", "ddim-100", "dpmpp-2m-10", "dpmpp-2m-20")
QUICK_SPREAD_POINTS = ("ddim-4",)
# Every sampler here runs on all three objectives (CONTINUOUS_SAMPLERS): a default list that one objective refuses
# would make --quick a flag error on that model. dpmpp-2m-sde is the auto sampler of DDPM and EDM models.
QUICK = dict(samplers=("ddim", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun"), steps=(2, 4), ddpm=False,
             num_samples=20, spread_seeds=(1,))


def _point(p: str) -> tuple[str, int]:
    name, _, k = p.rpartition("-")
    return name, int(k)


def spread_points_of(settings: SamplerBenchSettings) -> tuple[str, ...]:
    """The points drawn again with every spread seed: settings.spread_points when given (always honoured), else the
    default ones (--quick's own) that lie in the grid asked for. The defaults all lie in the default grid; a grid
    narrowed by --samplers or --steps keeps only those inside it, and none may remain."""
    if settings.spread_points is not None:
        return settings.spread_points
    grid = {(s, k) for s in settings.samplers for k in settings.steps}
    return tuple(p for p in (QUICK_SPREAD_POINTS if settings.quick else SPREAD_POINTS) if _point(p) in grid)


def points(settings: SamplerBenchSettings, num_timesteps: int, objective: str = "ddpm") -> list[tuple[str, int, int]]:
    """(sampler, steps, seed) in the order they are asked for: the grid, DDPM (a DDPM model's), then the spread seeds.
    An EDM or flow model has no discrete timesteps: no DDPM point. Which of them this model can be sampled at is
    check_points' to say."""
    continuous = objective != "ddpm"
    if continuous:
        from fastddpm.diffusion.continuous import CONTINUOUS_SAMPLERS

        wrong = [s for s in (*settings.samplers, *(_point(p)[0] for p in spread_points_of(settings)))
                 if s not in CONTINUOUS_SAMPLERS]
        if wrong:
            raise ConfigError(f"bench samplers: {', '.join(dict.fromkeys(wrong))} cannot sample this {objective} "
                              f"model; choose from {', '.join(CONTINUOUS_SAMPLERS)}")
    # DDPM walks all T timesteps whatever the step count asked: its one point is (ddpm, T), never (ddpm, k)
    out = [(s, num_timesteps if s == "ddpm" else k, settings.seed) for s in settings.samplers for k in settings.steps]
    if settings.ddpm and not continuous:
        out.append(("ddpm", num_timesteps, settings.seed))
    for p in spread_points_of(settings):
        name, k = _point(p)
        out += [(name, num_timesteps if name == "ddpm" else k, seed)
                for seed in (settings.seed, *settings.spread_seeds)]
    return list(dict.fromkeys(out))


def run_samplers(settings: SamplerBenchSettings, out_dir: str | Path | None = None,
                 log: Callable[[str], None] = print) -> dict:
    from fastddpm.device import resolve_device, resolve_precision
    from fastddpm.eval.evaluate import Evaluator
    from fastddpm.rundir.locate import locate
    from fastddpm.rundir.state_dicts import weights_digest
    from fastddpm.sampling import check_null_class_trained, compile_for_sampling, load_for_sampling

    device, _ = resolve_device(settings.device, setting="--device")
    ckpt = locate(settings.checkpoint, what="bench samplers:")
    if ckpt.kind == "diffusers":  # its FIDs would need data it does not record, and this bench reads the run's own
        raise ConfigError(f"bench samplers: {ckpt.path} is a diffusers folder, which records no dataset to score "
                          f"against: `fastddpm eval --checkpoint {ckpt.path} --data SOURCE --sampler NAME --steps K` "
                          "scores its samplers one at a time")
    model, cfg = load_for_sampling(ckpt, device=device)
    info = ckpt.info()
    T = cfg.diffusion.num_timesteps
    precision = resolve_precision(settings.precision, device)
    compile_on = device.type == "cuda" if settings.compile == "auto" else settings.compile == "on"
    batch_size = min(settings.batch_size or (1000 if device.type == "cuda" else 250), settings.num_samples)
    guidance = None
    if cfg.model.conditional:
        guidance = cfg.train.sample_guidance if settings.guidance is None else settings.guidance
    elif settings.guidance is not None:
        raise ConfigError("--guidance needs a conditional model; this checkpoint is unconditional")
    check_null_class_trained(cfg, guidance)
    out_dir = Path(out_dir) if out_dir else Path(info["file"]).parent.parent / "bench-samplers"
    make_writable_dir(out_dir, flag="bench samplers --out", fix=store.OUT_FIX)
    env = environment_record(device)
    todo = check_points(points(settings, T, cfg.diffusion.objective), settings, cfg, log)
    evaluator = Evaluator.for_config(cfg, device=device, log=log)
    sampling_model = compile_for_sampling(model, device) if compile_on else model
    # the weights themselves, not the path they were read from: the same reference reached through a copy of its
    # file is the same table, and a run retrained into the same path is not
    common = {"checkpoint": {"weights_sha256": weights_digest(model), "step": info["step"],
                             "images_seen": info["images_seen"]}, "num_samples": settings.num_samples,
              "spacing": settings.spacing, "guidance": guidance, "batch_size": batch_size,
              "precision": precision.name, "compile": compile_on, "features": evaluator.net.name,
              **store.device_identity(env)}
    json_path = out_dir / "samplers.json"
    previous = store.Previous(json_path, schema=SCHEMA, rows=lambda data: data.get("rows") or [],
                              remeasure=settings.remeasure, log=log)
    identities = [{**common, "sampler": sampler, "steps": steps, "seed": seed} for sampler, steps, seed in todo]
    reused = [previous.take(identity) for identity in identities]
    # Points of the same table measured by earlier runs into this folder (other samplers or steps, other seeds)
    # stay in it, written from the first point on: a table can be built over several runs, and a killed run
    # loses none of them.
    same = store.canonical(common)
    rows = previous.take_all(lambda ident: all(ident.get(k) == v for k, v in same.items()))
    if rows:
        log(f"carried {len(rows)} point(s) of the same checkpoint and settings from {json_path}")
    previous.finish_matching()
    # the spread points drawn, also where the defaults were (settings.spread_points None)
    settings_record = {**asdict(settings), "spread_points": list(spread_points_of(settings))}
    result = {"schema": SCHEMA, "settings": settings_record, "checkpoint": info, "environment": env,
              "features": evaluator.describe(), "conditional": cfg.model.conditional, "guidance": guidance,
              "objective": cfg.diffusion.objective, "rows": rows}
    log(f"bench samplers: {len(todo)} points x {settings.num_samples:,} samples from {info['file']} "
        f"(step {info['step']}), {device}, {precision.name}, compile {'on' if compile_on else 'off'}, "
        f"features {evaluator.net.label}")
    if compile_on and any(row is None for row in reused):
        warm_up(sampling_model, cfg, batch_size=batch_size, device=device, precision=precision, guidance=guidance,
                spacing=settings.spacing, log=log)
    for (sampler, steps, seed), identity, row in zip(todo, identities, reused):
        if row is None:
            row = measure_point(evaluator, sampling_model, cfg, settings, sampler=sampler, steps=steps, seed=seed,
                                batch_size=batch_size, device=device, precision=precision, guidance=guidance)
            row.update(identity=identity, run=store.run_record(env))
            log(f"  {sampler}-{steps} seed {seed} ({row['nfe']} NFE): {describe(row)}")
        else:
            log(f"  {sampler}-{steps} seed {seed}: reused from {json_path}")
        rows.append(row)
        write_reports(result, out_dir)
    result["summary"] = summarize(rows)
    write_reports(result, out_dir)
    plot = write_plot(result, out_dir / "samplers.png", log=log)
    log(report_markdown(result))
    log(f"wrote {json_path}, samplers.csv, samplers.md" + (f" and {plot}" if plot else ""))
    return result


def check_points(todo: list[tuple[str, int, int]], settings: SamplerBenchSettings, cfg,
                 log: Callable[[str], None]) -> list[tuple[str, int, int]]:
    """The points of `todo` whose sampler can walk their steps on this model, each logged otherwise with the reason:
    a DDPM model's samplers walk at most its T timesteps, the ODE solvers fewer (from the noisiest one with a finite
    half log-SNR), so the default grid's 100 and spread point ddim-100 do not fit a model trained with T = 50.
    Checked before the feature network is built (minutes, the first time) and before the first point, not left to
    fail in the sampler mid-table. None of the points asked for left (the grid's and --spread-points' own; not
    the DDPM reference or a default spread point): a ConfigError naming them and the limit, so that a run never
    measures only points the user did not ask for. Also said here, once: a narrowed grid that kept no default
    spread point."""
    from fastddpm.diffusion import network_calls, schedule_from_config

    T, schedule = cfg.diffusion.num_timesteps, schedule_from_config(cfg.diffusion)
    asked = {f"{s}-{T if s == 'ddpm' else k}" for s in settings.samplers for k in settings.steps}
    asked.update(f"{name}-{T if name == 'ddpm' else k}" for name, k in map(_point, settings.spread_points or ()))
    fit, reasons = [], {}
    for sampler, steps, seed in todo:
        try:
            network_calls(sampler, steps, T, schedule=schedule, spacing=settings.spacing)
        except ValueError as e:
            reasons.setdefault(f"{sampler}-{steps}", str(e))
            continue
        fit.append((sampler, steps, seed))
    for point, why in reasons.items():
        log(f"bench samplers: {point} left out: {why} on this model")
    if not any(f"{sampler}-{steps}" in asked for sampler, steps, _ in fit):
        raise ConfigError(f"bench samplers: no point asked for is left to draw on this model ({T} timesteps): "
                          f"{'; '.join(f'{p}: {w}' for p, w in reasons.items() if p in asked)}. Give smaller "
                          "--steps")
    if settings.spread_points is None and settings.spread_seeds and not spread_points_of(settings):
        defaults = QUICK_SPREAD_POINTS if settings.quick else SPREAD_POINTS
        log(f"bench samplers: no seed spread measured: none of the default spread points ({', '.join(defaults)}) "
            "lies in the grid asked for; add one with --spread-points SAMPLER-STEPS")
    return fit


def warm_up(model, cfg, *, batch_size: int, device, precision, guidance, spacing, log) -> None:
    """One untimed batch through the compiled model before the first timed point: torch.compile and the CUDA
    graph capture (seconds) would otherwise land in the first point's samples/s."""
    from fastddpm.eval.evaluate import sample_uint8

    t0 = time.perf_counter()
    with torch.inference_mode():
        sample_uint8(model, cfg, num_samples=batch_size, sampler="euler", steps=2, eta=0.0, seed=0,
                     batch_size=batch_size, device=device, autocast_dtype=precision.autocast_dtype,
                     guidance=guidance, spacing=spacing)
    log(f"warm-up: compiled the sampling model in {time.perf_counter() - t0:.1f} s (not timed)")


def measure_point(evaluator, model, cfg, settings: SamplerBenchSettings, *, sampler: str, steps: int, seed: int,
                  batch_size: int, device, precision, guidance) -> dict:
    """One point of the table: sample, score, time. A failure is recorded in the row, and the others still run."""
    from fastddpm.diffusion import network_calls, schedule_from_config

    row = {"sampler": sampler, "steps": steps, "seed": seed,
           "nfe": network_calls(sampler, steps, cfg.diffusion.num_timesteps,
                                schedule=schedule_from_config(cfg.diffusion), spacing=settings.spacing)}
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            metrics, _ = evaluator.evaluate(model, cfg, num_samples=settings.num_samples, sampler=sampler, steps=steps,
                                            seed=seed, batch_size=batch_size, device=device,
                                            autocast_dtype=precision.autocast_dtype, guidance=guidance,
                                            spacing=settings.spacing)
    except Exception as e:
        row.update(status="failed", error=f"{type(e).__name__}: {e}")
    else:
        s = metrics["sampling"]
        row.update(status="ok", fid=metrics["fid"], precision=metrics["precision"], recall=metrics["recall"],
                   class_accuracy=metrics.get("class_accuracy"), sampling_s=s["wall_s"],
                   samples_per_s=s["samples_per_s"], steady_samples_per_s=s.get("steady_samples_per_s"),
                   score_s=metrics["score_s"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def describe(row: dict) -> str:
    """A measured point, for the log."""
    if row["status"] != "ok":
        return f"failed: {row['error']}"
    accuracy = row.get("class_accuracy")
    return (f"FID {row['fid']:.3f}, precision {row['precision']:.3f}, recall {row['recall']:.3f}"
            + (f", class accuracy {accuracy:.1%}" if accuracy is not None else "")
            + f", {row['samples_per_s']:.1f} samples/s")


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (sampler, steps): FID over the seeds drawn (mean, min, max), NFE, samples/s."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok":
            groups.setdefault((r["sampler"], r["steps"]), []).append(r)
    out = []
    for (sampler, steps), rs in groups.items():
        fids = [r["fid"] for r in rs]
        acc = [r["class_accuracy"] for r in rs if r.get("class_accuracy") is not None]
        out.append({"sampler": sampler, "steps": steps, "nfe": rs[0]["nfe"], "seeds": len(rs),
                    "fid": statistics.fmean(fids), "fid_min": min(fids), "fid_max": max(fids),
                    "fid_std": statistics.stdev(fids) if len(fids) > 1 else None,
                    "precision": statistics.fmean(r["precision"] for r in rs),
                    "recall": statistics.fmean(r["recall"] for r in rs),
                    "class_accuracy": statistics.fmean(acc) if acc else None,
                    "samples_per_s": statistics.median(r["samples_per_s"] for r in rs)})
    return sorted(out, key=lambda e: (e["sampler"] != "ddpm", e["sampler"], e["steps"]))


def report_markdown(result: dict) -> str:
    summary = result.get("summary") or summarize(result["rows"])
    env, ck, st = result["environment"], result["checkpoint"], result["settings"]
    cond = result["conditional"]
    own_spacing = ("karras spacing (EDM's noise levels)" if result.get("objective") == "edm"  # not in older files
                   else "karras spacing for heun, trailing for the others")
    lines = [f"# bench samplers: {ck['file']} (step {ck['step']})", "",
             f"{st['num_samples']:,} samples per point, "
             f"{st['spacing'] + ' spacing' if st['spacing'] else own_spacing}, "
             f"features "
             f"{result['features']['label']}, device {env['device_name']}, torch {env['torch']}, commit "
             f"{env['git_commit']}, {env['date_utc']}", "",
             "| sampler | steps | NFE | FID | seeds (min-max) | precision | recall |"
             + (" class accuracy |" if cond else "") + " samples/s |",
             "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if cond else "") + " --- |"]
    for e in summary:
        spread = f"{e['seeds']} ({e['fid_min']:.2f}-{e['fid_max']:.2f})" if e["seeds"] > 1 else "1"
        lines.append(f"| {e['sampler']} | {e['steps']} | {e['nfe']} | {e['fid']:.2f} | {spread} | "
                     f"{e['precision']:.3f} | {e['recall']:.3f} |"
                     + (f" {store.fmt(e['class_accuracy'], '.1%')} |" if cond else "")
                     + f" {e['samples_per_s']:.1f} |")
    w = result.get("guidance")
    if w not in (None, 0.0, 1.0):
        # guided() runs the class and the null class in one call on a doubled batch
        lines += ["", f"Guidance W = {w:g}: each network call evaluates the U-Net on the class and on the null class "
                      "together (a batch twice the size), about twice the compute of an unguided call; NFE counts "
                      "calls, so compare it only between tables at the same guidance."]
    failed = [r for r in result["rows"] if r.get("status") == "failed"]
    for r in failed:
        lines.append(f"\nfailed: {r['sampler']}-{r['steps']} seed {r['seed']}: {r['error']}")
    lines += ["", "Measured by: " + "; ".join(f"{run['date_utc']} `{run['command_line']}` ({run['git_commit']})"
                                              for run in store.distinct_runs(result["rows"]))]
    return "\n".join(lines)


def write_reports(result: dict, out_dir: Path) -> None:
    store.write_json(out_dir / "samplers.json", result)
    buf = io.StringIO()
    fields = ["sampler", "steps", "nfe", "seed", "status", "fid", "precision", "recall", "class_accuracy",
              "samples_per_s", "steady_samples_per_s", "sampling_s", "error"]
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in result["rows"]:
        w.writerow(store.json_safe(r))
    store.atomic_write_text(out_dir / "samplers.csv", buf.getvalue())
    store.atomic_write_text(out_dir / "samplers.md", report_markdown(result) + "\n")


def write_plot(result: dict, path: Path, log: Callable[[str], None] = print) -> Path | None:
    """OUT/samplers.png: samplers_figure's chart."""
    from fastddpm import charts

    return charts.save(samplers_figure(result), path, dpi=120)


def samplers_figure(result: dict):
    """FID against network calls per image, one line per sampler (log x), DDPM as a marked point, a seed spread as a
    vertical min-max bar. The feature space goes in the title: as the y label it is longer than the axis."""
    from fastddpm import charts

    summary = result.get("summary") or summarize(result["rows"])
    fig = charts.figure(7, 4.5)
    ax = fig.subplots()
    for sampler in dict.fromkeys(e["sampler"] for e in summary):
        es = [e for e in summary if e["sampler"] == sampler]
        nfe = [e["nfe"] for e in es]
        fid = [e["fid"] for e in es]
        if sampler == "ddpm":
            ax.scatter(nfe, fid, marker="*", s=120, color="black", label=f"ddpm ({nfe[0]} steps)", zorder=3)
            continue
        line = ax.plot(nfe, fid, marker="o", label=sampler)[0]
        for e in es:
            if e["seeds"] > 1:
                ax.vlines(e["nfe"], e["fid_min"], e["fid_max"], color=line.get_color(), alpha=0.6)
    charts.log_x(ax, ticks=[e["nfe"] for e in summary])
    ax.set_xlabel("network calls per image (NFE)")
    ax.set_ylabel("FID")
    ck = result["checkpoint"]
    ax.set_title(f"samplers: {Path(ck['file']).name}, {result['settings']['num_samples']:,} samples\n"
                 f"FID in {result['features']['label']}", fontsize=10)
    fid_axis(ax, [v for e in summary for v in (e["fid"], e["fid_min"], e["fid_max"])])
    ax.grid(True, which="both", alpha=0.3)
    if summary:
        ax.legend()
    fig.tight_layout()
    return fig


def fid_axis(ax, values: list[float]) -> None:
    """The y axis over FIDs `values`, labelled in plain numbers over their whole range: linear under 10x (FID
    85-147 has one decade's tick inside it, 100, so a log axis labels at most 90 and 100), else log with a label
    at 1, 2 and 5 of every decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    values = [v for v in values if math.isfinite(v)]
    if not values or min(values) <= 0 or max(values) < 10 * min(values):
        return
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    ax.yaxis.set_minor_formatter(NullFormatter())
