"""The objectives table from run.sh's folder: per objective, the training (images, wall time, median images/s)
and FID (fastddpm features, 2,000 samples) at each sampler point; the best at <= 10 and <= 20 network calls.
Usage: python table.py OUTDIR > table.md ; also writes OUTDIR/objectives.json"""

import json
import re
import statistics
import sys
from pathlib import Path

NAMES = ["ddpm-eps-cosine", "ddpm-eps-linear", "ddpm-v-cosine", "edm", "flow"]


def main(out: Path) -> None:
    rows, summary = [], []
    for name in NAMES:
        run = out / name
        if not (run / "ema.safetensors").is_file():
            continue
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                   if '"images_per_s"' in line]
        log = (out / f"{name}.train.log").read_text() if (out / f"{name}.train.log").is_file() else ""
        wall = re.findall(r"wall ([\d.]+) s", log)
        train = {"images": metrics[-1]["images_seen"], "final_loss": metrics[-1]["loss"],
                 "median_images_per_s": statistics.median(m["images_per_s"] for m in metrics[1:]),
                 "wall_s": float(wall[-1]) if wall else None}
        points = []
        for f in sorted(run.glob("eval-*/eval_*.json")):
            d = json.loads(f.read_text())
            s = d["sampling"]
            points.append({"sampler": s["sampler"], "steps": s["steps"], "nfe": s["nfe"], "fid": d["fid"],
                           "precision": d["precision"], "recall": d["recall"], "sample_s": s["wall_s"]})
        best = {}
        for budget in (10, 20):
            ok = [p for p in points if p["nfe"] <= budget]
            best[budget] = min(ok, key=lambda p: p["fid"]) if ok else None
        rows.append({"objective": name, "train": train, "points": points, "best": best})
    print("| objective | train images | train wall (s) | img/s (median) | final loss | best <= 10 calls | "
          "best <= 20 calls |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t = r["train"]
        cell = lambda p: f"{p['fid']:.2f} ({p['sampler']}-{p['steps']}, {p['nfe']} calls)" if p else "-"  # noqa
        print(f"| {r['objective']} | {t['images']:,} | {t['wall_s'] or '-'} | {t['median_images_per_s']:.0f} | "
              f"{t['final_loss']:.4f} | {cell(r['best'][10])} | {cell(r['best'][20])} |")
    print()
    samplers = sorted({(p["sampler"], p["steps"], p["nfe"]) for r in rows for p in r["points"]},
                      key=lambda k: (k[0], k[1]))
    print("| sampler (steps, calls) | " + " | ".join(r["objective"] for r in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for s, k, nfe in samplers:
        cells = []
        for r in rows:
            p = next((p for p in r["points"] if (p["sampler"], p["steps"]) == (s, k)), None)
            cells.append(f"{p['fid']:.2f}" if p else "-")
        print(f"| {s}-{k} ({nfe}) | " + " | ".join(cells) + " |")
    (out / "objectives.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
