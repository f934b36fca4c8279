"""What the doctor sees of a loop from the outside, besides its steps and data waits: calls into
nn.MultiheadAttention and the modules that build attention weights (rule 17), the optimizer that steps (rule 19),
the batch size (rule 20) and the lines of the loop's own per-sample indexing (rule 22) and in-place updates after
the step (rule 23).

`doctor run` and `watch()` install an `AttentionWatch` for the length of the run; it wraps
nn.MultiheadAttention.forward on the class (the way `doctor run` times DataLoader.__iter__), counts the calls
made during the watched steps and how many asked for the attention weights, and puts the method back after.
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import threading
from collections import Counter

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fastddpm.doctor.marks import CLOSURE_MARK
from fastddpm.doctor.measurements import AttentionCalls, OptimizerInfo
from fastddpm.doctor.trace_loops import MIN_UPDATE_OPS, UPDATE_OPS

_NEED_WEIGHTS_ARG = 4  # forward(query, key, value, key_padding_mask, need_weights, ...)


class AttentionWatch:
    """Counts nn.MultiheadAttention.forward calls while `counting()` is true."""

    def __init__(self, counting):
        self.counting = counting
        self.calls = 0
        self.need_weights = 0
        self.modules: set[int] = set()
        self.sites: dict[str, str] = {}  # where the loop's code calls a module with need_weights=True -> its code
        self._orig = None

    def __enter__(self) -> AttentionWatch:
        orig = nn.MultiheadAttention.forward
        self._orig = orig
        watch = self

        def forward(module, *args, **kwargs):
            if watch.counting():
                watch.calls += 1
                need = kwargs.get("need_weights", args[_NEED_WEIGHTS_ARG] if len(args) > _NEED_WEIGHTS_ARG else True)
                watch.need_weights += bool(need)
                if need and id(module) not in watch.modules and len(watch.sites) < 3:
                    where, code = _caller_outside_torch()
                    watch.sites[where] = code  # the line to add need_weights=False to
                watch.modules.add(id(module))
            return orig(module, *args, **kwargs)

        forward.__wrapped__ = orig
        nn.MultiheadAttention.forward = forward
        return self

    def __exit__(self, *exc) -> bool:
        if self._orig is not None:
            nn.MultiheadAttention.forward = self._orig
            self._orig = None
        return False

    def measured(self, steps: int) -> AttentionCalls | None:
        """Per watched step; None when no call was seen (no nn.MultiheadAttention in the loop)."""
        if not self.calls or steps <= 0:
            return None
        return AttentionCalls(calls_per_step=self.calls / steps, need_weights_per_step=self.need_weights / steps,
                              modules=len(self.modules), call_sites=list(self.sites),
                              call_code=[c for c in self.sites.values() if c])


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _caller_outside_torch() -> tuple[str, str]:
    """(`train.py:31 in forward`, that line's code, "" where its source is not at hand): the innermost frame of the
    caller's stack outside torch (nn.Module.__call__ and its hooks sit between the call and the wrapped forward)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    if frame is None:
        return "an unknown place", ""
    return place_of(frame)


def place_of(frame) -> tuple[str, str]:
    """(`train.py:31 in forward`, or `train.py:31` outside a function, and that line's code) of `frame`: how every
    place in the user's code is worded in a report (rules 17, 22 and 23, and the stall watcher's stuck line)."""
    import linecache

    code = _without_comment(linecache.getline(frame.f_code.co_filename, frame.f_lineno))
    name = frame.f_code.co_name  # a function's name; not <module>, <genexpr>, <listcomp>: the line says it
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" + (
        f" in {name}" if not name.startswith("<") else ""), code


def _without_comment(line: str) -> str:
    """A line of code without its trailing comment (a '#' inside a string stays), stripped; "" if it does not
    tokenize on its own (a call spread over several lines)."""
    import io
    import tokenize

    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return line[:tok.start[1]].strip()
    except (tokenize.TokenError, SyntaxError):
        return ""
    return line.strip()


class LoopSites(TorchFunctionMode):
    """Where the loop's own code does what rules 22 and 23 find in the trace, by the line of the user's code that
    led there (the innermost frame in the user's files: not torch, installed packages or the standard library, so
    a diffusers EMAModel's loop is counted at the line that calls ema.step). Active for one warm-up step
    (SitesWindow), it counts calls made from outside torch (torch's own zero_grad and optimizer are not the loop's):
      updates  one of rule 23's in-place ops on a tensor autograd does not record, from an optimizer step to the
               next module call (an EMA of the weights after the step; a forward's in-place ops are not one)
      items    x[i] with a whole number i on a tensor (a sample indexed from the batch, rule 22), with the
               indexed tensor's first dimension; and a tensor iterated (`for x in batch`, `zip(pred, target)`:
               Tensor.__iter__ unbinds it inside torch, so the line is __iter__'s caller) or unbound along its
               first dimension by the user's own line, as many items as that dimension. A library's or torch's
               own iteration or unbind (an attention layer's split of its q, k, v) is not the loop's and is not
               counted, nor is what is not a tensor (`for p in model.parameters()`, the tuple `x.chunk(2)`
               returns)"""

    def __init__(self):
        super().__init__()
        self.counting_updates = True
        self.updates: Counter[str] = Counter()
        self.items: Counter[tuple[str, int]] = Counter()
        self.code: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and (
                (name == "__getitem__" and len(args) > 1 and _whole(args[1]) and args[0].dim() > 0)
                or (name in _UPDATE_NAMES and self.counting_updates
                    and (not torch.is_grad_enabled() or not args[0].requires_grad))):
            caller = sys._getframe(1)
            if not caller.f_code.co_filename.startswith(_TORCH_DIR):
                where, code = _user_frame(caller)
                if name == "__getitem__":
                    self.items[where, args[0].shape[0]] += 1
                else:
                    self.updates[where] += 1
                self.code.setdefault(where, code)
        elif name == "unbind" and args and isinstance(args[0], torch.Tensor) and _along_first(args, kwargs):
            frame = _iterating_user(sys._getframe(1))
            if frame is not None:
                where, code = place_of(frame)
                self.items[where, args[0].shape[0]] += args[0].shape[0]
                self.code.setdefault(where, code)
        return func(*args, **(kwargs or {}))

    def update_site(self) -> dict | None:
        """{"place": "train.py:57", "code": that line, "updates": the calls there} for the place with the most,
        where they are MIN_UPDATE_OPS or more; else None."""
        if not self.updates:
            return None
        where, n = self.updates.most_common(1)[0]
        return {"place": where, "code": self.code[where], "updates": n} if n >= MIN_UPDATE_OPS else None

    def item_sites(self) -> list[dict]:
        """[{"place", "code", "items": x[i] calls there, "length": the indexed tensors' first dimension}] for the
        places that indexed at least half of such a tensor's items one by one (a loop over it), most first."""
        return [{"place": where, "code": self.code[where], "items": n, "length": length}
                for (where, length), n in self.items.most_common() if n >= 2 and 2 * n >= length]


class SitesWindow:
    """LoopSites for one warm-up step, opened once and closed once on the thread that trains (a torch function mode
    is that thread's). While open, an optimizer step starts the count of updates and a module call ends it; a
    compiled model's first call closes the window (its forward must not be traced with the mode on)."""

    def __init__(self):
        self.sites = LoopSites()
        self.state = "ready"  # then "open", then "done"
        self._handles: list = []
        self._thread: int | None = None
        self._graphs_before = dynamo_graphs()[0]  # the process's earlier compilations are not this loop's

    def open(self, *, after_optimizer_step: bool) -> None:
        if self.state != "ready":
            return
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        compiled = dynamo_graphs()[0] > self._graphs_before

        def module_call(module, args):
            self.sites.counting_updates = False  # the forward's own in-place ops are no EMA
            if compiled:
                self.close()

        def optimizer_stepped(optimizer, args, kwargs):
            self.sites.counting_updates = True

        self.sites.counting_updates = after_optimizer_step
        self.sites.__enter__()
        self.state, self._thread = "open", threading.get_ident()
        self._handles = [register_module_forward_pre_hook(module_call),
                         register_optimizer_step_post_hook(optimizer_stepped)]

    def close(self) -> None:
        if self.state == "open" and threading.get_ident() == self._thread:
            self.state = "done"
            for h in self._handles:
                h.remove()
            self.sites.__exit__(None, None, None)

    def seen(self) -> dict:
        """What it counted, as Measurements fields."""
        return {"update_site": self.sites.update_site(), "item_sites": self.sites.item_sites()}


def dynamo_graphs() -> tuple[int, int, int]:
    """(graphs compiled, graph breaks, CUDA-graph skips) so far, from torch._dynamo's counters."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - no dynamo in this build: nothing was compiled
        return 0, 0, 0
    graphs = int(counters["stats"].get("unique_graphs", 0))
    breaks = int(sum(counters["graph_break"].values()))
    skips = int(counters["inductor"].get("cudagraph_skips", 0))
    return graphs, breaks, skips


def _whole(index) -> bool:
    """An index that picks one item: a Python int (not a bool), or a 0-d integer tensor."""
    if isinstance(index, torch.Tensor):
        return index.dim() == 0 and not index.is_floating_point() and index.dtype != torch.bool
    return isinstance(index, int) and not isinstance(index, bool)


_UPDATE_NAMES = {op.removeprefix("aten::") for op in UPDATE_OPS}
# installed packages and the standard library; fastddpm's own code is a user's where it is the loop (a planted
# case, a script calling its U-Net), and never the caller of an op the sites count otherwise
_NOT_USERS = tuple({_TORCH_DIR, *(sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib", "stdlib"))})


def _user_frame(frame) -> tuple[str, str]:
    """place_of the innermost frame from `frame` outward in the user's own files; of the outermost frame where
    every one is elsewhere."""
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_NOT_USERS)
                                        or frame.f_code.co_filename.startswith("<")):
        frame = frame.f_back
    return place_of(frame)


def _along_first(args, kwargs) -> bool:
    """An unbind call's dim (unbind(x), x.unbind(dim), dim=) is the first dimension of a tensor of 1 or more."""
    x, dim = args[0], (kwargs or {}).get("dim", args[1] if len(args) > 1 else 0)
    return x.dim() > 0 and isinstance(dim, int) and dim in (0, -x.dim())


# Tensor.__iter__ is `iter(self.unbind(0))`, and skips __torch_function__ itself: a mode sees the unbind only,
# called from this code
_TENSOR_ITER = torch.Tensor.__iter__.__code__


def _iterating_user(caller):
    """The frame of the user's code that splits a tensor into its items, given the caller of an unbind: the frame
    that iterates the tensor (the caller of Tensor.__iter__) or calls unbind itself, where that frame is in the
    user's own files; else None (torch's, a library's or the standard library's own split)."""
    frame = caller.f_back if caller.f_code is _TENSOR_ITER else caller
    if frame is None or frame.f_code.co_filename.startswith(_NOT_USERS) or frame.f_code.co_filename.startswith("<"):
        return None
    return frame


# Attention over fewer tokens than this is not worth a finding's place (and a 3x3 kernel is square too)
MIN_ATTENTION_TOKENS = 16


class AttentionSites:
    """The modules that build attention weights, found in one step: while active, global forward hooks keep the
    stack of modules being run, and `saw(t)` (a saved-tensor observer, see measure.SavedTensors' on_pack) takes a
    softmax's output of shape (..., L, L) that autograd keeps for the backward, the materialised weights, as built
    by the innermost module running. Linear attention's softmax over a (.., d, L) or (.., L, d) tensor is not
    square and is not taken. A compiled step is not hooked: dynamo would recompile for the hooks."""

    def __init__(self):
        self.sites: dict[int, dict] = {}  # id(module) -> module, cls, defined_at, forward_at, tokens
        self._stack: list[nn.Module] = []
        self._names: dict[int, dict[int, str]] = {}  # id(root) -> id(module) -> its name under root
        self._handles = []

    def __enter__(self) -> AttentionSites:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):
            self._stack.append(module)

        def post(module, args, output):
            if self._stack and self._stack[-1] is module:
                self._stack.pop()

        self._handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc) -> bool:
        for h in self._handles:
            h.remove()
        self._handles, self._stack = [], []
        return False

    def saw(self, t: torch.Tensor) -> None:
        if not self._stack or t.dim() < 3 or t.shape[-1] != t.shape[-2] or t.shape[-1] < MIN_ATTENTION_TOKENS:
            return
        if t.grad_fn is None or not type(t.grad_fn).__name__.startswith("Softmax"):
            return
        module = self._stack[-1]
        if id(module) not in self.sites:
            self.sites[id(module)] = {"module": self._name(module), "cls": type(module).__qualname__,
                                      "defined_at": defined_at(type(module)),
                                      "forward_at": defined_at(type(module).forward), "tokens": int(t.shape[-1])}

    def _name(self, module: nn.Module) -> str:
        root = self._stack[0]
        names = self._names.get(id(root))
        if names is None:
            names = self._names[id(root)] = {id(m): n for n, m in root.named_modules()}
        name = names.get(id(module))
        return type(root).__name__ + (f".{name}" if name else "")

    def found(self) -> list[dict]:
        return list(self.sites.values())


def defined_at(obj) -> str | None:
    """file:line of a class's or function's definition (relative to the working directory when under it), or
    None where there is no Python source (a built-in, a class made at run time)."""
    try:
        path, line = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return None
    if path is None:
        return None
    rel = os.path.relpath(path)
    return f"{path if rel.startswith('..') else rel}:{line}"


def optimizer_info(optimizer: torch.optim.Optimizer) -> OptimizerInfo:
    d = optimizer.defaults
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return OptimizerInfo(name=type(optimizer).__name__, param_tensors=len(params),
                         foreach=d.get("foreach"), fused=d.get("fused"),
                         conv_weights=sum(p.dim() == 4 for p in params), param_count=sum(p.numel() for p in params))


def conv_layout(params) -> str | None:
    """The memory format of the 4-D parameters (2-D convolution weights): "nchw", "channels_last", "mixed", or
    None where there are none. A 1x1 kernel's weight is both at once and does not count."""
    nhwc = nchw = 0
    for p in params:
        if p.dim() != 4:
            continue
        cl, plain = p.is_contiguous(memory_format=torch.channels_last), p.is_contiguous()
        nhwc += cl and not plain
        nchw += plain and not cl
    if not nhwc and not nchw:
        return None
    return "mixed" if nhwc and nchw else "channels_last" if nhwc else "nchw"


def batch_size(batch) -> int | None:
    """The leading dimension of the first tensor in a batch (a tensor, or a tuple/list/dict holding tensors)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = batch_size(item)
        if found is not None:
            return found
    return None


def mark_step_closures(*, profiling, took):
    """Wrap each closure given to a torch.optim step() (optimizer.step(closure): Lightning's automatic
    optimization, LBFGS), process-wide, until the returned handle's remove(). Such a step runs the loop's forward
    and backward inside its own call and its `Optimizer.step#` range: unwrapped, the optimizer's timed share and
    the trace's optimizer category would take the whole step (a conv net under Lightning read 99% optimizer, 0%
    convolutions). Each call of a wrapped closure reports its seconds to `took`, and runs in a CLOSURE_MARK range
    while `profiling()` is true, whose ops the trace charges to their own categories."""
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def wrap(closure):
        def closure_outside_optimizer(*a, **k):
            t0 = time.perf_counter()
            rf = torch.autograd.profiler.record_function(CLOSURE_MARK) if profiling() else None
            if rf is not None:
                rf.__enter__()
            try:
                return closure(*a, **k)
            finally:
                if rf is not None:
                    rf.__exit__(None, None, None)
                took(time.perf_counter() - t0)
        return closure_outside_optimizer

    def pre(optimizer, args, kwargs):
        # torch.optim passes the step's own arguments: (optimizer, closure) positionally, or closure=
        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": wrap(kwargs["closure"])}
        if len(args) > 1 and callable(args[1]):
            return (args[0], wrap(args[1]), *args[2:]), kwargs
        return None

    return register_optimizer_step_pre_hook(pre)
