"""Which torch device to run on: one check, so an absent device is a clear error everywhere."""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """A device that is unknown, unsupported, or not present on this machine."""


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here, or a DeviceError naming what is missing."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device={device!r} is unknown; allowed: cpu, cuda, cuda:N") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise DeviceError(f"device={device!r} is not supported; allowed: cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else f"no CUDA device is visible to torch (built for CUDA {torch.version.cuda}; check the driver and CUDA_VISIBLE_DEVICES)"
        )
        raise DeviceError(f"device={device!r} is not available: {why} (torch {torch.__version__}); allowed here: cpu")
    index = 0 if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device={device!r} is not available; allowed: cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)
