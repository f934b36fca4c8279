"""Rules 4-9 and 11 of docs/DOCTOR.md, read from the GPU timeline of a CUDA trace: does the GPU wait for the host
(4, launch-bound 6) or between kernels already queued (5), does the step make the host wait for the GPU (7), do
host-to-device copies stall it (8), do layout conversions take its time (11). Rule 9 (launch-queue depth) is
evidence in 4-6."""

from __future__ import annotations

from fastddpm.doctor.findings import Finding, Fix, pct
from fastddpm.doctor.measurements import Measurements
from fastddpm.doctor.rules_compute import item_loop_cost, param_loop_cost, per_tensor_launch_share
from fastddpm.doctor.thresholds import (GPU_IDLE_SHARE, GRAPH_KERNEL_SHARE, H2D_SHARE, ITEM_LOOP_SHARE,
                                        LAYOUT_SHARE, PARAM_LOOP_SHARE, SHORT_KERNEL_SHARE, SMALL_KERNEL_US)
from fastddpm.doctor.trace import TraceStats


def host_bound(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rules 4 and 6: the GPU idles > 20% of the kernel span, mostly waiting for Python to launch work
    (host-bound); with tiny eager kernels shorter than their launch call, launch-bound."""
    t = m.gpu_trace
    if t is None:
        # one entry for all the rules that read the GPU timeline, recorded with the first of them
        unavailable["4-6,8,9,11" if m.cuda else "4-6,8,9,11 (GPU timeline)"] = (
            "no CUDA device: the GPU timeline needs a CUDA trace" if not m.cuda
            else m.no_trace if m.trace is None
            else "the trace holds no GPU activity")
        return None
    python_share = t.host_wait_by_cause.get("host", 0.0)  # host-wait with no data wait or sync to blame
    if not (t.idle_share > GPU_IDLE_SHARE and t.host_wait_share >= t.kernel_wait_share
            and python_share > 0.5 * t.host_wait_share):
        return None
    graph_share = t.graph_kernel_share or 0.0
    captured = graph_share > 0  # some of the step already replays from CUDA graphs: never prescribe them
    eager_per_step = t.eager_kernels_per_step or 0.0
    # rule 6 reads eager kernels only: a graph replay has no per-kernel launch to be bound by
    tiny = (graph_share < GRAPH_KERNEL_SHARE and t.median_eager_kernel_us is not None
            and t.median_eager_kernel_us < SMALL_KERNEL_US and t.short_kernel_share > SHORT_KERNEL_SHARE)
    if tiny:
        title, rules = "LAUNCH-BOUND: kernels are shorter than the time to launch them", (4, 6)
        cause = ("many tiny kernels: the CPU spends longer issuing each kernel than the GPU spends running "
                 "it, so the GPU drains its queue and waits")
    elif captured:
        title, rules = "HOST-BOUND: the GPU waits for the host between graph replays", (4,)
        cause = ("the step already replays from a CUDA graph, yet the host takes longer between replays than "
                 "the GPU takes to run one: Python outside the graph (data, logging, the replay call)")
    else:
        title, rules = "HOST-BOUND: the GPU waits for Python between launches", (4,)
        cause = "the CPU cannot enqueue work fast enough (Python and framework overhead per op)"
    if captured:  # what is left outside the graph: its eager kernels, and the host time between replays
        fixes = ([Fix(None, f"kernels launched outside the graph ({eager_per_step:.0f} per step): move that "
                            "work inside the captured region, or fuse it with torch.compile")]
                 if eager_per_step >= 1 else [])
        fixes += [Fix("--batch-size auto (the throughput knee)",
                      "a larger batch: each replay does more work for the same host time between replays"),
                  Fix(None, "take per-step host work off the path between replays: log and read metrics "
                            "every N steps, prepare the next batch while the graph runs")]
    else:
        fixes = [Fix("--cuda-graphs capture (the whole step replayed as one graph: one launch per step)",
                     "capture the step in a CUDA graph: torch.compile(model, mode='reduce-overhead'), or "
                     "torch.cuda.graphs with static input buffers"),
                 Fix("--compile on (fuses elementwise chains into fewer, larger kernels)",
                     "torch.compile(model) with static shapes (drop_last=True)"),
                 Fix("--batch-size auto (the throughput knee)",
                     "a larger batch: the same launches, more work each"),
                 Fix(None, "fused optimizer and EMA: AdamW(..., fused=True); torch._foreach_lerp_ for the EMA")]
    idle_ev, kernels_ev = _gpu_evidence(t)
    evidence = [idle_ev, f"{pct(python_share)} of the span is host-wait with no data wait or sync to blame",
                kernels_ev]
    # the launches a per-tensor optimizer issues have their own finding (rule 19) and fix: not counted twice
    optimizer = per_tensor_launch_share(t)
    if optimizer:
        evidence.append(f"{pct(optimizer)} of the kernels are launched by a per-tensor optimizer step: that part "
                        "of the wait is costed under PER-TENSOR OPTIMIZER")
    cost = python_share * (1 - optimizer)
    # likewise a Python loop over the batch's samples (rule 22): its share of the wait is costed there, whose fix
    # (one batched op) removes the launches instead of replaying them
    loop = item_loop_cost(m)
    if loop is not None and loop["cost"] >= ITEM_LOOP_SHARE:
        cost = max(0.0, cost - loop["cost"])
        evidence.append(f"{pct(loop['cost'])} of the span is the host's per-sample loop: that part of the wait is "
                        "costed under PER-SAMPLE LOOP")
    # and a per-tensor EMA loop (rule 23), whose foreach update issues a few launches instead of two per tensor
    ema = param_loop_cost(m)
    if ema is not None and ema["share"] > PARAM_LOOP_SHARE:
        cost = max(0.0, cost - ema["cost"])
        evidence.append(f"{pct(ema['cost'])} of the span is the host's per-tensor EMA update: that part of the wait "
                        "is costed under PER-TENSOR EMA")
    return Finding("launch-bound" if tiny else "host-bound", rules, title, cost, evidence, cause, fixes)


def kernel_gaps(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 5: the GPU idles > 20% of the kernel span, mostly between kernels already queued."""
    t = m.gpu_trace
    if t is None or not (t.idle_share > GPU_IDLE_SHARE and t.kernel_wait_share > t.host_wait_share):
        return None
    if t.graph_kernel_share:  # some of the step already replays from CUDA graphs: never prescribe them
        title = "KERNEL GAPS: the GPU idles between the kernels of a graph replay"
        cause = ("the work is queued (replayed from a CUDA graph) but the GPU still idles between its "
                 "kernels: many small dependent kernels, each a node the GPU schedules in turn")
        fixes = [Fix("--compile on (fuses elementwise chains: fewer, larger nodes in the graph)",
                     "torch.compile before capturing, to fuse kernels"),
                 Fix("--batch-size auto (the throughput knee)",
                     "a larger batch: the same nodes, more work each")]
    else:
        title = "KERNEL GAPS: launch latency between back-to-back kernels"
        cause = "the work is queued but each kernel still pays launch latency; many small dependent kernels"
        fixes = [Fix("--cuda-graphs capture", "CUDA graphs (torch.compile mode='reduce-overhead')"),
                 Fix("--compile on", "torch.compile to fuse kernels")]
    idle_ev, kernels_ev = _gpu_evidence(t)
    return Finding("kernel-gaps", (5,), title, t.kernel_wait_share,
                   [idle_ev, f"{t.small_gap_count} gaps under 30 us between queued kernels", kernels_ev], cause, fixes)


def _gpu_evidence(t: TraceStats) -> tuple[str, str]:
    """The evidence rules 4-6 share: where the GPU's idle time goes; the kernels, and the queue (rule 9)."""
    idle = (f"the GPU is idle {pct(t.idle_share)} of the kernel span (threshold {pct(GPU_IDLE_SHARE)}): "
            f"{pct(t.host_wait_share)} waiting for the host to launch work, {pct(t.kernel_wait_share)} between "
            f"queued kernels")
    kernels = f"{t.kernels_per_step:.0f} kernels per step, median kernel {t.median_kernel_us:.1f} us"
    if t.graph_kernel_share:
        kernels += (f"; {pct(t.graph_kernel_share)} of them replay from CUDA graphs "
                    f"({t.graph_launches_per_step:g} cudaGraphLaunch per step), "
                    f"{t.eager_kernels_per_step or 0.0:.0f} per step are launched one by one")
    if t.short_kernel_share is not None:
        kernels += (f"; of the kernels launched one by one {pct(t.short_kernel_share)} run shorter than "
                    f"their launch call (median launch {t.median_launch_us:.1f} us)")
    kernels += f"; queue depth median {t.queue_depth_median:.0f}, max {t.queue_depth_max}"
    return idle, kernels


def sync_bound(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 7: the median step makes at least one blocking host-device sync."""
    t = m.gpu_trace
    if t is None or t.syncs_per_step is None:
        if not m.cuda:
            unavailable["7 (syncs)"] = ("a CPU device has no host-device syncs; .item() calls are counted "
                                        "(scalar_reads_per_step) but cost nothing here")
        elif m.trace is None:  # the syncs are counted from the trace's runtime calls
            unavailable["7 (syncs)"] = m.no_trace
        return None
    if not t.syncs_per_step >= 1:
        return None
    sync_idle_share = t.host_wait_by_cause.get("sync", 0.0)
    return Finding(
        "sync-bound", (7,), "SYNC-BOUND: the step forces the host to wait for the GPU", sync_idle_share,
        [f"{t.syncs_per_step:g} host-device syncs in the median step (cudaStreamSynchronize / cudaDeviceSynchronize "
         f"/ blocking copies, e.g. from .item()), in every step rather than on logging steps only",
         f"after them the GPU sits idle {pct(sync_idle_share)} of the kernel span while Python refills the "
         f"queue; the host spends {pct(t.sync_share)} of step time blocked in them"],
        "hidden syncs: .item(), float(tensor), printing or branching on a GPU value every step, or "
        "GradScaler under bf16",
        [Fix("--log-every N (fastddpm reads the loss only on logging steps)",
             "accumulate the loss on the device (loss_sum += loss.detach()) and call .item() every N steps"),
         Fix(None, "no .item() in EMA or metrics; no GradScaler with bf16; find the sync with "
                   "torch.cuda.set_sync_debug_mode('warn')")])


def transfer_bound(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 8: host-to-device copies take > 5% of GPU busy time, or any copy is from pageable memory."""
    t = m.gpu_trace
    if t is None or t.h2d_share is None:
        return None
    pageable = t.h2d_pageable or 0
    if not (t.h2d_share > H2D_SHARE or pageable > 0):
        return None
    # a pageable copy blocks the host: the GPU's wait for Python is charged to it too
    cost = max(t.h2d_exposed_share, t.host_wait_by_cause.get("host", 0.0) if pageable else 0.0)
    return Finding(
        "transfer-bound", (8,), "TRANSFER-BOUND: host-to-device copies are not overlapped", cost,
        [f"HtoD copies take {pct(t.h2d_share)} of GPU busy time ({t.h2d_bytes_per_step / 2**20:.1f} "
         f"MiB per step); {pct(t.h2d_exposed_share)} of the span they run with no kernel alongside",
         f"{pageable} copies from pageable memory, {t.h2d_pinned} from pinned (pageable copies "
         "block the host and cannot overlap)"],
        "transfers on the critical path: pageable source memory, or copies not issued ahead of use",
        [Fix("--data-placement device (no per-step copies at all)",
             "keep the dataset on the GPU, or copy from pinned buffers: DataLoader(pin_memory=True) and "
             "x.to(device, non_blocking=True)"),
         Fix("--data-placement stream (pinned double buffers copied on a side stream)",
             "pinned buffers allocated once, filled by the CPU, copied with non_blocking=True on a side "
             "stream one batch ahead; avoid calling .pin_memory() per batch")])


def layout_thrash(m: Measurements, unavailable: dict[str, str]) -> Finding | None:
    """Rule 11: layout-conversion kernels take > 5% of GPU busy time. The cause, and so the fix, turns on the
    convolution weights' memory format and on whose kernels convert: cuDNN's own NCHW <-> NHWC conversions around
    NCHW tensors want channels_last; channels_last tensors meeting NCHW-only ops want it off (or compiled); an
    NCHW model's own transposes and copies want compiling or one layout kept through the block."""
    t = m.gpu_trace
    if t is None or t.layout_share is None or not t.layout_share > LAYOUT_SHARE:
        return None
    compiled = m.compile is not None and m.compile.compiled_graphs > 0
    cudnn = (t.layout_format_share or 0.0) > 0.5
    layout = m.conv_layout
    ev = [f"layout-conversion kernels (nchwToNhwc / nhwcToNchw / transposes / .contiguous() and other strided "
          f"copies) take "
          f"{pct(t.layout_share)} of GPU busy time, {t.layout_kernels_per_step:.0f} per step"]
    if t.layout_format_share is not None:
        ev.append(f"{pct(t.layout_format_share)} of that time is cuDNN's NCHW <-> NHWC format conversions")
    if layout is not None:
        ev.append("the convolution weights are " + {"nchw": "NCHW (contiguous)", "channels_last": "channels_last",
                                                     "mixed": "partly channels_last, partly NCHW"}[layout])
    # in eager, ops between the convolutions without an NHWC kernel (GroupNorm) would convert back, so the fix
    # compiles too; `--try`'s channels-last trial applies the layout alone, so it is offered where the loop compiles
    to_nhwc = Fix("--channels-last on" + ("" if compiled else " --compile on"),
                  "model.to(memory_format=torch.channels_last), and each 4-D input batch "
                  "x.contiguous(memory_format=torch.channels_last)" + (
                      "" if compiled else "; with torch.compile, so GroupNorm and the other ops between the "
                                          "convolutions run in that layout too"),
                  trial="channels-last" if compiled else None)
    compile_fix = Fix("--compile on", "torch.compile the model (Inductor fuses the ops between the convolutions "
                                      "in the tensors' own layout)", trial="compile")
    lo_what = ("force Inductor's layout optimization, so its own tensors are channels_last and cuDNN meets "
               "NHWC: torch.compile(model, options={'force_layout_optimization': True})")
    if cudnn and compiled and layout != "channels_last":
        # Under torch.compile the conversions' share is no estimate of channels_last's gain: measured on an H200
        # (benchmarks/RESULTS.md, 2026-11-27), 18% of seed-1layer's step gave 1.09x and 23% of ddpm-cifar10's gave
        # 0.94x, its step then spending 12% in same-dtype copies. So `--try` measures the fix against no prediction.
        to_nhwc = Fix("--channels-last on", to_nhwc.code + "; measure it (--try): under torch.compile its gain is "
                      "not the conversions' share, as Inductor's own tensors stay NCHW and the conversions can come "
                      "back as copies (on an H200: 1.09x on seed-1layer, 0.94x on ddpm-cifar10)",
                      trial="channels-last", unpredicted=True)
        # Measured on an H200 (benchmarks/RESULTS.md, 2026-11-28), compiled and captured under bf16: Inductor's
        # layout optimization forced 1.18x on ddpm-cifar10's NCHW step, with channels_last weights too 1.13x
        lo = Fix("--inductor-layout channels-last", lo_what + " (on an H200: 1.18x on ddpm-cifar10 at batch 128, "
                 "whose conversions took 23% of its step; not a prediction here)", unpredicted=True)
        force = Fix("--channels-last on --inductor-layout channels-last",
                    "both: channels_last weights and inputs, and " + lo_what + " (on an H200: 1.13x on "
                    "ddpm-cifar10, 1.02x over channels_last alone on seed-1layer)", unpredicted=True)
    if cudnn:
        cause = ("cuDNN's tensor-core convolutions on this GPU run in NHWC, so around every convolution that meets "
                 "an NCHW tensor it converts the input, weight and gradient to NHWC and the result back"
                 + {"mixed": "; here the NCHW weights among the channels_last ones",
                    "channels_last": "; here the weights are channels_last but tensors reach them NCHW (the "
                                     "input batch, or a .contiguous() on the way)"}.get(layout, "")
                 + ("; compiled with Inductor's layout optimization forced, these conversions remain"
                    if compiled and m.inductor_layout == "channels-last"
                    else "; Inductor did not change the layout (it skips its layout optimization in a graph with a "
                    "convolution of at least twice as many input as output channels and a kernel wider than 1, "
                    "as a U-Net's decoder has after its skip concatenation)" if compiled else ""))
        unforced = compiled and m.inductor_layout != "channels-last"
        if layout == "channels_last":
            # channels_last is already on, so the tensors reach cuDNN NCHW: turning it off would leave cuDNN
            # converting everything; what helps keeps the tensors NHWC up to the convolutions
            inputs = Fix(None, "keep the tensors channels_last up to the convolutions: convert each 4-D input "
                               "batch with x.contiguous(memory_format=torch.channels_last), and drop .contiguous() "
                               "calls between the convolutions (they return NCHW)")
            if not compiled:
                fixes = [Fix("--compile on", "torch.compile the model, so GroupNorm and the other ops between the "
                                             "convolutions keep channels_last (in eager they return NCHW)",
                             trial="compile"), inputs]
            else:
                fixes = ([Fix("--inductor-layout channels-last", lo_what + " (on an H200: 1.02x over "
                              "channels_last alone on seed-1layer; not a prediction here)", unpredicted=True)]
                         if unforced else []) + [inputs]
        elif layout == "mixed":
            # the NCHW weights are the likelier cause, so channels_last throughout comes first
            fixes = [to_nhwc] + ([force] if unforced else [])
        else:
            fixes = ([lo] if unforced else []) + [to_nhwc] + ([force] if unforced else []) + (
                [Fix("--channels-last off in eager, or --compile on", "if the model is channels_last: drop "
                     ".to(memory_format=torch.channels_last) in eager mode, or compile the model")]
                if layout is None else [])
    elif layout in ("channels_last", "mixed"):
        forced = m.inductor_layout == "channels-last"
        cause = ("channels_last tensors meet ops without an NHWC kernel (GroupNorm in eager mode, .contiguous() "
                 "calls, views that need NCHW), so every such op converts back and forth"
                 + ("; compiled with Inductor's layout optimization forced, its copies remain" if compiled and forced
                    else "; compiled, Inductor's own tensors stayed NCHW (its layout optimization skips a graph "
                         "with a convolution of at least twice as many input as output channels), so it copies "
                         "between the layouts" if compiled else ""))
        off = Fix("--channels-last off", "drop .to(memory_format=torch.channels_last) from the model and its "
                                         "inputs (measure both: the layout that wins depends on the GPU)")
        if compiled:
            # The copies are between cuDNN's NHWC and Inductor's NCHW: forcing Inductor to NHWC removes them where
            # it holds (an H200: 1.02x on seed-1layer), while NCHW brings cuDNN's own conversions back (an H200:
            # channels_last 1.09x NCHW on seed-1layer, 0.94x on ddpm-cifar10). Neither is predicted from the
            # copies' share; `--try N` measures both where N leaves room. Already forced: only the other layout is
            # left to try.
            force_nhwc = Fix("--channels-last on --inductor-layout channels-last",
                             "keep channels_last and force Inductor's layout optimization, so its own tensors are "
                             "channels_last too: torch.compile(model, options={'force_layout_optimization': True}) "
                             "(on an H200: 1.02x on seed-1layer with channels_last; not a prediction here)",
                             unpredicted=True)
            fixes = [] if forced else [force_nhwc]
            fixes.append(Fix(off.fastddpm, off.code + "; under torch.compile NCHW brings cuDNN's format conversions "
                             "back, so only a measurement (--try) says which costs less", unpredicted=True))
        else:
            fixes = [off, compile_fix]
    elif layout == "nchw":
        cause = ("the model changes layout between its own ops: .contiguous() copies, transposes and permutes (an "
                 "attention's head split, a view that needs another order)")
        fixes = ([] if compiled else [compile_fix]) + [
            Fix(None, "find the .contiguous() / permute calls among the top kernels' ops and keep one layout "
                      "through the block")]
    else:  # the weights' format unseen (no torch.optim step watched) and no cuDNN conversions: both readings
        cause = ("tensors change layout between ops: channels_last tensors meeting ops without an NHWC kernel, or "
                 ".contiguous() / transposes in the model")
        fixes = [Fix("--channels-last off in eager, or --compile on", "if the model is channels_last: drop "
                     ".to(memory_format=torch.channels_last) in eager mode, or compile the model")]
    return Finding("layout-thrash", (11,), "LAYOUT THRASH: time spent converting between NCHW and NHWC",
                   t.layout_share * (1 - t.idle_share), ev, cause, fixes)
