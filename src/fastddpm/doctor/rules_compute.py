"""Rules 12, 13, 16-20, 22 and 23 of docs/DOCTOR.md, the step's own work: the compute rules, where the model's
arithmetic is slow, not the pipeline around it (Finding.group "compute"): matmul dtypes (12, 16), MFU (13),
materialised attention (17), eager elementwise work (18), a per-tensor optimizer (19), a small batch (20); and a
Python loop over the batch's samples (22), a per-tensor update of a copy of the parameters, an EMA (23)."""

from __future__ import annotations

from fastddpm.doctor.findings import Finding, Fix, math_words, pct
from fastddpm.doctor.measurements import Measurements
from fastddpm.doctor.thresholds import (ATTENTION_WEIGHTS_SHARE, BATCH_DOUBLING_SAVES, BIG_PARAMS, COMPILE_SAVES,
                                        CPU_LOW_MFU, CPU_MATMUL_SHARE, ELEMENTWISE_SHARE, FOREACH_SAVES,
                                        FP32_GEMM_SHARE, FUSED_ATTENTION_SAVES, GPU_IDLE_SHARE, HEALTHY_FLOOR,
                                        ITEM_LOOP_SAVES, ITEM_LOOP_SHARE, LAYOUT_SHARE, LOW_MFU_SHARE,
                                        LOW_PRECISION_MAX_SPEEDUP, LOW_PRECISION_MIN_RATIO, MEMORY_HEADROOM_SHARE,
                                        OPTIMIZER_OPS, OPTIMIZER_SHARE, OVERHEAD_SHARE, PARAM_LOOP_SAVES,
                                        PARAM_LOOP_SHARE, SMALL_BATCH)
from fastddpm.doctor.trace import BREAKDOWN_LABELS, TraceStats


NO_TRACE_RULES = ("12, 16-20, 22, 23 (the profiled step's ops: matmul dtypes, attention, elementwise, optimizer, "
                  "batch, per-sample loops, EMA updates)")


def precision(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 12: > 20% of matmul/conv FLOPs in fp32 while some run in bf16/fp16 (autocast gap); or, on a GPU,
    none in reduced precision at all (fp32)."""
    t = m.trace
    if t is None:
        # one entry for every rule that reads the profiled step's ops, recorded with the first of them (rule 13
        # has its own: MFU can be had without a trace, from flops_per_step)
        unavailable[NO_TRACE_RULES] = m.no_trace
        return None
    if t.gemm_unavailable:
        unavailable["12 (FLOPs by dtype, GEMM share, autocast coverage)"] = t.gemm_unavailable
        return None
    flops = t.gemm_flops_per_step
    total = sum(flops.values())
    low = flops.get("bf16", 0.0) + flops.get("fp16", 0.0) + flops.get("fp8", 0.0)
    fp32 = flops.get("fp32", 0.0)
    fp32_time_share = fp32_matmul_share(m, t)
    if total > 0 and flops.get("bf16", 0.0) > 0 and not m.cuda:
        emulated = _emulated_bf16(m, t, flops["bf16"] / total)
        if emulated is not None:  # more bf16 would make it slower still: the autocast gap is no fault here
            return emulated
    if total > 0 and low > 0 and fp32 / total > FP32_GEMM_SHARE:
        return Finding(
            "autocast-gap", (12,), "AUTOCAST GAP: part of the matmul work still runs in fp32",
            0.5 * fp32_time_share,
            [f"{pct(fp32 / total)} of matmul/conv FLOPs run with fp32 inputs while {pct(low / total)} run in "
             f"bf16/fp16: autocast covers only part of the hot path",
             f"fp32 matmuls/convs take {pct(fp32_time_share)} of " + _matmul_basis(t) +
             "; the cost is an estimate: bf16 runs about 2x the fp32/TF32 rate on tensor cores (on a CPU "
             "it depends on AMX/AVX512-BF16)"],
            "autocast does not cover the hot path: a forward outside the autocast block, explicit .float() "
            "calls, or a second model (EMA, loss network) called outside it",
            [Fix("--precision bf16 (fastddpm runs the whole loss under autocast)",
                 f"wrap the full forward and loss in torch.autocast('{'cuda' if m.cuda else 'cpu'}', "
                 "dtype=torch.bfloat16); keep the backward outside; look for .float() in the model",
                 trial="autocast-bf16")], group="compute")
    if total > 0 and low == 0:
        return _fp32_matmuls(m, t, total, fp32_time_share)
    return None


def _emulated_bf16(m: Measurements, t: TraceStats, bf16_flops_share: float) -> Finding | None:
    """Rule 12 on a CPU without native bf16: matmuls under bf16 autocast run emulated, several times slower than
    in fp32 (0.23x on the cpu-demo U-Net on a 2-core AMD EPYC with AVX2 only). Prescribe fp32, at the smaller of
    two gains: the model's own bf16 matmuls and convolutions replayed in both dtypes, and the device's peaks. The
    replay alone overstated the gain on an accelerate script (benchmarks/RESULTS.md, "The doctor on a CPU that
    emulates bf16"): alone, its convolutions ran faster in fp32 than they do inside a step."""
    lp = m.low_precision
    if lp is None or lp.native or lp.dtype != "bf16":
        return None
    own = lp.model_ratio is not None
    ratio = lp.model_ratio if own else lp.peak_ratio
    if ratio is None or ratio >= 1.0:
        return None  # measured no slower than fp32 here, whatever the flags say
    capped = own and lp.peak_ratio is not None and lp.peak_ratio > ratio
    if capped:  # the estimate stays conservative: the smaller slowdown of the two
        ratio = min(lp.peak_ratio, 1.0)
    share = m.unprofiled_share("matmul", t.matmul_share_by_dtype.get("bf16", 0.0)) if t.breakdown else \
        t.gemm_time_share.get("bf16", 0.0)
    cost = share * (1 - ratio)
    ev = [f"{pct(bf16_flops_share)} of matmul/conv FLOPs run with bf16 inputs; those matmuls and convolutions take "
          f"{pct(share)} of the step",
          f"{lp.reason}; measured now: bf16 matmuls {lp.peak_tflops * 1e3:.3g} GFLOP/s vs fp32 "
          f"{lp.fp32_peak_tflops * 1e3:.3g} GFLOP/s ({lp.peak_ratio:.2f}x)"]
    if own:
        ev.append(lp.model_basis)
    ev.append(f"estimate: that time at fp32's speed ({1 / ratio:.1f}x bf16's"
              + (", the device's peaks: the smaller gain of the two" if capped else "") + f") saves {pct(cost)} of "
              "the step")
    return Finding(
        "emulated-bf16", (12,), "EMULATED BF16: this CPU computes bf16 slower than fp32", cost, ev,
        "bf16 autocast pays off only where the CPU computes bf16 in hardware (amx_bf16, avx512_bf16); this one "
        "converts to fp32 and back around every matmul",
        [Fix("--precision fp32 (auto picks it on this CPU)",
             "drop torch.autocast('cpu', dtype=torch.bfloat16) (or pass enabled=False): fp32 is this CPU's fast "
             "path", trial="autocast-fp32")], group="compute")


def fp32_matmul_share(m: Measurements, t: TraceStats) -> float:
    """The share of the step in fp32 matmuls and convolutions: what autocast speeds up at the matmul rate ratio.
    Attention kernels are left out (a CPU's flash attention barely speeds up in bf16), and so is the profiler's
    per-op cost (Measurements.unprofiled_share). Without a breakdown (a trace whose kernels no op launched): the
    fp32 GEMM time, attention included."""
    if t.breakdown:
        return m.unprofiled_share("matmul", t.matmul_share_by_dtype.get("fp32", 0.0))
    return t.gemm_time_share.get("fp32", 0.0)


def _matmul_basis(t: TraceStats) -> str:
    """What fp32_matmul_share is a share of."""
    if not t.has_gpu:
        return "the step"
    return "the GPU's kernel span" if t.breakdown else "GPU busy time"


def _fp32_matmuls(m: Measurements, t: TraceStats, total: float, fp32_time_share: float) -> Finding | None:
    """Rule 16: every matmul runs in fp32. Prescribe autocast where the device's bf16/fp16 matmuls measured
    faster than fp32 (a GPU's tensor cores; a CPU with AMX or AVX512-BF16); elsewhere say fp32 is right."""
    lp = m.low_precision
    ev = [f"all {total / 1e9:.2f} GFLOP of matmul/conv work per step has fp32 inputs; the matmuls and "
          f"convolutions take {pct(fp32_time_share)} of {_matmul_basis(t)}"
          + (f" (attention, {pct(t.breakdown['attention'])}, is not counted: it is not matmul-rate bound)"
             if t.breakdown.get("attention", 0.0) >= 0.01 else "")]
    own = False  # the ratio is this model's own (replayed), not the device's peak's
    if lp is None:
        if not t.has_gpu:
            return None  # a CPU's bf16 rate was not measured (measure_peak=False): no claim either way
        ratio, dtype, native, basis = 2.0, "bf16", True, "assumed: bf16 tensor cores run ~2x the TF32 rate"
    else:
        ratio, dtype, native = lp.peak_ratio or 0.0, lp.dtype, lp.native
        basis = (f"measured now: {dtype} matmuls {lp.peak_tflops * 1e3:.3g} GFLOP/s vs fp32 "
                 f"{lp.fp32_peak_tflops * 1e3:.3g} GFLOP/s ({ratio:.2f}x); {lp.reason}")
        own = lp.model_ratio is not None and native
        if own:  # the model's own shapes, replayed: what the estimate uses
            ratio = lp.model_ratio
            ev.append(basis.replace("measured now:", "the device's peak:", 1))
            basis = lp.model_basis
    ev.append(basis)
    device = "cuda" if m.cuda else "cpu"
    if not (native and ratio >= LOW_PRECISION_MIN_RATIO):
        return Finding(
            "fp32", (16,), f"FP32 IS RIGHT HERE: {dtype} would not speed up "
                           f"{'this model' if own else 'this device'}'s matmuls", 0.0, ev,
            (f"this model's matmuls and convolutions are too small to gain from {dtype}: replayed, they ran "
             f"{ratio:.2f}x fp32's speed with their input casts" if own else
             f"{dtype} autocast pays off only where the hardware computes it natively; here it measured "
             f"{ratio:.2f}x fp32's matmul rate, so the casts would cost more than they save"),
            [Fix("keep --precision fp32 (auto does)", f"keep fp32: no torch.autocast('{device}', ...) for this "
                                                      f"{'model' if own else 'machine'}")],
            kind="note", group="compute")
    # the model's own ratio is counted as measured; the device's peak ratio, at most LOW_PRECISION_MAX_SPEEDUP
    speedup = ratio if own else min(ratio, LOW_PRECISION_MAX_SPEEDUP)
    cost = fp32_time_share * (1 - 1 / speedup)
    scaler = dtype == "fp16"
    code = (f"with torch.autocast('{device}', dtype=torch.{'float16' if scaler else 'bfloat16'}): loss = ... "
            "around forward and loss (not the backward)" +
            ("; and a torch.amp.GradScaler('cuda') for the backward and step" if scaler else ""))
    ev.append(f"estimate: the fp32 matmul time at {speedup:.2f}x the speed saves {pct(cost)} of the step (the other "
              f"work does not speed up)")
    return Finding(
        "fp32", (16,), f"FP32 MATMULS on hardware with native {dtype}", cost, ev,
        f"no autocast: the matmuls run at fp32's rate on a device whose {dtype} rate measured {ratio:.2f}x that",
        [Fix(f"--precision {dtype} (auto picks it)", code, trial=f"autocast-{dtype}")], group="compute")


def attention_weights(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 17: attention that materialises its weights (softmax(QK^T)V written out, nn.MultiheadAttention
    with its default need_weights=True, or SDPA's math fallback) takes > 3% of the step."""
    t = m.trace
    if t is None or not t.attention_share_by_impl:
        return None
    slow = {k: m.unprofiled_share("attention", v) for k, v in t.attention_share_by_impl.items() if "materialised" in k}
    share = sum(slow.values())
    if share <= ATTENTION_WEIGHTS_SHARE:
        return None
    where = "GPU span" if t.has_gpu else "step"
    ev = [f"attention that builds the full L x L weight matrix takes {pct(share)} of the {where}: " +
          ", ".join(f"{k} {pct(v)}" for k, v in slow.items())]
    calls = m.attention_calls
    if calls is not None and calls.need_weights_per_step > 0:
        ev.append(f"nn.MultiheadAttention.forward is called {calls.calls_per_step:g} times per step "
                  f"({calls.modules} module(s)), {calls.need_weights_per_step:g} of them with need_weights=True "
                  "(the default): it then returns the averaged weights and cannot use the fused kernel")
    sites = [s for s in m.attention_sites if s.get("cls") != "MultiheadAttention"]
    for site in m.attention_sites:
        ev.append(f"built by {site['module']} (class {site['cls']}"
                  + (f", defined at {site['defined_at']}" if site.get("defined_at") else "")
                  + f"): {site['tokens']} x {site['tokens']} weights")
    cost = FUSED_ATTENTION_SAVES * share
    ev.append(f"estimate: a fused kernel (scaled_dot_product_attention) saves at least half of it, "
              f"{pct(cost)} of the step")
    mha = calls is not None and calls.need_weights_per_step > 0
    at = f" at {', '.join(calls.call_sites)}" if mha and calls.call_sites else ""
    # the script's own call where it was seen on one line (`h, _ = self.attn(h, h, h)`), else the usual spelling
    call = (" and ".join(f"`{c}`" for c in calls.call_code) + " with need_weights=False added"
            if mha and calls.call_code else "attn(x, x, x, need_weights=False)")
    fixes = ([Fix(None, f"{call}{at}: nn.MultiheadAttention then runs F.scaled_dot_product_attention (keep the "
                        "default only where you use the weights)")]
             if mha else [])
    if sites or not mha:
        # one place per class and line: the instances of one class (a block used twice) are one edit
        places = dict.fromkeys(f"{s['cls']}.forward ({s.get('forward_at') or s['module']})" for s in sites)
        where = "in " + ", ".join(places) + ": " if sites else ""
        fixes.append(Fix("fastddpm's U-Net already calls F.scaled_dot_product_attention",
                         f"{where}replace softmax(q @ k.transpose(-2, -1) * scale) @ v with "
                         "F.scaled_dot_product_attention(q, k, v) (flash / memory-efficient kernels, no L x L "
                         "matrix)"))
    return Finding("attention-weights", (17,), "MATERIALISED ATTENTION: the L x L weights are built and stored",
                   cost, ev, "attention computed as separate matmuls and a softmax: the weight matrix is written "
                   "to memory, read back, and kept for the backward", fixes, group="compute")


def eager_elementwise(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 18: uncompiled elementwise and norm ops take > 25% of the step: torch.compile fuses them."""
    t = m.trace
    if t is None or not t.breakdown:
        return None
    if m.compile is not None and m.compile.compiled_graphs > 0:
        return None  # already compiled: what is left is not eager fusion's to fix
    elementwise, norm = m.unprofiled_share("elementwise"), m.unprofiled_share("norm")
    ema = param_loop_cost(m)
    if ema is not None:  # the EMA's updates are rule 23's: compiling the model would not touch them
        elementwise = max(0.0, elementwise - ema["ops_share"])
    share = elementwise + norm
    if share <= ELEMENTWISE_SHARE:
        return None
    cost = COMPILE_SAVES * share
    where = "GPU span" if t.has_gpu else "step"
    return Finding(
        "eager-elementwise", (18,), "EAGER ELEMENTWISE: activations and norms run one op at a time", cost,
        [f"elementwise/activation ops take {pct(elementwise)} and norms {pct(norm)} of the {where}, in eager mode "
         f"(nothing compiled)",
         f"estimate: fusing them saves {pct(COMPILE_SAVES)} of that time, {pct(cost)} of the step "
         "(each eager op reads and writes its whole tensor; a fused kernel does it once)"],
        "each elementwise op is a separate pass over memory (and a separate dispatch): "
        + _fused_ops_named(t) + " between the matmuls",
        [Fix("--compile on", "model = torch.compile(model) (first steps compile: worth it for runs of minutes or "
                             "more)", trial="compile")], group="compute")


def _fused_ops_named(t: TraceStats) -> str:
    """The step's own norm and elementwise ops with the most time (a CPU trace's aten ops: a LayerNorm and GELU
    model is not told of GroupNorm and SiLU); a GPU trace's kernel names say less, so the usual U-Net ones."""
    names = [o["name"].removeprefix("aten::") for o in t.top_ops if o.get("category") in ("norm", "elementwise")]
    if t.has_gpu or not names:
        return "norms, activations, adds and scales"
    return "here " + ", ".join(dict.fromkeys(names[:4])) + " and the like"


def per_tensor_optimizer(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 19: the optimizer updates one tensor at a time (torch's default on a CPU) and takes > 5% of the step:
    a fused kernel updates every parameter in one pass over its memory (foreach, in a few ops). Over hundreds of
    tensors (>= 300 ops per step) the cost is the per-op overhead; over a few big ones it is the passes, one per
    update term (AdamW: about ten), which only fused=True removes."""
    t = m.trace
    if t is None or t.optimizer_kind != "per-tensor" or not t.breakdown:
        return None
    opt = m.optimizer
    name = opt.name if opt is not None else "the optimizer"
    ops = t.optimizer_ops_per_step or 0
    many = ops >= OPTIMIZER_OPS
    if not many and (opt is None or opt.param_count < BIG_PARAMS):  # neither many tensors nor big ones
        return None
    waiting = t.has_gpu and (t.idle_share or 0.0) > GPU_IDLE_SHARE  # a GPU that waits for launches
    launches = per_tensor_launch_share(t) if waiting and many else 0.0
    if launches:
        # on a GPU the optimizer's kernels are tiny: its cost is the launches, while the GPU waits for them
        share = t.host_wait_by_cause.get("host", 0.0)
        cost = share * launches
        ev = [f"{pct(launches)} of the step's {t.kernels_per_step:.0f} kernels are launched by {name}.step, "
              f"{ops:.0f} ops per step: one op per parameter tensor per update term",
              f"the GPU waits for the host to launch work {pct(share)} of the span; those launches are "
              f"{pct(cost)} of it"]
    else:
        share = m.unprofiled_share("optimizer")
        if share <= OPTIMIZER_SHARE:
            return None
        cost = FOREACH_SAVES * share
        ev = [f"{name}.step takes {pct(share)} of the step, {ops:.0f} ops per step: one op per parameter tensor "
              "per update term" + ("" if many else ", each a pass over that tensor's memory")]
    if opt is not None:
        ev.append(f"{opt.param_tensors} parameter tensors; foreach={opt.foreach}, fused={opt.fused} "
                  "(None: torch picks per-tensor on a CPU, foreach on CUDA)")
    if not launches:
        ev.append(f"estimate: a fused update saves at least half of it, {pct(cost)} of the step")
    cls = opt.name if opt is not None else "AdamW"
    why = ("the optimizer's for-loop over parameters issues several ops for every tensor: with hundreds of tensors "
           "the per-op overhead (on a GPU, a kernel launch each) outweighs the arithmetic" if many else
           f"the optimizer's update runs term by term, each a pass over the memory of all {opt.param_count:,} "
           "parameters (AdamW makes about ten): a fused kernel reads and writes each parameter, gradient and moment "
           "once")
    code = (f"torch.optim.{cls}(params, ..., fused=True) (CPU and CUDA, Adam/AdamW/SGD), or foreach=True" if many
            else f"torch.optim.{cls}(params, ..., fused=True) (CPU and CUDA, Adam/AdamW/SGD; foreach=True would "
                 "save little over a few tensors)")
    return Finding(
        "per-tensor-optimizer", (19,), "PER-TENSOR OPTIMIZER: " + ("one small op per parameter per update" if many
                                                                  else "one pass over memory per update term"),
        cost, ev, why,
        [Fix("fastddpm's AdamW is foreach (fused on CUDA) already", code, trial="fused-optimizer")],
        group="pipeline" if launches else "compute")  # launches are the pipeline's problem, not the math's


def per_tensor_launch_share(t: TraceStats) -> float:
    """The share of a GPU step's kernels launched by a per-tensor optimizer (0 for foreach / fused ones)."""
    if t.optimizer_kind != "per-tensor" or (t.optimizer_ops_per_step or 0) < OPTIMIZER_OPS:
        return 0.0
    return (t.kernel_share_by_category or {}).get("optimizer", 0.0)


def small_batch(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 20: a small batch (<= 32) whose per-step overhead (Python, framework, optimizer) is > 20% of the
    step, with memory to spare: a larger batch spreads that overhead over more images."""
    t = m.trace
    if t is None or not t.breakdown or m.batch_size is None or m.batch_size > SMALL_BATCH:
        return None
    if m.memory is not None and m.memory.peak_share >= MEMORY_HEADROOM_SHARE:
        return None
    overhead = sum(m.unprofiled_share(k) for k in ("python", "framework", "optimizer"))
    if overhead <= OVERHEAD_SHARE:
        return None
    k = m.batches_per_step()
    if k > 1:
        return _small_micro_batch(m, k)
    cost = BATCH_DOUBLING_SAVES * overhead
    return Finding(
        "small-batch", (20,), f"SMALL BATCH: {m.batch_size} images share each step's fixed overhead", cost,
        [f"batch {m.batch_size}; Python, framework and optimizer time, which do not grow with the batch, take "
         f"{pct(overhead)} of the step",
         f"estimate: twice the batch halves that overhead per image, {pct(cost)} of the time per image"],
        "the per-step costs (op dispatch, autograd bookkeeping, the optimizer over every parameter) are paid "
        "once per step however many images it holds",
        [Fix("--batch-size auto (the throughput knee; fastddpm scales the learning rate with it)",
             "raise batch_size toward the throughput knee (not the out-of-memory edge); scale the learning rate "
             "with it")], group="compute")


def _small_micro_batch(m: Measurements, k: float) -> Finding | None:
    """Rule 20 on a loop that accumulates gradients over `k` micro-batches per optimizer step: the dispatch and
    autograd overhead is paid once per micro-batch, the optimizer's once per step already. A micro-batch twice as
    large with half the accumulation keeps the images per step (and the learning rate) and halves the first;
    the optimizer's share stays as it is, so it is not counted."""
    per_micro = sum(m.unprofiled_share(c) for c in ("python", "framework"))
    if per_micro <= OVERHEAD_SHARE:
        return None
    cost = BATCH_DOUBLING_SAVES * per_micro
    b = m.batch_size
    return Finding(
        "small-batch", (20,), f"SMALL MICRO-BATCH: {b} images per forward, {k:g} accumulated per optimizer step",
        cost,
        [f"micro-batch {b}, {k:g} per optimizer step ({b * k:g} images); Python and framework time, paid once per "
         f"micro-batch whatever its size, take {pct(per_micro)} of the step",
         f"estimate: micro-batches twice as large, half as many, halve that overhead: {pct(cost)} of the step "
         "(the optimizer already runs once per accumulated step: not counted)"],
        "op dispatch and autograd bookkeeping are paid once per micro-batch: accumulating many small ones pays "
        "them many times for the same images per optimizer step",
        [Fix("--batch-size with --accum-steps lowered by the same factor (the global batch stays)",
             f"raise the DataLoader's batch_size and lower the accumulation steps by the same factor (batch_size="
             f"{b * 2}, " + ("without accumulation" if k <= 2 else f"accumulated over {k / 2:g}") + f"): the same "
             f"{b * k:g} images per optimizer step, so the same learning rate; accumulate only what memory does "
             "not hold at once")], group="compute")


def low_mfu(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 13: MFU < 5% on a GPU that is idle < 20% of the time: busy, but with little math."""
    if m.mfu is None:
        unavailable["13 (MFU)"] = m.mfu_unavailable or "FLOPs or peak not measured"
        return None
    t = m.gpu_trace
    if t is None and m.trace is not None and m.trace.breakdown and not m.cuda:
        return _cpu_low_mfu(m)
    if t is None or not (m.mfu.mfu < LOW_MFU_SHARE and t.idle_share < GPU_IDLE_SHARE):
        return None
    mf = m.mfu
    # the residual: busy time that rules 17 and 18 already explain is costed there, with their own fixes (a
    # materialised attention fused, eager elementwise ops compiled), and is not counted twice here
    explained = _explained_by_compute_rules(m, t)
    residual = max(0.0, (1 - t.idle_share) - explained)
    ev = [f"MFU {pct(mf.mfu)}: {mf.flops_per_step / 1e9:.1f} GFLOP per step in {mf.step_ms:.2f} ms "
          f"against a measured {mf.peak_dtype} matmul peak of {mf.peak_tflops:.0f} TFLOP/s, with the GPU "
          f"idle only {pct(t.idle_share)}"]
    if explained > 0:
        ev.append(f"{pct(explained)} of the span is layout conversions, materialised attention or eager "
                  f"elementwise work, costed by their own findings; this estimate covers the other {pct(residual)}")
    ev.extend(_roofline_evidence(m))
    memory_bound = m.roofline is not None and m.roofline.binds == "memory"
    return Finding(
        "low-mfu", (13,), "LOW MFU: the GPU is busy but does little math", min(0.5, residual * 0.5), ev,
        ("the step must move more bytes than it does math: its roofline is on the memory side, so fewer bytes "
         "(bf16 activations, ops fused under compile) is the way down" if memory_bound else
         "memory- or elementwise-bound kernels (norms, activations, copies) dominate"),
        [Fix("--compile on (fuses elementwise chains); --precision bf16; a larger --batch-size or model",
             "torch.compile for fusion, bf16, larger batch or wider layers")], group="compute")


def _roofline_evidence(m: Measurements) -> list[str]:
    """The roofline's word on a low MFU: which side binds, and how near the step is to that bound."""
    r = m.roofline
    if r is None:
        return []
    return [f"roofline: the {r.binds} side binds (compute {r.compute_ms:.3g} ms, memory {r.memory_ms:.3g} ms a "
            f"step); the step takes {r.step_ms:.3g} ms: it runs at {pct(r.share)} of its roofline"]


def _explained_by_compute_rules(m: Measurements, t: TraceStats) -> float:
    """The share of the span that rules 11 (layout conversions), 17 (materialised attention) and 18 (eager
    elementwise) account for."""
    out = 0.0
    if t.layout_share is not None and t.layout_share > LAYOUT_SHARE:
        out += t.layout_share * (1 - t.idle_share)
    if t.attention_share_by_impl:
        slow = sum(v for k, v in t.attention_share_by_impl.items() if "materialised" in k)
        out += slow if slow > ATTENTION_WEIGHTS_SHARE else 0.0
    if t.breakdown and not (m.compile is not None and m.compile.compiled_graphs > 0):
        eager = t.breakdown.get("elementwise", 0.0) + t.breakdown.get("norm", 0.0)
        out += eager if eager > ELEMENTWISE_SHARE else 0.0
    return out


def _cpu_low_mfu(m: Measurements) -> Finding | None:
    """Rule 13 on a CPU: MFU < 30% with under half the step in matmuls/attention: the step's time goes to the
    work around the math. (A step that is mostly matmuls runs as fast as its shapes allow: healthy.)"""
    mf = m.mfu
    b = {k: m.unprofiled_share(k) for k in m.trace.breakdown}
    math_share = b.get("matmul", 0.0) + b.get("attention", 0.0)
    if not (mf.mfu < CPU_LOW_MFU and math_share < CPU_MATMUL_SHARE):
        return None
    rest = 1 - math_share
    top = sorted(((v, BREAKDOWN_LABELS[k]) for k, v in b.items() if k not in ("matmul", "attention")), reverse=True)
    return Finding(
        "low-mfu", (13,), "LOW MFU: most of the step is not matmul work", HEALTHY_FLOOR,
        [f"MFU {pct(mf.mfu)}: {mf.flops_per_step / 1e9:.2f} GFLOP per step in {mf.step_ms:.1f} ms against a "
         f"measured {mf.peak_dtype} matmul peak of {mf.peak_tflops * 1e3:.3g} GFLOP/s",
         f"{math_words(m.trace.breakdown)} take {pct(math_share)} of the step; the other {pct(rest)}: " +
         ", ".join(f"{label} {pct(v)}" for v, label in top[:4]), *_roofline_evidence(m)],
        "the arithmetic the model needs is a small part of the step: per-op overhead, memory-bound ops",
        [Fix("--compile on; a larger --batch-size", "torch.compile(model); a larger batch; fewer, larger ops",
             trial="compile")],
        group="compute")


def _site_words(site: dict | None) -> tuple[str, str]:
    """A loop's place in the user's code (watchers.LoopSites), as evidence says it (" train.py:57 (`code`)") and
    as a fix points at it (" at train.py:57"); both "" where it was not counted."""
    if site is None:
        return "", ""
    code = f" (`{site['code']}`)" if site.get("code") else ""
    return f" {site['place']}{code}", f" at {site['place'].split(' in ')[0]}"


def item_loop_cost(m: Measurements) -> dict | None:
    """Rule 22's reading of the trace: the loop over the batch's samples (trace_loops' dict, as "loop"), its
    time and its backward's in the profiled step ("span_ms", "back_ms", of a "step_ms" step), their "share" of
    the step and the "cost" a batched op gives back; None without such a loop. On a GPU the share is at most the idle
    share: the host's loop costs only where the GPU waits for it. rules_gpu's host-bound finding leaves this cost
    to rule 22, as it leaves a per-tensor optimizer's launches to rule 19."""
    t = m.trace
    loops = t.item_loops if t is not None else []
    if m.batch_size is not None:
        # as many items as the batch has samples; a loop over layers (rows of a (depth, C) parameter) is not one
        loop = next((x for x in loops if x["items"] == m.batch_size), None)
    else:  # the batch unseen (no DataLoader batch watched): items that are images or sequences, the longest loop
        loop = max((x for x in loops if all(len(s) >= 3 for s in x["shapes"])), key=lambda x: x["items"],
                   default=None)
    if loop is None or not loop.get("step_us"):
        return None
    # The share of the profiled step, scaled by ITEM_LOOP_SAVES: measured against the batched loss on a 2-core CPU
    # (benchmarks/RESULTS.md), taking the profiler's average cost per recorded op out first instead predicted 1.05x
    # and not even a finding where 1.17x and 1.27x were measured (the loop's small ops cost the profiler less than
    # the average op, and the engine's work between its per-sample backward nodes is in neither count)
    step_ms = loop["step_us"] / 1e3
    span_ms, back_ms = loop["span_us"] / 1e3, loop.get("backward_us", 0.0) / 1e3
    share = min(1.0, (span_ms + back_ms) / step_ms)
    if t.has_gpu:
        share = min(share, t.idle_share or 0.0)
    cost = ITEM_LOOP_SAVES * share * (1 - 1 / max(loop["indexed_per_step"], 1))
    return {"loop": loop, "span_ms": span_ms, "back_ms": back_ms, "step_ms": step_ms, "share": share, "cost": cost}


def item_loop(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 22: the step indexes a tensor sample by sample (x[i] for i over a first dimension as long as the
    batch) and runs each sample's ops on their own: one op dispatch (and on a GPU one launch) per sample where
    one batched op would do. The cost counts the loop's own time, from its first index to the end of its last
    item's ops, and the backward's autograd nodes evaluated once per sample, as shares of the profiled step, less
    one sample's share (the batched op is dispatched once)."""
    found = item_loop_cost(m)
    if found is None or found["cost"] < ITEM_LOOP_SHARE:
        return None
    loop, cost, share, t = found["loop"], found["cost"], found["share"], m.trace
    span_ms, back_ms, step_ms = found["span_ms"], found["back_ms"], found["step_ms"]
    n, indexed = loop["items"], loop["indexed_per_step"]
    shapes = " and ".join("(" + ", ".join(map(str, s)) + ")" for s in loop["shapes"])
    each = ", ".join(loop["per_item_ops"])
    # the line of the user's code that indexes them, where the doctor ran the script
    site = next((s for s in m.item_sites if s["length"] == n), None)
    at, fix_at = _site_words(site)
    ev = [f"{indexed} of the {n} items along the first dimension of the tensor(s) {shapes} indexed one by one each "
          f"step{' at' + at if at else ''} ("
          + (f"the batch's {n} samples)" if m.batch_size == n else "each item itself 2-D or more; the batch size "
             "was not seen)") + (f"; each goes through {each}" if each else ""),
          f"the loop takes {span_ms:.2f} ms of a {step_ms:.2f} ms profiled step and its backward's per-sample "
          f"autograd nodes {back_ms:.2f} ms ({pct(share)} together"
          + ", the profiler slowing them as the rest of the step"
          + ("; counted only up to the GPU's idle share, the time it waits for the host" if t.has_gpu else "")
          + f"); a profiled share reads high for many small ops, so the estimate counts {ITEM_LOOP_SAVES:.0%} of it, "
            f"less one sample's share (a batched op still runs once): {pct(cost)}"]
    return Finding(
        "item-loop", (22,), f"PER-SAMPLE LOOP: the step handles {n} samples one at a time in Python", cost, ev,
        "each sample's ops are dispatched on their own (and their backward nodes recorded one by one), so the "
        "per-op overhead is paid once per sample instead of once per batch",
        [Fix(None, f"replace the loop{fix_at} with one op over "
                   "the whole batch: F.mse_loss(pred, target) for the mean of "
                   "equal-sized samples' losses, F.mse_loss(pred, target, reduction='none').flatten(1).mean(1) "
                   "for each sample's own loss, a tensor index (x[idx]) or torch.where for per-sample choices, "
                   "torch.vmap for a per-sample function" + (f" (here: {each})" if each else ""))],
        group="compute")


def param_loop_cost(m: Measurements) -> dict | None:
    """Rule 23's reading of the trace: the run of in-place updates outside the optimizer (trace_loops'
    param_update_loop, as "loop") when it writes at least half as many elements as the optimizer's parameters
    (a loop over the parameters, not over a few activations), with its "share" of the profiled step, its ops'
    own time's "ops_share" (elementwise time that rule 18 leaves to it) and the "cost" a foreach update gives back;
    else None. On a GPU the share is at most the idle share: the host's loop costs only where the GPU waits."""
    t = m.trace
    loop = t.param_update_loop if t is not None else None
    if loop is None or not loop.get("step_us"):
        return None
    if m.optimizer is not None and m.optimizer.param_count and loop["elements"] * 2 < m.optimizer.param_count:
        return None
    share = min(1.0, loop["span_us"] / loop["step_us"])
    if t.has_gpu:
        share = min(share, t.idle_share or 0.0)
    return {"loop": loop, "share": share, "ops_share": min(share, loop["ops_us"] / loop["step_us"]),
            "cost": PARAM_LOOP_SAVES * share}


def param_loop(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 23: the loop updates a copy of the parameters (an EMA of the weights) tensor by tensor after the
    optimizer step, in ops of its own: one dispatch (on a GPU one launch) per tensor per op and a pass over each
    tensor per op, where torch._foreach_lerp_ updates every tensor in one call and one pass. Rule 19's twin for
    what runs outside the optimizer."""
    found = param_loop_cost(m)
    if found is None or found["share"] <= PARAM_LOOP_SHARE:
        return None
    loop, share, cost = found["loop"], found["share"], found["cost"]
    opt = m.optimizer
    tensors = f"{opt.param_tensors} " if opt is not None and opt.param_tensors else ""
    names = [n.removeprefix("aten::") for n in loop["per_tensor_ops"]]
    at, fix_at = _site_words(m.update_site)  # the line of the user's code that made them, where it was counted
    ev = [f"{loop['updates']} in-place updates ({', '.join(names)}) one tensor at a time each step, outside the "
          f"optimizer{', made at' + at if at else ''}, writing {loop['elements']:,} elements"
          + (f" ({loop['elements'] / opt.param_count:.1f}x the optimizer's {opt.param_count:,} parameters)"
             if opt is not None and opt.param_count else ""),
          f"the loop takes {loop['span_us'] / 1e3:.2f} ms of a {loop['step_us'] / 1e3:.2f} ms profiled step "
          f"({pct(share)}" + ("; counted only up to the GPU's idle share" if m.trace.has_gpu else "")
          + f"); estimate: a foreach update gives back {PARAM_LOOP_SAVES:.0%} of it, {pct(cost)} of the step"]
    return Finding(
        "per-tensor-ema", (23,), "PER-TENSOR EMA: the weights' average is updated one tensor at a time", cost, ev,
        f"a Python loop over the {tensors}parameter tensors after the optimizer step issues {' and '.join(names)} "
        "for every tensor, each a dispatch of its own and a pass over that tensor's memory; the optimizer may be "
        "fused, this loop is not",
        [Fix("fastddpm's EMA is already three foreach ops (--ema-every k updates it every k steps)",
             "with torch.no_grad(): torch._foreach_lerp_(ema_params, model_params, 1 - decay) in place of the "
             f"loop{fix_at}, the two lists built once (ema_params "
             "= list(ema.parameters()), model_params = list(model.parameters())): one call for every tensor and "
             "one pass over each; or "
             "torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay)), or "
             "diffusers' EMAModel(..., foreach=True)")],
        group="compute")
