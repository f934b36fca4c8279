"""`fastddpm bench ladder`'s results as text and files: each rung's progress line, the DDPM and MLP tables,
ladder.json / ladder.csv / mlp.csv / ladder.md (rewritten after every rung) and the chart."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Callable

from fastddpm.bench import ladder_rungs, store



def progress_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status'].upper()} ({r['reason']})"
    s = r["step_ms"]
    return (f"{r['images_per_s']:,.0f} img/s (batch {r['batch_size']}, {r['precision']}), step {s['median']:.2f} ms "
            f"[{s['min']:.2f}-{s['max']:.2f}], warm-up {r['warmup_s']:.1f} s, GPU busy "
            + ("n/a" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.0f}%") + f", MFU {_mfu(r)}, "
            f"{_roofline(r)} of the roofline")


def _mfu(r: dict) -> str:
    return "n/a" if r.get("mfu_pct") is None else f"{r['mfu_pct']:.1f}% ({r['mfu_dtype']})"


def _roofline(r: dict) -> str:
    return "n/a" if r.get("roofline_pct") is None else f"{r['roofline_pct']:.1f}% ({r['roofline_binds']})"


def _cell(text: str | None) -> str:
    return store.table_cell(text, 140, cut_mark="")


DDPM_HEADER = ("| rung | change | batch | prec | images/s [min-max] | epoch s | x baseline | x previous | "
               "warm-up s | GPU busy % | MFU % (dtype) | % of roofline (binds) | peak mem GiB | recompiles | status |")


def table_markdown(rows: list[dict]) -> str:
    lines = [DDPM_HEADER, "|" + "---|" * (DDPM_HEADER.count("|") - 1)]
    for r in rows:
        if r["status"] != "ok":
            reason = _cell(r["reason"])
            status = reason if reason.startswith(r["status"]) else f"{r['status']}: {reason}"
            lines.append(f"| {r['rung']} | {r['title']} |" + " - |" * 12 + f" {status} |")
            continue
        lo, hi = r["images_per_s_range"]
        lines.append(
            f"| {r['rung']} | {r['title']} | {r['batch_size']} | {r['precision']} | {r['images_per_s']:,.0f} "
            f"[{lo:,.0f}-{hi:,.0f}] | {r['epoch_s']:.1f} | {store.fmt(r['speedup_vs_baseline'], '.2f')} | "
            f"{store.fmt(r['speedup_vs_previous'], '.2f')} | {r['warmup_s']:.2f} | "
            f"{store.fmt(None if r['gpu_busy'] is None else 100 * r['gpu_busy'], '.0f')} | {_mfu(r)} | "
            f"{_roofline(r)} | "
            f"{store.fmt(r['peak_memory_gib'], '.2f')} | {store.fmt(r['recompiles_after_warmup'], 'd', '-')} | ok |")
    return "\n".join(lines)


def mlp_table_markdown(rows: list[dict]) -> str:
    lines = ["| Method | Total Time (s) | Speedup | Test accuracy | status |", "|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | - | - | - | failed: {_cell(r['error'])} |")
            continue
        speed = "baseline" if r["rung"] == "0" else store.fmt(r["speedup"], ".2f") + "x"
        lines.append(f"| {r['name']} | {r['total_s']:.2f} | {speed} | {r['accuracy']:.4f} | ok |")
    return "\n".join(lines)


CSV_FIELDS = ["rung", "title", "status", "batch_size", "precision", "images_per_s", "images_per_s_min",
              "images_per_s_max", "step_ms_median", "epoch_s", "speedup_vs_baseline", "speedup_vs_previous",
              "warmup_s", "setup_s", "gpu_busy", "mfu_pct", "roofline_pct", "roofline_binds", "peak_memory_gib",
              "recompiles_after_warmup", "reason"]


def _csv_text(fields: list[str], rows: list[dict]) -> str:
    f = io.StringIO()
    w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    return f.getvalue()


def write_results(result: dict, out_dir: Path, log: Callable[[str], None] = print, *,
                  chart: bool = False) -> str | None:
    """ladder.json, ladder.csv, mlp.csv and ladder.md, each replaced atomically; ladder.png too when `chart`
    (once, at the end: matplotlib costs a second or two). Returns the chart's path, or None."""
    store.write_json(out_dir / "ladder.json", result)
    csv_rows = []
    for r in result["rungs"]:
        rng = r["images_per_s_range"] or [None, None]
        csv_rows.append({**{k: r.get(k) for k in CSV_FIELDS}, "images_per_s_min": rng[0], "images_per_s_max": rng[1],
                         "step_ms_median": r["step_ms"]["median"] if r["step_ms"] else None})
    store.atomic_write_text(out_dir / "ladder.csv", _csv_text(CSV_FIELDS, csv_rows))
    mlp_rows = result["mlp"]["rows"]
    if mlp_rows:
        fields = ["rung", "name", "status", "total_s", "epoch_s", "speedup", "accuracy", "final_loss", "error"]
        store.atomic_write_text(out_dir / "mlp.csv", _csv_text(fields, [{k: r.get(k) for k in fields}
                                                                        for r in mlp_rows]))
    settings = result.get("settings") or {}
    quick = (f" (--quick: every batch / {settings.get('batch_divisor', 1)}, a pipeline check)"
             if settings.get("quick") else "")
    chart_path = write_chart(result["rungs"], out_dir / "ladder.png", result["environment"]["device_name"] + quick,
                             log) if chart else None
    env = result["environment"]
    md = ["# fastddpm bench ladder", ""]
    if not result.get("complete", True):
        # what this command still owes: its planned rungs not yet run (a rung skipped on this device is done)
        planned = result["settings"].get("rungs") or [r.key for r in ladder_rungs.DDPM_RUNGS]
        finished = {r["rung"] for r in result["rungs"] if r["status"] in ("ok", "failed", "skipped")}
        pending = [k for k in planned if k not in finished]
        done = {s: sum(r["status"] == s for r in result["rungs"]) for s in ("ok", "failed", "skipped")}
        md += [f"**Incomplete**: the run was stopped (or is still running) before rung(s) "
               f"{', '.join(pending) or 'the MLP ladder'}; so far {done['ok']} measured, {done['failed']} failed, "
               f"{done['skipped']} skipped on this device. The same command into this folder measures the rest.", ""]
    md += [f"- command: `{env['command_line']}`",
          f"- device: {env['device_name']} ({env['device']}), driver {env.get('cuda_driver') or 'n/a'}, CUDA runtime "
          f"{env.get('cuda_runtime') or 'n/a'}",
          f"- torch {env['torch']}, python {env['python']}, fastddpm {env['fastddpm']}, commit {env['git_commit']}"
          + (" (uncommitted changes)" if env.get("git_dirty") else ""),
          f"- date (UTC): {env['date_utc']}",
          f"- data: {result['data']['num_images']:,} images of {result['data']['source']} (fingerprint "
          f"{result['data']['fingerprint']}); preset {result['settings']['preset']}"]
    runs = result.get("runs") or []
    if len(runs) > 1 or (runs and runs[0]["date_utc"] != env["date_utc"]):
        md += ["- rows measured by: " + "; ".join(
            f"{run['date_utc']} `{run['command_line']}` (commit {str(run['git_commit'])[:12]}"
            + (", uncommitted changes" if run.get("git_dirty") else "") + ")" for run in runs)]
    md += ["", "## DDPM ladder (seed 000)", "", table_markdown(result["rungs"]), ""]
    for r in result["rungs"]:
        extra = "; ".join(r["notes"] + ([f"CUDA graphs failed: {r['cuda_graphs_failed']}"]
                                        if r.get("cuda_graphs_failed") else []))
        md.append(f"- rung {r['rung']} ({r['title']}): {r['change']}" + (f". {extra}" if extra else ""))
    if mlp_rows:
        info = result["mlp"]["info"]
        md += ["", "## MLP ladder (seed 002)", "",
               f"784-128-64-10, batch 64, Adam 1e-3, {info['epochs']} epoch(s) on {info['train_images']:,} "
               f"{info['source']} images; accuracy on {info['test_images']:,} test images.", "",
               mlp_table_markdown(mlp_rows), ""]
        for r in mlp_rows:
            if r["notes"]:
                md.append(f"- {r['name']}: {'; '.join(r['notes'])}")
    md += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    if chart_path:
        md += ["", "![images/s per rung](ladder.png)"]
    store.atomic_write_text(out_dir / "ladder.md", "\n".join(md) + "\n")
    return chart_path


def rung_label(r: dict) -> str:
    """A rung's bar label: its number and title, the title's batch the one it ran (rung 4 is "batch 192", the
    seed's; --quick runs it at 48)."""
    title = re.sub(r"batch \d+", f"batch {r['batch_size']}", r["title"]) if r.get("batch_size") else r["title"]
    return f"{r['rung']}\n{title}"


def write_chart(rows: list[dict], path: Path, device_name: str, log) -> str | None:
    from fastddpm import charts

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    labels = [rung_label(r) for r in rows]
    values = [r["images_per_s"] if r["status"] == "ok" else 0 for r in rows]
    fig = charts.figure(max(8, 1.1 * len(rows)), 5)
    ax = fig.subplots()
    bars = ax.bar(range(len(rows)), values, color=["tab:blue" if r["status"] == "ok" else "lightgrey" for r in rows])
    positive = [v for v in values if v > 0]
    if max(positive) / min(positive) > 20:
        charts.log_y(ax)
    for bar, r in zip(bars, rows):
        text = f"{r['speedup_vs_baseline']:.2f}x" if r["status"] == "ok" and r["speedup_vs_baseline"] else r["status"]
        y = bar.get_height() if r["status"] == "ok" else min(positive)
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("images/s (steady state)")
    ax.set_title(f"fastddpm bench ladder on {device_name}: images/s, speedup over the baseline")
    fig.tight_layout()
    return str(charts.save(fig, path, dpi=120))
