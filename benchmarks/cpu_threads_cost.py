"""What fixing the CPU thread count costs: the trainer calls torch.set_num_threads at start (exact resume needs a
reduction order that depends on the thread count alone, see fastddpm.device.fix_cpu_threads), which also
switches MKL's dynamic threading off. This measures the training step of a preset on the CPU both ways.

Each variant runs in its own fresh process (the switch cannot be undone in-process), alternating A B A B ..., so
the machine's drift hits both alike; warm-up steps are not timed; the median of the repeats and their spread
are reported, as a ratio B / A.

    python benchmarks/cpu_threads_cost.py --preset cpu-demo --steps 60 --repeats 3 [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def child(preset: str, steps: int, warmup: int, fixed: bool) -> None:
    import torch

    if fixed:
        from fastddpm.device import fix_cpu_threads

        fix_cpu_threads(None)
    from fastddpm.config import get_preset, resolve_model_shape
    from fastddpm.device import resolve_precision
    from fastddpm.trainer.batches import ResidentBatches
    from fastddpm.trainer.build import Optimization, build_model
    from fastddpm.trainer.fast_path import resolve_fast_path

    cfg = resolve_model_shape(get_preset(preset), (1, 1, 28, 28))
    device = torch.device("cpu")
    precision = resolve_precision("fp32", device)
    fast = resolve_fast_path(cfg.train, device, precision)
    model, schedule = build_model(cfg, device=device, fast=fast)
    step_fn = Optimization(cfg, model, schedule, device=device, precision=precision, fast=fast).build_step()
    bs = cfg.train.batch_size
    images = torch.randint(0, 256, (bs * 8, 1, 28, 28), dtype=torch.uint8).numpy()
    batches = ResidentBatches(images, batch_size=bs, num_timesteps=cfg.diffusion.num_timesteps, seed=0, device=device)
    for m in range(warmup):
        step_fn([batches.get(m)], lr=1e-3, step=m)
    t0 = time.perf_counter()
    for m in range(warmup, warmup + steps):
        step_fn([batches.get(m)], lr=1e-3, step=m)
    seconds = time.perf_counter() - t0
    print(json.dumps({"images_per_s": steps * bs / seconds, "threads": torch.get_num_threads()}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-demo")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=("default", "fixed"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.preset, args.steps, args.warmup, args.child == "fixed")
        return 0
    from fastddpm.measure import environment_record

    runs: dict[str, list[float]] = {"default": [], "fixed": []}
    for r in range(args.repeats):
        for variant in ("default", "fixed"):
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--preset", args.preset,
                                  "--steps", str(args.steps), "--warmup", str(args.warmup)],
                                 capture_output=True, text=True, check=True)
            rate = json.loads(out.stdout.strip().splitlines()[-1])["images_per_s"]
            runs[variant].append(rate)
            print(f"repeat {r + 1}: {variant:7s} {rate:7.1f} img/s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {"preset": args.preset, "steps": args.steps, "warmup": args.warmup, "runs": runs, "median": med,
              "ratio_fixed_over_default": med["fixed"] / med["default"], "environment": environment_record("cpu")}
    print(f"median: default {med['default']:.1f} img/s [{min(runs['default']):.1f}-{max(runs['default']):.1f}], "
          f"fixed {med['fixed']:.1f} img/s [{min(runs['fixed']):.1f}-{max(runs['fixed']):.1f}]; "
          f"fixed / default = {result['ratio_fixed_over_default']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
