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

from fastddpm.bench.timing import environment_record  # noqa: E402


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--preset", default="seed-1layer")
    p.add_argument("--nproc", default=None, help="world sizes, e.g. 1,2,4 (default: 1 and every GPU)")
    p.add_argument("--parallel", default="ddp", help="ddp, fsdp or both (ddp,fsdp); default ddp")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    worlds = [int(n) for n in args.nproc.split(",")] if args.nproc else sorted({1, max(gpus, 1)})
    modes = args.parallel.split(",")
    plain, dist = [], {(n, m): [] for n in worlds for m in modes}
    for _ in range(args.repeats):
        plain.append(run(None, args))
        for n, m in dist:
            dist[n, m].append(run(n, args, m))
    base = statistics.median(plain)
    print(f"plain: {base:,.0f} img/s (runs: {', '.join(f'{x:,.0f}' for x in plain)})")
    rows = []
    for (n, m), runs in dist.items():
        rate = statistics.median(runs)
        rows.append({"world_size": n, "parallel": m, "images_per_s": rate, "per_gpu": rate / n,
                     "efficiency": rate / n / base, "runs": runs})
        print(f"torchrun x{n} {m}: {rate:,.0f} img/s, {rate / n:,.0f} per GPU = {100 * rate / n / base:.1f}% of plain "
              f"(runs: {', '.join(f'{x:,.0f}' for x in runs)})")
    result = {"environment": environment_record("cuda" if gpus else "cpu", sys.argv), "plain_images_per_s": base,
              "plain_runs": plain, "distributed": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
