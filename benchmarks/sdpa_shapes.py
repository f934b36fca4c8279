"""Attention at a preset's own shapes: forward + backward time of each scaled_dot_product_attention backend, and
of the same attention zero-padded to a larger head dimension.

    PYTHONPATH=src python benchmarks/sdpa_shapes.py --presets seed-1layer --batch-size 1024 [--device cuda]
        [--dtype bf16] [--pad 8,16,32] [--steps 20] [--repeats 5] [--out sdpa.json]

Why: on an H200 the seed U-Net's eight attention calls took 40% of its compiled step, one of them (on PyTorch's
flash kernel, whose smallest tile is a head dimension of 32) as long as the other seven. The U-Net keeps 4 heads
at every level, so its head dimension follows the channels down to 4. Zero-padding q, k and v along the head
dimension computes the same function when the softmax scale stays 1/sqrt(d) of the true d: the padded columns of
q and k add 0 to every dot product, and the padded columns of the output (from v's zeros) are sliced off. So a
padded call is what `--attention-head-pad N` (fastddpm.models.attention) runs in the model.

Each (shape, variant) is checked against fp32 math attention on two images (`max_abs_diff`), then timed with
`fastddpm.measure.time_steps` (CUDA events on a GPU), forward and backward of q, k, v, after warm-up; the
variants of one shape alternate within every repeat so drift hits them alike. A backend that cannot run a shape (head dimension, dtype, device) is recorded with its error.
--out is rewritten after every shape, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fastddpm.bench.store import write_json  # noqa: E402
from fastddpm.bench.throughput import preset_image_shape  # noqa: E402
from fastddpm.config.presets import get_preset  # noqa: E402
from fastddpm.measure import environment_record, summarize, time_steps  # noqa: E402
from fastddpm.models import build_unet  # noqa: E402
from fastddpm.models.attention import attend  # noqa: E402

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def _spy(calls: list[tuple[int, ...]]):
    """Record the q shape (B, heads, tokens, head dim) of every F.scaled_dot_product_attention call."""
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def attention_shapes(preset: str) -> list[dict]:
    """The preset's attention calls in forward order: [{"heads", "tokens", "head_dim", "calls"}], equal shapes
    merged (a forward of 2 random images on the CPU; the batch is the caller's)."""
    c, h, w = preset_image_shape(preset)
    cfg = dataclasses.replace(get_preset(preset).model, image_channels=c, image_size=h)
    model = build_unet(cfg).eval()
    calls: list[tuple[int, ...]] = []
    y = torch.zeros(2, dtype=torch.long) if cfg.num_classes else None
    with _spy(calls), torch.no_grad():
        model(torch.randn(2, c, h, w), torch.randint(0, 1000, (2,)), *([y] if y is not None else []))
    merged: dict[tuple[int, int, int], int] = {}
    for _, heads, tokens, head_dim in calls:
        merged[(heads, tokens, head_dim)] = merged.get((heads, tokens, head_dim), 0) + 1
    return [{"heads": a, "tokens": t, "head_dim": d, "calls": n} for (a, t, d), n in merged.items()]


def attention(q, k, v, *, backend: str, pad_to: int | None):
    """SDPA on one backend; with `pad_to`, q, k, v zero-padded along the head dimension to `pad_to` and the
    scale kept at 1/sqrt(true head dim), the output sliced back: the same function."""
    ctx = sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] is not None else contextlib.nullcontext()
    with ctx:
        return attend(q, k, v, pad_to=pad_to or 0)


def variants(head_dim: int, pads: list[int]) -> list[tuple[str, str, int | None]]:
    """(name, backend, pad_to): every backend as is, then the default backend padded to each larger size."""
    out = [(name, name, None) for name in BACKENDS]
    out += [(f"default-pad{p}", "default", p) for p in pads if p > head_dim]
    return out


def time_shape(shape: dict, batch: int, dtype: torch.dtype, device: torch.device, pads: list[int], *,
               steps: int, repeats: int, warmup: int = 3) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    dims = (batch, shape["heads"], shape["tokens"], shape["head_dim"])
    q, k, v = (torch.randn(dims, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(dims, device=device, dtype=dtype, generator=gen)
    # every variant checked against fp32 math attention on the first two images (the whole batch would not fit
    # the math backend's L x L matrices at the larger shapes)
    reference = attention(q[:2].float(), k[:2].float(), v[:2].float(), backend="math", pad_to=None)
    runs: dict[str, dict] = {}
    live = []
    for name, backend, pad in variants(shape["head_dim"], pads):
        def step(_i, backend=backend, pad=pad):  # forward + backward, no gradient accumulated into q, k, v
            torch.autograd.grad(attention(q, k, v, backend=backend, pad_to=pad), (q, k, v), grad)
        try:
            for _ in range(warmup):
                step(0)
            with torch.no_grad():
                out = attention(q[:2], k[:2], v[:2], backend=backend, pad_to=pad).float()
            runs[name] = {"max_abs_diff": float((out - reference).abs().max())}
            live.append((name, step))
            runs.setdefault(name, {})["ms"] = []
        except RuntimeError as e:  # this backend cannot run this shape here
            runs[name] = {"error": str(e).splitlines()[0][:200]}
    for r in range(repeats):
        order = live[r % len(live):] + live[:r % len(live)] if live else []  # rotate: none always goes first
        for name, step in order:
            runs[name]["ms"].append(time_steps(step, steps, device) / steps)
    for name, _ in live:
        runs[name]["summary"] = summarize(runs[name]["ms"])
    timed = {n: r["summary"]["median"] for n, r in runs.items() if "summary" in r}
    best = min(timed, key=timed.get) if timed else None
    return {**shape, "batch": batch, "variants": runs, "best": best,
            "best_vs_default": timed["default"] / timed[best] if best and "default" in timed else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="seed-1layer", help="comma-separated presets (default seed-1layer)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--pad", default="8,16,32", help="head dimensions to zero-pad smaller ones to (default 8,16,32)")
    p.add_argument("--steps", type=int, default=20, help="forward + backward calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("sdpa_shapes.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    pads = sorted(int(x) for x in a.pad.split(",") if x)
    record = {"environment": environment_record(device), "dtype": a.dtype, "batch_size": a.batch_size,
              "steps": a.steps, "repeats": a.repeats, "shapes": {}}
    for preset in a.presets.split(","):
        record["shapes"][preset] = []
        for shape in attention_shapes(preset):
            row = time_shape(shape, a.batch_size, dtype, device, pads, steps=a.steps, repeats=a.repeats)
            record["shapes"][preset].append(row)
            write_json(a.out, record)  # as measured
            d = row["variants"].get("default", {}).get("summary", {}).get("median")
            print(f"{preset} heads {shape['heads']} tokens {shape['tokens']} head dim {shape['head_dim']} "
                  f"(x{shape['calls']}): default {d if d is None else f'{d:.3f} ms'}, best {row['best']}"
                  + (f" ({row['best_vs_default']:.2f}x)" if row["best_vs_default"] else ""), flush=True)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
