"""Small training loops, each with one planted fault, and the verdict the doctor must reach on it.

They are the doctor's proof (tests/test_doctor_planted.py runs them; the CPU-observable ones in CI, the rest
on a GPU) and a self-test a user can run on their own machine:

    python -m fastddpm.doctor.planted                 # every case that this device can show
    python -m fastddpm.doctor.planted --cases slow-loader,item-every-step --device cuda

Each case returns the Report; EXPECTED says which bottleneck it plants.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fastddpm.doctor.api import watch
from fastddpm.doctor.report import Report

EXPECTED = {
    "slow-loader": "data-bound",  # the loader sleeps (I/O latency)
    "heavy-transform": "data-bound",  # per-sample Python work in the training process (CPU-bound, rule 3)
    "epoch-respawn": "epoch-spikes",  # non-persistent workers started again each epoch (spawn)
    "item-every-step": "sync-bound",  # loss.item() every step (GPU; on a CPU it is free)
    "pageable-h2d": "transfer-bound",  # big batches copied from pageable memory each step (GPU)
    "tiny-kernels": "launch-bound",  # a deep stack of tiny layers at batch 8 (GPU)
    "big-matmul": "healthy",  # large matmuls on resident data: compute-bound
    "uneven-last-batch": "recompiles",  # torch.compile meets a ragged last batch
    "channels-last-thrash": "layout-thrash",  # NHWC convs with .contiguous() between them, in eager (GPU)
    "autocast-gap": "autocast-gap",  # half of the matmul work outside autocast
    # the compute rules: each case runs in the device's native precision except where precision is the fault
    "fp32-matmuls": "fp32",  # big fp32 matmuls on hardware with native bf16 (healthy where bf16 is not native)
    "mha-need-weights": "attention-weights",  # nn.MultiheadAttention with its default need_weights=True
    "eager-elementwise": "eager-elementwise",  # norms and activations around cheap 1x1 convs, uncompiled
    "per-tensor-adam": "per-tensor-optimizer",  # AdamW(foreach=False) over hundreds of small tensors
    "per-sample-loss": "item-loop",  # the loss summed sample by sample in a Python loop
}
GPU_ONLY = {"item-every-step", "pageable-h2d", "tiny-kernels", "channels-last-thrash"}
# On a GPU a per-sample loop also leaves the GPU waiting for the host's launches; the host-bound finding leaves
# the loop's part of that wait to rule 22, but the case has not run on a GPU yet, so it is not claimed there
CPU_ONLY = {"per-sample-loss"}


def expected(name: str, device) -> str:
    """The verdict case `name` must get on `device`: EXPECTED's, except on hardware without native bf16/fp16, where
    fp32 matmuls are the right choice (the doctor says so in a note, and the run is healthy) and the autocast-gap
    case's bf16 half is the fault: it runs emulated, slower than fp32. That fault needs both: flags that say bf16 is
    emulated (FASTDDPM_CPU_FLAGS, which the test suite sets without bf16 on every machine, or the CPU's own) and a
    CPU that is in fact slower in bf16, since the doctor measures that before it says so; on a CPU with native bf16
    the case stays the autocast gap it plants."""
    device = torch.device(device)
    native = _native_dtype(device) is not None
    if name == "fp32-matmuls" and not native:
        return "healthy"
    if name == "autocast-gap" and not native and device.type == "cpu":
        from fastddpm.device import cpu_native_bf16, hardware_cpu_flags

        if not cpu_native_bf16(hardware_cpu_flags())[0]:
            return "emulated-bf16"
    return EXPECTED[name]


# ---------------------------------------------------------------------- datasets (module level: picklable)
class RandomVectors(Dataset):
    def __init__(self, n: int, dim: int, sleep_s: float = 0.0, work: int = 0):
        self.n, self.dim, self.sleep_s, self.work = n, dim, sleep_s, work
        self.data = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)  # a slow disk or network read
        if self.work:
            acc = 0.0
            for k in range(self.work):  # per-sample Python work: decode/augment written in Python
                acc += (k * 31 + i) % 7
            return self.data[i] + acc * 0.0
        return self.data[i]


def _mlp(dim: int, width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(dim, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, dim))
    return nn.Sequential(*layers)


def _loop(dr, model: nn.Module, opt, device, *, to_device: Callable | None = None, item: bool = False,
          autocast_dtype=None, compiled: nn.Module | None = None, host_work_s: float = 0.0,
          per_sample: bool = False):
    net = compiled or model
    for x in dr.batches():
        x = to_device(x) if to_device else x.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = net(x).float()
            if per_sample:  # the planted loop: each sample's loss on its own, then their mean
                loss = sum(out[i].square().mean() for i in range(out.shape[0])) / out.shape[0]
            else:
                loss = out.square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if item:
            _ = loss.item()  # the planted sync: a float every step "for the progress bar"
        if host_work_s:
            _host_work(host_work_s)
        dr.step()


def _host_work(seconds: float) -> None:
    """Python busy for `seconds`: a stand-in for a loop's per-step host work (logging, metrics, bookkeeping)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _half_dtype(device) -> torch.dtype:
    """The autocast dtype the device computes natively: bf16 on a CPU and on CUDA from sm80, fp16 below (a T4's
    bf16 is emulated, and a planted case must not measure the emulation)."""
    if device.type != "cuda":
        return torch.bfloat16
    from fastddpm.device import cuda_native_bf16

    return torch.bfloat16 if cuda_native_bf16(device)[0] else torch.float16


def _native_dtype(device) -> torch.dtype | None:
    """The reduced precision the device computes natively (None: fp32 is its fast path): the dtype a planted
    compute case runs in, so that precision is not a fault it plants by accident."""
    if device.type == "cuda":
        return _half_dtype(device)
    from fastddpm.device import cpu_native_bf16

    return torch.bfloat16 if cpu_native_bf16()[0] else None


def _window(kw: dict, **defaults) -> dict:
    # the planted windows are short and sized to show their fault (an epoch boundary, a ragged batch): steps
    # only, so a loaded machine cannot cut them short
    out = {"time_budget_s": None, **defaults}
    out.update(kw)
    return out


# ---------------------------------------------------------------------- the cases
def _slow_dataset_case(ds: Dataset, device, kw: dict) -> Report:
    """A small MLP fed by `ds` through a plain DataLoader (num_workers=0): the dataset is the planted fault."""
    model = _mlp(128, 256, 2).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(DataLoader(ds, batch_size=32, shuffle=True), device=device, **_window(kw, warmup_steps=3, steps=30,
                                                                                     profile_steps=5)) as dr:
        _loop(dr, model, opt, device)
    return dr.report


def slow_loader(device, **kw) -> Report:
    return _slow_dataset_case(RandomVectors(4096, 128, sleep_s=2e-4), device, kw)


def heavy_transform(device, **kw) -> Report:
    return _slow_dataset_case(RandomVectors(4096, 128, work=3000), device, kw)


def epoch_respawn(device, **kw) -> Report:
    # spawn (the default on macOS and Windows) makes each worker import torch: the cost every epoch pays
    # when persistent_workers=False
    ds = RandomVectors(6 * 64, 256)
    loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=1, persistent_workers=False,
                        multiprocessing_context="spawn")
    model = _mlp(256, 512, 3).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(loader, device=device, **_window(kw, warmup_steps=2, steps=16, profile_steps=0,
                                                loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device)
    return dr.report


def item_every_step(device, **kw) -> Report:
    """loss.item() every step, then the step's host work (the progress bar, metrics: 2 ms here) before the next
    launch. A sync costs what the host does after it: without the sync that work overlaps the GPU's step; with it
    the GPU waits it out. So on a GPU the step is sized to keep the GPU busy (H100: a few ms in bf16, kernels far
    longer than their launches) and the host work is a real share of it. At width 2048 an H100 ran the step's
    kernels (1.9 ms) faster than Python launched them: host-bound 34% outran sync-bound 31%; at 4096 the
    matmuls (0.4 ms each) keep a queue and the gaps left are the sync's."""
    cuda = device.type == "cuda"
    width, batch = (4096, 8192) if cuda else (256, 64)
    data = torch.randn(batch * 8, width, device=device)
    model = _mlp(width, width, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda)
    with watch(_ResidentLoader(data, batch), device=device, **_window(kw, warmup_steps=5, steps=30,
                                                                      profile_steps=10, loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device, item=True, host_work_s=0.002 if cuda else 0.0,
              autocast_dtype=_native_dtype(device))
    return dr.report


def pageable_h2d(device, **kw) -> Report:
    # 8 batches of 48 MiB, pageable: on an H100 batches of 6 MiB copied in under a millisecond, and the step's
    # tiny kernels (launch-bound) weighed as much as the copy
    host = torch.randn(8, 64, 3, 256, 256)
    loader = [host[i] for i in range(8)]
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(loader, device=device, **_window(kw, warmup_steps=3, steps=30, profile_steps=10,
                                                loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device, to_device=lambda x: x.to(device))
    return dr.report


def tiny_kernels(device, **kw) -> Report:
    data = torch.randn(8 * 64, 32, device=device)
    model = _mlp(32, 32, 24).to(device)
    # multi-tensor: the launches are the layers' own (a per-tensor optimizer's are rule 19's, per-tensor-adam)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    with watch(_ResidentLoader(data, 8), device=device, **_window(kw, warmup_steps=5, steps=30, profile_steps=10,
                                                                  loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device)
    return dr.report


def _resident_case(device, kw: dict, model: nn.Module, opt, data: torch.Tensor, batch: int,
                   autocast_dtype=None) -> Report:
    """A loop over batches already on the device, with the window most cases use."""
    with watch(_ResidentLoader(data, batch), device=device, **_window(kw, warmup_steps=3, steps=20,
                                                                      profile_steps=5, loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device, autocast_dtype=autocast_dtype)
    return dr.report


def _big_mlp(device, kw: dict, cuda_size: tuple[int, int], autocast_dtype) -> Report:
    width, batch = cuda_size if device.type == "cuda" else (1024, 256)
    model = _mlp(width, width, 2).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return _resident_case(device, kw, model, opt, torch.randn(batch * 8, width, device=device), batch,
                          autocast_dtype)


def big_matmul(device, **kw) -> Report:
    return _big_mlp(device, kw, (8192, 4096), _native_dtype(device))


def fp32_matmuls(device, **kw) -> Report:
    """big-matmul's loop in fp32, where the device could run it in bf16/fp16."""
    return _big_mlp(device, kw, (4096, 2048), None)


class _SelfAttention(nn.Module):
    """Tokens through nn.MultiheadAttention called the way most tutorials call it: attn(x, x, x)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        h, _weights = self.attn(x, x, x)  # need_weights=True by default: the planted fault
        return self.out(x + h)


def mha_need_weights(device, **kw) -> Report:
    # GPU: batch 128 keeps an H100 busy (at 32 its launches left it idle a quarter of the step in one run)
    tokens, dim, batch = (1024, 128, 128) if device.type == "cuda" else (256, 64, 64)
    data = torch.randn(batch * 4, tokens, dim, device=device)
    model = _SelfAttention(dim, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return _resident_case(device, kw, model, opt, data, batch, _native_dtype(device))


class _NormAct(nn.Module):
    """Blocks of GroupNorm, SiLU, a scale and a residual around a cheap 1x1 conv: memory-bound elementwise
    work, one pass over the feature map per op in eager mode."""

    def __init__(self, c: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, c, 1))
                                    for _ in range(depth))
        self.gains = nn.Parameter(torch.ones(depth))

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            h = b(x)
            x = x + self.gains[i] * torch.sigmoid(h) * h
        return x


def eager_elementwise(device, **kw) -> Report:
    # GPU: batch 256 keeps an H100 busy (at 64 the host's launches left it idle a third of the step: host-bound)
    c, size, batch = (64, 64, 256) if device.type == "cuda" else (32, 32, 64)
    data = torch.randn(batch * 4, c, size, size, device=device)
    model = _NormAct(c, 6).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return _resident_case(device, kw, model, opt, data, batch, _native_dtype(device))


def per_sample_loss(device, **kw) -> Report:
    """A small conv net whose loss is summed sample by sample in Python: 64 dispatches (and backward nodes) for
    each op of the loss where one would do."""
    data = torch.randn(64 * 4, 4, 16, 16, device=device)
    model = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 4, 3, padding=1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    with watch(_ResidentLoader(data, 64), device=device, **_window(kw, warmup_steps=3, steps=20, profile_steps=5,
                                                                   loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device, autocast_dtype=_native_dtype(device), per_sample=True)
    return dr.report


def per_tensor_adam(device, **kw) -> Report:
    data = torch.randn(64 * 8, 16, device=device)
    model = _mlp(16, 16, 150).to(device)  # 302 parameter tensors of 16 x 16 or 16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # the planted fault (a CPU's default)
    return _resident_case(device, kw, model, opt, data, 64, _native_dtype(device))


def uneven_last_batch(device, **kw) -> Report:
    ds = RandomVectors(7 * 32 + 5, 128)  # 7 full batches and a ragged one of 5
    model = _mlp(128, 256, 2).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend = "inductor" if device.type == "cuda" else "eager"  # eager: dynamo guards without C++ builds on CPU
    torch._dynamo.reset()  # as in a fresh process: no shape already marked dynamic by an earlier run
    compiled = torch.compile(model, backend=backend)
    with watch(DataLoader(ds, batch_size=32, shuffle=True, drop_last=False), device=device,
               **_window(kw, warmup_steps=2, steps=20, profile_steps=0, loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device, compiled=compiled)
    return dr.report


class _ContiguousHabit(nn.Module):
    """A channels_last model whose blocks call .contiguous() on the convolution's output (a habit from NCHW code,
    "for the view that follows"), then convert the sum back to channels_last for the next convolution: two layout
    copies per block, forward and backward. On an H100 (torch 2.11, batch 64) the copies took 21% of the step,
    twice the next finding. GroupNorm in eager, the textbook case, cost only ~10% there: a secondary finding; and
    with depthwise convolutions the step did so little math that low MFU came first."""

    def __init__(self, c: int, depth: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(depth))

    def forward(self, x):
        for conv in self.convs:
            h = conv(x).contiguous()  # NHWC -> NCHW
            x = (h + x).contiguous(memory_format=torch.channels_last)  # and back
        return x


def channels_last_thrash(device, **kw) -> Report:
    data = torch.randn(64 * 4, 64, 64, 64, device=device).to(memory_format=torch.channels_last)
    model = _ContiguousHabit(64, 6).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    with watch(_ResidentLoader(data, 64), device=device, **_window(kw, warmup_steps=3, steps=20, profile_steps=5,
                                                                   loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device, autocast_dtype=_half_dtype(device))
    return dr.report


class _HalfCovered(nn.Module):
    """A small front under autocast, a big back that leaves autocast (the planted gap)."""

    def __init__(self, width: int):
        super().__init__()
        self.front = nn.Linear(width, width)
        self.back = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.front(x)
        with torch.autocast(x.device.type, enabled=False):  # "numerics": the fp32 island
            return self.back(h.float())


def autocast_gap(device, **kw) -> Report:
    # GPU: batch 8192 keeps an H100 busy with the matmuls (at 1024 it idled 46% of the step, host-bound)
    width, batch = (2048, 8192) if device.type == "cuda" else (256, 128)
    data = torch.randn(batch * 8, width, device=device)
    model = _HalfCovered(width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    with watch(_ResidentLoader(data, batch), device=device, **_window(kw, warmup_steps=3, steps=20, profile_steps=5,
                                                                      loader_probe_s=0)) as dr:
        _loop(dr, model, opt, device, autocast_dtype=_half_dtype(device))
    return dr.report


class _ResidentLoader:
    """Batches sliced from a tensor already on the device (what a well-fed loop looks like)."""

    def __init__(self, data: torch.Tensor, batch: int):
        self.data, self.batch = data, batch

    def __iter__(self):
        for i in range(0, self.data.shape[0] - self.batch + 1, self.batch):
            yield self.data[i:i + self.batch]


def _one_cpu_thread(case: Callable[..., Report]) -> Callable[..., Report]:
    """On a CPU device, run the case's (small) model on one thread. Each case plants its fault in one place;
    with several intra-op threads, another busy process on the machine makes OpenMP threads wait on each other
    and a tiny step slows down 10-100x, which would bury the planted fault under a fault of the machine."""

    @functools.wraps(case)
    def run(device, **kw) -> Report:
        if torch.device(device).type != "cpu":
            return case(device, **kw)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return case(device, **kw)
        finally:
            torch.set_num_threads(threads)

    return run


CASES: dict[str, Callable[..., Report]] = {name: _one_cpu_thread(fn) for name, fn in {
    "slow-loader": slow_loader, "heavy-transform": heavy_transform, "epoch-respawn": epoch_respawn,
    "item-every-step": item_every_step, "pageable-h2d": pageable_h2d, "tiny-kernels": tiny_kernels,
    "big-matmul": big_matmul, "uneven-last-batch": uneven_last_batch,
    "channels-last-thrash": channels_last_thrash, "autocast-gap": autocast_gap,
    "fp32-matmuls": fp32_matmuls, "mha-need-weights": mha_need_weights, "eager-elementwise": eager_elementwise,
    "per-tensor-adam": per_tensor_adam, "per-sample-loss": per_sample_loss,
}.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastddpm.doctor.planted", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cases", default=None, help="comma-separated (default: all this device can show)")
    p.add_argument("--out", default=None, metavar="DIR", help="write each case's report under DIR/<case>")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    names = args.cases.split(",") if args.cases else [
        n for n in CASES if n not in (CPU_ONLY if device.type == "cuda" else GPU_ONLY)]
    rows, ok = [], True
    for name in names:
        t0 = time.perf_counter()
        out = f"{args.out}/{name}" if args.out else None
        report = CASES[name](device, out=out, print_report=False)
        wall = time.perf_counter() - t0
        want = expected(name, device)
        good = report.bottleneck == want
        ok &= good
        rows.append((name, want, report.bottleneck, report.verdict["cost"], wall, good))
        print(f"{name:22s} expected {want:20s} got {report.bottleneck:20s} "
              f"cost {100 * report.verdict['cost']:5.1f}%  {wall:5.1f} s  {'ok' if good else 'WRONG'}", flush=True)
    print(f"{sum(r[-1] for r in rows)}/{len(rows)} planted faults diagnosed correctly on {device}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
