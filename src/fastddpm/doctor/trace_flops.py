"""The matmul, convolution and attention ops of a profiler trace: which ops they are, their FLOPs from the
recorded input shapes (counted as torch.utils.flop_counter.FlopCounterMode counts them), their input dtypes, and
the kernels each of them (and each GroupNorm op) launched. Rule 12 (matmul dtypes) and rule 13 (MFU) read these."""

from __future__ import annotations

import bisect
import re

# Matmul/conv ops whose inputs' dtype says whether autocast covered them (rule 12). `aten::conv2d` and
# `aten::linear` are left out: under autocast they appear as an fp32 outer call that casts around the bf16
# `aten::convolution` / `aten::addmm` that does the work. Some of these ops still nest (the SDPA backward op
# calls `aten::_flash_attention_backward` / `aten::_efficient_attention_backward`): only the outermost one of
# a nest is counted (`nested_ops`).
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution", "aten::convolution_backward",
            "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward",
            "aten::_flash_attention_backward",
            "aten::_efficient_attention_backward", "aten::_scaled_dot_product_flash_attention_backward",
            "aten::_scaled_dot_product_efficient_attention_backward",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
NORM_OPS = {"aten::group_norm", "aten::native_group_norm", "aten::native_group_norm_backward"}

DTYPE = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64",
         "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8"}


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text or "")]


def gemm_flops(name: str, dims: list, concrete: list | None = None) -> int:
    """FLOPs (2 per multiply-add) of one matmul/conv/attention op from its recorded input shapes, counted as
    torch.utils.flop_counter.FlopCounterMode counts them.

    Conv backward counts each gradient it computes (input, weight) as one forward. Attention counts QK^T and
    PV forward; backward recomputes QK^T and adds dP, dV, dQ, dK (2.5x forward when the head dims agree)."""
    try:
        if name == "aten::mm":
            (m, k), (_, n) = dims[0], dims[1]
            return 2 * m * k * n
        if name == "aten::addmm":
            (m, k), (_, n) = dims[1], dims[2]
            return 2 * m * k * n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = dims[0], dims[1]
            return 2 * b * m * k * n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = dims[1], dims[2]
            return 2 * b * m * k * n
        if name in ("aten::convolution", "aten::convolution_backward"):
            concrete = concrete or []
            backward = name.endswith("backward")
            x, w = (dims[1], dims[2]) if backward else (dims[0], dims[1])
            if len(w) < 3:
                return 0
            # after the tensors: stride, padding, dilation, transposed, output_padding, groups; the tensors are
            # (input, weight, bias) forward and (grad_output, input, weight, bias_sizes) backward
            base = 4 if backward else 3
            stride = _ints(concrete[base]) if len(concrete) > base else []
            pad = _ints(concrete[base + 1]) if len(concrete) > base + 1 else []
            dil = _ints(concrete[base + 2]) if len(concrete) > base + 2 else []
            transposed = len(concrete) > base + 3 and concrete[base + 3] in ("True", "1")
            kernel = w[2:]
            if transposed:
                # weight (C_in, C_out/groups, k...): every *input* pixel scatters into a C_out/groups x k patch
                pixels = x[2:]
            elif backward:
                pixels = dims[0][2:]  # grad_output has the forward's output size
            else:
                pixels = [
                    (s + 2 * (pad[i] if i < len(pad) else 0) - (dil[i] if i < len(dil) else 1) * (k - 1) - 1)
                    // (stride[i] if i < len(stride) else 1) + 1
                    for i, (s, k) in enumerate(zip(x[2:], kernel))
                ]
            # w[0] * w[1] is C_out * C_in/groups (or C_in * C_out/groups transposed): grouped convs included
            fwd = 2 * x[0] * w[0] * w[1] * _prod(pixels) * _prod(kernel)
            if not backward:
                return fwd
            # output_mask (last argument): which of grad_input, grad_weight, grad_bias are computed; each of the
            # first two costs one forward (the first layer's input needs no gradient). FlopCounterMode counts a
            # grouped conv's weight gradient `groups` times; this counts the work done.
            mask = re.findall(r"True|False|1|0", concrete[-1]) if concrete else []
            return fwd * (sum(v in ("True", "1") for v in mask[:2]) if len(mask) >= 2 else 2)
        if "attention" in name:
            backward = "backward" in name
            q, k, v = dims[1:4] if backward else dims[0:3]  # backward ops take grad_out first
            if not (len(q) == len(k) == len(v) == 4):
                return 0
            if name in ("aten::_flash_attention_backward", "aten::_efficient_attention_backward"):
                q, k, v = ([t[0], t[2], t[1], t[3]] for t in (q, k, v))  # these take (B, L, H, D), not (B, H, L, D)
            b, h, l, d_qk = q
            s, d_v = k[2], v[3]
            qk = 2 * b * h * l * s * d_qk  # scores = Q K^T: (B, H, L, S)
            pv = 2 * b * h * l * s * d_v  # out = P V: (B, H, L, Dv)
            # backward: QK^T again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q
            return 3 * qk + 2 * pv if backward else qk + pv
    except (IndexError, TypeError, ValueError):
        return 0
    return 0


def op_dtype(e: dict) -> str:
    """The input dtype of a matmul/conv op (addmm/baddbmm: of the matrices, not the bias)."""
    types = (e.get("args") or {}).get("Input type") or ["?"]
    t = types[1] if e.get("name") in ("aten::addmm", "aten::baddbmm") and len(types) > 1 else types[0]
    return DTYPE.get(t, t or "?")


def nested_ops(op_events: list[dict], names: set[str]) -> set[int]:
    """ids of the ops named in `names` that run inside another such op on the same thread: counting both would
    count one piece of work twice (an SDPA backward op and the attention kernel op it calls)."""
    by_tid: dict = {}
    for o in op_events:
        if o.get("name") in names:
            by_tid.setdefault(o.get("tid"), []).append(o)
    out = set()
    for lst in by_tid.values():
        open_ends: list[float] = []  # ends of the enclosing ops still open, outermost first
        for o in sorted(lst, key=lambda o: (float(o["ts"]), -float(o.get("dur", 0)))):
            ts = float(o["ts"])
            while open_ends and open_ends[-1] <= ts:
                open_ends.pop()
            if open_ends:
                out.add(id(o))
            open_ends.append(ts + float(o.get("dur", 0)))
    return out


def gemm_flops_of(e: dict) -> float:
    args = e.get("args") or {}
    if "flops" in args and e.get("name") not in ("aten::convolution_backward",):
        return float(args["flops"])
    return float(gemm_flops(e.get("name", ""), args.get("Input Dims") or [], args.get("Concrete Inputs")))


def kernel_owner_ops(kernels: list[dict], launches: dict, op_events: list[dict]) -> dict[int, dict]:
    """For each kernel, the innermost matmul/conv/norm op (on the launching thread) enclosing its launch."""
    by_tid: dict = {}
    for o in op_events:
        if o.get("name") in GEMM_OPS or o.get("name") in NORM_OPS:
            by_tid.setdefault(o.get("tid"), []).append(o)
    for lst in by_tid.values():
        lst.sort(key=lambda o: float(o["ts"]))
    starts = {tid: [float(o["ts"]) for o in lst] for tid, lst in by_tid.items()}
    out = {}
    for k in kernels:
        launch = launches[k["args"]["correlation"]]
        tid = launch.get("tid")
        lst = by_tid.get(tid)
        if not lst:
            continue
        ts = float(launch["ts"])
        i = bisect.bisect_right(starts[tid], ts) - 1
        # ops nest, so the latest-starting op that still encloses the launch is the innermost one; a few
        # steps back suffice (these ops do not nest deeply)
        for j in range(i, max(-1, i - 8), -1):
            o = lst[j]
            if float(o["ts"]) + float(o.get("dur", 0)) >= ts:
                out[id(k)] = o
                break
    return out
