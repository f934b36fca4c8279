"""State dicts that load anywhere: a model saved plain, compiled or DDP-wrapped loads into any of the three, and
an optimizer's state saved on one device or code path resumes on another."""

from __future__ import annotations

import hashlib

import torch

from fastddpm.rundir.files import CheckpointError


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (torch.compile's `_orig_mod.`, DDP's `module.`) so every model's keys agree."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of a module's weights (keys, dtypes, shapes and bytes, wrapper prefixes stripped): what identifies
    the weights a measurement was made with, wherever the file was found or copied."""
    digest = hashlib.sha256()
    for key, value in sorted(clean_state_dict(module.state_dict()).items()):
        value = value.detach().cpu().contiguous()
        digest.update(f"{key}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside torch.compile's OptimizedModule and DDP's wrapper (in any nesting)."""
    while True:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
            module = module._orig_mod  # torch.compile(module)
        else:
            return module


def load_model_state(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, what: str = "the state dict"
                     ) -> None:
    """Load a state dict saved from a plain, compiled or DDP-wrapped model into a plain, compiled or DDP-wrapped
    one: the prefixes are stripped on both sides. A key mismatch names the keys (an architecture change)."""
    target = unwrap_model(module)
    state_dict = clean_state_dict(state_dict)
    expected = target.state_dict().keys()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{what} does not fit this {type(target).__name__}: "
            + (f"missing {len(missing)} key(s) ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
               if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {len(unexpected)} key(s) ({', '.join(unexpected[:4])}"
               f"{', ...' if len(unexpected) > 4 else ''})" if unexpected else "")
            + ". It was saved from a different architecture: build the model from the config saved with it")
    target.load_state_dict(state_dict)


def portable_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict with tensor learning rates as floats, so any device or path can load it."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])  # note: sync, at checkpoint time only
    return state


def with_current_optimizer_flags(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A saved optimizer state whose param groups carry this run's implementation flags (fused, foreach,
    capturable) and lr representation, so a checkpoint from any device or path resumes on this one."""
    saved = {**saved, "param_groups": [dict(g) for g in saved["param_groups"]]}
    for group, current in zip(saved["param_groups"], optimizer.param_groups):
        for key in ("fused", "foreach", "capturable", "differentiable", "lr"):
            if key in current:
                group[key] = current[key]
    return saved


def match_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Each optimizer state tensor shaped like its parameter (AdamW's moments) given the parameter's memory format.
    Optimizer.load_state_dict casts dtype and device, not layout, and CUDA's fused AdamW refuses a channels_last
    parameter with NCHW moments: a checkpoint saved in one layout (channels_last off) and resumed in the other
    (the seed U-Net's channels_last auto on a GPU) failed at its first step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p) or {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


# The AdamW settings a run's config gives. Optimizer.load_state_dict restores the saved param groups' values, so a
# resume would keep the checkpoint's betas and weight decay and ignore the flags: they are put back after a load.
# (The learning rate is the loop's to set every step; its object is put back too, a tensor where the step reads one.)
CONFIGURED_OPTIMIZER_KEYS = ("betas", "weight_decay", "lr")


def configured_optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's configured settings, taken before a checkpoint is loaded into `optimizer`."""
    return [{k: g[k] for k in CONFIGURED_OPTIMIZER_KEYS if k in g} for g in optimizer.param_groups]


def restore_optimizer_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> str | None:
    """Put `settings` (configured_optimizer_settings, before the load) back into the loaded param groups. Returns a
    line naming the betas and weight decay that differ from the checkpoint's, None when none does."""
    changed = {}
    for group, wanted in zip(optimizer.param_groups, settings):
        for key, value in wanted.items():
            if key != "lr" and _plain(group.get(key)) != _plain(value):
                changed[key] = (_plain(group.get(key)), _plain(value))
            group[key] = value
    if not changed:
        return None
    return ("note: this run's AdamW settings replace the checkpoint's: "
            + ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changed.items()))


def _plain(value):
    """A setting as numbers (betas may be saved as a list, or as tensors), for comparing and printing."""
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return float(value) if isinstance(value, (torch.Tensor, int, float)) else value


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of an FSDP-sharded module on rank 0, on the CPU ({} on the other ranks).
    A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
