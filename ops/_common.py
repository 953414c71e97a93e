"""Shared plumbing of the ``dtkv`` custom ops: Triton availability, backend choice, ownership arithmetic, checks.

Shape legend used by every op module:

- ``P``: local pages of the pool (``pool.shape[0]``); ``S``: page size (tokens per page);
- ``D``: elements of one stored row; ``W``: words (int64/int32/... reinterpretations) of one row or page;
- ``N``: rows (tokens) handed to a write; ``K``: entries of a page list.

Ownership reaches a registered op as plain ints ``(cp_size, num_pages, layout_code, rank)``
(:func:`ownership_args`) so that the op schema needs no custom class; the arithmetic is the one documented in
:mod:`dtkv.ownership` (``layout_code`` 0 = interleave, 1 = block).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from dtkv._env import debug_enabled, get_backend
from dtkv.ownership import OwnershipSpec, PageOwnership, ownership_spec

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "LAYOUT_CODES",
    "OwnershipLike",
    "OwnershipSpec",
    "check_ownership_ints",
    "device_ctx",
    "owner_local_torch",
    "owned_rows_torch",
    "ownership_args",
    "ownership_spec",
    "resolve_backend",
    "should_validate",
    "tl",
    "triton",
    "validate_locs",
    "word_view",
]

# ------------------------------------------------------------------------------------------- Triton import
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    _TRITON_MISSING = ""
except ImportError as _e:  # pragma: no cover - exercised by a subprocess test
    HAS_TRITON = False
    _TRITON_MISSING = f"the 'triton' package could not be imported ({_e}); install dtkv[triton]"

    class _MissingKernel:
        def __init__(self, fn: Any) -> None:
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid: Any) -> Any:
            raise NotImplementedError(f"Triton kernel {self.__name__} is unavailable: {_TRITON_MISSING}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"Triton kernel {self.__name__} is unavailable: {_TRITON_MISSING}")

    class _MissingTriton:
        """Stands in for ``triton`` and ``triton.language`` so that kernel definitions still import."""

        def jit(self, fn: Any = None, **kwargs: Any) -> Any:
            return _MissingKernel(fn) if fn is not None else _MissingKernel

        def __getattr__(self, name: str) -> Any:
            return None

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingTriton()  # type: ignore[assignment]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip() == "1"
"""Whether Triton kernels were defined in interpreter mode (read once, at import, as Triton does)."""

LAYOUT_CODES = {"interleave": 0, "block": 1}
_BACKENDS = ("auto", "torch", "triton")


# ------------------------------------------------------------------------------------------- backend
def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``"auto" | "torch" | "triton"`` into the concrete kernel family for tensors on ``device``.

    ``"auto"`` defers to :func:`dtkv._env.get_backend` (``DTKV_BACKEND``); when that is ``"auto"`` too, Triton is
    used on CUDA tensors when it imports, torch otherwise.

    Raises:
        ValueError: ``backend`` is not one of the three names.
        NotImplementedError: ``"triton"`` was asked for but Triton is missing, or the tensors are on a CPU and
            Triton was not put in interpreter mode (``TRITON_INTERPRET=1`` before ``dtkv.ops`` is imported).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got backend={backend!r}")
    if backend == "auto":
        backend = get_backend()
    if backend == "auto":
        return "triton" if (HAS_TRITON and device.type == "cuda") else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise NotImplementedError(f"backend='triton' is unavailable: {_TRITON_MISSING}")
        if device.type != "cuda" and not INTERPRET:
            raise NotImplementedError(
                f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before dtkv.ops is imported; "
                f"got tensors on {device}"
            )
    return backend


@contextlib.contextmanager
def device_ctx(device: torch.device) -> Iterator[None]:
    """Make ``device`` current while a Triton kernel is launched (Triton launches on the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            yield
    else:
        yield


def should_validate(validate: bool | None) -> bool:
    """Default of the ``validate`` switch of the write ops.

    ``None`` means: validate in eager (one host sync), and under ``torch.compile`` only when ``DTKV_DEBUG=1``
    (the compiled hot path stays sync-free; invalid rows are then skipped by the kernel's mask).
    """
    if validate is not None:
        return bool(validate)
    return debug_enabled() or not torch.compiler.is_compiling()


# ------------------------------------------------------------------------------------------- ownership
OwnershipLike = PageOwnership | OwnershipSpec


@torch.compiler.assume_constant_result
def _placement_args(ownership: PageOwnership) -> tuple[int, int, int]:
    # Evaluated on the real object at trace time: on torch >= 2.13 ``PageOwnership`` is an opaque value type
    # (like every ``Placement``) whose equality Dynamo guards on but whose attributes it cannot read.
    if not isinstance(ownership, PageOwnership):
        raise TypeError(f"ownership must be a dtkv.PageOwnership or OwnershipSpec, got {type(ownership).__name__}")
    return ownership.cp_size, ownership.num_pages, LAYOUT_CODES[ownership.layout]


def ownership_args(ownership: OwnershipLike) -> tuple[int, int, int]:
    """``(cp_size, num_pages, layout_code)`` of a ``PageOwnership`` or ``OwnershipSpec``, as the ops take them."""
    if isinstance(ownership, tuple):
        if ownership[2] not in LAYOUT_CODES:
            raise ValueError(f"layout must be one of {tuple(LAYOUT_CODES)}, got layout={ownership[2]!r}")
        return ownership[0], ownership[1], LAYOUT_CODES[ownership[2]]
    return _placement_args(ownership)


def check_ownership_ints(cp_size: int, num_pages: int, layout_code: int, rank: int) -> None:
    """Validate the ownership ints of a registered op (metadata only; safe in fake/meta mode)."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got cp_size={cp_size}")
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got num_pages={num_pages}")
    if layout_code not in (0, 1):
        raise ValueError(f"layout_code must be 0 (interleave) or 1 (block), got layout_code={layout_code}")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, cp_size={cp_size}), got rank={rank}")


def chunk_of(cp_size: int, num_pages: int) -> int:
    """Pages per rank of the block layout (``ceil(num_pages / cp_size)``)."""
    return -(-num_pages // cp_size)


def owner_local_torch(
    pages: torch.Tensor, cp_size: int, num_pages: int, layout_code: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner rank and local page index of each (non-negative) page; the arithmetic of :mod:`dtkv.ownership`."""
    if layout_code == 0:
        return pages % cp_size, torch.div(pages, cp_size, rounding_mode="floor")
    chunk = chunk_of(cp_size, num_pages)
    return torch.div(pages, chunk, rounding_mode="floor"), pages % chunk


def owned_rows_torch(
    locs: torch.Tensor,
    page_size: int,
    cp_size: int,
    num_pages: int,
    layout_code: int,
    rank: int,
    num_local_pages: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows a rank keeps: ``(row_idx, local_page, offset)``, each int64 ``[kept]`` (synchronizes on CUDA).

    A row is kept when its location is not ``-1``, lies in the logical pool, its page is owned by ``rank`` and
    the page's local index fits the pool; everything else is skipped (the kernels' mask).
    """
    x = locs.to(torch.int64)
    page = torch.div(x, page_size, rounding_mode="floor")
    owner, local = owner_local_torch(page.clamp(min=0), cp_size, num_pages, layout_code)
    keep = (x >= 0) & (page < num_pages) & (owner == rank) & (local < num_local_pages)
    sel = keep.nonzero().squeeze(1)
    return sel, local[sel], (x - page * page_size)[sel]


if HAS_TRITON:

    @triton.jit
    def owner_local(page, cp_size, chunk, LAYOUT: tl.constexpr):
        """Triton twin of :func:`owner_local_torch` for non-negative ``page``."""
        if LAYOUT == 0:
            owner = page % cp_size
            local = page // cp_size
        else:
            owner = page // chunk
            local = page - owner * chunk
        return owner, local

    @triton.jit
    def locate_rows(
        locs_ptr,  # [N] int32/int64
        r,  # [BLOCK_R] row indices
        num_rows,
        num_pages,
        num_local_pages,
        rank,
        PAGE_SIZE: tl.constexpr,
        CP: tl.constexpr,
        CHUNK: tl.constexpr,
        LAYOUT: tl.constexpr,
        IDX64: tl.constexpr,
    ):
        """``(keep, local_page, offset)`` of rows ``r``: the kernels' mask and destination.

        Page size, cp size and chunk are compile-time constants and the arithmetic is int32 unless locations may
        reach 2**31 (``IDX64``): divisions become shifts or multiplies instead of 64-bit division routines.
        """
        rmask = r < num_rows
        loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
        if IDX64:
            loc = loc.to(tl.int64)
        else:
            loc = loc.to(tl.int32)
        page = loc // PAGE_SIZE
        off = loc - page * PAGE_SIZE
        owner, local = owner_local(page, CP, CHUNK, LAYOUT)
        keep = rmask & (loc >= 0) & (page < num_pages) & (owner == rank) & (local < num_local_pages)
        return keep, local.to(tl.int64), off.to(tl.int64)

    @triton.jit
    def e4m3_bits(y, PREROUND: tl.constexpr):
        """fp32 -> e4m3fn bits (uint8) with round-to-nearest-even, saturating at +-448.

        On the GPU the hardware conversion (``cvt.rn.satfinite``) does it. With ``PREROUND`` (set under the
        interpreter) the value is first rounded to e4m3 precision with integer arithmetic (normal range: keep 3
        mantissa bits; subnormal range below 2**-6: multiples of 2**-9 through the ``+2**14 - 2**14`` trick), so
        the final conversion is exact: the interpreter's own conversion drops the carry into the exponent
        (127.9 -> 64). Both give the bits of torch's ``.to(torch.float8_e4m3fn)``.
        """
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if not PREROUND:
            return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        bits = y.to(tl.int32, bitcast=True)
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        a = tl.abs(y)
        sub = ((a + 16384.0) - 16384.0).to(tl.int32, bitcast=True) | (bits & -2147483648)
        r = tl.where(a < 0.015625, sub, normal).to(tl.float32, bitcast=True)
        return r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    @triton.jit
    def bf16_rn(x):
        """fp32 -> bf16 with round-to-nearest-even via integer arithmetic (the interpreter truncates)."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

else:  # pragma: no cover
    owner_local = locate_rows = e4m3_bits = bf16_rn = None


def locate_constexprs(cp_size: int, num_pages: int, layout_code: int, page_size: int) -> dict[str, int | bool]:
    """Compile-time arguments of :func:`locate_rows` (one kernel specialization per geometry)."""
    return {
        "PAGE_SIZE": page_size,
        "CP": cp_size,
        "CHUNK": chunk_of(cp_size, num_pages),
        "LAYOUT": layout_code,
        "IDX64": num_pages * page_size >= 2**31,
    }


# ------------------------------------------------------------------------------------------- checks
def validate_locs(
    locs: torch.Tensor,
    *,
    page_size: int,
    cp_size: int,
    num_pages: int,
    layout_code: int,
    rank: int,
    num_local_pages: int,
    require_owned: bool,
) -> None:
    """Host check of token locations before any write (synchronizes once on CUDA).

    Every entry must be ``-1`` (skipped) or a location of a logical page in ``[0, num_pages)`` whose local index
    fits the pool; with ``require_owned`` the page must also be owned by ``rank``.

    Raises:
        ValueError: naming the first bad entry, its page, and the rule it breaks.
    """
    if locs.numel() == 0:
        return
    x = locs.to(torch.int64)
    limit = num_pages * page_size
    page = torch.div(x, page_size, rounding_mode="floor")
    owner, local = owner_local_torch(page.clamp(min=0), cp_size, num_pages, layout_code)
    bad_range = (x < -1) | (x >= limit)
    valid = x >= 0
    bad_local = valid & ~bad_range & (owner == rank) & (local >= num_local_pages)
    bad_owner = valid & ~bad_range & (owner != rank) if require_owned else torch.zeros_like(valid)
    flags = torch.stack([bad_range.any(), bad_local.any(), bad_owner.any()]).cpu().tolist()
    if flags[0]:
        i = int(bad_range.nonzero()[0, 0])
        raise ValueError(
            f"locs must hold token locations in [-1, {limit}) (num_pages={num_pages} * page_size={page_size}; "
            f"-1 is skipped), got locs[{i}]={int(x[i])}"
        )
    if flags[1]:
        i = int(bad_local.nonzero()[0, 0])
        raise ValueError(
            f"locs[{i}]={int(x[i])} is in logical page {int(page[i])}, local page {int(local[i])} of rank {rank}, "
            f"but pool holds only {num_local_pages} local pages"
        )
    if flags[2]:
        i = int(bad_owner.nonzero()[0, 0])
        raise ValueError(
            f"locs[{i}]={int(x[i])} is in logical page {int(page[i])}, owned by rank {int(owner[i])}, not by "
            f"rank {rank}: a direct write may only target this rank's own pages (page-aligned split)"
        )


_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def word_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as the widest integer words its last dim, strides and offset allow (no copy).

    The copy kernels move words, never elements: a 656-byte fp8 row is 82 int64 words, a bf16 576-row 144.
    ``t``'s last dim must be contiguous (stride 1).
    """
    nbytes = t.element_size()
    offset = t.storage_offset() * nbytes
    for dtype in _WORD_DTYPES:
        w = dtype.itemsize
        if w < nbytes or (w > nbytes and (t.shape[-1] * nbytes) % w):
            continue
        if offset % w or any((s * nbytes) % w for s in t.stride()[:-1]):
            continue
        return t if t.dtype == dtype else t.view(dtype)
    return t.view(torch.uint8)  # every tensor with a stride-1 last dim has a byte view
