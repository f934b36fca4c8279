"""The model card (README.md) of a `fastddpm export` folder: what the run trained on and for how long, what the
network's inputs and output are, the FID the run (or `fastddpm eval`) measured for these weights, and how to sample
from the folder in this format, in code that runs from the folder itself."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path


def _network_io(cfg) -> tuple[str, str]:
    """What the exported network's x and t are, and how to sample from it, for the run's objective."""
    d = cfg.diffusion
    if d.objective == "edm":
        return ("x float32 = x_sigma / sqrt(sigma^2 + sigma_data^2) (EDM's c_in scaling), x_sigma = x0 + sigma eps "
                "with x0 in [-1, 1], t float32 (B,) = 250 ln(sigma); output: EDM's F, x0 = c_skip x_sigma + c_out F",
                "an EDM sampler (Karras et al. 2022) with schedule.json's sigma_data and levels")
    if d.objective == "flow":
        return ("x float32 = x_t = (1 - t) x0 + t eps with x0 in [-1, 1], t float32 (B,) = 1000 t with t in "
                "[0, 1]; output: the velocity eps - x0",
                "a flow-matching Euler or Heun sampler over schedule.json's shifted levels")
    return (f"x float32 in [-1, 1] (noised), t int64 (B,) in [0, {d.num_timesteps - 1}]; output: the predicted "
            f"{'noise (epsilon)' if d.prediction == 'epsilon' else d.prediction}",
            "any DDPM/DDIM sampler given schedule.json's betas")


def fid_of_these_weights(evals: list[dict], info: dict) -> dict | None:
    """The evaluation of the exported weights: the run's record at their step (an export of an earlier checkpoint
    must not carry a later FID), with a finite FID; None when the run measured none there, or for raw weights (the
    trainer evaluates the EMA ones)."""
    if info.get("weights", "ema") != "ema":
        return None
    same = [r for r in evals if r.get("step") == info.get("step") and r.get("images_seen") == info.get("images_seen")]
    return same[-1] if same and isinstance(same[-1].get("fid"), (int, float)) else None


def result_files(run_dir, extra: Sequence[str | Path] = ()) -> list[Path]:
    """Where `fastddpm eval`'s results of a run are: its eval/eval_*.json (eval's default --out), each one
    `eval --out DIR` wrote elsewhere (listed in eval/results_elsewhere.jsonl), and `extra` (`export --eval-results`:
    a result's .json, or a folder of them)."""
    files = sorted(run_dir.eval_dir.glob("eval_*.json")) if run_dir.eval_dir.is_dir() else []
    try:
        listed = run_dir.eval_elsewhere.read_text().splitlines()
    except (OSError, UnicodeDecodeError):  # none written elsewhere, or the list unreadable: nothing to add
        listed = []
    for line in listed:
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(entry, dict) and isinstance(entry.get("result"), str):
            files.append(Path(entry["result"]))
    for path in map(Path, extra):
        files += sorted(path.glob("eval_*.json")) if path.is_dir() else [path]
    return list(dict.fromkeys(p.absolute() for p in files))  # a result both listed and given: read once


def _digest_now(checkpoint: dict, measured_at: float, cache: dict) -> str | None:
    """The weights digest of the checkpoint file an older result names (eval recorded no digest before), computed
    now as eval computes it; None where the file is gone or no longer loads, or was written after the result: the
    path may hold other weights than were measured (a resume from an earlier checkpoint saves the same step again
    at the same path, and ema.safetensors is rewritten with every checkpoint)."""
    file, weights = checkpoint.get("file"), checkpoint.get("weights", "ema")
    if not isinstance(file, str) or weights not in ("ema", "model"):
        return None
    try:
        written = Path(file).stat().st_mtime
    except OSError:
        return None
    if written > measured_at:
        return None
    if (file, weights) not in cache:
        from fastddpm.config import ConfigError
        from fastddpm.rundir.files import CheckpointError
        from fastddpm.rundir.locate import locate
        from fastddpm.rundir.state_dicts import weights_digest
        from fastddpm.sampling import load_for_sampling

        try:
            model, _ = load_for_sampling(locate(file, weights=weights), weights=weights)
            cache[file, weights] = weights_digest(model)
        except (ConfigError, CheckpointError, OSError):  # damaged or replaced by something else since
            cache[file, weights] = None
    return cache[file, weights]


def eval_of_these_weights(run_dir, digest: str, info: dict, *, extra: Sequence[str | Path] = ()) -> dict | None:
    """`fastddpm eval`'s result for exactly the exported weights, from result_files: a record whose weights_sha256
    (fastddpm.rundir.state_dicts.weights_digest) is `digest`, with a finite FID. A step number alone would not do:
    a resume from an earlier checkpoint trains the same steps again to other weights. A result written before eval
    recorded the digest is matched by the digest of the checkpoint file it names, computed now (_digest_now), where
    its step and images seen are the exported weights' (the others cannot be these weights' result, and are not
    loaded). Of several, the one of the most samples, then the newest. Returns what the card names: fid, where the
    record is (the run's eval/... or its absolute path), sampler, steps, num_samples, guidance (None:
    unconditional) and the features' label; None where eval measured none of these weights."""
    found, digests_now = [], {}
    run_path = run_dir.path.absolute()
    for path in result_files(run_dir, extra):
        try:
            record = json.loads(path.read_text())
            when = path.stat().st_mtime
        except (OSError, ValueError):  # unreadable, or being written: no result to quote
            continue
        if not isinstance(record, dict) or record.get("schema") != "fastddpm-eval-1":
            continue
        fid, checkpoint = record.get("fid"), record.get("checkpoint") or {}
        if not isinstance(fid, (int, float)) or not math.isfinite(fid) or not isinstance(checkpoint, dict):
            continue
        measured = checkpoint.get("weights_sha256")
        if measured is None and (checkpoint.get("step"), checkpoint.get("images_seen")) == (
                info.get("step"), info.get("images_seen")):
            measured = _digest_now(checkpoint, when, digests_now)
        if measured != digest:
            continue
        sampling = record.get("sampling") or {}
        where = f"the run's {path.relative_to(run_path)}" if run_path in path.parents else str(path)
        found.append(((sampling.get("num_samples") or 0, when), {
            "fid": fid, "where": where, "sampler": sampling.get("sampler"),
            "steps": sampling.get("steps"), "num_samples": sampling.get("num_samples"),
            "guidance": record.get("headline_guidance"),
            "features_label": (record.get("features") or {}).get("label", "features unknown")}))
    return max(found, key=lambda f: f[0])[1] if found else None


def seen_line(info: dict) -> str:
    """The card's line of how long the weights trained and which they are; weights read from a diffusers folder
    (no step, no images seen recorded) are said to be that, not "0 images"."""
    from fastddpm.rundir.locate import WEIGHTS_LABELS

    seen = ("not recorded (weights read from a diffusers folder)" if info.get("step") is None else
            f"{info.get('images_seen') or 0:,} (step {info['step']})")
    return f"- images seen: {seen}; weights: {WEIGHTS_LABELS[info.get('weights', 'ema')]}"


def fid_lines(fid: dict | None, evaluated: dict | None) -> list[str]:
    """The card's FID lines, every format's: `fid`, the run's own evaluation of these weights
    (fid_of_these_weights); `evaluated`, `fastddpm eval`'s (eval_of_these_weights); or that none measured them."""
    lines = []
    if fid:
        lines.append(f"- FID {fid['fid']:.2f} at {fid.get('images_seen', 0):,} images "
                     f"({fid.get('features_label', 'features unknown')})")
    if evaluated:
        e = evaluated
        guided = "" if e["guidance"] is None else f", guidance {e['guidance']:g}"
        lines.append(f"- FID {e['fid']:.2f} by `fastddpm eval` of these weights ({e['where']}): "
                     f"{e['sampler']} {e['steps']} steps, {e['num_samples']:,} samples{guided}, {e['features_label']}")
    if not fid and not evaluated:
        lines.append("- FID: not measured for these weights by the run (`fastddpm eval` measures it)")
    return lines


def model_card(cfg, info: dict, fid: dict | None, fmt: str, files: list[str], command: str, *,
               evaluated: dict | None = None) -> str:
    """The card's text. `fid`: the run's own evaluation of these weights (fid_of_these_weights); `evaluated`:
    `fastddpm eval`'s (eval_of_these_weights)."""
    m, d = cfg.model, cfg.diffusion
    inputs, sampler = _network_io(cfg)
    lines = [f"# fastddpm denoiser ({cfg.preset or 'custom'} preset)", "",
             f"- trained on: `{cfg.data.source}` ({m.image_channels}x{m.image_size}x{m.image_size} images)"
             + (f", {m.num_classes} classes: {', '.join(m.class_names)}" if m.conditional else ""),
             seen_line(info),
             (f"- diffusion: {d.num_timesteps} steps, {d.schedule} schedule, predicts {d.prediction} "
              "(schedule.json holds the betas)" if d.objective == "ddpm" else
              f"- diffusion: {d.objective} (schedule.json holds its parameters and the network's inputs)"),
             *fid_lines(fid, evaluated)]
    lines += [f"- format: {fmt}; files: {', '.join(files)}",
              f"- inputs: x (B, {m.image_channels}, {m.image_size}, {m.image_size}), t"
              + (f", y int64 (B,) in [0, {m.num_classes}] ({m.num_classes} = no class)" if m.conditional else "")
              + f"; {inputs}; the output has x's shape",
              f"- made by: `{command}`", "", *how_to_sample(cfg, fmt, sampler)]
    return "\n".join(lines) + "\n"


def how_to_sample(cfg, fmt: str, sampler: str) -> list[str]:
    """The card's sampling instructions: only what loads this format's folder (fastddpm sample reads a safetensors
    export but not ONNX or .pt2; the folder's sample_onnx.py reads ONNX only), each run from the folder itself (the
    path it was exported to is the exporter's: a copied or uploaded folder is elsewhere)."""
    m, d = cfg.model, cfg.diffusion
    guidance = cfg.train.sample_guidance
    if fmt == "safetensors":
        cls = (f" Add `--class NAME|ID|all` for one of the classes above (guided at W = {guidance:g} unless "
               "`--guidance W`)." if m.conditional else "")
        return [f"Sample from this folder with `fastddpm sample --checkpoint .` (or `--checkpoint model.safetensors`; "
                f"the images go to samples/ here unless `--out DIR`), `fastddpm.load('.')` in Python, or "
                f"{sampler}.{cls}"]
    if fmt == "onnx":
        cls = (f" `--class NAME|ID` draws one of the classes above with classifier-free guidance at W = "
               f"{guidance:g}, the run's, as `fastddpm sample` does (`--guidance W` to change it); without "
               "`--class` it draws unconditionally." if m.conditional else "")
        return [f"Sample from this folder with `python sample_onnx.py . --out grid.png` (fastddpm's sampler for ONNX "
                "exports, copied here: it needs onnxruntime and numpy only: DDIM, or Euler's method for an EDM or "
                f"flow model; `--help` lists its options), or with {sampler}.{cls} model.onnx carries schedule.json "
                "and config.json in its metadata (`fastddpm.schedule`, `fastddpm.config`), so `python sample_onnx.py "
                "model.onnx` samples the file alone too. `fastddpm sample` does not read ONNX: it samples the run "
                "this came from (export.json names its checkpoint)."]
    # torch-export: torch alone loads it; fastddpm sample and the ONNX example do not read .pt2
    y = (f", torch.full((n,), {m.num_classes})" if m.conditional else "")
    how = "Sample with torch alone" + ("" if d.objective == "ddpm" else f", by Euler's method below (or {sampler})")
    lines = [f"{how} (`fastddpm sample` does not read .pt2: it samples the run this came from, which export.json "
             "names):", "", "```python",
             "import json, torch" if d.objective == "ddpm" else "import json, math, torch",
             'folder = "."  # this folder',
             'net = torch.export.load(f"{folder}/model.pt2").module()',
             'schedule = json.load(open(f"{folder}/schedule.json"))']
    if d.objective != "ddpm":
        return lines + _euler_loop(d.objective, y, m.num_classes if m.conditional else None)
    x0 = ("a.sqrt() * x - (1 - a).sqrt() * out" if d.prediction == "v" else "(x - (1 - a).sqrt() * out) / a.sqrt()")
    return lines + [
        'alpha_bar = torch.cumprod(1 - torch.tensor(schedule["betas"], dtype=torch.float64), 0)',
        f"n, T, steps = 16, {d.num_timesteps}, 20  # DDIM (eta 0) over 20 evenly spaced timesteps",
        "ts = [round(T - i * T / steps) - 1 for i in range(steps)]",
        'x = torch.randn(n, *schedule["image_shape"], dtype=torch.float64)',
        "with torch.no_grad():",
        "    for i, t in enumerate(ts):",
        f"        out = net(x.float(), torch.full((n,), t){y}).double()"
        + (f"  # y: a class id, {m.num_classes} = none; guided: out(none) + W (out(y) - out(none))"
           if m.conditional else ""),
        "        a, a_next = alpha_bar[t], alpha_bar[ts[i + 1]] if i + 1 < steps else torch.tensor(1.0)",
        f"        x0 = ({x0}).clamp(-1, 1)",
        "        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()",
        "        x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps",
        "images = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)  # (n, C, H, W)", "```"]


def _euler_loop(objective: str, y: str, num_classes: int | None) -> list[str]:
    """The .pt2 card's loop for an EDM or flow export: Euler's method over the levels `fastddpm sample --sampler
    euler` walks (Karras et al.'s for EDM, the shifted even ones for flow), as sample_onnx.euler does in numpy."""
    if objective == "edm":
        levels = ['rho, sd = schedule["rho"], schedule["sigma_data"]',
                  'hi, lo = schedule["sigma_max"] ** (1 / rho), schedule["sigma_min"] ** (1 / rho)',
                  "levels = [(hi + i / max(steps - 1, 1) * (lo - hi)) ** rho for i in range(steps)]  # sigma",
                  "alpha, sigma = [1.0] * (steps + 1), levels + [0.0]  # x = alpha x0 + sigma eps"]
        call = ["        norm = math.sqrt(v * v + sd * sd)  # EDM's preconditioning: c_in, c_noise, c_skip, c_out",
                f"        out = net((x / norm).float(), torch.full((n,), 250 * math.log(v)){y}).double()",
                "        x0 = sd * sd / norm**2 * x + v * sd / norm * out"]
    else:
        levels = ['s = schedule["shift"]', "shift = lambda t: s * t / (1 + (s - 1) * t)",
                  'levels = [shift(1 + i / max(steps - 1, 1) * (shift(schedule["t_min"]) - 1)) for i in '
                  "range(steps)]  # t",
                  "alpha, sigma = [1 - v for v in levels] + [1.0], levels + [0.0]  # x = alpha x0 + sigma eps"]
        call = [f"        out = net(x.float(), torch.full((n,), 1000 * v){y}).double()",
                "        x0 = x - v * out  # out: the velocity eps - x0"]
    if num_classes is not None:
        call[-2] += f"  # y: a class id, {num_classes} = none; guided: out(none) + W (out(y) - out(none))"
    return ["n, steps = 16, 20  # Euler's method (DDIM's update) over 20 levels, then to 0",
            *levels, 'x = sigma[0] * torch.randn(n, *schedule["image_shape"], dtype=torch.float64)',
            "with torch.no_grad():", "    for i, v in enumerate(levels):", *call,
            "        x0 = x0.clamp(-1, 1)", "        eps = (x - alpha[i] * x0) / sigma[i]",
            "        x = alpha[i + 1] * x0 + sigma[i + 1] * eps",
            "images = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)  # (n, C, H, W)", "```"]
