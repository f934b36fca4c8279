"""`fastddpm bench throughput`'s results as text: the progress line of each variant, the markdown table and
report, and the files (throughput.json and throughput.md, rewritten after every variant)."""

from __future__ import annotations

from pathlib import Path

from fastddpm.bench import store
from fastddpm.measure import share_warning

TABLE_HEADER = ("| preset | batch | images/s | x first | step ms median [min-max] | compile s | MFU % (peak dtype) | "
                "% of roofline (binds) | peak mem GiB | recompiles | graph breaks | input wait % | status |")


def _short_error(row: dict, limit: int = 100) -> str:
    return store.table_cell(row["error"], limit)


def progress_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"FAILED ({_short_error(row, 200)})"
    s = row["step_ms"]
    mem = "" if row["peak_memory_gib"] is None else f", peak {row['peak_memory_gib']:.2f} GiB"
    rec = "" if row["recompiles_after_warmup"] is None else \
        f", recompiles {row['recompiles_after_warmup']}, graph breaks {row['graph_breaks']}"
    graphs = f", CUDA graphs failed: {row['cuda_graphs_failed']}" if row["cuda_graphs_failed"] and \
        row["fast_path"].get("cuda_graphs", "").startswith("capture") else ""
    warning = _share_warning(row)
    return (f"{row['images_per_s']:,.0f} img/s, step {s['median']:.2f} ms [{s['min']:.2f}-{s['max']:.2f}], "
            f"{_warmup_text(row)}, MFU {row['mfu_pct']:.2f}% of the {row['mfu_dtype']} peak, "
            f"{_roofline(row)} of the roofline{mem}{rec}, "
            f"input wait {row['input_wait_pct']:.1f}%{graphs}" + (f"\n  WARNING: {warning}" if warning else ""))


def _compiled(row: dict) -> bool:
    """Whether the warm-up compiled or captured anything: only then is its time a compile time."""
    fast = row.get("fast_path") or {}
    return fast.get("compile", "on").startswith("on") or fast.get("cuda_graphs", "").startswith("capture")


def _compile_cell(row: dict) -> str:
    return f"{row['compile_s']:.2f}" if _compiled(row) else "-"


def _warmup_text(row: dict) -> str:
    if _compiled(row):
        return f"compile {row['compile_s']:.1f} s"
    return f"warm-up {row['compile_s']:.1f} s (nothing compiled)"


def _share_warning(row: dict) -> str | None:
    return share_warning(row.get("mfu_pct"), row.get("roofline_pct"), row.get("roofline_binds"))


def _roofline(row: dict) -> str:
    """`12.3% (memory)`: images/s as a share of what the roofline allows, and the side that binds."""
    if row.get("roofline_pct") is None:
        return "n/a"
    return f"{row['roofline_pct']:.1f}% ({row['roofline_binds']})"


def _name(row: dict) -> str:
    return f"{row['preset']} batch {row['batch_size']}" + (f" {row['choice']}" if row.get("choice") else "")


def table_markdown(rows: list[dict]) -> str:
    """The table; comparing choices, a `choice` column after the batch and `x first` within each preset and batch."""
    choices = any(r.get("choice") for r in rows)
    header = TABLE_HEADER.replace("| batch |", "| batch | choice |") if choices else TABLE_HEADER
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in rows:
        key = f"| {r['preset']} | {r['batch_size']} |" + (f" {r.get('choice') or '-'} |" if choices else "")
        if r["status"] != "ok":
            lines.append(f"{key} failed |" + " - |" * 9 + f" failed: {_short_error(r)} |")
            continue
        s = r["step_ms"]
        lines.append(
            f"{key} {r['images_per_s']:,.0f} | {store.fmt(r['ratio_to_first'], '.2f')} | "
            f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] | {_compile_cell(r)} | {r['mfu_pct']:.2f} "
            f"({r['mfu_dtype']}) | {_roofline(r)} | "
            f"{store.fmt(r['peak_memory_gib'], '.2f')} | {store.fmt(r['recompiles_after_warmup'], 'd')} | "
            f"{store.fmt(r['graph_breaks'], 'd')} | {r['input_wait_pct']:.1f} | ok |"
        )
    return "\n".join(lines)


def report_markdown(result: dict) -> str:
    env, s, rows = result["environment"], result["settings"], result["results"]
    commit = str(env["git_commit"])[:12] + (" (uncommitted changes)" if env.get("git_dirty") else "")
    cuda = "" if env.get("cuda_runtime") is None else f", CUDA runtime {env['cuda_runtime']}"
    driver = "" if env.get("cuda_driver") is None else f", driver {env['cuda_driver']}"
    # Each row's MFU divides by the peak its own run measured: rows reused from an earlier run into this folder
    # used that run's peak (and bandwidth), so every distinct one is listed, with its rows when a dtype has several.
    peaks: dict[tuple, list[str]] = {}
    bandwidths: dict[tuple, list[str]] = {}
    for r in rows:
        if r["status"] == "ok":
            peaks.setdefault((r["mfu_dtype"], r["mfu_peak_tflops"], r["mfu_peak_label"]), []).append(_name(r))
            if r.get("bandwidth_gbps"):
                bandwidths.setdefault((r["bandwidth_gbps"], r["bandwidth_label"]), []).append(_name(r))
    several = {dtype for dtype, *_ in peaks if sum(d == dtype for d, *_ in peaks) > 1}
    lines = ["# fastddpm bench throughput", ""]
    if not result.get("complete", True):
        lines += [f"**Incomplete**: {len(rows)} of {result['planned_variants']} variants measured so far (the run "
                  "was stopped, or is still running); the same command into this folder measures the rest.", ""]
    lines += [
        f"- date (UTC): {env['date_utc']}",
        f"- device: {env['device_name']} ({env['device']}){driver}{cuda}; {env['torch_threads']} torch threads",
        f"- software: torch {env['torch']}, python {env['python']}, fastddpm {env['fastddpm']}, commit {commit}",
        f"- command: `{env['command_line']}`",
    ]
    runs = result.get("runs") or []
    if len(runs) > 1 or (runs and runs[0]["date_utc"] != env["date_utc"]):
        lines += ["- rows measured by: " + "; ".join(
            f"{run['date_utc']} `{run['command_line']}` (commit {str(run['git_commit'])[:12]}"
            + (", uncommitted changes" if run.get("git_dirty") else "") + ")" for run in runs)]
    lines += [
        f"- settings: precision {s['precision_resolved']} ({s['precision_reason']}); compile {s['compile']}, "
        f"cuda graphs {s['cuda_graphs']}, data placement {s['data_placement']}; warm-up {s['warmup_steps']} steps, "
        f"then {s['repeats']} x {s['steps']} timed steps",
    ] + [f"- peak for MFU ({dtype}): {tflops:,.3f} TFLOP/s ({label})"
         + (f", for {', '.join(names)}" if dtype in several else "")
         for (dtype, tflops, label), names in peaks.items()]
    for (gbps, label), names in bandwidths.items():
        lines += [f"- memory bandwidth for the roofline: {gbps:,.1f} GB/s ({label})"
                  + (f", for {', '.join(names)}" if len(bandwidths) > 1 else "")]
    if bandwidths:
        lines += ["- the roofline is max(FLOPs / peak, bytes / bandwidth) an image, the bytes being the activations "
                  "autograd saves (written and read) and the update's passes over the parameters "
                  "(fastddpm.measure.roofline)"]
    lines += ["", table_markdown(rows), ""]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["## Failed variants", ""]
        lines += [f"- {_name(r)} ({r['error_type']}): {r['error']}" for r in failed]
        lines.append("")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        lines += ["## Per variant", ""]
        for r in ok:
            fp = r["fast_path"]
            lines.append(f"- {_name(r)}: {r['parameters']:,} parameters, precision {r['precision']}, "
                         f"{r['gflops_per_image']:.3f} GFLOP per training image, {r['achieved_tflops']:.3f} TFLOP/s; "
                         + (f"{r['mb_per_image']:.2f} MB moved per image at least (activations "
                            f"{r['activation_bytes_per_image'] / 1e6:.2f} MB, saved once and read once), a bound of "
                            f"{r['bound_us_per_image']:,.1f} us per image ({r['roofline_binds']}); "
                            if r.get("mb_per_image") is not None else "") +
                         f"compile {fp['compile']}; cuda graphs {fp['cuda_graphs']}"
                         # rows written before the two keys existed lack them
                         + "".join(f"; {label} {fp[k]}" for k, label in (("inductor_layout", "inductor layout"),
                                                                        ("attention_head_pad", "head pad"))
                                   if k in fp)
                         + (f" (capture failed: {r['cuda_graphs_failed']})" if r["cuda_graphs_failed"]
                            and fp["cuda_graphs"].startswith("capture") else "")
                         + f"; input {r['input_ms_per_step']:.3f} ms/step; "
                           f"final loss {store.fmt(r['final_loss'], '.4f')}"
                         + (f". **Warning**: {_share_warning(r)}" if _share_warning(r) else ""))
        lines.append("")
    lines += ["## How to read it", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


def write_results(result: dict, out_dir: Path) -> None:
    store.write_json(out_dir / "throughput.json", result)
    store.atomic_write_text(out_dir / "throughput.md", report_markdown(result))
