"""The one rule that picks a Triton kernel or its torch reference.

    BATON_KERNELS=auto    (default) Triton when the tensors are on CUDA and triton imports,
                          the torch reference otherwise (CPU serving, CI)
    BATON_KERNELS=torch   always the reference (A/B checks on a GPU)
    BATON_KERNELS=triton  always Triton; on CPU this needs TRITON_INTERPRET=1 set before the
                          kernels are imported (slow: tests and debugging only)

Triton is imported lazily, the first time a kernel is picked, so CPU serving never imports it.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

_MODES = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_mode() -> str:
    mode = os.environ.get("BATON_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"BATON_KERNELS={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should run on `tensor`'s device."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        if not triton_available():
            raise RuntimeError("BATON_KERNELS=triton but triton is not installed (pip install triton)")
        return True
    return tensor.is_cuda and triton_available()
