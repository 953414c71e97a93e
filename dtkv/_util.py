"""Small helpers with one home: ceil division, integer-array coercion, unique-in-order, deprecation warnings.

- :func:`cdiv` -- ``ceil(a / b)`` for ints, numpy arrays and tensors (``b > 0``).
- :func:`as_int_array` -- a user's integer list (ints, numpy array or integer tensor) as int64 numpy, with the
  errors worded once (argument, value, rule); :func:`as_int_list` is the same as Python ints.
- :func:`first_occurrence` / :func:`unique_in_order` -- distinct values of a 1-D tensor in order of first
  occurrence (page lists keep their order when duplicates are dropped).
- :func:`warn_deprecated` -- the one wording of "old name -> new name" deprecations, as a
  :class:`DtkvDeprecationWarning` (the suite turns that category into an error: a renamed name is kept for one
  release for users, never used by dtkv itself).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

__all__ = [
    "as_int_array",
    "as_int_list",
    "DtkvDeprecationWarning",
    "cdiv",
    "first_occurrence",
    "unique_in_order",
    "warn_deprecated",
]

T = TypeVar("T", int, np.ndarray, torch.Tensor)

_INT64_MAX = np.iinfo(np.int64).max


def cdiv(a: T, b: int) -> T:
    """Ceil division ``ceil(a / b)`` for ``b > 0``: ints, int numpy arrays and int tensors (elementwise).

    Example:
        >>> cdiv(10, 4), cdiv(8, 4), cdiv(0, 4)
        (3, 2, 0)
    """
    return -(-a // b)


def as_int_array(
    name: str,
    values: object,
    *,
    ndim: int | None = 1,
    shape_hint: str = "",
    min_value: int | None = None,
) -> np.ndarray:
    """``values`` as a new int64 numpy array, or an error naming ``name``, the offending value and the rule.

    Accepts a sequence (or other iterable) of Python/numpy ints, an integer numpy array or an integer tensor (on
    any device: copied to the host). Bools, floats and strings are rejected even inside a list; an empty input of
    any dtype (``[]``, ``torch.tensor([])``) is an empty array.

    Args:
        name: the argument's name, used in every message.
        values: what the caller passed.
        ndim: required number of dims (``None``: any shape, flattened).
        shape_hint: the expected shape in words for the messages, e.g. ``"[num_reqs]"``.
        min_value: smallest allowed entry (``None``: no bound).

    Returns:
        int64 numpy ``[n]`` (``ndim`` 1 or None) or of the input's shape.

    Raises:
        TypeError: not integers, or not a sequence/array/tensor at all.
        ValueError: wrong number of dims, an entry below ``min_value``, or an entry outside int64.
    """
    hint = f" ({shape_hint})" if shape_hint else ""
    if type(values) in (list, tuple) and all(type(v) is int for v in values):  # the common case, fast
        try:
            arr = np.array(values, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{name} must fit in int64, got {name}={list(values)}") from None
    elif isinstance(values, torch.Tensor):
        non_int = values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool
        if non_int and values.numel():  # an empty tensor holds nothing to truncate, like an empty list
            raise TypeError(f"{name} must be an integer tensor, got {name}.dtype={values.dtype}")
        if ndim is not None and values.dim() != ndim:
            raise ValueError(
                f"{name} must have {ndim} dim{'s' if ndim != 1 else ''}{hint}, got {name}.shape={list(values.shape)}"
            )
        arr = values.detach().to("cpu", torch.int64).numpy().copy()
    elif isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Iterable, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of ints or an integer tensor, got {type(values).__name__}")
    else:
        seq = values if isinstance(values, (Sequence, np.ndarray)) else list(values)
        if not isinstance(seq, np.ndarray):
            bad = next((v for v in seq if isinstance(v, (bool, np.bool_))), None)
            if bad is not None:
                raise TypeError(f"{name} must hold ints, got {bad!r} ({type(bad).__name__})")
        arr = np.asarray(seq)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype == object:  # ints beyond int64, or mixed types
            bad = _first_non_int(arr.ravel().tolist())
            if bad is not None:
                raise TypeError(f"{name} must hold ints, got {bad!r} ({type(bad).__name__})")
            raise ValueError(f"{name} must fit in int64, got {name}={seq}")
        if arr.dtype.kind not in "iu":
            bad = _first_non_int(seq if not isinstance(seq, np.ndarray) else arr.ravel().tolist())
            what = f"{bad!r} ({type(bad).__name__})" if bad is not None else f"dtype {arr.dtype}"
            raise TypeError(f"{name} must hold ints, got {what}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
            raise ValueError(f"{name} must fit in int64, got {name} containing {int(arr.max())}")
        if ndim is not None and arr.ndim != ndim:
            flat = "a flat sequence of ints" if ndim == 1 else f"a {ndim}-D array of ints"
            raise ValueError(f"{name} must be {flat}{hint}, got shape {list(arr.shape)}")
        arr = arr.astype(np.int64, copy=True)
    if ndim is None:
        arr = arr.reshape(-1)
    if min_value is not None and arr.size and arr.min() < min_value:
        i = int(np.argmax(arr.reshape(-1) < min_value))
        raise ValueError(f"{name} must be >= {min_value}, got {name}[{i}]={int(arr.reshape(-1)[i])}")
    return arr


def _first_non_int(items: Iterable[object]) -> object | None:
    """The first entry that is not an int (nested sequences are searched depth first), or None."""
    for v in items:
        if isinstance(v, (list, tuple)):
            inner = _first_non_int(v)
            if inner is not None:
                return inner
        elif isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            return v
    return None


def as_int_list(name: str, values: object, *, min_value: int | None = None) -> list[int]:
    """:func:`as_int_array` (any shape, flattened) as a list of Python ints."""
    return as_int_array(name, values, ndim=None, min_value=min_value).tolist()


def first_occurrence(values: torch.Tensor) -> torch.Tensor:
    """bool ``[n]``: True where ``values[i]`` (a 1-D tensor) appears for the first time.

    Plan-phase helper: ``torch.unique`` synchronizes on CUDA.
    """
    n = values.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    pos = torch.arange(n, device=values.device)
    uniq, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.int64, device=values.device)
    first.scatter_reduce_(0, inverse, pos, reduce="amin")
    return first[inverse] == pos


def unique_in_order(values: torch.Tensor) -> torch.Tensor:
    """The distinct values of a 1-D tensor in order of first occurrence (``[4, 1, 4, 2] -> [4, 1, 2]``)."""
    return values[first_occurrence(values)]


class DtkvDeprecationWarning(DeprecationWarning):
    """A dtkv name renamed or removed in the next release (:func:`warn_deprecated`)."""


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Emit the :class:`DtkvDeprecationWarning` of a renamed public name (kept for one release)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DtkvDeprecationWarning,
        stacklevel=stacklevel,
    )
