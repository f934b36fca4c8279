"""The numbers that fire docs/DOCTOR.md's rules, in one place: each rule's threshold, and the share of a problem's
cost that its fix is counted to give back. The rules_*.py modules and the verdict (rules.py) read them."""

HEALTHY_FLOOR = 0.05  # a finding that costs less than 5% of step time does not make a verdict
# a fix expected to give back less than this share of the step is not ranked, tried or listed as a finding: it is
# under the spread of the step times it would be measured by (2-5% between runs of one loop), so the report says
# in one line that it was checked and is negligible (autocast on a step whose matmuls are a sliver of it)
NEGLIGIBLE_SHARE = 0.01

# thresholds (docs/DOCTOR.md), tuned on the planted cases in tests/test_doctor_planted.py
DATA_WAIT_SHARE = 0.10
LOADER_MARGIN = 1.5
IN_PROCESS_CPU_SHARE = 0.4  # share of an in-process data wait spent computing that makes it CPU-bound
EPOCH_SPIKE_X = 3.0
GPU_IDLE_SHARE = 0.20
SMALL_KERNEL_US = 10.0
SHORT_KERNEL_SHARE = 0.5
# a step with at least this share of its kernels replayed from CUDA graphs is not launch-bound, whatever its
# few eager kernels look like: the graph already pays one launch for the rest
GRAPH_KERNEL_SHARE = 0.5
H2D_SHARE = 0.05
LAYOUT_SHARE = 0.05
FP32_GEMM_SHARE = 0.20
LOW_MFU_SHARE = 0.05
MEMORY_HEADROOM_SHARE = 0.50
DRIFT_SHARE = 0.05
DRIFT_FIFTH_STEPS = 3  # rule 15 compares medians of the watch's first and last fifth: this many steps each
# the compute rules (16-20). Their costs are deliberately conservative: a fix must give at least what the
# report promised (benchmarks/RESULTS.md measures the seed-style script before and after its top fix)
LOW_PRECISION_MIN_RATIO = 1.2  # bf16/fp16 matmuls must measure this much faster than fp32 to be prescribed
LOW_PRECISION_MAX_SPEEDUP = 2.0  # the matmul speed-up the estimate counts, however fast the peak ratio reads
ATTENTION_WEIGHTS_SHARE = 0.03  # materialised attention over this share of the step fires rule 17
FUSED_ATTENTION_SAVES = 0.5  # of the materialised attention's time: the fused kernel's usual gain, halved
ELEMENTWISE_SHARE = 0.25  # eager elementwise + norm over this share of the step fires rule 18
COMPILE_SAVES = 0.3  # of that time: fusion removes the memory round trips, not the math (conservative)
OPTIMIZER_SHARE = 0.05  # a per-tensor optimizer over this share of the step fires rule 19
OPTIMIZER_OPS = 300  # from this many ops per step (~25 tensors for AdamW) the per-op overhead is the cost, and on a
# waiting GPU the launches; under it, a few big tensors, the memory passes (one per update term), which fused removes
BIG_PARAMS = 500_000  # under OPTIMIZER_OPS, rule 19 needs this many parameters (2 MB a pass in fp32): a tiny
# model's optimizer share is overhead no fused kernel removes
FOREACH_SAVES = 0.5  # of the optimizer's time: a fused (or multi-tensor) update replaces one op per tensor per term
SMALL_BATCH = 32  # rule 20: at or under this batch, the per-step overhead is a large share of each image's cost
OVERHEAD_SHARE = 0.2  # ... when Python, framework and optimizer time take this share of the step
BATCH_DOUBLING_SAVES = 0.5  # doubling the batch spreads the per-step overhead over twice the images
CPU_LOW_MFU = 0.3  # rule 13 on a CPU: MFU under this with less than half the step in the matmuls
CPU_MATMUL_SHARE = 0.5
ITEM_LOOP_SHARE = 0.03  # rule 22: a Python loop over the batch's samples taking this share of the step
# ... of which one batched op gives back this much: the profiler slows the loop's many small ops more than the
# step's few large ones, so its profiled share reads high (on a 2-core CPU, benchmarks/RESULTS.md, the whole share
# predicted 1.25-1.32x where 1.09-1.25x was measured)
ITEM_LOOP_SAVES = 0.75
PARAM_LOOP_SHARE = 0.05  # rule 23: the loop's own update of a copy of the parameters (an EMA) over this share
# ... of which torch._foreach_lerp_ gives back this much: one op per tensor instead of two and one pass over each
# tensor instead of two (on a 2-core CPU it gave back 55-70% of the loop's profiled share, benchmarks/RESULTS.md)
PARAM_LOOP_SAVES = 0.5
# rule 24: other processes keeping this share of the usable cores busy (and at least this many cores) while the
# steps are watched make the report's times those of a contended step
BUSY_OTHERS_SHARE = 0.25
BUSY_OTHERS_MIN_CORES = 0.5
