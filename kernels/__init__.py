"""Triton expert kernels, shipped as ``lightning_hetermoe.kernels`` (placeholder until the kernels land)."""

import torch


def triton_available(device: torch.device) -> bool:
    return False


def unavailable_reason(device: torch.device) -> str:
    return "the Triton expert kernels are not built yet"


def grouped_mlp(*args, **kwargs):
    raise NotImplementedError("Triton grouped_mlp is not implemented yet")
