"""Input validation shared by every public entry point: one place that words the errors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_int", "check_tensor"]


def check_int(name: str, value: object, *, min_value: int | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``name``, the value and the rule."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {name}={value!r} ({type(value).__name__})")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {name}={value}")
    return value


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Check a tensor's type, dtype, rank, shape (``None`` entries are free) and device.

    Raises:
        TypeError: ``t`` is not a tensor, or its dtype is not allowed.
        ValueError: its rank, shape or device differ from what is asked.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = allowed[0] if len(allowed) == 1 else list(allowed)
            raise TypeError(f"{name} must have dtype {want}, got {name}.dtype={t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {name}.shape={tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                want_s = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
                raise ValueError(f"{name} must have shape {want_s}, got {name}.shape={list(t.shape)} (dim {i})")
    if device is not None and torch.device(device).type != t.device.type:
        raise ValueError(f"{name} must be on {torch.device(device).type}, got {name}.device={t.device}")
    return t
