"""Draw the CPU sampler tables of benchmarks/RESULTS.md (issue #16) as FID against network calls.

`fastddpm bench samplers` draws this plot itself from the rows of its own folder. The CPU table was built over
several sessions whose run folders (git-ignored) did not survive, so this script draws it from the FIDs recorded
in RESULTS.md, sections "Few-step samplers (issue #16): FID against network calls, on the CPU" and "...: the
SDE solver". The numbers below are copied from those tables; change both together. The plot itself is
fastddpm's (bench.samplers.write_plot).

    .venv/bin/python benchmarks/plot_cpu_samplers.py [--out benchmarks/cpu/samplers.png]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fastddpm.bench.samplers import write_plot
from fastddpm.diffusion import network_calls

NUM_TIMESTEPS = 1000
# FID per step count, one value per seed (seed 0 first), fastddpm-features, 2,000 samples each.
FID_BY_SAMPLER_STEPS: dict[str, dict[int, list[float]]] = {
    "ddim": {5: [18.53], 10: [13.78], 20: [12.94], 50: [12.74, 12.23, 12.34], 100: [13.15, 12.57, 12.66]},
    "dpmpp-2m": {5: [19.06], 10: [14.22, 13.25, 14.15], 20: [12.85, 12.23, 12.65], 50: [12.78], 100: [12.78]},
    "unipc": {5: [16.47], 10: [12.52], 20: [12.13], 50: [12.74], 100: [12.84]},
    "heun": {5: [24.36], 10: [13.58], 20: [12.85], 50: [12.93], 100: [13.03]},
    # Measured 2026-11-23 (afternoon) with a retrained feature network and a retrained checkpoint (same code and
    # seeds as the other points; DDIM-5 re-measured 18.50 there against 18.53): see RESULTS.md.
    "ddpm": {NUM_TIMESTEPS: [6.48]},
    # Measured 2026-11-25 on that retrained checkpoint's twin (the same command again; DDIM-5 18.50 on both):
    # RESULTS.md, "Few-step samplers (issue #16): the SDE solver".
    "dpmpp-2m-sde": {10: [10.67], 20: [7.58, 7.76, 8.21], 50: [6.24, 6.30, 6.92], 100: [6.20]},
}


def summary() -> list[dict]:
    out = []
    for sampler, by_steps in FID_BY_SAMPLER_STEPS.items():
        for steps, fids in by_steps.items():
            out.append({"sampler": sampler, "steps": steps, "nfe": network_calls(sampler, steps, NUM_TIMESTEPS),
                        "seeds": len(fids), "fid": statistics.fmean(fids), "fid_min": min(fids),
                        "fid_max": max(fids)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "cpu" / "samplers.png"))
    args = ap.parse_args()
    result = {"summary": summary(), "features": {"label": "fastddpm-features"},
              "checkpoint": {"file": "quickstart cpu-demo (CPU)"}, "settings": {"num_samples": 2000}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    path = write_plot(result, Path(args.out), log=print)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
