"""Device and precision choices, each with the reason it was made (printed and recorded in run.json)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fastddpm.config import ConfigError


@dataclass
class Precision:
    name: str                          # "fp32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None  # None = no autocast
    use_grad_scaler: bool              # fp16 only: bf16 has fp32's exponent range, so nothing underflows
    reason: str

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


def resolve_device(spec: str) -> tuple[torch.device, str]:
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), f"auto: CUDA is available ({torch.cuda.get_device_name(0)})"
        return torch.device("cpu"), "auto: no CUDA device, using the CPU"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"train.device={spec!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={spec!r} but CUDA is not available here: use --device cpu or auto")
    return device, "requested"


def resolve_precision(spec: str, device: torch.device) -> Precision:
    if device.type != "cuda":
        if spec in ("auto", "fp32"):
            return Precision("fp32", None, False, f"{spec}: fp32 on {device.type}")
        if spec == "bf16":
            return Precision("bf16", torch.bfloat16, False, f"requested bf16 autocast on {device.type}")
        raise ConfigError(f"train.precision=fp16 needs a CUDA GPU (device is {device}); use fp32 or bf16")
    bf16_ok = torch.cuda.is_bf16_supported()
    if spec == "auto":
        if bf16_ok:
            return Precision("bf16", torch.bfloat16, False, "auto: the GPU supports bf16 (fp32 range, no loss scaling)")
        return Precision("fp16", torch.float16, True, "auto: no bf16 on this GPU, fp16 with GradScaler")
    if spec == "bf16":
        if not bf16_ok:
            raise ConfigError("train.precision=bf16 but this GPU has no native bf16 (it would be emulated, slowly): "
                              "use fp16 or auto")
        return Precision("bf16", torch.bfloat16, False, "requested")
    if spec == "fp16":
        return Precision("fp16", torch.float16, True, "requested (with GradScaler)")
    return Precision("fp32", None, False, "requested")
