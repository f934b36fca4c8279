"""Seed 002's MLP ladder: the feed-forward net 784-128-64-10 on MNIST-format data, batch 64, Adam 1e-3.

Four rungs, each a real training run of `epochs` epochs, timed end to end (the seed's "total time"):
  0 baseline       DataLoader(shuffle=True), num_workers=0: each item goes uint8 -> PIL -> normalised tensor,
                   as torchvision's MNIST dataset does; loss.item() every step (the seed's loop)
  1 workers        + num_workers=N
  2 pin+nb         + pin_memory=True and .to(device, non_blocking=True)
  3 fastddpm loop  the data resident on the device as normalised floats, a device randperm per epoch sliced
                   per step, fused Adam, the loss summed on the device (one sync per epoch), and on CUDA the
                   whole step (forward, backward, Adam) captured in one CUDA graph. Static shapes: the ragged
                   last batch of each epoch is dropped (one batch of 937 for MNIST).
Test accuracy after training is reported for each rung.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

MEAN, STD = 0.1307, 0.3081  # the seed's Normalize((0.1307,), (0.3081,))
BATCH_SIZE = 64  # the seed's batch

MLP_RUNGS = [("0", "baseline (num_workers=0)"), ("1", "N workers"), ("2", "+ pin_memory, non_blocking"),
             ("3", "fastddpm loop (resident, fused, graph)")]


class SimpleFeedForwardNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x):
        x = x.view(-1, 28 * 28)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class MnistStyleDataset(torch.utils.data.Dataset):
    """Per item: uint8 (28, 28) -> PIL image -> float tensor, normalised (torchvision MNIST + ToTensor + Normalize)."""

    def __init__(self, images_N1HW: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images_N1HW, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        im = Image.fromarray(np.asarray(self.images[i, 0]), mode="L")
        x = torch.from_numpy(np.array(im, dtype=np.float32)).div_(255.0).sub_(MEAN).div_(STD)[None]
        return x, int(self.labels[i])


@dataclass
class MlpData:
    train_x: np.ndarray  # uint8 (N, 1, 28, 28)
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def _new_model(device: torch.device, seed: int) -> SimpleFeedForwardNN:
    torch.manual_seed(seed)  # every rung starts from the same weights
    return SimpleFeedForwardNN().to(device)


@torch.no_grad()
def accuracy(model: nn.Module, data: MlpData, device: torch.device) -> float:
    x = torch.from_numpy(np.asarray(data.test_x, dtype=np.float32)).to(device).div_(255).sub_(MEAN).div_(STD)
    y = torch.from_numpy(np.asarray(data.test_y, dtype=np.int64)).to(device)
    model.eval()
    correct = sum(int((model(x[i:i + 4096]).argmax(1) == y[i:i + 4096]).sum()) for i in range(0, len(y), 4096))
    return correct / len(y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_loader_rung(data: MlpData, device: torch.device, *, epochs: int, workers: int, pin: bool,
                    non_blocking: bool, seed: int) -> dict:
    """The seed's train(): DataLoader, .to(device), zero_grad, forward, backward, step, loss.item()."""
    model = _new_model(device, seed)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(MnistStyleDataset(data.train_x, data.train_y), batch_size=BATCH_SIZE,
                                         shuffle=True, num_workers=workers, pin_memory=pin and device.type == "cuda",
                                         generator=torch.Generator().manual_seed(seed))
    _sync(device)
    t0 = time.perf_counter()
    losses = []
    for _ in range(epochs):
        model.train()
        total = 0.0
        for x, y in loader:
            x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()  # note: the seed's per-step host sync
        losses.append(total / len(loader))
    _sync(device)
    return {"total_s": time.perf_counter() - t0, "epoch_losses": losses, "accuracy": accuracy(model, data, device),
            "notes": [] if not pin or device.type == "cuda" else ["pin_memory is a no-op without CUDA"]}


def run_fast_rung(data: MlpData, device: torch.device, *, epochs: int, seed: int) -> dict:
    """fastddpm's loop for the MLP: resident data, device randperm slices, fused Adam, CUDA graph on CUDA."""
    cuda = device.type == "cuda"
    notes = []
    _sync(device)
    t0 = time.perf_counter()  # everything counts: the upload, the capture, the epochs
    x_all = torch.from_numpy(np.asarray(data.train_x)).to(device).float().div_(255).sub_(MEAN).div_(STD)
    y_all = torch.from_numpy(np.asarray(data.train_y, dtype=np.int64)).to(device)
    n, B = len(y_all), BATCH_SIZE
    steps_per_epoch = n // B  # drop the ragged tail: one static shape
    model = _new_model(device, seed)
    criterion = nn.CrossEntropyLoss()
    # A tensor lr and capturable=True let a captured graph run Adam's update; fused = one kernel for all params.
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device=device), fused=True,
                                 capturable=cuda)
    static_x = torch.zeros(B, 1, 28, 28, device=device)
    static_y = torch.zeros(B, dtype=torch.int64, device=device)

    def body() -> torch.Tensor:
        loss = criterion(model(static_x), static_y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    graph = None
    if cuda:
        saved = [p.detach().clone() for p in model.parameters()]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up on a side stream: Adam's lazy state, cuBLAS workspaces
            for _ in range(3):
                optimizer.zero_grad(set_to_none=True)
                body()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = body()
        # The warm-up and capture trained on zeros: put the weights and Adam's state back as they were.
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
            for state in optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        v.zero_()
        notes.append("CUDA graph: forward + backward + fused Adam captured once, replayed per step")
    else:
        notes.append(f"{device.type}: no CUDA graph capture (skipped: needs CUDA); fused Adam, resident data")
    g = torch.Generator(device=device).manual_seed(seed)
    losses = []
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, device=device, generator=g)
        total = torch.zeros((), device=device)
        for k in range(steps_per_epoch):
            idx = perm[k * B:(k + 1) * B]
            static_x.copy_(x_all[idx])
            static_y.copy_(y_all[idx])
            if graph is not None:
                graph.replay()
                total += static_loss
            else:
                optimizer.zero_grad(set_to_none=True)
                total += body()
        losses.append(float(total) / steps_per_epoch)  # note: one sync per epoch
    _sync(device)
    return {"total_s": time.perf_counter() - t0, "epoch_losses": losses, "accuracy": accuracy(model, data, device),
            "notes": notes + [f"drops the ragged last batch: {steps_per_epoch} steps per epoch"]}


def run_mlp_rung(key: str, data: MlpData, device: torch.device, *, epochs: int, workers: int, seed: int = 0,
                 log=print) -> dict:
    """One rung of the MLP ladder, as a row; a failure is recorded in the row (the other rungs still run)."""
    plans = {"0": dict(workers=0, pin=False, non_blocking=False), "1": dict(workers=workers, pin=False,
             non_blocking=False), "2": dict(workers=workers, pin=True, non_blocking=True), "3": None}
    kw = plans[key]
    name = dict(MLP_RUNGS)[key].replace("N workers", f"{workers} workers")
    log(f"  mlp rung {key} ({name}): {epochs} epoch(s) on {len(data.train_y):,} images ...")
    row = {"rung": key, "name": name, "status": "ok", "error": None, "total_s": None, "epoch_s": None,
           "speedup": None, "accuracy": None, "final_loss": None, "notes": []}
    try:
        out = (run_fast_rung(data, device, epochs=epochs, seed=seed) if kw is None
               else run_loader_rung(data, device, epochs=epochs, seed=seed, **kw))
        row.update(total_s=out["total_s"], epoch_s=out["total_s"] / epochs, accuracy=out["accuracy"],
                   final_loss=out["epoch_losses"][-1], notes=out["notes"])
    except Exception as e:  # noqa: BLE001 - a failed rung is reported; the others still run
        row.update(status="failed", error=f"{type(e).__name__}: {e}")
    log(f"  mlp rung {key}: " + (f"{row['total_s']:.2f} s, accuracy {row['accuracy']:.4f}" if row["status"] == "ok"
                                 else f"FAILED ({row['error']})"))
    return row


def fill_mlp_speedups(rows: list[dict]) -> None:
    """Speed-up of each ok rung over rung 0's total time (None while rung 0 is missing or failed)."""
    base = next((r["total_s"] for r in rows if r["rung"] == "0" and r["status"] == "ok"), None)
    for r in rows:
        r["speedup"] = base / r["total_s"] if r["status"] == "ok" and base else None


def run_mlp_ladder(data: MlpData, device: torch.device, *, epochs: int, workers: int, seed: int = 0,
                   log=print) -> list[dict]:
    rows = [run_mlp_rung(key, data, device, epochs=epochs, workers=workers, seed=seed, log=log)
            for key, _ in MLP_RUNGS]
    fill_mlp_speedups(rows)
    return rows
