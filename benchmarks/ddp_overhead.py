"""DDP's (and FSDP's) overhead on one GPU, and scaling where several exist: images/s of `fastddpm train` run plainly
vs under `torchrun --nproc-per-node N` (DDP or --parallel fsdp, world size N), same config, alternated so drift hits
all alike.

    PYTHONPATH=src python benchmarks/ddp_overhead.py --data fashion-mnist [--nproc 1,2,4,8] [--parallel ddp,fsdp]

Throughput is read from the trainer's own metrics.jsonl: images_seen over wall time between logging steps,
after the first two intervals (compilation, autotuning). Per GPU = global images/s / world size; scaling
efficiency = per-GPU rate / the plain single-GPU rate. A world of 1 under torchrun runs the full DDP path (process
group, DDP wrapper, all-reduce), which is the overhead being measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fastddpm.bench.store import write_json  # noqa: E402
from fastddpm.measure import environment_record  # noqa: E402


def run(nproc: int | None, args: argparse.Namespace, parallel: str = "ddp") -> float:
    with tempfile.TemporaryDirectory() as out:
        train = ["train", "--preset", args.preset, "--data", args.data, "--out", out, "--max-steps", str(args.steps),
                 "--log-every", str(args.log_every), "--checkpoint-every", "none", "--no-progress"]
        if nproc is None:
            cmd = [sys.executable, "-m", "fastddpm", *train]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   "-m", "fastddpm", *train, "--parallel", parallel]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        rates = [row["images_per_s"] for row in rows if "images_per_s" in row][2:]
        if not rates:
            raise SystemExit("too few logging intervals: raise --steps or lower --log-every")
        return statistics.median(rates)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--preset", default="seed-1layer")
    p.add_argument("--nproc", default=None, help="world sizes, e.g. 1,2,4 (default: 1 and every GPU)")
    p.add_argument("--parallel", default="ddp", help="ddp, fsdp or both (ddp,fsdp); default ddp")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON result here (rewritten after each repeat)")
    return p


def summary(plain: list[float], dist: dict) -> tuple[float, list[dict]]:
    base = statistics.median(plain)
    rows = []
    for (n, m), runs in dist.items():
        if runs:
            rate = statistics.median(runs)
            rows.append({"world_size": n, "parallel": m, "images_per_s": rate, "per_gpu": rate / n,
                         "efficiency": rate / n / base, "runs": runs})
    return base, rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gpus = torch.cuda.device_count()
    worlds = [int(n) for n in args.nproc.split(",")] if args.nproc else sorted({1, max(gpus, 1)})
    modes = args.parallel.split(",")
    env = environment_record("cuda" if gpus else "cpu", sys.argv if argv is None else [sys.argv[0], *argv])
    plain, dist = [], {(n, m): [] for n in worlds for m in modes}
    for r in range(args.repeats):
        plain.append(run(None, args))
        for n, m in dist:
            dist[n, m].append(run(n, args, m))
        if args.out:  # after each repeat: a run stopped by a time limit keeps the repeats it finished
            base, rows = summary(plain, dist)
            write_json(Path(args.out), {"environment": env, "complete": r + 1 == args.repeats,
                                        "repeats_done": r + 1, "plain_images_per_s": base, "plain_runs": plain,
                                        "distributed": rows})
    base, rows = summary(plain, dist)
    print(f"plain: {base:,.0f} img/s (runs: {', '.join(f'{x:,.0f}' for x in plain)})")
    for row in rows:
        n, m, rate = row["world_size"], row["parallel"], row["images_per_s"]
        print(f"torchrun x{n} {m}: {rate:,.0f} img/s, {rate / n:,.0f} per GPU = {100 * row['efficiency']:.1f}% of "
              f"plain (runs: {', '.join(f'{x:,.0f}' for x in row['runs'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
