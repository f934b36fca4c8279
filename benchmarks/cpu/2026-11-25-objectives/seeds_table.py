"""The training-seed table of the objectives comparison: FID per objective x training seed at the scored points,
and the paired differences (flow minus each DDPM objective, same seed, same precision, same feature network).

Reads raw/ (seed 0, bf16 on an AMD Zen 5), raw-fp32/seedN/NAME/ (seeds.sh's fp32 arm), raw-cond-fp32/seedN/NAME/
(its conditional arm, guidance W = 2: each cell also gives the class accuracy) and, where given, the bf16 arm's
seeds.sh folder. Usage: python seeds_table.py [BF16_SEEDS_DIR] > seeds.md"""

import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ["flow", "ddpm-eps-linear", "ddpm-eps-cosine", "ddpm-v-cosine", "edm"]
POINTS = [("unipc", 10), ("dpmpp-2m-sde", 10), ("dpmpp-2m-sde", 20), ("heun", 10)]


def runs() -> list[dict]:
    """One record per (arm, seed, objective) that has at least one score."""
    found = []
    folders = [("bf16", 0, HERE / "raw" / name, name) for name in NAMES]
    for arm in ("fp32", "cond-fp32"):
        for seed_dir in sorted((HERE / f"raw-{arm}").glob("seed*")):
            folders += [(arm, int(seed_dir.name[4:]), seed_dir / name, name) for name in NAMES]
    if len(sys.argv) > 1:
        for seed_dir in sorted(Path(sys.argv[1]).glob("seed*")):
            folders += [("bf16", int(seed_dir.name[4:]), seed_dir / name, name) for name in NAMES]
    for arm, seed, folder, name in folders:
        evals = sorted(folder.glob("eval_*.json")) + sorted(folder.glob("eval-*/eval_*.json"))
        if not evals:
            continue
        fids, accuracy, features = {}, {}, set()
        for f in evals:
            d = json.loads(f.read_text())
            s = d["sampling"]
            fids[(s["sampler"], s["steps"])] = (d["fid"], s["nfe"])
            if d.get("guidance"):  # a conditional model: the first (here the only) scale's class accuracy
                accuracy[(s["sampler"], s["steps"])] = d["guidance"][0]["class_accuracy"]
            features.add(re.sub(r".*-features-|\.npz$", "", d["reference"]["file"]))
        found.append({"arm": arm, "seed": seed, "objective": name, "fid": fids, "accuracy": accuracy,
                      "features": sorted(features)})
    return found


def best(r: dict, calls: int) -> float | None:
    """The lowest FID at <= `calls` network calls among POINTS (seed 0 scored more points: the same set for all)."""
    ok = [fid for point, (fid, nfe) in r["fid"].items() if nfe <= calls and point in POINTS]
    return min(ok) if ok else None


def main() -> None:
    rows = runs()
    cols = " | ".join(f"{s}-{k}" for s, k in POINTS)
    print(f"| arm | seed | objective | {cols} | best <= 10 calls | best <= 20 calls |")
    print("| --- | --- | --- |" + " --- |" * (len(POINTS) + 2))
    for r in sorted(rows, key=lambda r: (r["arm"], NAMES.index(r["objective"]), r["seed"])):
        cells = [f"{r['fid'][p][0]:.2f}" + (f" ({r['accuracy'][p]:.1%})" if p in r["accuracy"] else "")
                 if p in r["fid"] else "-" for p in POINTS]
        b10, b20 = best(r, 10), best(r, 20)
        print(f"| {r['arm']} | {r['seed']} | {r['objective']} | " + " | ".join(cells)
              + f" | {b10:.2f} | {b20:.2f} |" if b10 is not None and b20 is not None else " | - | - |")
    print()
    print("Paired: flow's best minus the objective's best at the same seed, arm and feature network "
          "(negative: flow lower, i.e. better).")
    print()
    print("| objective | budget | per (arm, seed) | mean | min | max |")
    print("| --- | --- | --- | --- | --- | --- |")
    flows = {(r["arm"], r["seed"]): r for r in rows if r["objective"] == "flow"}
    for name in NAMES[1:]:
        for calls in (10, 20):
            diffs = []
            for r in rows:
                f = flows.get((r["arm"], r["seed"]))
                if r["objective"] != name or f is None or f["features"] != r["features"]:
                    continue
                a, b = best(f, calls), best(r, calls)
                if a is not None and b is not None:
                    diffs.append((r["arm"], r["seed"], a - b))
            if diffs:
                d = [x for _, _, x in diffs]
                print(f"| {name} | <= {calls} | " + ", ".join(f"{arm} s{seed}: {x:+.2f}" for arm, seed, x in diffs)
                      + f" | {statistics.mean(d):+.2f} | {min(d):+.2f} | {max(d):+.2f} |")
    print()
    arms = sorted({(r["arm"], f) for r in rows for f in r["features"]})
    print("Feature networks (fastddpm-features, by the hash in the reference statistics' name): "
          + "; ".join(f"{arm}: {f}" for arm, f in arms))


if __name__ == "__main__":
    main()
