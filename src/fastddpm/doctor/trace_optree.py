"""Where the step goes, op by op: the host ops of the measured steps as per-thread nesting trees, each op charged
to a category of fastddpm.doctor.trace.BREAKDOWN (matmul, attention, norm, ...) by its name, the outermost
categorised op winning. trace.py adds the categories' time up into TraceStats.breakdown."""

from __future__ import annotations

import bisect

from fastddpm.doctor.marks import CLOSURE_MARK, DATA_MARK, HOST_MARK_CATS, STEP_MARK

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
              "aten::convolution_backward", "aten::_convolution", "aten::mkldnn_convolution",
              "aten::cudnn_convolution", "aten::addbmm", "aten::cudnn_convolution_transpose", "aten::_scaled_mm"}
SOFTMAX_OPS = {"aten::softmax", "aten::_softmax", "aten::_softmax_backward_data", "aten::_safe_softmax"}
# with a softmax over attention weights beside them: attention written out by hand
BATCHED_MATMUL_OPS = {"aten::bmm", "aten::baddbmm"}


def _dims(e: dict) -> list:
    return [d for d in (e.get("args") or {}).get("Input Dims") or [] if isinstance(d, list)]


def weights_side(e: dict) -> int | None:
    """L, when a softmax's input ends in an (L, L) square: attention weights over L tokens (Q K^T). A softmax over
    one axis of a (.., d, L) tensor (linear attention's) or over classes is not one: None. 0 when the trace
    recorded no shapes (then every softmax may be one)."""
    dims = _dims(e)
    if not dims:
        return 0
    first = dims[0]
    return first[-1] if len(first) >= 2 and first[-1] == first[-2] and first[-1] > 1 else None


def weights_bmm(e: dict, sides: set[int]) -> bool:
    """A batched matmul of attention written out: an (L, L) square of one of the weights softmaxes' sizes `sides`
    as its output (Q K^T) or as either factor (the weights times V, in either operand order; the gradients have
    the same shapes). Linear attention's K V^T, (.., d, L) x (.., L, d) -> (.., d, d), beside no such softmax,
    is not one. Without recorded shapes (0 in `sides`, or none here) every batched matmul beside a weights
    softmax counts."""
    dims = [d for d in _dims(e) if len(d) == 3]
    if 0 in sides or len(dims) < 2:
        return True
    (_, m, k), (_, _, n) = dims[-2], dims[-1]  # baddbmm's first input is the bias: the factors are the last two
    return (m == n and m in sides) or (m == k and m in sides) or (k == n and k in sides)


NORM_BREAKDOWN_OPS = {"aten::group_norm", "aten::native_group_norm", "aten::native_group_norm_backward",
                      "aten::layer_norm", "aten::native_layer_norm", "aten::native_layer_norm_backward",
                      "aten::batch_norm", "aten::_batch_norm_impl_index", "aten::native_batch_norm",
                      "aten::native_batch_norm_backward", "aten::_native_batch_norm_legit",
                      "aten::_native_batch_norm_legit_functional", "aten::cudnn_batch_norm",
                      "aten::cudnn_batch_norm_backward", "aten::instance_norm", "aten::rms_norm",
                      "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward",
                      # F.normalize's reduction (RMSNorm written as F.normalize(x) * g * sqrt(d)), which keeps
                      # its dim (gradient clipping's norms do not): its division and scaling stay elementwise
                      "aten::linalg_vector_norm", "aten::norm"}
VECTOR_NORMS = {"aten::linalg_vector_norm": 3, "aten::norm": 3}  # -> the keepdim argument's position


def _keepdim(e: dict) -> bool:
    """Whether a vector norm kept its reduced dim (F.normalize does); True where the trace has no arguments."""
    concrete = (e.get("args") or {}).get("Concrete Inputs") or []
    i = VECTOR_NORMS.get(e.get("name"), 3)
    return len(concrete) <= i or concrete[i] in ("True", "")
COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::to", "aten::contiguous", "aten::clone", "aten::cat",
            "aten::stack", "aten::index_select", "aten::gather", "aten::index", "aten::_copy_from",
            "aten::_copy_from_and_resize", "aten::to_dense", "aten::masked_select", "aten::repeat"}
# views, allocation and wrappers: cheap bookkeeping, or a call whose work is done by the op inside it
TRANSPARENT_OPS = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::as_strided", "aten::as_strided_", "aten::view",
    "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::t", "aten::transpose", "aten::permute",
    "aten::expand", "aten::select", "aten::slice", "aten::squeeze", "aten::unsqueeze", "aten::flatten",
    "aten::unflatten", "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::split", "aten::chunk", "aten::narrow", "aten::unbind", "aten::resize_",
    "aten::result_type", "aten::item", "aten::_local_scalar_dense", "aten::linear", "aten::matmul", "aten::einsum",
    "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv_transpose1d", "aten::conv_transpose2d",
    "aten::conv_transpose3d", "aten::set_", "aten::is_nonzero", "aten::view_as", "aten::expand_as",
    "aten::split_with_sizes", "aten::unsafe_split", "aten::movedim", "aten::numpy_T", "aten::record_stream"}


def _attention_impl(name: str) -> str | None:
    """The attention implementation an op belongs to, or None: fused SDPA kernels by backend, SDPA's math
    fallback, and nn.MultiheadAttention's inference fast path."""
    if "scaled_dot_product" not in name and "flash_attention" not in name and "efficient_attention" not in name \
            and "multi_head_attention" not in name:
        return None
    if "math" in name:
        return "SDPA math (materialised)"
    if "for_cpu" in name:
        return "SDPA flash (CPU)"
    if "flash" in name:
        return "SDPA flash"
    if "efficient" in name:
        return "SDPA memory-efficient"
    if "cudnn" in name:
        return "SDPA cuDNN"
    if "multi_head_attention" in name:
        return "nn.MultiheadAttention fast path"
    return "SDPA"  # the dispatching op itself: its child names the kernel


class OpTree:
    """The host events of the measured steps as per-thread nesting trees, each node charged to a category."""

    class Node:
        __slots__ = ("e", "ts", "end", "children", "cat", "impl", "owner")

        def __init__(self, e: dict):
            self.e, self.ts = e, float(e["ts"])
            self.end = self.ts + float(e.get("dur", 0))
            self.children: list = []
            self.cat: str | None = None
            self.impl: str | None = None  # attention: its implementation
            self.owner = self  # the outermost op of this category around it (the matmul whose dtype counts)

    def __init__(self, xs: list[dict], step_of, step_ends: list[float] | None = None):
        """`step_of`: a moment -> the index of the measured step it falls in, or None. `step_ends`: each step's
        end; an op that outlasts its step is cut there. `doctor run` ends a step in torch.optim's post-hook, which
        runs inside the `Optimizer.step#` range: that range runs on past the step boundary, and in the last
        profiled step over the profiler's own stop (5.6 ms, against the optimizer's own 0.36 ms, in one review's
        run), time that belongs to the next step or to none."""
        self.main_tid = next((e.get("tid") for e in xs if e.get("name") == STEP_MARK
                              and e.get("cat") in HOST_MARK_CATS), None)
        step_at = {}  # id(event) -> its step
        for e in xs:
            if e.get("cat") in ("cpu_op", "user_annotation") and e.get("name") != STEP_MARK:
                i = step_of(float(e["ts"]))
                if i is not None:
                    step_at[id(e)] = i
        events = [e for e in xs if id(e) in step_at]
        # the token counts of the softmaxes over attention weights (L of an (L, L) input)
        self.weight_sides = {side for e in events if e.get("name") in SOFTMAX_OPS
                             and (side := weights_side(e)) is not None}
        self.roots: dict = {}  # tid -> top-level nodes, in time order
        self._starts: dict = {}  # id(a list of sibling nodes) -> their start times, for innermost_at
        by_tid: dict = {}
        for e in events:
            by_tid.setdefault(e.get("tid"), []).append(e)
        for tid, lst in by_tid.items():
            roots, stack = [], []
            for e in sorted(lst, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
                node = OpTree.Node(e)
                if step_ends is not None:
                    node.end = min(node.end, step_ends[step_at[id(e)]])
                while stack and stack[-1].end <= node.ts:
                    stack.pop()
                (stack[-1].children if stack else roots).append(node)
                stack.append(node)
            for r in roots:
                self._categorise(r, None, None)
            self.roots[tid] = roots

    def _own_category(self, name: str, cat: str | None, e: dict | None = None) -> str | None:
        if name == DATA_MARK:
            return "data"
        if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            return "optimizer"
        if _attention_impl(name) is not None:
            return "attention"
        if name in SOFTMAX_OPS and weights_side(e or {}) is not None:
            return "attention"
        if name in BATCHED_MATMUL_OPS and self.weight_sides and weights_bmm(e or {}, self.weight_sides):
            return "attention"
        if name in MATMUL_OPS:
            return "matmul"
        if name in NORM_BREAKDOWN_OPS and not (name in VECTOR_NORMS and not _keepdim(e or {})):
            return "norm"
        if name in COPY_OPS:
            return "copy"
        if cat == "cpu_op" and name.startswith("aten::") and name not in TRANSPARENT_OPS:
            return "elementwise?"  # unless something inside it is of another category (a wrapper we do not know)
        return None

    def _categorise(self, node: "OpTree.Node", inherited: str | None, owner) -> None:
        """Outermost category wins; an unknown aten op is elementwise unless it wraps categorised work."""
        name = node.e.get("name", "")
        own = self._own_category(name, node.e.get("cat"), node.e)
        if name == CLOSURE_MARK:  # the loop's forward and backward inside Optimizer.step: not the optimizer's
            inherited, owner = None, None
        if inherited is not None:
            node.cat, node.owner = inherited, owner
        elif own == "elementwise?":
            node.cat = "elementwise" if not self._wraps_work(node) else None
        else:
            node.cat = own
        if node.cat == "attention" and node.owner is node:
            node.impl = self._impl(node)
        for c in node.children:
            self._categorise(c, node.cat, node.owner if node.cat is not None else None)

    def _wraps_work(self, node: "OpTree.Node") -> bool:
        for c in node.children:
            own = self._own_category(c.e.get("name", ""), c.e.get("cat"), c.e)
            if own not in (None, "elementwise?") or self._wraps_work(c):
                return True
        return False

    def _impl(self, node: "OpTree.Node") -> str:
        found = None
        todo = [node]
        while todo:
            n = todo.pop()
            impl = _attention_impl(n.e.get("name", ""))
            if impl is not None and (found is None or found == "SDPA"):
                found = impl
            todo.extend(n.children)
        return found or "softmax(QK^T)V (materialised)"

    def walk(self, tid=None):
        """Every node of thread `tid` (all threads when None), parents before children."""
        todo = [n for t, roots in self.roots.items() if tid is None or t == tid for n in reversed(roots)]
        while todo:
            n = todo.pop()
            yield n
            todo.extend(reversed(n.children))

    def optimizer_kind(self) -> tuple[str | None, float | None]:
        steps = [n for n in self.walk() if n.e.get("name", "").startswith("Optimizer.step#")]
        if not steps:
            return None, None
        names = [d.e.get("name", "") for s in steps for d in self._descendants(s)]
        kind = ("fused" if any("_fused_" in x for x in names) else
                "foreach" if any("_foreach_" in x for x in names) else "per-tensor")
        # the ops the optimizer itself issues (not what they call inside): one per tensor per term when
        # per-tensor, a few for all tensors when foreach or fused (on a CPU a foreach op still loops inside)
        own = sum(1 for s in steps for c in s.children if c.e.get("name") != CLOSURE_MARK)
        return kind, own / len(steps)

    @staticmethod
    def _descendants(node: "OpTree.Node"):
        """The ops under `node`, less a step closure's (the loop's forward and backward, not the optimizer's)."""
        todo = [c for c in node.children if c.e.get("name") != CLOSURE_MARK]
        while todo:
            n = todo.pop()
            yield n
            todo.extend(c for c in n.children if c.e.get("name") != CLOSURE_MARK)

    def innermost_at(self, tid, ts: float) -> "OpTree.Node | None":
        """The deepest node of thread `tid` open at `ts` (a binary search per level: a GPU trace asks once per
        kernel)."""
        level = self.roots.get(tid) or []
        found = None
        while level:
            starts = self._starts.get(id(level))
            if starts is None:
                starts = self._starts[id(level)] = [n.ts for n in level]
            i = bisect.bisect_right(starts, ts) - 1
            if i < 0 or level[i].end < ts:
                break
            found = level[i]
            level = found.children
        return found
