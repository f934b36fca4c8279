"""The folder a GPU session fills (benchmarks/gpu_session.sh) -> the tables for benchmarks/RESULTS.md.

    PYTHONPATH=src python benchmarks/summarize_gpu.py benchmarks/gpu/<date> [--out FILE]

Reads what each part writes: throughput-*/throughput.json, ladder/ladder.json, doctor/planted.txt and
doctor/overhead.json, doctor-try/report.json, doctor-fast*/*/report.json, attention/*.json, ddp/ddp_overhead.json,
quality-*/quality.json, eval/eval_*.json, samplers/samplers.json, tests/junit.xml, and the call records
(calls/<time>.json: device, driver, torch, commit given; calls/parts.jsonl: which call ran which part). Every
table is headed by the device, date, torch version, commit and command that produced it. A part with no results yet is listed as not measured. Writes FOLDER/SUMMARY.md
(or --out) and prints it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


# ----------------------------------------------------------------------------------------------------------------
# Where each number came from


class Calls:
    """The session's call records: the commit each call was given (the device's tree has no .git, so a result's
    own git_commit reads "unknown" there), and which call ran each part."""

    def __init__(self, folder: Path):
        self.envs = {}
        for path in sorted((folder / "calls").glob("*.json")):
            try:
                self.envs[path.stem] = json.loads(path.read_text())
            except ValueError:
                continue
        self.parts = []
        lines = folder / "calls" / "parts.jsonl"
        if lines.is_file():
            self.parts = [json.loads(line) for line in lines.read_text().splitlines() if line.strip()]

    def env_before(self, date_utc: str | None) -> dict:
        """The call record of the call running at `date_utc` (the last one that started before it)."""
        stamps = sorted(self.envs, key=lambda k: self.envs[k].get("date_utc", ""))
        chosen = {}
        for k in stamps:
            if date_utc is None or self.envs[k].get("date_utc", "") <= date_utc:
                chosen = self.envs[k]
        return chosen or (self.envs[stamps[0]] if stamps else {})

    def env_of_part(self, part: str) -> dict:
        """The call record of the last call that ran `part`."""
        stamp = next((p["call"] for p in reversed(self.parts) if p["part"] == part), None)
        return self.envs.get(stamp, {}) if stamp else {}

    def commit(self, commit: str | None, date_utc: str | None) -> str:
        if commit and commit != "unknown":
            return commit
        return self.env_before(date_utc).get("commit_given") or "unknown"


def _short(commit: str | None) -> str:
    return str(commit or "unknown")[:12]


def provenance(env: dict, runs: list[dict], calls: Calls) -> list[str]:
    """Lines naming the device, torch, and for each run its date, commit and command."""
    device = env.get("device_name", "?")
    extras = [f"driver {env['cuda_driver']}" if env.get("cuda_driver") else None,
              f"CUDA {env['cuda_runtime']}" if env.get("cuda_runtime") else None,
              f"{env['device_memory_gib']} GiB" if env.get("device_memory_gib") else None]
    extras = ", ".join(e for e in extras if e)
    lines = [f"Device: {device}{f' ({extras})' if extras else ''}; torch {env.get('torch', '?')}."]
    for run in runs or [{"date_utc": env.get("date_utc"), "command_line": env.get("command_line"),
                         "git_commit": env.get("git_commit"), "git_dirty": env.get("git_dirty")}]:
        commit = calls.commit(run.get("git_commit"), run.get("date_utc"))
        dirty = " (uncommitted changes)" if run.get("git_dirty") else ""
        lines.append(f"Measured {run.get('date_utc', '?')}, commit {_short(commit)}{dirty}: "
                     f"`{run.get('command_line')}`.")
    return lines


def _f(v, spec: str, missing: str = "n/a") -> str:
    return missing if v is None else format(v, spec)


# ----------------------------------------------------------------------------------------------------------------
# One section per part


def section_tests(folder: Path, calls: Calls) -> list[str]:
    path = folder / "tests" / "junit.xml"
    if not path.is_file():
        return ["### GPU tests (`pytest -m cuda`)", "", "Not run yet (part `tests`).", ""]
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    env = calls.env_of_part("tests")
    lines = ["### GPU tests (`pytest -m cuda`)", ""]
    lines += provenance(env, [], calls) if env else []
    lines += ["", f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped "
              f"({float(suite.get('time', 0)):.0f} s).", ""]
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            first = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            lines.append(f"- FAILED {case.get('classname')}::{case.get('name')}: {first}")
    return lines + [""]


def section_throughput(folder: Path, calls: Calls) -> list[str]:
    from fastddpm.bench.throughput import table_markdown

    paths = sorted(folder.glob("throughput*/throughput.json"))
    if not paths:
        return ["### Throughput (`fastddpm bench throughput`, issue #3)", "",
                "Not measured yet (parts `throughput`, `throughput-2layer`).", ""]
    lines = []
    for path in paths:
        r = json.loads(path.read_text())
        presets = ", ".join(r["settings"]["presets"])
        s = r["settings"]
        lines += [f"### Throughput: {presets} (`fastddpm bench throughput`, issue #3)", ""]
        lines += provenance(r["environment"], r.get("runs") or [], calls)
        clock = "CUDA events" if str(r["environment"]["device"]).startswith("cuda") else "perf_counter: a CPU"
        lines += [f"Precision {s['precision_resolved']}, compile {s['compile']}, CUDA graphs {s['cuda_graphs']}, "
                  f"data {s['data_placement']}; warm-up {s['warmup_steps']} steps, then {s['repeats']} x {s['steps']} "
                  f"timed steps ({clock})."]
        peaks = {}
        for row in r["results"]:
            if row["status"] == "ok":
                peaks.setdefault(row["mfu_dtype"], (row["mfu_peak_tflops"], row["mfu_peak_label"]))
        lines += [f"MFU peak ({d}): {t:,.1f} TFLOP/s ({label})." if t >= 10 else f"MFU peak ({d}): {t:.3f} TFLOP/s "
                  f"({label})." for d, (t, label) in peaks.items()]
        if not r.get("complete", True):
            lines.append(f"**Incomplete**: {len(r['results'])} of {r['planned_variants']} variants measured.")
        lines += ["", table_markdown(r["results"]), ""]
    return lines


def section_ladder(folder: Path, calls: Calls) -> list[str]:
    from fastddpm.bench.ladder_report import mlp_table_markdown, table_markdown

    path = folder / "ladder" / "ladder.json"
    title = "### The optimisation ladder (`fastddpm bench ladder`, issue #4)"
    if not path.is_file():
        return [title, "", "Not measured yet (parts `ladder`, `ladder-fast`).", ""]
    r = json.loads(path.read_text())
    lines = [title, ""] + provenance(r["environment"], r.get("runs") or [], calls)
    d = r["data"]
    lines.append(f"Data: {d['num_images']:,} images of {Path(str(d['source'])).name} (fingerprint {d['fingerprint']}); "
                 f"preset {r['settings']['preset']}; {r['settings']['workers_resolved']} DataLoader workers.")
    pending = [row["rung"] for row in r["rungs"] if row["status"] == "not run"]
    if pending or not r.get("complete", True):
        lines.append(f"**Incomplete**: rungs not measured yet: {', '.join(pending) or 'the run was cut short'}.")
    ok = [row for row in r["rungs"] if row["status"] == "ok"]
    if ok and ok[0]["rung"] == "0":
        top = max(ok, key=lambda row: row["images_per_s"])
        apart = (top.get("run") or {}).get("date_utc") != (ok[0].get("run") or {}).get("date_utc")
        lines.append(f"Top rung: {top['rung']} ({top['title']}) at {top['speedup_vs_baseline']:.1f}x rung 0 "
                     "(target on an H100: >= 15x)" + (
                         f"; the two were measured in different calls ({ok[0]['run']['date_utc']} and "
                         f"{top['run']['date_utc']}): the ratio spans the two calls, not one run"
                         if apart and top.get("run") and ok[0].get("run") else "") + ".")
    lines += ["", table_markdown(r["rungs"]), ""]
    if r["mlp"]["rows"]:
        lines += ["MLP ladder (seed 002):", "", mlp_table_markdown(r["mlp"]["rows"]), ""]
    return lines


def section_doctor_try(folder: Path, calls: Calls) -> list[str]:
    """`doctor run --try 3` on the seed-style script: each top fix's predicted and measured gain."""
    title = "### The doctor's fixes tried on a GPU (`doctor run --try`, issue #31)"
    report = folder / "doctor-try" / "report.json"
    if not report.is_file():
        return [title, "", "Not measured yet (part `doctor-try`).", ""]
    r = json.loads(report.read_text())
    env = calls.env_of_part("doctor-try")
    lines = [title, ""] + (provenance(env, [], calls) if env else [])
    lines += ["", f"Verdict: {r['verdict']['id']}.", "",
              "| fix | finding | predicted | measured (median) | spread | rounds | what it changed |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for t in r.get("trials") or []:
        pred = f"{t['predicted']:.2f}x" if t.get("predicted") else "n/a"
        meas = f"{t['measured']:.2f}x" if t.get("measured") else f"not measured ({t.get('failed') or 'nothing changed'})"
        spread = f"{t['spread'][0]:.2f}-{t['spread'][1]:.2f}x" if t.get("spread") else ""
        lines.append(f"| {t['fix']} | {t.get('finding') or ''} | {pred} | {meas} | {spread} | {t['rounds']} | "
                     f"{'; '.join(t.get('applied') or [])} |")
    if not r.get("trials"):
        lines.append("| (no fix tried: see logs/doctor-try.log) | | | | | | |")
    return lines + [""]


def section_doctor_fast(folder: Path, calls: Calls) -> list[str]:
    """`doctor train` on the fast path, one report a model: verdict, MFU, the roofline and the top kernels."""
    title = "### The fast path profiled by its own doctor (`doctor train`, issue #32)"
    # doctor-fast's rows, then doctor-fast-cl's (channels_last), each part's call named: they may differ
    reports = sorted(folder.glob("doctor-fast*/*/report.json"), key=lambda p: (p.parent.parent.name, p))
    if not reports:
        return [title, "", "Not measured yet (part `doctor-fast`).", ""]
    lines = [title, ""]
    for part in dict.fromkeys(p.parent.parent.name for p in reports):
        env = calls.env_of_part(part)
        lines += ([f"`{part}`:"] + provenance(env, [], calls)) if env else []
    lines += ["", "| run | verdict | step ms | MFU | % of roofline (binds) | compute / memory ms | top kernels |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for path in reports:
        r = json.loads(path.read_text())
        m = r["measurements"]
        ss, mf, roof = m.get("step_stats") or {}, m.get("mfu") or {}, m.get("roofline") or {}
        step = ss.get("gpu_median_ms") or ss.get("median_ms")
        top = "; ".join(f"{o['name']} {100 * o['share']:.0f}% ({o['category']})"
                        for o in ((m.get("trace") or {}).get("top_ops") or [])[:3])
        name = path.parent.name + (" (channels_last)" if path.parent.parent.name.endswith("-cl") else "")
        cells = [name, r["verdict"]["id"], f"{step:.3f}" if step else "n/a",
                 f"{100 * mf['mfu']:.1f}% ({mf['peak_dtype']})" if mf else "n/a",
                 f"{100 * roof['share']:.0f}% ({roof['binds']})" if roof else
                 f"n/a ({m.get('roofline_unavailable')})",
                 f"{roof['compute_ms']:.3f} / {roof['memory_ms']:.3f}" if roof else "", top or "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def section_attention(folder: Path, calls: Calls) -> list[str]:
    """benchmarks/sdpa_shapes.py: each attention shape's forward + backward time, by backend and padding."""
    title = "### Attention at the presets' shapes (`benchmarks/sdpa_shapes.py`, issue #32)"
    paths = sorted(folder.glob("attention/*.json"))
    if not paths:
        return [title, "", "Not measured yet (part `attention`).", ""]
    lines = [title, ""]
    for path in paths:
        r = json.loads(path.read_text())
        lines += provenance(r["environment"], [], calls)
        lines += [f"{r['dtype']}, batch {r['batch_size']}; median ms of {r['repeats']} repeats x {r['steps']} "
                  "forward + backward calls, the variants alternating; `error`: the backend cannot run the shape.",
                  ""]
        for preset, rows in r["shapes"].items():
            names = list(dict.fromkeys(n for row in rows for n in row["variants"]))
            lines += [f"{preset}:", "", "| heads x tokens x head dim (calls) | " + " | ".join(names) +
                      " | best (vs default) |", "| --- |" + " --- |" * (len(names) + 1)]
            for row in rows:
                v = row["variants"]
                cells = [("error" if "error" in v[n] else f"{v[n]['summary']['median']:.3f}") if n in v else ""
                         for n in names]
                best = f"{row['best']} ({row['best_vs_default']:.2f}x)" if row.get("best_vs_default") else "n/a"
                lines.append(f"| {row['heads']} x {row['tokens']} x {row['head_dim']} ({row['calls']}) | "
                             + " | ".join(cells) + f" | {best} |")
            lines.append("")
    return lines


PLANTED_LINE = re.compile(r"^(?P<case>\S+)\s+expected (?P<expected>\S+)\s+got (?P<got>\S+)\s+cost\s+(?P<cost>[\d.]+)%"
                          r"\s+(?P<wall>[\d.]+) s\s+(?P<ok>ok|WRONG)")


def section_doctor(folder: Path, calls: Calls) -> list[str]:
    title = "### The doctor on a GPU (issue #5)"
    planted, overhead = folder / "doctor" / "planted.txt", folder / "doctor" / "overhead.json"
    if not planted.is_file() and not overhead.is_file():
        return [title, "", "Not measured yet (part `doctor`).", ""]
    lines = [title, ""]
    if planted.is_file():
        rows = [m.groupdict() for m in map(PLANTED_LINE.match, planted.read_text().splitlines()) if m]
        env = calls.env_of_part("doctor")
        lines += ["Planted faults (`python -m fastddpm.doctor.planted --device cuda`):", ""]
        lines += provenance(env, [], calls) if env else []
        lines += ["", "| case | planted | verdict | cost (share of step time) | wall s | |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['case']} | {r['expected']} | {r['got']} | {r['cost']}% | {r['wall']} | {r['ok']} |"
                  for r in rows]
        if not rows:
            lines.append(f"| (no case finished: see {planted} and logs/doctor.log) | | | | | |")
        lines.append("")
    if overhead.is_file():
        o = json.loads(overhead.read_text())
        lines += ["Watch overhead (`benchmarks/doctor_overhead.py`; promise <= 3%) and a full profile "
                  "(`doctor train`; promise <= 60 s):", ""]
        lines += provenance(o["environment"], [], calls)
        if not o.get("complete", True):
            lines.append("**Incomplete**: the run was cut short.")
        costs = o.get("cuda_costs_us")
        lines += ["", f"Bookkeeping: {o['bookkeeping_us_per_step']:.1f} us per step (empty loop)." + (
            " The watch's CUDA pieces, us per call: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}"
                                                               for k, v in costs.items()) + "." if costs else ""), "",
                  "| width | batch | steps a run | step ms plain | step ms watched | overhead median [min, max] | "
                  "whole runs (first fetch and last step in) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]

        def pct(f: dict) -> str:
            return (f"{100 * f['overhead_median']:+.2f}% [{100 * f['overhead_min']:+.2f}%, "
                    f"{100 * f['overhead_max']:+.2f}%]")

        for r in o["overhead"]:
            st = r.get("steady") or r  # rows before the steady figures timed whole runs only
            lines.append(f"| {r['width']} | {r['batch']} | {r.get('steps', '')} | {st['plain_step_ms_median']:.3f} | "
                         f"{st['watched_step_ms_median']:.3f} | {pct(st)} | "
                         f"{pct(r) if 'steady' in r else 'the same runs'} |")
        prof = o.get("full_profile")
        if prof:
            verdict = (prof.get("verdict") or {}).get("id", "n/a")
            lines += ["", f"Full profile: `{prof['command']}`: {prof['wall_s']:.1f} s end to end, exit "
                          f"{prof['returncode']}, verdict {verdict}."]
        lines.append("")
    return lines


def section_ddp(folder: Path, calls: Calls) -> list[str]:
    title = "### DDP and FSDP overhead (`benchmarks/ddp_overhead.py`, issue #7)"
    path = folder / "ddp" / "ddp_overhead.json"
    if not path.is_file():
        return [title, "", "Not measured yet (part `ddp`).", ""]
    r = json.loads(path.read_text())
    lines = [title, ""] + provenance(r["environment"], [], calls)
    if not r.get("complete", True):
        lines.append(f"**Incomplete**: {r.get('repeats_done')} repeat(s) done.")
    runs = ", ".join(f"{x:,.0f}" for x in r["plain_runs"])
    lines += ["", "| path | world size | images/s | per GPU | of plain | runs |",
              "| --- | --- | --- | --- | --- | --- |",
              f"| plain | 1 | {r['plain_images_per_s']:,.0f} | {r['plain_images_per_s']:,.0f} | 100% | {runs} |"]
    for d in r["distributed"]:
        lines.append(f"| {d['parallel']} | {d['world_size']} | {d['images_per_s']:,.0f} | {d['per_gpu']:,.0f} | "
                     f"{100 * d['efficiency']:.1f}% | {', '.join(f'{x:,.0f}' for x in d['runs'])} |")
    return lines + [""]


def section_quality(folder: Path, calls: Calls) -> list[str]:
    title = "### Time to quality (`fastddpm bench quality`, issue #6)"
    files = {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.glob("quality-*/quality.json"))}
    if not files:
        return [title, "", "Not measured yet (parts `quality-reference`, `quality-fast`, `quality-options`, "
                "`quality-options-2`, `quality-objectives`).", ""]
    lines = [title, ""]
    for name, r in files.items():
        lines += [f"`{name}`: " + " ".join(provenance(r["environment"], [], calls))]
    first = next(iter(files.values()))
    s = first["settings"]
    from fastddpm.bench.quality import _recorded

    lines += ["", f"FID in {first.get('features')}, {s['eval_samples']:,} samples, {_recorded(first, 'eval_sampler')} "
              f"{s['eval_steps']}; wall times are training time (compile included, evaluation excluded). An EDM or "
              "flow option's FID at its objective's own sampler is in the last column.", "",
              "| run | recipe | images | train wall s | final FID | time to target s | images to target | "
              "own sampler: FID |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ref = next((r["reference"] for r in files.values()
                if r.get("reference") and not r["reference"].get("given_target")), None)
    if ref:
        lines.append(f"| reference | {s['preset']} as is | {_f(ref.get('images_seen'), ',')} | "
                     f"{_f(ref.get('train_wall_s'), '.1f')} | {_f(ref.get('final_fid'), '.3f')} (target) | "
                     f"{_f(ref.get('train_wall_s'), '.1f')} | {_f(ref.get('images_seen'), ',')} | - |")
    fast_file = files.get("quality-fast")
    if fast_file and fast_file.get("fast"):
        f, hit = fast_file["fast"], fast_file["fast"].get("time_to_target")
        lines.append(f"| fast | {', '.join(fast_file['settings']['fast_overrides'])} | {_f(f['images_seen'], ',')} | "
                     f"{_f(f['train_wall_s'], '.1f')} | {_f(f['final_fid'], '.3f')} | "
                     f"{_f(hit and hit['wall_s'], '.1f')} | {_f(hit and hit['images_seen'], ',')} | - |")
    for name in ("quality-options", "quality-options-2", "quality-objectives"):
        for o in (files.get(name) or {}).get("options", []):
            own = o.get("own_sampler")
            lines.append(f"| option {o['name'].removeprefix('option-')} | fast + {', '.join(o['overrides'])} | "
                         f"{_f(o['images_seen'], ',')} | {_f(o['train_wall_s'], '.1f')} | {_f(o['final_fid'], '.3f')} "
                         "| - | - | " + (f"{own['sampler']} {own['steps']}: {_f(own['fid'], '.3f')}" if own else "-")
                         + " |")
    if fast_file and fast_file.get("speedup_vs_reference"):
        lines += ["", f"Speed-up in wall time to the target: {fast_file['speedup_vs_reference']:.2f}x (target on an "
                      "H100: <= 60 s for the fast run)."]
    return lines + [""]


def section_eval(folder: Path, calls: Calls) -> list[str]:
    title = "### `fastddpm eval` on a GPU (issue #6)"
    paths = sorted((folder / "eval").glob("eval_*.json"))
    if not paths:
        return [title, "", "Not measured yet (part `eval`, in the call of `quality-reference`).", ""]
    lines = [title, ""]
    rows = ["| samples | sampler | precision | compile | samples/s overall | samples/s steady | FID | precision | "
            "recall |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        r = json.loads(path.read_text())
        smp = r["sampling"]
        env = r["environment"]
        call = calls.env_before(env.get("date_utc"))
        lines += provenance({**env, "command_line": env.get("command_line") or call.get("command_line")}, [], calls)
        rows.append(f"| {smp['num_samples']:,} | {path.stem.split('_')[1]} | {smp['precision']} | {smp['compile']} | "
                    f"{_f(smp.get('samples_per_s'), ',.1f')} | {_f(smp.get('steady_samples_per_s'), ',.1f')} | "
                    f"{_f(r['fid'], '.3f')} | {_f(r['precision'], '.3f')} | {_f(r['recall'], '.3f')} |")
    return lines + [""] + rows + [""]


def section_samplers(folder: Path, calls: Calls) -> list[str]:
    title = "### `fastddpm bench samplers` on a GPU (issue #16)"
    path = folder / "samplers" / "samplers.json"
    if not path.is_file():
        return [title, "", "Not measured yet (part `samplers`, in the call of `quality-reference`).", ""]
    r = json.loads(path.read_text())
    rows = ["| sampler | steps | NFE | FID | seeds (min-max) | precision | recall | samples/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in r.get("summary") or []:
        spread = f"{e['seeds']} ({e['fid_min']:.2f}-{e['fid_max']:.2f})" if e["seeds"] > 1 else "1"
        rows.append(f"| {e['sampler']} | {e['steps']} | {e['nfe']} | {_f(e['fid'], '.2f')} | {spread} | "
                    f"{_f(e['precision'], '.3f')} | {_f(e['recall'], '.3f')} | {_f(e['samples_per_s'], ',.1f')} |")
    runs = []
    for row in r.get("rows") or []:
        if row.get("run") and row["run"] not in runs:
            runs.append(row["run"])
    return ([title, ""] + provenance(r["environment"], runs, calls)
            + ["", f"{r['settings']['num_samples']:,} samples per point from {r['checkpoint']['file']}; FID in "
               f"{r['features']['label']}.", ""] + rows + [""])


SECTIONS = (section_tests, section_throughput, section_ladder, section_eval, section_samplers, section_quality,
            section_doctor, section_doctor_try, section_doctor_fast, section_attention, section_ddp)


def summarize(folder: Path) -> str:
    calls = Calls(folder)
    lines = [f"## GPU session {folder.name}", "",
             f"Generated by `python benchmarks/summarize_gpu.py {folder}` from the files the session's parts "
             "wrote.", ""]
    for section in SECTIONS:
        lines += section(folder, calls)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="the session's results folder (benchmarks/gpu/<date>)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here (default FOLDER/SUMMARY.md)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        p.error(f"{args.folder} is not a folder")
    text = summarize(args.folder)
    (args.out or args.folder / "SUMMARY.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
