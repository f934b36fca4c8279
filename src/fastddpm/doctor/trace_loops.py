"""A Python loop over the samples of a batch inside the step, read from the trace: the training thread indexes
one tensor item by item along its first dimension (`x[i]`, `x[i:i + 1]`, or all at once with `for x in batch`
and `zip(pred, target)`), op by op, where one batched op would do. Each index is an aten::select (or a one-item
aten::slice, or an aten::unbind for all the items) issued by the loop's own code, not by an op: the
selects autograd's backward or an op's implementation makes sit inside another op and are left out, as is a
loop over chunks of several items (gradient accumulation's micro-batches) and a dataset's per-sample reads
inside the data wait."""

from __future__ import annotations

import statistics
from collections import Counter

from fastddpm.doctor.marks import DATA_MARK
from fastddpm.doctor.trace_optree import TRANSPARENT_OPS, OpTree

INDEX_OPS = {"aten::select", "aten::slice"}
BACKWARD_NODE = "autograd::engine::evaluate_function: "
OPTIMIZER_MARKS = ("Optimizer.step#", "Optimizer.zero_grad#")  # their ops are the optimizer's
MIN_ITEMS = 4  # a first dimension this long or longer, and at least this many items indexed, make a loop


def _unbound(e: dict) -> tuple | None:
    """The shape of a tensor split into its items along the first dimension (aten::unbind: `for x in batch`,
    `zip(pred, target)`), else None."""
    args = e.get("args") or {}
    dims, concrete = args.get("Input Dims") or [], args.get("Concrete Inputs") or []
    if not dims or not isinstance(dims[0], list) or not dims[0]:
        return None
    try:
        dim = int(concrete[1]) if len(concrete) > 1 and concrete[1] != "" else 0
    except ValueError:
        return None
    return tuple(dims[0]) if dim in (0, -len(dims[0])) else None


def _item_index(e: dict) -> tuple[tuple, int] | None:
    """(the indexed tensor's shape, the item) of an op that takes one item along the first dimension, else None."""
    args = e.get("args") or {}
    dims, concrete = args.get("Input Dims") or [], args.get("Concrete Inputs") or []
    if not dims or not isinstance(dims[0], list) or not dims[0] or len(concrete) < 3:
        return None
    shape = tuple(dims[0])
    try:
        dim = int(concrete[1])
        first = int(concrete[2])
        if e.get("name") == "aten::slice":
            if len(concrete) < 5 or int(concrete[3]) - first != 1 or int(concrete[4]) != 1:
                return None  # a chunk of several items, or a strided slice: not one item
    except ValueError:
        return None
    if dim not in (0, -len(shape)):
        return None
    return shape, first % shape[0] if shape[0] else first


def item_loops(tree: OpTree, step_bounds: list[tuple[float, float]]) -> list[dict]:
    """The training thread's loops over the items of a tensor's first dimension, one for each length indexed so in
    at least half the steps `step_bounds` ((start, end) in trace microseconds); the items must be tensors (a loop
    over a vector's scalars, a layer's gain, is none). Which is over the batch's samples is rule 22's to say (it
    knows the batch). Each: {"items": the dimension's length, "indexed_per_step": distinct items indexed,
    "shapes": the tensors indexed, "span_us": the loop's median time per step (from its first index to the end
    of the last item's ops, cut at the step's end), "ops_in_span": the ops recorded in that time (the profiler's
    cost is paid per op), "step_us": the profiled steps' median, "per_item_ops": the ops each item goes through,
    most frequent first, "backward_us" and "backward_ops": the same two for the autograd nodes the backward
    evaluates once per item}."""
    per_step: list[dict] = [{} for _ in step_bounds]  # shape -> {item: first ts}
    starts = [a for a, _ in step_bounds]

    def step_at(ts: float) -> int | None:
        for i in range(len(step_bounds) - 1, -1, -1):
            if starts[i] <= ts <= step_bounds[i][1]:
                return i
        return None

    main = [(n, False) for n in reversed(tree.roots.get(tree.main_tid, []))]
    while main:
        node, in_op = main.pop()
        name = node.e.get("name", "")
        if name == DATA_MARK:
            continue  # a map-style dataset's per-sample reads: the input pipeline's (rules 1 and 3)
        is_op = node.e.get("cat") == "cpu_op"
        if is_op and not in_op and name in INDEX_OPS:
            found = _item_index(node.e)
            i = step_at(node.ts)
            if found is not None and i is not None and len(found[0]) >= 2:
                per_step[i].setdefault(found[0], {}).setdefault(found[1], node.ts)
        elif is_op and not in_op and name == "aten::unbind":  # every item at once; the loop over them follows
            shape, i = _unbound(node.e), step_at(node.ts)
            if shape is not None and i is not None and len(shape) >= 2:
                items = per_step[i].setdefault(shape, {})
                for k in range(shape[0]):
                    items.setdefault(k, node.ts)
        main.extend((c, in_op or is_op) for c in reversed(node.children))

    by_length: dict[int, list[dict]] = {}
    for i, shapes in enumerate(per_step):
        for n in sorted({s[0] for s in shapes}):
            looped = {s: items for s, items in shapes.items()
                      if s[0] == n and n >= MIN_ITEMS and len(items) >= max(MIN_ITEMS, n // 2)}
            if looped:
                by_length.setdefault(n, []).append(_one_loop(tree, looped, step_bounds[i]))
    return [_median_loop(n, found) for n, found in sorted(by_length.items()) if len(found) * 2 >= len(step_bounds)]


def _one_loop(tree: OpTree, looped: dict, bounds: tuple[float, float]) -> dict:
    """One step's loop over the items of the tensors `looped` ({shape: {item: when it was indexed}})."""
    times = sorted(ts for items in looped.values() for ts in items.values())
    indexed = max(len(items) for items in looped.values())
    first = times[0]
    # the ops the loop issues once an item: its end is where the last item's ones end. Looked for from the first
    # index to the backward or the optimizer (whose per-tensor ops would repeat as often)
    window = []
    for n in _top_level(tree, first, bounds[1]):
        name = n.e.get("name", "")
        if name.startswith(BACKWARD_NODE):
            break
        if name not in INDEX_OPS | TRANSPARENT_OPS | {"aten::unbind"}:
            window.append(n)
    counts = Counter(n.e.get("name", "") for n in window)
    per_item = [k for k, c in counts.most_common() if c >= indexed * 0.9]
    ends = [[n.end for n in window if n.e.get("name", "") == k][min(counts[k], indexed) - 1] for k in per_item]
    # without such ops, from the first index to the last plus one item's share
    end = min(bounds[1], max(ends) if ends else first + (times[-1] - first) * indexed / max(1, indexed - 1))
    inside = sum(1 for n in tree.walk(tree.main_tid) if n.e.get("cat") == "cpu_op" and first <= n.ts <= end)
    back_us, back_ops = _per_item_backward(tree, bounds, indexed)
    return {"indexed": indexed, "shapes": sorted(looped), "span_us": end - first, "ops": inside,
            "step_us": bounds[1] - bounds[0], "per_item": per_item[:3], "back_us": back_us, "back_ops": back_ops}


def _median_loop(items: int, loops: list[dict]) -> dict:
    return {"items": items, "indexed_per_step": statistics.median_high([x["indexed"] for x in loops]),
            "shapes": [list(s) for s in loops[0]["shapes"]],
            "span_us": statistics.median(x["span_us"] for x in loops),
            "ops_in_span": statistics.median(x["ops"] for x in loops),
            "step_us": statistics.median(x["step_us"] for x in loops),
            "per_item_ops": loops[0]["per_item"],
            "backward_us": statistics.median(x["back_us"] for x in loops),
            "backward_ops": statistics.median(x["back_ops"] for x in loops)}


def _per_item_backward(tree: OpTree, bounds: tuple[float, float], indexed: int) -> tuple[float, int]:
    """The backward's share of the loop: the autograd nodes evaluated once per sample in the step (as many times
    as the items indexed, or more: the loop's own ops' gradients), and the engine's own ops as often between them
    (the aten::add_ that sums each sample's gradient into the batch's: a select's backward is a batch-sized
    tensor of zeros around one sample's gradient), on any thread (a CUDA backward runs on the engine's device
    thread). Returns (their time in microseconds, the ops recorded inside them)."""
    found = list(_top_level(tree, *bounds, every_thread=True))
    backward_from = min((n.ts for n in found if n.e.get("name", "").startswith(BACKWARD_NODE)), default=None)
    if backward_from is None:
        return 0.0, 0
    nodes: dict[str, list] = {}
    for n in found:
        if n.ts >= backward_from:
            nodes.setdefault(n.e.get("name", ""), []).append(n)
    time_us, ops = 0.0, 0
    for same in nodes.values():
        if len(same) >= indexed * 0.9:
            time_us += sum(n.end - n.ts for n in same)
            ops += sum(1 + _count(n) for n in same)
    return time_us, ops


def _count(node) -> int:
    return sum(1 + _count(c) for c in node.children)


def _top_level(tree: OpTree, start: float, end: float, *, every_thread: bool = False, data_wait: bool = True):
    """The training thread's (or `every_thread`'s) outermost ops that start in [start, end], in time order per
    thread: under a mark (a step closure) too, but not inside the optimizer's step or zero_grad, nor (`data_wait`
    False) inside the data wait. An autograd node of the backward is one such op."""
    for tid, roots in tree.roots.items():
        if not every_thread and tid != tree.main_tid:
            continue
        todo = list(reversed(roots))
        while todo:
            n = todo.pop()
            name = n.e.get("name", "")
            if (n.end < start or n.ts > end or name.startswith(OPTIMIZER_MARKS)
                    or (not data_wait and name == DATA_MARK)):
                continue
            if n.e.get("cat") == "cpu_op":
                if start <= n.ts <= end:
                    yield n
                continue
            todo.extend(reversed(n.children))


# A loop over the parameters outside the optimizer (an EMA of the weights: `p_ema.mul_(d).add_(p, alpha=1 - d)`,
# `p_ema.lerp_(p, 1 - d)`, diffusers' `s.sub_((1 - d) * (s - p))`): each tensor's in-place update, and the ops that
# feed it, one tensor at a time; a forward's in-place adds are parted by its matmuls and convolutions
UPDATE_OPS = {"aten::mul_", "aten::add_", "aten::sub_", "aten::lerp_", "aten::copy_", "aten::addcmul_",
              "aten::div_", "aten::addcdiv_"}
UPDATE_HELPERS = {"aten::detach", "aten::detach_", "aten::alias", "aten::view", "aten::lift_fresh", "aten::mul",
                  "aten::add", "aten::sub", "aten::rsub", "aten::lerp", "aten::empty", "aten::empty_like",
                  "aten::empty_strided", "aten::to", "aten::_to_copy"}
MIN_UPDATE_OPS = 16  # in-place updates in one run: fewer are a handful of tensors, whose per-op overhead is small


def param_update_loop(tree: OpTree, step_bounds: list[tuple[float, float]]) -> dict | None:
    """The training thread's longest run of outermost in-place updates in each step (outside the optimizer, its
    backward and its data wait; nothing but their feeding ops, UPDATE_HELPERS, between them), where at least half
    the steps have one of MIN_UPDATE_OPS or more. Whether it runs over the parameters is rule 23's to say (it knows
    the optimizer's). Medians over those steps: {"updates": in-place ops, "elements": the elements they write,
    "span_us": from the first to the end of the last, "ops_us": the run's ops' own time, "step_us": the profiled
    step, "per_tensor_ops": the in-place ops' names, most frequent first}; None without one."""
    found = []
    for start, end in step_bounds:
        best, run = None, []
        for n in list(_top_level(tree, start, end, data_wait=False)) + [None]:
            name = n.e.get("name", "") if n is not None else ""
            if name in UPDATE_OPS or (run and name in UPDATE_HELPERS):
                run.append(n)
                continue
            updates = [x for x in run if x.e.get("name") in UPDATE_OPS]
            if len(updates) >= MIN_UPDATE_OPS and (best is None or len(updates) > len(best[1])):
                best = (run, updates)
            run = []
        if best is not None:
            run, updates = best
            found.append({"updates": len(updates), "elements": sum(_elements(x.e) for x in updates),
                          "span_us": min(end, updates[-1].end) - updates[0].ts,
                          "ops_us": sum(x.end - x.ts for x in run), "step_us": end - start,
                          "names": Counter(x.e.get("name", "") for x in updates)})
    if not found or len(found) * 2 < len(step_bounds):
        return None
    names = sum((x["names"] for x in found), Counter())
    return {"updates": statistics.median_high([x["updates"] for x in found]),
            "elements": statistics.median_high([x["elements"] for x in found]),
            **{k: statistics.median(x[k] for x in found) for k in ("span_us", "ops_us", "step_us")},
            "per_tensor_ops": [k for k, _ in names.most_common()]}


def _elements(e: dict) -> int:
    dims = (e.get("args") or {}).get("Input Dims") or []
    if not dims or not isinstance(dims[0], list):
        return 0
    count = 1
    for d in dims[0]:
        count *= int(d)
    return count
