"""The doctor's report: a terminal summary (readable in 30 seconds), JSON, and a self-contained HTML page with
the step timeline. All three render the same `Report`; nothing is measured here."""

from __future__ import annotations

import html
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fastddpm.doctor.rules import Finding
from fastddpm.doctor.thresholds import NEGLIGIBLE_SHARE
from fastddpm.doctor.trace import BREAKDOWN, BREAKDOWN_LABELS
from fastddpm.doctor.trials import MIN_ROUNDS


@dataclass
class Report:
    verdict: dict
    findings: list[Finding]
    measurements: dict
    unavailable: dict[str, str]
    environment: dict
    context: str = "user"  # "fastddpm": fixes as trainer settings first; "user": code changes first
    files: dict[str, str] = field(default_factory=dict)
    trials: list[dict] = field(default_factory=list)  # --try: fixes measured (fastddpm.doctor.trials.Trial)
    script: dict | None = None  # doctor run: what the script drives (fastddpm.doctor.script_context)

    # ------------------------------------------------------------------ accessors
    @property
    def healthy(self) -> bool:
        return bool(self.verdict["healthy"])

    @property
    def bottleneck(self) -> str:
        """The verdict's id: 'healthy', 'data-bound', 'epoch-spikes', 'sync-bound', 'launch-bound', ..."""
        return self.verdict["id"]

    def finding(self, id_: str) -> Finding | None:
        return next((f for f in self.findings if f.id == id_), None)

    def to_dict(self) -> dict:
        return {"format": "fastddpm-doctor-1", "verdict": self.verdict,
                "findings": [f.to_dict() for f in self.findings], "measurements": self.measurements,
                "unavailable": self.unavailable, "environment": self.environment, "context": self.context,
                "files": self.files, **({"trials": self.trials} if self.trials else {}),
                **({"script": self.script} if self.script else {})}

    # ------------------------------------------------------------------ terminal
    def _fix_lines(self, f: Finding) -> list[str]:
        out = []
        for fix in f.fixes:
            first, second = (fix.fastddpm, fix.code) if self.context == "fastddpm" else (fix.code, fix.fastddpm)
            if first:
                out.append(first if second is None or self.context != "fastddpm" else f"{first}")
            elif second and self.context == "fastddpm":
                out.append(f"(in your own code) {second}")
        return out

    def text(self) -> str:
        m, env = self.measurements, self.environment
        ss = m.get("step_stats") or {}
        lines = [f"fastddpm doctor: {ss.get('steps', 0)} steps watched, {m.get('profiled_steps', 0)} profiled, on "
                 f"{env.get('device_name', env.get('device'))} (torch {env.get('torch')}), "
                 f"{env.get('wall_s', 0):.1f} s"]
        v = self.verdict
        lines.append("")
        lines.append(f"verdict: {v['title']}" + ("" if v["healthy"] else f"  (~{100 * v['cost']:.0f}% of step time)"))
        top = self.finding(v["id"]) if not v["healthy"] else None
        ranked = self.ranked_compute()
        if top is not None:
            for e in top.evidence:
                lines.append(f"  evidence: {e}")
            lines.append(f"  cause: {top.cause}")
            if ranked:
                lines.append("  compute fixes, ranked by expected gain:")
                for i, f in enumerate(ranked, 1):
                    fx = self._fix_lines(f)
                    lines.append(f"    {i}. [{f.id}: ~{100 * f.cost:.0f}% of the step, {f.speedup:.2f}x] "
                                 f"{fx[0] if fx else f.title}")
                    lines.extend(f"       or: {x}" for x in fx[1:])
            else:
                lines.append("  fixes, best first:")
                for i, fx in enumerate(self._fix_lines(top), 1):
                    lines.append(f"    {i}. {fx}")
        shown = {top.id} | {f.id for f in ranked} if top is not None else set()
        others = [f for f in self.findings if f.id not in shown and not f.negligible]
        negligible = [f for f in self.findings if f.id not in shown and f.negligible]
        if others or negligible:
            lines.append("")
            lines.append("also found:")
            for f in others:
                tag = {"opportunity": "opportunity", "note": "note"}.get(f.kind, f"~{100 * f.cost:.0f}%")
                lines.append(f"  - [{tag}] {f.title}: {f.evidence[0]}")
            if negligible:
                lines.append(f"  - [negligible] checked, each under {NEGLIGIBLE_SHARE:.0%} of the step (no change "
                             "worth making): " + "; ".join(f"{f.title} ({100 * f.cost:.1f}%)" for f in negligible))
        lines.append("")
        # where every step has CUDA events, they time it: a loop that never syncs queues steps faster than the GPU
        # runs them, so its host times (0.3 ms against the GPU's 11 ms on an H200) say nothing of the step
        gpu = ss.get("fifths_basis") == "CUDA events" and ss.get("gpu_p10_ms") is not None
        step = ("no steps measured" if not ss else
                f"step {ss['gpu_median_ms']:.2f} ms median by CUDA events (p10 {ss['gpu_p10_ms']:.2f}, p90 "
                f"{ss['gpu_p90_ms']:.2f})" if gpu else
                f"step {ss['median_ms']:.2f} ms median (p10 {ss['p10_ms']:.2f}, p90 {ss['p90_ms']:.2f})")
        tr = m.get("trace") or {}
        parts = [step]
        if ss:
            parts.append(f"data wait {100 * ss['data_wait_ms_total'] / max(ss['host_ms_total'], 1e-9):.0f}%")
        if tr:
            if tr.get("syncs_per_step") is not None:
                parts.append(f"syncs/step {tr['syncs_per_step']:g}")
            if tr.get("has_gpu"):
                parts.append(f"GPU idle {100 * tr['idle_share']:.0f}%")
                parts.append(f"kernels/step {tr['kernels_per_step']:.0f}")
        if m.get("mfu"):
            parts.append(_mfu_text(m["mfu"], m.get("low_precision")))
        lines.append("measured: " + "; ".join(parts))
        if m.get("roofline"):
            lines.append(f"roofline: {roofline_text(m['roofline'])}")
        elif m.get("roofline_unavailable"):
            lines.append(f"roofline: unavailable: {m['roofline_unavailable']}")
        split = breakdown_text(tr)
        if split:
            lines.append(f"where the step goes ({tr.get('breakdown_basis')}): {split}")
        if tr.get("top_ops"):
            lines.append(f"top {'kernels' if tr.get('has_gpu') else 'ops'}: {top_ops_text(tr['top_ops'])}")
        for line in (self.script or {}).get("frameworks") or []:
            lines.append(f"the script drives: {line}")
        for t in self.trials:
            lines.append(f"tried: {trial_line(t)}")
        for note in m.get("notes") or []:
            lines.append(f"note: {note}")
        for rule, why in self.unavailable.items():
            lines.append(f"unavailable: {rules_label(rule)}: {why}")
        if self.files:
            lines.append("files: " + ", ".join(f"{k} {v}" for k, v in self.files.items()))
        return "\n".join(lines)

    def print(self) -> None:
        print(self.text())

    def ranked_compute(self) -> list[Finding]:
        """With a compute verdict: its findings, largest expected gain first (the verdict's `ranked`)."""
        return [f for f in (self.finding(i) for i in self.verdict.get("ranked", [])) if f is not None]

    # ------------------------------------------------------------------ files
    def save(self, out_dir: str | Path) -> dict[str, str]:
        """report.txt, report.json, report.html in `out_dir` (a trace kept with save_trace is already there)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.files.update({"text": str(out / "report.txt"), "json": str(out / "report.json"),
                           "html": str(out / "report.html")})
        (out / "report.txt").write_text(self.text() + "\n")
        (out / "report.json").write_text(json.dumps(self.to_dict(), indent=2, default=_jsonable) + "\n")
        (out / "report.html").write_text(self.html())
        return self.files

    def html(self) -> str:
        return render_html(self)


def breakdown_text(trace: dict) -> str:
    """The compute breakdown as one line: categories over 0.5%, largest first, matmul by dtype and attention by
    implementation in brackets."""
    b = trace.get("breakdown") or {}
    if not b:
        return ""
    parts = []
    for k in sorted((k for k in BREAKDOWN if b.get(k, 0.0) >= 0.005), key=lambda k: -b[k]):
        sub = {"matmul": trace.get("matmul_share_by_dtype"), "attention": trace.get("attention_share_by_impl")}.get(k)
        detail = (" [" + ", ".join(f"{n} {100 * v:.0f}%" for n, v in sorted(sub.items(), key=lambda kv: -kv[1])
                                   if v >= 0.005) + "]") if sub and len(sub) > 0 else ""
        if k == "optimizer" and trace.get("optimizer_kind"):
            detail = f" [{trace['optimizer_kind']}]"
        parts.append(f"{BREAKDOWN_LABELS[k]} {100 * b[k]:.0f}%{detail}")
    return ", ".join(parts)


def roofline_text(r: dict) -> str:
    """The step against its roofline in one line: the share reached, the side that binds and both sides."""
    moved_mb = 2 * r["activation_mb_per_step"] + r["update_mb_per_step"]
    return (f"{100 * r['share']:.0f}% of the bound ({r['binds']} binds): step {r['step_ms']:.3g} ms, bound "
            f"{r['bound_ms']:.3g} ms = max(compute {r['compute_ms']:.3g} ms at the matmul peak, memory "
            f"{r['memory_ms']:.3g} ms: {moved_mb:,.1f} MB at {r['bandwidth_gbps']:,.0f} GB/s)")


def top_ops_text(top: list[dict], n: int = 5) -> str:
    """The kernels (GPU) or ops (CPU) that take most of the step, with their share and calls per step."""
    return "; ".join(f"{o['name']} {100 * o['share']:.0f}% ({o['calls_per_step']:g}/step, {o['category']})"
                     for o in top[:n])


def _mfu_text(mf: dict, lowp: dict | None = None) -> str:
    """MFU with the dtype of the peak it divides by: the same run reads ~2x apart against bf16 and fp32 peaks.
    A peak in a dtype the device emulates (bf16 on a CPU without bf16 instructions) is said so: a step many times
    slower than in fp32 reads as a fair MFU against it."""
    emulated = bool(lowp and not lowp.get("native") and lowp.get("dtype") == mf["peak_dtype"])
    fp32 = (f"; {100 * mf['mfu'] * mf['peak_tflops'] / lowp['fp32_peak_tflops']:.1f}% of the fp32 peak"
            if emulated and lowp.get("fp32_peak_tflops") else "")
    return (f"MFU {100 * mf['mfu']:.1f}% ({mf['peak_dtype']} peak {mf['peak_tflops']:.3g} TFLOP/s"
            f"{', emulated by this device' if emulated else ''}{fp32})")


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    return str(x)


# ---------------------------------------------------------------------- HTML
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1100px;color:#1d2733}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px;border-bottom:1px solid #dde3ea}
.verdict{padding:12px 16px;border-radius:6px;font-size:16px;font-weight:600}
.bad{background:#fde8e6;border-left:6px solid #d93b2b} .ok{background:#e5f5ea;border-left:6px solid #2f9e55}
table{border-collapse:collapse} \
td,th{padding:3px 10px;border-bottom:1px solid #eef1f4;text-align:left;vertical-align:top}
.muted{color:#6b7785} code{background:#f3f5f7;padding:1px 4px;border-radius:3px}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}
svg text{font:11px system-ui,sans-serif;fill:#3c4853}
"""

COLORS = {"compute": "#4a7fc1", "data": "#e8912d", "gpu": "#2f9e55", "idle": "#e6e9ee", "sync": "#d93b2b",
          "epoch": "#8a5cc2", "recompile": "#111"}


# The step chart's axis ends at this many median steps: an epoch start that respawns loader workers or a step that
# compiles can take 100x a step, and an axis up to it would draw every other step a pixel or two high.
STEPS_AXIS_MEDIANS = 4.0


def _steps_svg(steps: list[dict], width: int = 1040, height: int = 180) -> str:
    """Watched steps as bars: data wait (orange) under compute (blue); epoch starts and recompiles marked. A step
    past the axis (STEPS_AXIS_MEDIANS median steps) is drawn to its top, cut, with its time written above."""
    if not steps:
        return "<p class=muted>no watched steps</p>"
    longest = max(s["host_ms"] for s in steps)
    top = min(longest, STEPS_AXIS_MEDIANS * statistics.median(s["host_ms"] for s in steps)) or longest or 1.0
    n = len(steps)
    pad_l, pad_b = 48, 20
    pad_t = 16 if longest > top else 8  # room for the times of the cut bars
    bw = (width - pad_l - 8) / n
    h = height - pad_b - pad_t
    out = [f'<svg id="steps-chart" width="{width}" height="{height}" role="img" '
           f'aria-label="step times of {n} watched steps">']
    for frac in (0, 0.5, 1):
        y = pad_t + h * (1 - frac)
        out.append(f'<line x1="{pad_l}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eef1f4"/>'
                   f'<text x="4" y="{y + 4:.1f}">{top * frac:.1f} ms</text>')
    for i, s in enumerate(steps):
        x = pad_l + i * bw
        cut = s["host_ms"] > top  # its bar stops at the axis's end, in the proportions of its own two parts
        scale = h / (s["host_ms"] if cut else top)
        dh = scale * s["data_wait_ms"]
        ch = scale * max(0.0, s["host_ms"] - s["data_wait_ms"])
        y_data = pad_t + h - dh
        out.append(f'<rect class="bar-data" x="{x:.1f}" y="{y_data:.1f}" width="{max(bw - 1, 0.5):.1f}" '
                   f'height="{dh:.1f}" fill="{COLORS["data"]}"><title>step {s["index"]}: data wait '
                   f'{s["data_wait_ms"]:.2f} ms</title></rect>')
        out.append(f'<rect class="bar-compute" x="{x:.1f}" y="{y_data - ch:.1f}" width="{max(bw - 1, 0.5):.1f}" '
                   f'height="{ch:.1f}" fill="{COLORS["compute"]}"><title>step {s["index"]}: {s["host_ms"]:.2f} ms'
                   f'</title></rect>')
        if cut:  # a white gap across the bar, and the step's own time above the axis
            out.append(f'<rect class="bar-cut" x="{x:.1f}" y="{pad_t + h * 0.12:.1f}" width="{max(bw - 1, 0.5):.1f}" '
                       f'height="3" fill="#fff"/><text class="bar-cut-label" x="{x + bw / 2:.1f}" y="{pad_t - 4}" '
                       f'text-anchor="middle">{_ms_or_s(s["host_ms"])}</text>')
        if s["epoch_start"]:
            out.append(f'<text x="{x:.1f}" y="{height - 4}" fill="{COLORS["epoch"]}">E</text>')
        if s["recompiles"]:
            out.append(f'<text x="{x:.1f}" y="{height - 4}" fill="{COLORS["recompile"]}">C</text>')
    out.append("</svg>")
    return "".join(out)


def rules_label(key: str) -> str:
    """An `unavailable` key as read: "rule 7 (syncs)", "rules 4-6,8,9,11 (GPU timeline)"."""
    several = any(c in key.split(" (", 1)[0] for c in ",-")
    return f"{'rules' if several else 'rule'} {key}"


def _ms_or_s(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"


def _timeline_svg(tl: dict, width: int = 1040, *, gpu: bool = True) -> str:
    """The profiled steps on one time axis: host steps, data waits, and on a GPU the syncs and GPU busy/idle."""
    steps = tl.get("steps") or []
    if not steps:
        return "<p class=muted>no profiled steps</p>"
    t_end = steps[-1][1] or 1.0
    pad_l = 70
    sx = (width - pad_l - 8) / t_end
    lanes = [("host step", 10), ("data wait", 34)] + ([("syncs", 58), ("GPU", 82)] if gpu else [])
    height = 124 if gpu else 76
    out = [f'<svg id="timeline" width="{width}" height="{height}" role="img" aria-label="profiled timeline">']
    for name, y in lanes:
        out.append(f'<text x="4" y="{y + 13}">{name}</text>')
    for i, (a, b) in enumerate(steps):
        out.append(f'<rect class="tl-step" x="{pad_l + a * sx:.2f}" y="10" width="{max((b - a) * sx - 1, 0.5):.2f}" '
                   f'height="18" fill="{COLORS["compute"] if i % 2 == 0 else "#7fa6d8"}"><title>step {i}: '
                   f'{(b - a) / 1000:.2f} ms</title></rect>')
    for a, b in tl.get("data_wait") or []:
        out.append(f'<rect class="tl-data" x="{pad_l + a * sx:.2f}" y="34" width="{max((b - a) * sx, 0.5):.2f}" '
                   f'height="18" fill="{COLORS["data"]}"><title>data wait {(b - a) / 1000:.2f} ms</title></rect>')
    if gpu:
        for t in tl.get("syncs") or []:
            out.append(f'<line class="tl-sync" x1="{pad_l + t * sx:.2f}" x2="{pad_l + t * sx:.2f}" y1="58" y2="76" '
                       f'stroke="{COLORS["sync"]}" stroke-width="2"><title>host sync</title></line>')
        out.append(f'<rect x="{pad_l}" y="82" width="{t_end * sx:.2f}" height="18" fill="{COLORS["idle"]}"/>')
        for a, b in tl.get("gpu_busy") or []:
            out.append(f'<rect class="tl-gpu" x="{pad_l + a * sx:.2f}" y="82" width="{max((b - a) * sx, 0.3):.2f}" '
                       f'height="18" fill="{COLORS["gpu"]}"/>')
    out.append(f'<text x="{pad_l}" y="{height - 6}">0</text><text x="{width - 70}" y="{height - 6}">'
               f'{t_end / 1000:.1f} ms</text>')
    out.append("</svg>")
    return "".join(out)


def trial_line(t: dict) -> str:
    """A tried fix, measured against the script without it (a Trial's dict form)."""
    if t["failed"] or not t["applied"]:
        return f"{t['fix']}: not measured ({t['failed'] or 'the fix found nothing to change in this script'})"
    pred = f"; predicted {t['predicted']:.2f}x" if t["predicted"] else ""
    lo, hi = t["spread"]
    # the trial process names what it changed, starting with the fix's own words: those are not said twice
    what = "" if all(a.startswith(t["what"]) for a in t["applied"]) else f" ({t['what']})"
    if t["rounds"] < MIN_ROUNDS:  # --try-seconds ran out after one: no spread, and one pair of runs is noise
        return (f"{t['fix']}{what}: measured {t['measured']:.2f}x in 1 round{pred} (not conclusive: one pair of runs "
                f"measures the machine's noise as much as the fix; give --try-seconds more time for "
                f"{MIN_ROUNDS}+ rounds); {'; '.join(t['applied'])}")
    said = ("slower here: leave it out" if hi < 1 else
            "no gain beyond the runs' spread" if lo <= 1 else "faster in every round")
    return (f"{t['fix']}{what}: measured {t['measured']:.2f}x [{lo:.2f}-{hi:.2f}] over {t['rounds']} alternating "
            f"rounds{pred} ({said}); {'; '.join(t['applied'])}")


def render_html(r: Report) -> str:
    e = html.escape
    v = r.verdict
    m = r.measurements
    top = r.finding(v["id"]) if not v["healthy"] else None
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>fastddpm doctor: {e(v['id'])}</title>"
             f"<style>{_CSS}</style></head><body>",
             "<h1>fastddpm doctor</h1>",
             f"<p class=muted>{e(str(r.environment.get('device_name', '')))} &middot; torch "
             f"{e(str(r.environment.get('torch')))} &middot; {e(str(r.environment.get('date')))} &middot; "
             f"<code>{e(' '.join(map(str, r.environment.get('command', []))))}</code></p>",
             f"<div id=verdict class='verdict {'ok' if v['healthy'] else 'bad'}'>{e(v['title'])}"
             + ("" if v["healthy"] else f" <span class=muted>(~{100 * v['cost']:.0f}% of step time)</span>")
             + "</div>"]
    if top is not None:
        parts.append("<h2>Evidence</h2><ul>" + "".join(f"<li>{e(x)}</li>" for x in top.evidence) + "</ul>")
        ranked = r.ranked_compute()
        if ranked:
            parts.append(f"<p><b>Cause.</b> {e(top.cause)}</p><h2>Compute fixes, ranked by expected gain</h2><ol>")
            for f in ranked:
                parts.append(f"<li><b>{e(f.title)}</b> <span class=muted>(~{100 * f.cost:.0f}% of the step, "
                             f"{f.speedup:.2f}x)</span><br>" + "<br>".join(_fix_html(r, fx) for fx in f.fixes)
                             + "</li>")
        else:
            parts.append(f"<p><b>Cause.</b> {e(top.cause)}</p><h2>Fixes, best first</h2><ol>")
            for fx in top.fixes:
                parts.append("<li>" + _fix_html(r, fx) + "</li>")
        parts.append("</ol>")
    if r.trials:
        against = "the config" if r.context == "fastddpm" else "the script"
        parts.append(f"<h2>Fixes tried (measured against {against} without them)</h2><ul>"
                     + "".join(f"<li>{e(trial_line(t))}</li>" for t in r.trials) + "</ul>")
    split = (m.get("trace") or {}).get("breakdown") or {}
    if split:
        parts.append("<h2>Where the step goes</h2>" + _breakdown_svg(m.get("trace") or {}))
    if m.get("notes"):
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(x)}</li>" for x in m["notes"]) + "</ul>")
    parts.append("<h2>Step timeline (watched steps)</h2><div class=legend>"
                 f"<span style='background:{COLORS['compute']}'></span>compute"
                 f"<span style='background:{COLORS['data']}'></span>data wait"
                 f"<b style='color:{COLORS['epoch']};margin-left:12px'>E</b> epoch start"
                 "<b style='margin-left:12px'>C</b> compile</div>")
    parts.append(_steps_svg(m.get("steps") or []))
    tl = (m.get("trace_timeline") or {})
    gpu = bool((m.get("trace") or {}).get("has_gpu"))
    if gpu:
        parts.append("<h2>Profiled steps: host and GPU</h2><div class=legend>"
                     f"<span style='background:{COLORS['gpu']}'></span>GPU busy"
                     f"<span style='background:{COLORS['idle']}'></span>GPU idle"
                     f"<span style='background:{COLORS['sync']}'></span>host sync</div>")
    else:  # a CPU run: the host's steps and data waits; no GPU lanes to draw
        parts.append("<h2>Profiled steps</h2><div class=legend>"
                     f"<span style='background:{COLORS['compute']}'></span>step"
                     f"<span style='background:{COLORS['data']}'></span>data wait</div>")
    parts.append(_timeline_svg(tl, gpu=gpu))
    parts.append("<h2>All findings</h2><table><tr><th>finding</th><th>rules</th><th>cost</th><th>evidence</th></tr>")
    for f in r.findings:
        cost = (f.kind if f.kind != "bottleneck" else
                f"{100 * f.cost:.1f}% (negligible)" if f.negligible else f"{100 * f.cost:.0f}%")
        parts.append(f"<tr><td>{e(f.title)}</td><td>{', '.join(map(str, f.rules))}</td><td>{e(cost)}</td>"
                     f"<td>{'<br>'.join(e(x) for x in f.evidence)}</td></tr>")
    if not r.findings:
        parts.append("<tr><td colspan=4>none</td></tr>")
    parts.append("</table><h2>Breakdown</h2><table>")
    for k, val in _breakdown(m):
        parts.append(f"<tr><td>{e(k)}</td><td>{e(val)}</td></tr>")
    parts.append("</table>")
    if r.unavailable:
        parts.append("<h2>Not measured</h2><ul>" + "".join(f"<li>{e(rules_label(k))}: {e(v2)}</li>"
                                                           for k, v2 in r.unavailable.items()) + "</ul>")
    parts.append("</body></html>\n")
    return "".join(parts)


def _fix_html(r: Report, fx) -> str:
    """A fix as the diagnosed loop applies it, as the text report words it: fastddpm's setting for `doctor train`
    (the code change beside it), the code change alone for a user's own script (fastddpm's settings are not
    theirs to set)."""
    e = html.escape
    code = f"<b>your code:</b> {e(fx.code)}"
    if not fx.fastddpm or r.context != "fastddpm":
        return code
    return f"<b>fastddpm:</b> <code>{e(fx.fastddpm)}</code><br>{code}"


BREAKDOWN_COLORS = {"matmul": "#4a7fc1", "attention": "#8a5cc2", "norm": "#2f9e55", "elementwise": "#7cc47f",
                    "optimizer": "#d9a02b", "copy": "#e8912d", "data": "#d93b2b", "framework": "#9aa5b1",
                    "python": "#c9d0d8", "idle": "#eef1f4"}


def _breakdown_svg(trace: dict, width: int = 1040) -> str:
    """The compute breakdown as one stacked bar with a legend."""
    b = trace["breakdown"]
    total = sum(b.values()) or 1.0
    out = [f'<p class=muted>{html.escape(str(trace.get("breakdown_basis") or ""))}</p>'
           f'<svg id="breakdown" width="{width}" height="34" role="img" aria-label="where the step goes">']
    x = 0.0
    for k in BREAKDOWN:
        v = b.get(k, 0.0)
        if v <= 0:
            continue
        w = width * v / total
        out.append(f'<rect class="bd-{k}" x="{x:.1f}" y="4" width="{max(w, 0.5):.1f}" height="26" '
                   f'fill="{BREAKDOWN_COLORS[k]}">'
                   f'<title>{html.escape(BREAKDOWN_LABELS[k])} {100 * v:.1f}%</title></rect>')
        x += w
    out.append("</svg><div class=legend>" + "".join(
        f"<span style='background:{BREAKDOWN_COLORS[k]}'></span>{html.escape(BREAKDOWN_LABELS[k])} "
        f"{100 * b[k]:.0f}%" for k in BREAKDOWN if b.get(k, 0.0) >= 0.005) + "</div>")
    text = breakdown_text(trace)
    if text:
        out.append(f"<p>{html.escape(text)}</p>")
    return "".join(out)


def _breakdown(m: dict) -> list[tuple[str, str]]:
    rows = []
    ss = m.get("step_stats") or {}
    if ss:
        rows.append(("step time (watched, host)", f"median {ss['median_ms']:.2f} ms, p10 {ss['p10_ms']:.2f}, "
                                                  f"p90 {ss['p90_ms']:.2f}, max {ss['max_ms']:.2f}"))
        rows.append(("data wait", f"{100 * ss['data_wait_ms_total'] / max(ss['host_ms_total'], 1e-9):.1f}% of "
                                  f"watched time"))
        if "gpu_median_ms" in ss:
            rows.append(("step time (GPU events)", f"median {ss['gpu_median_ms']:.2f} ms" + (
                f", p10 {ss['gpu_p10_ms']:.2f}, p90 {ss['gpu_p90_ms']:.2f}" if ss.get("gpu_p10_ms") is not None
                else "")))
    cpu = m.get("cpu_load")
    if cpu:
        rows.append(("CPU load", f"main {cpu['main_cores']:.2f} cores, workers {cpu['workers_cores']:.2f} cores "
                                 f"({cpu['workers_seen']} process{'es' if cpu['workers_seen'] != 1 else ''}) of "
                                 f"{cpu['cpu_count']}"))
    tr = m.get("trace") or {}
    for key, label in (("ops_per_step", "host ops per step"), ("syncs_per_step", "host syncs per step"),
                       ("scalar_reads_per_step", ".item() calls per step (the loop's own)"),
                       ("idle_share", "GPU idle share of span"), ("host_wait_share", "host-wait share"),
                       ("kernel_wait_share", "kernel-wait share"), ("kernels_per_step", "kernels per step"),
                       ("median_kernel_us", "median kernel (us)"),
                       ("graph_kernel_share", "kernels replayed from CUDA graphs"),
                       ("short_kernel_share", "eager kernels shorter than their launch"),
                       ("queue_depth_median", "launch queue depth (median)"), ("h2d_share", "HtoD share of busy"),
                       ("h2d_pageable", "pageable HtoD copies"), ("layout_share", "layout-conversion share"),
                       ("groupnorm_share", "GroupNorm share")):
        if tr.get(key) is not None:
            val = tr[key]
            rows.append((label, f"{val:.3g}" if isinstance(val, float) else str(val)))
    if tr.get("gemm_flops_per_step"):
        rows.append(("matmul/conv GFLOP per step by input dtype",
                     ", ".join(f"{k} {v / 1e9:.2f}" for k, v in tr["gemm_flops_per_step"].items())))
    if m.get("mfu"):
        mf = m["mfu"]
        rows.append(("MFU", f"{_mfu_text(mf, m.get('low_precision'))}: {mf['flops_per_step'] / 1e9:.2f} GFLOP/step; "
                            f"{mf['peak_dtype']} is "
                            f"{mf['peak_dtype_basis']}; peak {mf['peak_label']}"))
    if m.get("roofline"):
        r = m["roofline"]
        rows.append(("roofline", f"{roofline_text(r)}; bytes: {r['bytes_basis']}; bandwidth "
                                 f"{r['bandwidth_label']}"))
    for o in tr.get("top_ops") or []:
        rows.append((f"top {'kernel' if tr.get('has_gpu') else 'op'}: {o['category']}",
                     f"{100 * o['share']:.1f}%, {o['calls_per_step']:g} a step: {o['name']}"))
    comp = m.get("compile") or {}
    if comp:
        rows.append(("torch.compile", ", ".join(f"{k} {v}" for k, v in comp.items())))
    if m.get("memory"):
        mem = m["memory"]
        rows.append(("device memory peak", f"{mem['peak_allocated_bytes'] / 2**30:.2f} of "
                                           f"{mem['total_bytes'] / 2**30:.0f} GiB"))
    if m.get("loader_probe"):
        p = m["loader_probe"]
        if p.get("batches_per_s"):
            rows.append(("loader alone", f"{p['batches_per_s']:.1f} batches/s"))
    for k in ("telemetry_start", "telemetry_end"):
        if m.get(k):
            t = m[k]
            rows.append((k.replace("_", " "), f"SM {t['sm_clock_mhz']:.0f} MHz, {t['temperature_c']:.0f} C, "
                                              f"{t.get('power_w')} W ({t['source']})"))
    return rows
