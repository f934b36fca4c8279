"""One optimizer step: forward, loss, backward (over accumulation micro-batches), clip, update, EMA.

`train_step` is the plain, textbook step: the reference every faster path is tested against.

`TrainStep` is the fast path, one callable per step with no host syncs inside:
  * the learning rate and the EMA decay are device tensors updated with fill_ (a launch, not a sync), so a
    changing value never makes torch.compile recompile, and a captured CUDA graph sees the new value;
  * compile=True compiles the loss (q_sample + U-Net + MSE: one graph, with AOTAutograd's backward graph) with
    static shapes (dynamic=False). The update is left eager: fused AdamW is already one kernel (dynamo does not
    trace into it, so compiling it only adds graph breaks) and the clip and EMA are foreach ops;
  * cuda_graphs="capture" records the whole step (all micro-batches, backward, clip, fused capturable AdamW,
    EMA) into one CUDA graph and replays it: one launch per step instead of hundreds. The batch is drawn
    outside the graph (its randomness is a function of (seed, step)) and copied into static input buffers.
    cuda_graphs="reduce-overhead" uses torch.compile's CUDA graph trees instead.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from fastddpm.device import Precision
from fastddpm.diffusion.objective import diffusion_loss
from fastddpm.trainer.batches import Batch
from fastddpm.trainer.ema import EMA
from fastddpm.trainer.fsdp import is_sharded


def train_step(model, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, schedule,
               prediction: str, batch: Batch, precision: Precision, grad_clip: float | None,
               min_snr_gamma: float | None = None) -> torch.Tensor:
    """The plain step. Returns the detached loss on the device; reading it (.item()) is the caller's sync."""
    with precision.autocast(batch.x0.device):
        loss = diffusion_loss(model, schedule, prediction, batch.x0, batch.t, batch.noise, min_snr_gamma, batch.y)
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        if grad_clip is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)  # skips the step when the scaled gradients hold inf/nan
        scaler.update()
    else:
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return loss.detach()


def make_optimizer(model: torch.nn.Module, *, lr: float, betas, weight_decay: float, device: torch.device,
                   tensor_lr: bool, capturable: bool, allow_fused: bool = True) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for all parameters) where this torch supports it on the device; foreach otherwise,
    and with `allow_fused=False` (FSDP's DTensor shards)."""
    kwargs = dict(betas=betas, weight_decay=weight_decay)
    fused_ok = allow_fused and (device.type == "cuda" or (device.type == "cpu" and tensor_lr))
    if fused_ok:
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    if capturable:
        kwargs["capturable"] = True
    lr_value = torch.tensor(lr, dtype=torch.float32, device=device) if tensor_lr else lr
    return torch.optim.AdamW(model.parameters(), lr=lr_value, **kwargs)


def inductor_mode(compile_mode: str, cuda_graphs: str) -> str | None:
    """torch.compile's mode for the loss: Inductor's CUDA graph trees only with cuda_graphs=reduce-overhead (a
    step captured by fastddpm must not hold graphs of its own inside), max-autotune's kernel search on request."""
    trees = cuda_graphs == "reduce-overhead"
    if compile_mode == "max-autotune":
        return "max-autotune" if trees else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if trees else None


def compile_kwargs(compile_mode: str, cuda_graphs: str, inductor_layout: str = "heuristic") -> dict:
    """torch.compile's mode, or its options where Inductor's layout is forced (torch.compile takes one or the
    other: the mode's own options are spelt out then)."""
    mode = inductor_mode(compile_mode, cuda_graphs)
    if inductor_layout != "channels-last":  # Inductor's own heuristic decides
        return {"mode": mode}
    # Inductor's layout optimization makes its convolutions' outputs (and so the ops between them) channels_last;
    # its heuristic skips it in a graph with a convolution of >= 2x as many input as output channels
    # (torch/_inductor/graph.py, decide_layout_opt), which every U-Net decoder has
    from torch._inductor import list_mode_options  # imported here: Inductor loads only when compiling

    options = dict(list_mode_options(mode)) if mode else {}
    options["force_layout_optimization"] = True
    return {"options": options}


class CudaGraphCaptureError(RuntimeError):
    """The step could not be captured in a CUDA graph; the message names the setting that runs without one."""


class TrainStep:
    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, ema: EMA, schedule, prediction: str, precision: Precision,
                 grad_clip: float | None, accum_steps: int = 1, compile: bool = False,
                 compile_mode: str = "default", cuda_graphs: str = "off", inductor_layout: str = "heuristic",
                 ema_every: int = 1, device: torch.device, min_snr_gamma: float | None = None,
                 forward_model: torch.nn.Module | None = None):
        self.model, self.optimizer, self.scaler, self.ema = model, optimizer, scaler, ema
        # What the loss calls: the model itself, or its DistributedDataParallel wrapper (whose backward
        # all-reduces the gradients). Parameters, optimizer and EMA always use the plain model.
        self.forward_model = forward_model if forward_model is not None else model
        self._ddp = isinstance(self.forward_model, torch.nn.parallel.DistributedDataParallel)
        self._fsdp = is_sharded(self.forward_model)  # FSDP2: parameters and gradients are DTensor shards
        self.schedule, self.prediction, self.precision = schedule, prediction, precision
        self.min_snr_gamma = min_snr_gamma
        self.grad_clip, self.accum_steps, self.ema_every = grad_clip, accum_steps, ema_every
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        lr = optimizer.param_groups[0]["lr"]
        self.tensor_lr = isinstance(lr, torch.Tensor)
        self.lr_t = lr if self.tensor_lr else None
        self.ema_weight_t = torch.zeros((), device=device)  # 1 - beta, refreshed each step with fill_
        # Non-finite guard, on the device: the first step whose loss or gradient norm is not finite, and every
        # step after it, skips the update and the EMA (fused AdamW reads found_inf, as under a GradScaler), so
        # the weights keep their last finite values without a host sync; the loop reads first_bad_step() on
        # logging steps and stops the run there.
        self.fused = bool(optimizer.param_groups[0].get("fused"))
        self.healthy_t = torch.ones((), dtype=torch.bool, device=device)
        self.step_t = torch.zeros((), dtype=torch.long, device=device)
        self.first_bad_step_t = torch.full((), -1, dtype=torch.long, device=device)
        self.compile = compile
        self.cuda_graphs = cuda_graphs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_failed: str | None = None
        self._capturing = False
        self._static: list[Batch] | None = None
        self._static_loss: torch.Tensor | None = None

        loss_fn = self._loss
        if compile:
            loss_fn = torch.compile(self._loss, dynamic=False,
                                    **compile_kwargs(compile_mode, cuda_graphs, inductor_layout))
        self._loss_fn = loss_fn

    # -- the pieces ------------------------------------------------------------------------------------------
    def _loss(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
              y: torch.Tensor | None = None) -> torch.Tensor:
        # Autocast's weight-cast cache must be off under CUDA graph capture (cached casts would be freed).
        with self.precision.autocast(x0.device, cache=self.cuda_graphs != "capture"):
            return diffusion_loss(self.forward_model, self.schedule, self.prediction, x0, t, noise,
                                  self.min_snr_gamma, y)

    def _update(self, loss: torch.Tensor) -> None:
        if self.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        elif self._fsdp:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], foreach=True)
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if self._fsdp:
            norm = norm.full_tensor()  # the norm of the sharded gradients is a DTensor: its value (a collective)
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        if self._ddp or self._fsdp:
            # Every rank must skip together or none: a rank's own loss can be NaN while the reduced gradients are
            # not. One scalar all-reduce (queued on the stream: no host sync).
            agreed = finite.to(torch.int32)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            finite = agreed.bool()
        self.first_bad_step_t.copy_(torch.where(self.healthy_t & ~finite, self.step_t, self.first_bad_step_t))
        self.healthy_t.logical_and_(finite)
        if self.fused:
            self.optimizer.found_inf = (~self.healthy_t).float()  # the fused kernel skips the step when 1
            self.optimizer.step()
        elif bool(self.healthy_t):  # foreach: the CPU path (no sync there), and FSDP's (one small sync per step)
            self.optimizer.step()

    def _body(self, batches: Sequence[Batch], do_ema: bool) -> torch.Tensor:
        """forward+backward over the micro-batches, update, EMA. Gradients are zeroed at the start (in place
        when graphs are on, so their memory stays where the graph recorded it)."""
        self.optimizer.zero_grad(set_to_none=self.graph is None and not self._capturing)
        total = torch.zeros((), device=self.device)
        for i, b in enumerate(batches):
            # DDP: all-reduce the gradients once, after the last micro-batch (no_sync on the others)
            last = i == len(batches) - 1
            if self._fsdp:  # FSDP's no_sync: reduce-scatter the gradients after the last micro-batch only
                self.forward_model.set_requires_gradient_sync(last)
            with self.forward_model.no_sync() if self._ddp and not last else contextlib.nullcontext():
                loss = self._loss_fn(b.x0, b.t, b.noise, b.y)
                if self.scaler is not None:
                    self.scaler.scale(loss / self.accum_steps).backward()
                else:
                    (loss / self.accum_steps).backward()
            total = total + loss.detach()
        if self.scaler is not None:
            if self.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self._update(total)
        if do_ema:
            self.ema.update(self.ema_weight_t * self.healthy_t)  # a weight of 0 after a non-finite step: skipped
        return total / len(batches)

    # -- the step --------------------------------------------------------------------------------------------
    def first_bad_step(self) -> int | None:
        """The first step (0-based) whose loss or gradients were not finite, or None. Note: a host sync."""
        bad = int(self.first_bad_step_t)
        return None if bad < 0 else bad

    def set_hyper(self, lr: float, step: int, ema_steps: int = 1) -> None:
        self.step_t.fill_(step)
        if self.tensor_lr:
            self.lr_t.fill_(lr)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        beta = self.ema.beta(step) ** ema_steps
        self.ema_weight_t.fill_(1.0 - beta)

    def __call__(self, batches: Sequence[Batch], *, lr: float, step: int,
                 ema_steps: int | None = None) -> torch.Tensor:
        """One optimizer step over `accum_steps` micro-batches. Returns the mean loss, on the device. `ema_steps`:
        how many steps the EMA update folds in (fastddpm.trainer.ema.ema_steps; 0: none); None: `ema_every` on
        its grid, as a caller that does not know the run's last step (the benchmarks) wants."""
        assert len(batches) == self.accum_steps
        if ema_steps is None:
            ema_steps = self.ema_every if step % self.ema_every == 0 else 0
        self.set_hyper(lr, step, max(ema_steps, 1))
        do_ema = ema_steps > 0
        if self.cuda_graphs == "capture" and self.graph_failed is None and self.ema_every == 1:
            if self.graph is None:
                self._capture(batches)
            if self.graph is not None:
                for static, b in zip(self._static, batches):
                    static.x0.copy_(b.x0)
                    static.t.copy_(b.t)
                    static.noise.copy_(b.noise)
                    if b.y is not None:  # a conditional run's labels: a static buffer like the rest
                        static.y.copy_(b.y)
                self.graph.replay()
                return self._static_loss.clone()
        if self.compile and self.cuda_graphs == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return self._body(batches, do_ema)

    # -- CUDA graph capture ----------------------------------------------------------------------------------
    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = list(self.params) + list(self.ema.params)
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def _capture_unsupported(self) -> str | None:
        if self.scaler is not None or self.device.type != "cuda":
            return "CUDA graphs need a CUDA device and no GradScaler (use bf16 or fp32)"
        return None

    def _capture(self, batches: Sequence[Batch]) -> None:
        """Warm up on a side stream, capture one step, then put every state tensor back as it was, so the
        warm-up steps leave no trace and resume stays exact. A failure raises CudaGraphCaptureError (the state
        put back first): going on eager in the same process is not safe (a failed capture can leave the CUDA
        context so that a later eager kernel crashes the process, as seen on an H100)."""
        self.graph_failed = self._capture_unsupported()
        if self.graph_failed is not None:
            return
        before = {id(t): t.detach().clone() for t in self._state_tensors()}
        side = None
        try:
            side = torch.cuda.Stream(self.device)
            self._static = [Batch(x0=b.x0.clone(), t=b.t.clone(), noise=b.noise.clone(), indices=b.indices,
                                  y=b.y.clone() if b.y is not None else None) for b in batches]
            side.wait_stream(torch.cuda.current_stream(self.device))
            self._capturing = True
            with torch.cuda.stream(side):
                for i in range(3):  # warm-up: lazy state init, compile, cuBLAS/cuDNN workspaces
                    if i == 2:
                        # A host sync cannot be captured: find one here, with a clear message, not mid-capture.
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        self._body(self._static, True)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device)):
                self._static_loss = self._body(self._static, True)
            self.graph = graph
        except Exception as e:
            self.graph = None
            self.graph_failed = f"{type(e).__name__}: {e}"
            raise CudaGraphCaptureError(
                f"capturing the training step in a CUDA graph failed ({self.graph_failed}). The run stops here: "
                f"after a failed capture the process cannot safely go on without graphs. Nothing was trained "
                f"with the graph and no checkpoint was touched. Run again with --cuda-graphs off (or "
                f"--compile on --cuda-graphs reduce-overhead; in Python, cuda_graphs=\"off\")") from e
        finally:
            # Side-stream warm-up kernels may still run (after an exception): let them finish before restoring.
            if side is not None:
                torch.cuda.current_stream(self.device).wait_stream(side)
            self._capturing = False
            with torch.no_grad():
                for t in self._state_tensors():
                    if id(t) in before:
                        t.copy_(before[id(t)])
                    else:  # optimizer state created during warm-up: its fresh value is zero (step, moments)
                        t.zero_()
            self.optimizer.zero_grad(set_to_none=self.graph is None)
