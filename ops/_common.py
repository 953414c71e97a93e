"""Shared plumbing of the ``dtkv`` custom ops: Triton availability, backend choice, ownership arithmetic, index
arguments, Triton helpers of the row kernels, fp8 rounding and word views.

Shape legend used by every op module:

- ``P``: local pages of the pool (``pool.shape[0]``); ``S``: page size (tokens per page);
- ``D``: elements of one stored row; ``W``: words (int64/int32/... reinterpretations) of one row or page;
- ``N``: rows (tokens) handed to a write; ``K``: entries of a page list.

Ownership reaches a registered op as plain ints ``(cp_size, num_pages, scheme_code, rank)``
(:func:`ownership_args`) so that the op schema needs no custom class; the torch side calls the arithmetic of
:mod:`dtkv.ownership` itself (:func:`dtkv.ownership.owner_and_local`), the Triton side mirrors it
(:func:`owner_local`); ``scheme_code`` 0 = interleave, 1 = block (:data:`dtkv.ownership.SCHEME_CODES`).

Index tensors (token locations, send lists, page maps) cross into the kernels through :func:`index_arg`, the one
normalization step of every op on both backends: the kernels read ``ptr + i``, so a strided, transposed or
expanded view must become contiguous first. Range masks come before any narrowing: :func:`locate_rows` and the
torch references compare entries in the width they were given.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch

from dtkv._env import debug_enabled, get_backend
from dtkv._util import cdiv
from dtkv.layouts import FP8_E4M3_MAX
from dtkv.ownership import (
    SCHEME_CODES,
    SCHEMES,
    OwnershipSpec,
    PageOwnership,
    owner_and_local,
    ownership_spec,
    pages_per_rank,
)

__all__ = [
    "HAS_TRITON",
    "HIST_HAS_MASK",
    "INTERPRET",
    "SCHEME_CODES",
    "OwnershipLike",
    "OwnershipSpec",
    "cdiv",
    "check_ownership_ints",
    "check_pages_contiguous",
    "check_rank",
    "device_ctx",
    "e4m3_blocks_torch",
    "index_arg",
    "locate",
    "locate_args",
    "masked_histogram",
    "num_sms",
    "owner_and_local",
    "ownership_args",
    "ownership_spec",
    "pow2_at_least",
    "resolve_backend",
    "should_validate",
    "tl",
    "triton",
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

HIST_HAS_MASK = HAS_TRITON and "mask" in inspect.signature(tl.histogram).parameters
"""Whether this Triton's ``tl.histogram`` takes a ``mask`` (:func:`masked_histogram` works around it if not)."""

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip() == "1"
"""Whether Triton kernels were defined in interpreter mode (read once, at import, as Triton does)."""

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
    spec = ownership_spec(ownership)
    return spec[0], spec[1], SCHEME_CODES[spec[2]]


def ownership_args(ownership: OwnershipLike) -> tuple[int, int, int]:
    """``(cp_size, num_pages, scheme_code)`` of a ``PageOwnership`` or ``OwnershipSpec``, as the ops take them."""
    if isinstance(ownership, tuple):
        if ownership[2] not in SCHEME_CODES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got scheme={ownership[2]!r}")
        return ownership[0], ownership[1], SCHEME_CODES[ownership[2]]
    return _placement_args(ownership)


def check_ownership_ints(cp_size: int, num_pages: int, scheme_code: int, rank: int) -> None:
    """Validate the ownership ints of a registered op (metadata only; safe in fake/meta mode)."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got cp_size={cp_size}")
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got num_pages={num_pages}")
    if scheme_code not in (0, 1):
        raise ValueError(f"scheme_code must be 0 (interleave) or 1 (block), got scheme_code={scheme_code}")
    check_rank(rank, cp_size)


def check_rank(rank: int, cp_size: int) -> None:
    """``rank`` must be a rank of the CP group: ``0 <= rank < cp_size``."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, cp_size={cp_size}), got rank={rank}")


# ------------------------------------------------------------------------------------------- index arguments
def index_arg(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An index, location or page-map argument as every kernel reads it: contiguous, of ``dtype`` if given.

    The one normalization step at the boundary of every op, on both backends (the kernels read ``ptr + i``; a
    slice, transpose or expanded view read that way yields other entries). Free for the usual contiguous tensor
    of the right dtype; one small copy otherwise. Values are not touched: range masks are applied in the width
    the entries were given (:func:`locate_rows`, :func:`dtkv.ops._row_write.owned_rows_torch`), before any
    narrowing.
    """
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


if HAS_TRITON:

    @triton.jit
    def owner_local(page, cp_size, pages_per_rank, SCHEME: tl.constexpr):
        """Triton twin of :func:`dtkv.ownership.owner_and_local` for non-negative ``page``."""
        if SCHEME == 0:
            owner = page % cp_size
            local = page // cp_size
        else:
            owner = page // pages_per_rank
            local = page - owner * pages_per_rank
        return owner, local

    @triton.jit
    def locate_rows(
        locs_ptr,  # [N] int32/int64, contiguous (index_arg)
        r,  # [BLOCK_R] row indices
        num_rows,
        num_locs,  # num_pages * PAGE_SIZE: the logical token locations
        num_local_pages,
        rank,
        PAGE_SIZE: tl.constexpr,
        CP: tl.constexpr,
        PAGES_PER_RANK: tl.constexpr,
        SCHEME: tl.constexpr,
        IDX64: tl.constexpr,
    ):
        """``(keep, local_page, offset)`` of rows ``r``: the kernels' mask and destination.

        The range mask ``0 <= loc < num_locs`` is applied first, in the width the locations were given, so an
        int64 location past 2**31 or 2**32 is skipped rather than narrowed onto a valid one. Only then is the
        arithmetic done in int32 unless kept locations may reach 2**31 (``IDX64``): with page size, cp size and
        pages per rank compile-time constants, divisions become shifts or multiplies instead of 64-bit division
        routines.
        """
        rmask = r < num_rows
        loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
        keep, local, off = locate(
            loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64
        )
        return keep, local.to(tl.int64), off.to(tl.int64)

    @triton.jit
    def locate(
        loc,  # [BLOCK_R] int32/int64 locations as loaded (-1 where rmask is off)
        rmask,  # [BLOCK_R] rows that exist
        num_locs,
        num_local_pages,
        rank,
        PAGE_SIZE: tl.constexpr,
        CP: tl.constexpr,
        PAGES_PER_RANK: tl.constexpr,
        SCHEME: tl.constexpr,
        IDX64: tl.constexpr,
    ):
        """:func:`locate_rows` on locations already loaded; ``local``/``offset`` int32, or int64 with ``IDX64``."""
        in_range = rmask & (loc >= 0) & (loc < num_locs)
        if IDX64:
            loc = loc.to(tl.int64)
        else:
            loc = loc.to(tl.int32)
        page = loc // PAGE_SIZE
        off = loc - page * PAGE_SIZE
        owner, local = owner_local(page, CP, PAGES_PER_RANK, SCHEME)
        keep = in_range & (owner == rank) & (local < num_local_pages)
        return keep, local, off

    @triton.jit
    def e4m3_bits(y, PREROUND: tl.constexpr):
        """fp32 -> e4m3fn bits (uint8) with round-to-nearest-even, saturating at +-448.

        On the GPU the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``, two values an instruction) does it,
        saturation included: a finite value past +-448 rounds to +-448 either way, so no clamp is spent on it (two
        instructions a value, in kernels that are close to issue-bound; ``tests/test_ops_compile.py`` checks that the
        compiled kernels use only that conversion). With ``PREROUND`` (set under the interpreter) the value is
        clamped, then rounded to e4m3 precision with integer arithmetic (normal range: keep 3 mantissa bits;
        subnormal range below 2**-6: multiples of 2**-9 through the ``+2**14 - 2**14`` trick), so the final
        conversion is exact: the interpreter's own conversion drops the carry into the exponent (127.9 -> 64).
        Both give the bits of torch's ``.clamp(-448, 448).to(torch.float8_e4m3fn)`` for finite values.
        """
        if not PREROUND:
            return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        bits = y.to(tl.int32, bitcast=True)
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        a = tl.abs(y)
        sub = ((a + 16384.0) - 16384.0).to(tl.int32, bitcast=True) | (bits & -2147483648)
        r = tl.where(a < 0.015625, sub, normal).to(tl.float32, bitcast=True)
        return r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    @triton.jit
    def scalar_mask(cond, like, INTERPRETER: tl.constexpr):
        """A scalar condition as the mask of a tile shaped like ``like`` (an integer tensor of the tile's shape).

        Compiled, ``cond`` comes back as it is (the load or store broadcasts a scalar mask itself: the kernel's IR
        is what it would be without this helper). Under the interpreter (``INTERPRETER``) it is spread to a bool
        tile explicitly: the interpreter gives a scalar comparison's result its operands' dtype, so an implicit
        broadcast of it is an int32 array, which Triton 3.9's interpreter refuses as a mask ("mask has unsupported
        dtype"; 3.7 accepted it).
        """
        if INTERPRETER:
            return tl.where(cond, like == like, like != like)
        else:
            return cond

    @triton.jit
    def masked_histogram(d, BINS: tl.constexpr, take, HIST_MASK: tl.constexpr):
        """int32 ``[BINS]`` counts of the digits ``d`` (each in ``[0, BINS)``) where ``take``. Without
        ``HIST_MASK`` (an older Triton's histogram takes no mask) the digits not taken are counted in a bin past
        ``BINS`` and dropped. Triton's histogram costs about a bin a thread per 32 digits."""
        if HIST_MASK:
            out = tl.histogram(d, BINS, mask=take)
        else:
            both = tl.reshape(tl.histogram(tl.where(take, d, BINS), 2 * BINS), [2, BINS])
            out = tl.sum(tl.where(tl.arange(0, 2)[:, None] == 0, both, 0), axis=0)
        return out

    @triton.jit
    def bf16_rn(x):
        """fp32 -> bf16 with round-to-nearest-even via integer arithmetic (the interpreter truncates)."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

else:  # pragma: no cover
    owner_local = locate_rows = locate = e4m3_bits = scalar_mask = masked_histogram = bf16_rn = None


def locate_args(cp_size: int, num_pages: int, scheme_code: int, page_size: int) -> dict[str, int | bool]:
    """The geometry arguments of :func:`locate_rows`, as the row kernels take them (one specialization each)."""
    return {
        "num_locs": num_pages * page_size,
        "PAGE_SIZE": page_size,
        "CP": cp_size,
        "PAGES_PER_RANK": pages_per_rank(cp_size, num_pages),
        "SCHEME": scheme_code,
        "IDX64": num_pages * page_size >= 2**31,
    }


# ------------------------------------------------------------------------------------------- fp8 (torch side)
def e4m3_blocks_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 blocks ``[..., B]``: (e4m3 bytes uint8 ``[..., B]``, fp32 scales ``amax / 448`` ``[...]``).

    ``x * (448 / amax)`` rounded to nearest even, saturating; an all-zero block gets scale 0 and zeros. The torch
    twin of the kernels' ``amax -> scale, 1 / scale`` and :func:`e4m3_bits`, with the same IEEE operations.
    """
    amax = x.abs().amax(dim=-1)
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)  # a tensor divisor: CUDA multiplies by 1/scalar instead
    inv = torch.where(amax > 0, torch.full_like(amax, FP8_E4M3_MAX) / amax, torch.ones_like(amax))
    q = (x * inv[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


# ------------------------------------------------------------------------------------------- pools of pages
def check_pages_contiguous(name: str, pool: torch.Tensor) -> None:
    """``pool`` ``[P, ...]``: a tensor of >= 2 dims whose pages are contiguous (any page stride, so a layer view of
    a layered buffer is fine): what the page-copy kernels read as ``[P, W]`` words."""
    if not isinstance(pool, torch.Tensor) or pool.dim() < 2:
        got = list(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(f"{name} must be a tensor [num_local_pages, ...] with >= 2 dims, got {got}")
    inner = pool.shape[1:]
    want = [1] * len(inner)
    for d in range(len(inner) - 2, -1, -1):
        want[d] = want[d + 1] * inner[d + 1]
    if any(s != w and n > 1 for s, w, n in zip(pool.stride()[1:], want, inner)):
        raise ValueError(f"{name} pages must be contiguous (any page stride), got {name}.stride()={pool.stride()}")


# ------------------------------------------------------------------------------------------- grid sizes
@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: a CUDA device's own count; 132 (an H200's) elsewhere, so the
    interpreter's grids match a GPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def pow2_at_least(x: int, floor: int) -> int:
    """The smallest power of two ``>= x`` and ``>= floor`` (a Triton block's extent)."""
    return max(floor, 1 << max(0, x - 1).bit_length())


# ------------------------------------------------------------------------------------------- word views
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
