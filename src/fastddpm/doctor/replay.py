"""The model's own matmuls and convolutions, replayed in fp32 and in bf16/fp16: the speed-up autocast gives THIS
model, not a large square matmul's.

A device's peak ratio (bf16 matmul rate / fp32's, about 2x on a CPU with AVX512-BF16) overstates what small
convolutions gain: at 8 channels a bf16 convolution, with the cast of its input, can be slower than fp32's. The
profiled trace records every op's shapes and arguments, so the ops that take most of the fp32 matmul time are
rebuilt from them (random contiguous data of the same shapes, the same convolution parameters) and timed both
ways, as autocast would run them: a forward casts its fp32 input each call (the weights' casts are cached); a
backward runs on low-precision gradients. The ratio is their time-weighted mean, and it is what rule 16
promises. A CPU trace only: a GPU trace's host durations are launches, not kernels.
"""

from __future__ import annotations

import ast
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fastddpm.doctor.trace_flops import nested_ops

FORWARD = {"aten::convolution", "aten::mm", "aten::addmm", "aten::bmm"}
BACKWARD = {"aten::convolution_backward"}
COVER = 0.9  # replay the ops that take this share of the fp32 matmul time (at most MAX_OPS distinct shapes)
MAX_OPS = 12


@dataclass
class Replay:
    ratio: float  # fp32 time / low-precision time over the replayed ops, weighted by their time in the trace
    ops: int  # distinct (op, shapes) replayed
    covered: float  # their share of the trace's matmul/conv time in the replayed ops' dtype
    of: str = "fp32"  # that dtype

    def basis(self, dtype: str) -> str:
        speed = (f"ran {self.ratio:.2f}x faster in {dtype} than in fp32" if self.ratio >= 1 else
                 f"ran in {dtype} at {self.ratio:.2f}x fp32's speed")
        return (f"replayed: this model's own {self.ops} heaviest matmul/convolution shapes ({100 * self.covered:.0f}% "
                f"of its {self.of} matmul time) {speed}, input casts included")


# the profiler's "Input type" names of the dtypes whose ops can be replayed
INPUT_TYPES = {"fp32": "float", "bf16": "c10::BFloat16", "fp16": "c10::Half"}


def replay(events: list[dict], dtype: torch.dtype, device: torch.device | str, *, of: str = "fp32") -> Replay | None:
    """The speed-up of the trace's matmuls and convolutions in `dtype` over fp32, measured by replaying them; None
    when the trace records no such op with its shapes, or is a GPU trace: there an op's host duration is its
    launch, not its kernel, and says nothing of which shapes take the time (the device's peak ratio is used).
    `of`: the ops replayed, by their input dtype: "fp32" (what autocast would speed up), or "bf16"/"fp16" (a loop
    already under autocast: what dropping it would give, a ratio below 1 where the device emulates the dtype)."""
    device = torch.device(device)
    if device.type != "cpu" or any(e.get("cat") == "kernel" for e in events):
        return None
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("name") in FORWARD | BACKWARD]
    inside = nested_ops(ops, FORWARD | BACKWARD)  # an mm inside a convolution's own call counts once
    groups: dict[str, list] = {}  # key -> [total us, calls, event]
    for e in ops:
        name, args = e.get("name"), e.get("args") or {}
        if id(e) in inside or "Input Dims" not in args:
            continue
        if any(t not in (INPUT_TYPES[of], "") for t in (args.get("Input type") or [])[:3]):
            continue  # not an op of that dtype (or of mixed dtypes): not the question asked
        key = json.dumps([name, args["Input Dims"], args.get("Concrete Inputs")])
        g = groups.setdefault(key, [0.0, 0, e])
        g[0] += float(e.get("dur", 0))
        g[1] += 1
    total = sum(g[0] for g in groups.values())
    if not total:
        return None
    fp32_s = low_s = covered = 0.0
    ops = 0
    for us, calls, e in sorted(groups.values(), key=lambda g: -g[0]):
        if covered / total >= COVER or ops >= MAX_OPS:
            break
        try:
            pair = _rebuild(e, dtype, device)
            if pair is None:
                continue
            t32, tlow = (_time(fn, device) for fn in pair)
        except Exception:  # noqa: BLE001 - an op this build cannot run in `dtype` (or out of memory): not counted
            continue
        # each op's traced time is the time in its own dtype; the other dtype's is that time scaled by the replay
        if of == "fp32":
            fp32_s, low_s = fp32_s + us * 1e-6, low_s + us * 1e-6 * tlow / t32
        else:
            fp32_s, low_s = fp32_s + us * 1e-6 * t32 / tlow, low_s + us * 1e-6
        covered += us
        ops += 1
    if not ops or not low_s:
        return None
    # min: a sum of the parts may round past 1
    return Replay(ratio=fp32_s / low_s, ops=ops, covered=min(1.0, covered / total), of=of)


def _concrete(args: dict, i: int):
    text = (args.get("Concrete Inputs") or [""] * (i + 1))[i]
    return ast.literal_eval(text) if text not in ("", None) else None


def _rebuild(e: dict, dtype: torch.dtype, device: torch.device) -> tuple[Callable, Callable] | None:
    """(the op in fp32, the op as autocast runs it in `dtype`), on random data of the recorded shapes."""
    name, args = e["name"], e["args"]
    dims = args["Input Dims"]
    g = torch.Generator(device=device).manual_seed(0)

    def rand(shape, dt=torch.float32):
        return torch.randn(shape, generator=g, device=device).to(dt) if shape else None

    if name == "aten::convolution":
        x, w, b = (rand(d) for d in dims[:3])
        params = [_concrete(args, i) for i in range(3, 9)]
        if None in params:
            return None
        stride, padding, dilation, transposed, out_pad, groups = params
        wl, bl = w.to(dtype), b.to(dtype) if b is not None else None

        def conv(x_, w_, b_):
            return torch.ops.aten.convolution(x_, w_, b_, stride, padding, dilation, transposed, out_pad, groups)

        return (lambda: conv(x, w, b)), (lambda: conv(x.to(dtype), wl, bl))
    if name == "aten::convolution_backward":
        gy, x, w = (rand(d) for d in dims[:3])
        params = [_concrete(args, i) for i in range(3, 11)]
        if None in params[1:]:
            return None
        bias_sizes, stride, padding, dilation, transposed, out_pad, groups, mask = params
        low = [t.to(dtype) for t in (gy, x, w)]

        def conv_back(gy_, x_, w_):
            return torch.ops.aten.convolution_backward(gy_, x_, w_, bias_sizes, stride, padding, dilation, transposed,
                                                       out_pad, groups, mask)

        return (lambda: conv_back(gy, x, w)), (lambda: conv_back(*low))
    tensors = [rand(d) for d in dims[:3] if d]
    if len(tensors) != (3 if name == "aten::addmm" else 2):
        return None
    if name == "aten::addmm":  # a Linear: bias, input, weight^T; the bias and weight casts are cached
        bias, x, w = tensors
        bl, wl = bias.to(dtype), w.to(dtype)
        return (lambda: torch.addmm(bias, x, w)), (lambda: torch.addmm(bl, x.to(dtype), wl))
    op = torch.mm if name == "aten::mm" else torch.bmm
    a, b = tensors
    bl = b.to(dtype)  # the second factor: a weight's cached cast, or a tensor already in low precision
    return (lambda: op(a, b)), (lambda: op(a.to(dtype), bl))


def _time(fn: Callable, device: torch.device, budget_s: float = 0.05) -> float:
    """Seconds per call: warm once, then the median of repeats of batches of calls within about `budget_s`. A call
    longer than the whole budget is timed twice, the faster kept: an emulated dtype's matmul (bf16 on a CPU without
    avx512_bf16 or amx_bf16 multiplies at about 1.4 GFLOP/s: 0.4 s for 256 x 1024 x 1024) would cost seconds more
    in five repeats and change no verdict."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        sync()
        return max(time.perf_counter() - t0, 1e-7)

    fn()
    sync()
    once = timed()
    if once >= budget_s:
        return min(once, timed())
    n = max(1, int(budget_s / 5 / once))
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()  # note: sync, the batch of calls has run
        runs.append((time.perf_counter() - t0) / n)
    return statistics.median(runs)
