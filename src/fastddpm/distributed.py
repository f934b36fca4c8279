"""Scale-out on PyTorch's own engine: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK, this module turns them
into a process group and a device, and holds the few collectives training and evaluation need.

    torchrun --nproc-per-node 8 -m fastddpm train --data mnist --out runs/x          # one node, 8 GPUs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m fastddpm train ...
    torchrun --nproc-per-node 8 -m fastddpm eval --checkpoint runs/x --num-samples 50000  # 1/8 of the samples each

One process per device. NCCL on CUDA, gloo on CPU (tests run 2 CPU processes on gloo). Rank 0 writes
checkpoints, grids and logs; every rank computes. Nothing here is home-made communication: DDP
(fastddpm.trainer.build.wrap_ddp) or FSDP2 (fastddpm.trainer.fsdp, `--parallel fsdp`) does the gradient work.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastddpm.config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: a single process, no process group
    owns_group: bool = True  # init_distributed created the group, so shutdown() destroys it

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def restarted(self) -> bool:
        """torchrun restarted the workers after a failure (--max-restarts): resume from the latest checkpoint."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


SINGLE = DistInfo()


def launched_by_torchrun(command: str = "train") -> bool:
    """RANK and WORLD_SIZE both set (torchrun sets both, as does any launcher of its env:// convention). One of them
    alone is a launcher set up half-way: a ConfigError (unless it says rank 0 / a world of 1), since every process
    would otherwise run alone as rank 0 of 1, all of them writing the same files. `command` (train, eval) is the
    fastddpm command the error's fix names."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if (rank is None) == (world is None):
        return rank is not None
    given, missing, alone = ("RANK", "WORLD_SIZE", "0") if world is None else ("WORLD_SIZE", "RANK", "1")
    if os.environ[given].strip() == alone:
        return False
    raise ConfigError(f"{given}={os.environ[given]} is set but {missing} is not: every process would run alone as "
                      f"rank 0 of 1, writing the same files. Launch with `torchrun --nproc-per-node N -m fastddpm "
                      f"{command} ...` (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT), set "
                      f"{missing} too, or unset {given} for a single process")


_SAME_ON_EVERY_RANK = "fastddpm_same_on_every_rank"  # the attribute same_on_every_rank sets on an error


@contextlib.contextmanager
def same_on_every_rank():
    """Marks the errors of code that every process of a torchrun job runs alike on the same inputs: before the
    process group exists (the command line, config files and run folder, read on one node), or checks of what the
    ranks agreed on (the checkpoint to resume, against the data rank 0 prepared). The command line prints such an
    error once per node (fastddpm.cli.a_later_process_of_its_node), where each rank had printed the same line. Not
    for what may differ by rank: joining the group (a rank that cannot reach rank 0, a LOCAL_RANK without its
    device), a collective that failed, anything on a rank's own device or share of the data. A process silenced
    there might be the only one that knew why."""
    try:
        yield
    except Exception as e:
        setattr(e, _SAME_ON_EVERY_RANK, True)
        raise


def is_same_on_every_rank(e: BaseException) -> bool:
    """Whether `e` was raised inside same_on_every_rank()."""
    return getattr(e, _SAME_ON_EVERY_RANK, False)


def init_distributed(device: torch.device, timeout_s: float = 600.0, *, command: str = "train",
                     timeout_setting: str = "train.dist_timeout_s") -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun describes (if any). Returns (info, this rank's device).

    `device` is what the config resolved to without distribution: a CUDA device becomes cuda:LOCAL_RANK.
    `command` and `timeout_setting` (what sets `timeout_s`) are named by the errors."""
    if not launched_by_torchrun(command):
        return SINGLE, device
    # Under torchrun even a world of 1 runs the distributed path (DDP included): that is how its overhead over
    # the plain path is measured (benchmarks/ddp_overhead.py).
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ConfigError(f"LOCAL_RANK={local} but this process sees {torch.cuda.device_count()} CUDA device(s)"
                              + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                              + ": one process per device, so start at most that many per node (--nproc-per-node)"
                              + (", or make more devices visible" if visible is not None else ""))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        # Before the group exists: torch.distributed.nn binds `group.WORLD` as a default argument of ten functions
        # when it is imported, and torch._dynamo (torch.compile, DDP's constructor) imports it. Imported after
        # init_process_group it holds the live group forever, destroy_process_group cannot free it, and the
        # backend's threads (gloo's run loops, NCCL's watchdog) are still running while the interpreter shuts
        # down: an intermittent SIGABRT at exit ("terminate called without an active exception").
        # (bound to its own name: a bare `import torch.distributed.nn` would make `torch` local to this function)
        import torch.distributed.nn as _dist_nn  # noqa: F401
        # The timeout bounds a wait on a dead peer; torchrun's agent also tears the group down when a worker exits.
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        except (dist.DistNetworkError, dist.DistStoreError, ValueError) as e:
            # No rendezvous (address unreachable, port taken, a rank late, MASTER_* unset): torch's message names
            # neither the address nor the setting that bounds the wait.
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            where = f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}"
            raise ConfigError(
                f"rank {rank} of {world} could not join the process group ({where}, {timeout_setting}="
                f"{timeout_s:g}): {type(e).__name__}: {first}. Rank 0 listens on MASTER_PORT at MASTER_ADDR, which "
                f"every rank must reach; the port must be free there (torchrun --master-port / --rdzv-endpoint "
                f"HOST:PORT), and every rank must start within {timeout_setting}") from e
        owns = True
    else:  # the caller's group (fastddpm.train called inside a script that set one up): theirs to destroy
        owns = False
    return DistInfo(rank=rank, world_size=world, local_rank=local, backend=backend, owns_group=owns), device


def shutdown(info: DistInfo) -> None:
    """Destroy the process group so that its backend's threads end here, not while the interpreter shuts down.

    destroy_process_group only drops torch's own references: the group lives on while anything else holds it.
    - A DDP wrapper's reducer holds it; a wrapper caught in a reference cycle is freed by the next cyclic GC,
      which at the end of a run may only come during interpreter finalization: collect first.
    - Under FSDP, every DeviceMesh keeps its groups in `_pg_registry`, and DTensor's sharding caches (unbounded,
      keyed by specs that name the mesh) keep every mesh alive for the life of the process: empty the
      registries once the groups are destroyed (a mesh is unusable after that anyway)."""
    if info.enabled and info.owns_group and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        mesh_module = sys.modules.get("torch.distributed.device_mesh")
        if mesh_module is not None:
            # (isinstance reads each object's class: torch.distributed's deprecated `reduce_op` warns when read)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                for obj in gc.get_objects():
                    if isinstance(obj, mesh_module.DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None),
                                                                              dict):
                        obj._pg_registry.clear()


def collective_failure(e: BaseException, timeout_s: float, *, setting: str = "--dist-timeout-s") -> str | None:
    """One line for a collective that failed on a peer (gloo raises a RuntimeError, NCCL a DistBackendError, one
    of them): the wait ran past the process group's timeout, or the peer's end of the connection closed (it
    ended first, and its own error says why). None for any other error, which keeps its traceback."""
    if not isinstance(e, RuntimeError):
        return None
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    said = re.sub(r"^\[[^\]]*\]\s*", "", first)  # the backend's "[/path/to/pair.cc:553] " source location
    said = said.split(". This is typically")[0]  # gloo's advice after the fact, which the line below gives
    if re.search(r"timed out|timeout", said, re.IGNORECASE):
        return (f"this rank waited longer than {setting}={timeout_s:g} s for the other ranks ({said}). While the "
                f"others wait, rank 0 works alone (an evaluation and its first set-up, a sample grid, a checkpoint): "
                f"raise {setting} to cover it, e.g. {setting} {max(600.0, 4 * timeout_s):g}")
    if re.search(r"connection (closed|reset) by peer|broken pipe", said, re.IGNORECASE):
        return (f"another rank ended while this one waited for it ({said}): that rank's own error, in its output "
                f"above, says why")
    return None


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def mean_across_ranks(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The average of a device tensor over ranks (in place)."""
    if info.enabled:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x.div_(info.world_size)
    return x


def broadcast_object(obj, info: DistInfo):
    """Rank 0's `obj` (anything picklable) on every rank. Note: a collective."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: int, info: DistInfo, device: torch.device) -> int:
    """The largest `flag` over ranks (e.g. a signal's exit code, 0 = none). Note: a collective and a host sync."""
    if not info.enabled:
        return flag
    t = torch.tensor(flag, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
