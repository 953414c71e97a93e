"""Launch configurations of the ``dtkv.ops`` Triton kernels: a small table tuned per size, read at every launch.

Kernels never search at run time. A launch asks :func:`launch_config` for ``(op, size, device)``:

- on a device named :data:`TUNED_DEVICE` or one of :data:`TUNED_SIBLINGS`, the entry of :data:`TUNED` ``[op]``
  tuned at the size nearest to ``size`` on a log scale: a size between two tuned sizes takes the nearer one (the
  boundary is their geometric mean, a tie goes to the larger), a size below or above the tuned range the nearest
  end; keys an entry lacks come from :data:`DEFAULTS`;
- on any other device (another GPU, the CPU under the Triton interpreter), :data:`DEFAULTS` ``[op]``, or while
  :data:`TUNED` has no entry for ``op``.

:func:`override` (a context manager) replaces keys of one op's configuration for every size and device: the tests
run each kernel variant through it and ``benchmarks/tune_ops.py`` times candidates with it.

Ops (``op`` key: its ``size``; its configuration keys):

- ``write_owned`` (owner filter at cp > 1): rows of the chunk; ``variant`` (``"tile"``: a tile of ``block_r`` rows
  per program, tiles without a kept row skip their copy; ``"window"``: ``window / block_r`` programs per window of
  ``window`` rows, a window whose kept rows are evenly spaced (whole pages, or every cp-th row) copied as dense
  tiles of ``block_r`` kept rows), ``layout`` (``"rows"``: a ``[block_r, W]`` tile in chunks of each row;
  ``"flat"``: the tile's ``block_r * W`` words as one span, :mod:`dtkv.ops._copy`), ``block_r``, ``window``,
  ``chunk_w`` (widest chunk in words, :func:`dtkv.ops._copy.span_chunks`; 0 = one masked chunk), ``num_warps``.
- ``direct_write`` (``direct=True``, or cp = 1): rows; ``layout``, ``block_r``, ``chunk_w``, ``num_warps``.
- ``quantize_write_mla_fp8``, ``quantize_write_indexer_fp8``: rows; ``block_r``, ``num_warps``.
- ``dequantize_mla_rows``: rows; ``block_r``, ``num_warps``.
- ``rope_interleave_into``: (token, head) rows; ``block_r``, ``num_warps``.
- ``pack_owned_pages``, ``pack_layer_pages``: send rows; ``rows`` (pages per program), ``parts`` (programs per
  page), ``chunk_w``, ``num_warps``.
- ``remap``: indices (``numel``); ``block``, ``num_warps``, ``map16`` (``"never"``, ``"always"`` or ``"large"``: a
  2-byte copy of ``page_map`` when its int32 form exceeds 128 KiB, so that it stays in L1), ``idx_cg`` (1: the
  indices bypass L1).
- ``indexer_logits``: queries of the call; ``variant`` (``"keys"``: keys on the dot's M dimension, the head sum
  along N in registers; ``"split"``: the same with one dot per query of the block, ``block_q`` 1, 2 or 4;
  ``"queries"``: queries x heads on M), ``block_q`` (queries per program), ``block_k`` (key
  columns per tile), ``num_warps``, ``num_stages``, ``ctas_per_sm`` (the grid's target: a call whose query blocks
  are fewer splits its key range over programs), ``maxnreg`` (register cap per thread, 0: the compiler's choice).
  Its table is written by ``python benchmarks/bench_indexer_logits.py --sweep --write-table``.

The :data:`TUNED` block is written by ``python benchmarks/tune_ops.py --write-table tuned.json`` from the JSON of a
sweep on an H200 (``python benchmarks/tune_ops.py --out tuned.json``); edit :data:`DEFAULTS` by hand.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch

__all__ = ["DEFAULTS", "TUNED", "TUNED_DEVICE", "TUNED_SIBLINGS", "launch_config", "override"]

Config = dict[str, int | str]

TUNED_DEVICE = "NVIDIA H200"
"""The device :data:`TUNED` was measured on (``torch.cuda.get_device_name``)."""

TUNED_SIBLINGS = ("NVIDIA H100 80GB HBM3",)
"""Devices that take :data:`TUNED` too: the tuned device's SMs (sm_90, 132 of them, the same clocks) with less and
slower memory (an H100 SXM). On one H100 the indexer's tuned launches gave 493 / 515 TFLOP/s at 4096 / 8192
queries x 32K keys against the defaults' 344 / 373, bit for bit the same keys (2026-12-06)."""

DEFAULTS: dict[str, Config] = {
    "write_owned": {"variant": "tile", "layout": "rows", "block_r": 16, "window": 64, "chunk_w": 128, "num_warps": 4},
    "direct_write": {"layout": "rows", "block_r": 16, "chunk_w": 128, "num_warps": 4},
    "quantize_write_mla_fp8": {"block_r": 4, "num_warps": 4},
    "quantize_write_indexer_fp8": {"block_r": 16, "num_warps": 2},
    # dequantize: 8 rows x 4 scale blocks x 128 codes a program (32 values a thread at 4 warps); not timed yet
    "dequantize_mla_rows": {"block_r": 8, "num_warps": 4},
    # rope into the query buffer: 32 (token, head) rows of 64 dims a program (16 values a thread); not timed yet
    "rope_interleave_into": {"block_r": 32, "num_warps": 4},
    # pack: two programs per 41 984-byte page (halves of 2624 words in chunks 2048 + 512 + 64), 8 warps: about 10
    # words per thread, 36 registers (full occupancy), every load of a half in flight at once; compiled for sm_90
    # offline (benchmarks/compile_ops.py). Closest to main's pack kernel (two 4096-word blocks per page, 4 warps),
    # measured at 90-93% of the same-size copy on an H200 (2026-12-01); none of these configurations has been
    # timed yet (Triton 3.6 did not compile them before the fix of ops/pack_layer_pages.py).
    "pack_owned_pages": {"rows": 1, "parts": 2, "chunk_w": 4096, "num_warps": 8},
    "pack_layer_pages": {"rows": 1, "parts": 2, "chunk_w": 4096, "num_warps": 8},
    "remap": {"block": 1024, "num_warps": 4, "map16": "large", "idx_cg": 0},
    # indexer logits: 2 queries x 64 heads on N against 64 keys on M, one warpgroup: 161 registers, 35 KB of shared
    # memory in the sm_90 build (3 programs per SM); not timed yet
    "indexer_logits": {"variant": "keys", "block_q": 2, "block_k": 64, "num_warps": 4, "num_stages": 3,
                       "ctas_per_sm": 3, "maxnreg": 0},
}  # fmt: skip
"""Configurations for untuned devices and sizes; every op's full set of keys."""

# BEGIN TUNED: written by `python benchmarks/tune_ops.py --write-table <json>`; do not edit by hand
# fmt: off
TUNED_ON = (
    "NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-12-01 (dtkv h28-ops 410fcc1); NVIDIA H200, torch "
    "2.11.0+cu130, triton 3.6.0, 2026-12-01 (dtkv h28-ops 41aa3a6): direct_write, pack_layer_pages, "
    "pack_owned_pages, quantize_write_mla_fp8, remap, write_owned; NVIDIA H200, torch 2.11.0+cu130, "
    "triton 3.6.0, 2026-12-01 (dtkv 3009ed5): indexer_logits"
)
TUNED: dict[str, dict[int, Config]] = {
    "direct_write": {
        65536: {"layout": "flat", "block_r": 16, "chunk_w": 1024, "num_warps": 4},
        262144: {"layout": "flat", "block_r": 8, "chunk_w": 512, "num_warps": 8},
        1048576: {"layout": "flat", "block_r": 16, "chunk_w": 1024, "num_warps": 4},
    },
    "indexer_logits": {
        16: {
            "variant": "keys",
            "block_q": 8,
            "block_k": 64,
            "num_warps": 8,
            "num_stages": 3,
            "ctas_per_sm": 3,
            "maxnreg": 0,
        },
        4096: {
            "variant": "keys",
            "block_q": 1,
            "block_k": 128,
            "num_warps": 4,
            "num_stages": 2,
            "ctas_per_sm": 3,
            "maxnreg": 0,
        },
        8192: {
            "variant": "keys",
            "block_q": 1,
            "block_k": 128,
            "num_warps": 4,
            "num_stages": 2,
            "ctas_per_sm": 3,
            "maxnreg": 0,
        },
    },
    "pack_layer_pages": {
        1024: {"rows": 1, "parts": 1, "chunk_w": 4096, "num_warps": 8},
        4096: {"rows": 1, "parts": 1, "chunk_w": 4096, "num_warps": 8},
        16384: {"rows": 1, "parts": 1, "chunk_w": 4096, "num_warps": 8},
    },
    "pack_owned_pages": {
        1024: {"rows": 1, "parts": 1, "chunk_w": 4096, "num_warps": 8},
        4096: {"rows": 1, "parts": 1, "chunk_w": 4096, "num_warps": 8},
        16384: {"rows": 1, "parts": 1, "chunk_w": 4096, "num_warps": 8},
    },
    "quantize_write_indexer_fp8": {
        65536: {"block_r": 8, "num_warps": 2},
        262144: {"block_r": 16, "num_warps": 2},
        1048576: {"block_r": 16, "num_warps": 2},
    },
    "quantize_write_mla_fp8": {
        65536: {"block_r": 2, "num_warps": 1},
        262144: {"block_r": 2, "num_warps": 1},
        1048576: {"block_r": 2, "num_warps": 1},
    },
    "remap": {
        4194304: {"block": 2048, "num_warps": 8, "map16": "never", "idx_cg": 0},
        16777216: {"block": 1024, "num_warps": 4, "map16": "never", "idx_cg": 1},
        67108864: {"block": 1024, "num_warps": 4, "map16": "always", "idx_cg": 1},
    },
    "write_owned": {
        262144: {"variant": "tile", "layout": "flat", "block_r": 16, "window": 64, "chunk_w": 1024, "num_warps": 4},
        1048576: {"variant": "window", "layout": "flat", "block_r": 16, "window": 64, "chunk_w": 1024, "num_warps": 4},
        4194304: {"variant": "window", "layout": "flat", "block_r": 16, "window": 64, "chunk_w": 1024, "num_warps": 4},
    },
}
# fmt: on
# END TUNED

_OVERRIDES: dict[str, Config] = {}


def _check_op(op: str) -> None:
    if op not in DEFAULTS:
        raise ValueError(f"op must be one of {sorted(DEFAULTS)}, got op={op!r}")


@functools.lru_cache(maxsize=16)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def _nearest(entries: dict[int, Config], size: int) -> Config:
    """The entry tuned at the size nearest to ``size`` on a log scale (ties: the larger)."""
    x = math.log2(max(size, 1))
    return entries[min(entries, key=lambda s: (abs(math.log2(s) - x), -s))]


def launch_config(op: str, size: int, device: torch.device) -> Config:
    """The launch configuration of ``op`` for a call of ``size`` (the module docstring's rule); a fresh dict."""
    _check_op(op)
    cfg = dict(DEFAULTS[op])
    entries = TUNED.get(op)
    if entries and _device_name(device) in (TUNED_DEVICE, *TUNED_SIBLINGS):
        cfg.update(_nearest(entries, size))
    cfg.update(_OVERRIDES.get(op, {}))
    return cfg


@contextlib.contextmanager
def override(op: str, **cfg: int | str) -> Iterator[None]:
    """Use ``cfg`` (some or all of ``op``'s keys) for every launch of ``op`` inside the block; nests, restores.

    Raises:
        ValueError: an unknown op or key.
    """
    _check_op(op)
    unknown = sorted(set(cfg) - set(DEFAULTS[op]))
    if unknown:
        raise ValueError(f"override of {op!r} got unknown keys {unknown}; its keys are {sorted(DEFAULTS[op])}")
    before = _OVERRIDES.get(op)
    _OVERRIDES[op] = {**(before or {}), **cfg}
    try:
        yield
    finally:
        if before is None:
            del _OVERRIDES[op]
        else:
            _OVERRIDES[op] = before
