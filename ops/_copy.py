"""Triton building blocks of the copy kernels: spans of machine words moved in at most four wide chunks.

A *span* is ``SPAN`` consecutive words of one row of a tile (a stored row of a row write, a page or an equal part of
a page of a pack). :func:`span_chunks` splits it into at most four chunks of power-of-two widths (``82`` int64 words
of a 656-byte fp8 row: ``64 + 16 + 2``), so no lane is masked off except in a fourth chunk wider than what is left.
:func:`load_span` issues every chunk's load before :func:`store_span` issues any store: a store may alias a later
load, so neither the compiler nor the hardware would start that load before the store, and a tile copied chunk by
chunk waits for one memory round trip per chunk. Loads are ``evict_first`` (each byte is read once).

A *flat tile* (:func:`flat_rows`) is ``R`` rows of ``W`` words taken as one span of ``R * W`` words, cut into
chunks the same way: a warp's lanes cover consecutive words across row ends, so no lane idles at a row's tail and a
row boundary inside a sector is written by one request. Word ``e`` of the tile is word ``e % W`` of tile row
``e // W``; the kernel finds each word's destination from its row. Groups of :func:`vector_words` words stay in one
row (``W`` and every stride are multiples of it), so the kernels may say so (``tl.multiple_of`` /
``tl.max_contiguous``) and loads and stores stay 16 bytes wide.

Legend: ``R`` rows of a tile, ``SPAN`` words of a span, ``CWk`` width of chunk ``k`` (0 = unused).
"""

from __future__ import annotations

import functools

from ._common import HAS_TRITON, tl, triton

__all__ = [
    "MAX_CHUNKS",
    "flat_rows",
    "load_span",
    "needs_int64",
    "row_dst",
    "span_chunks",
    "store_span",
    "vector_words",
]

MAX_CHUNKS = 4
"""Chunks of one span (the tile's loads in flight together)."""


@functools.lru_cache(maxsize=256)
def span_chunks(span: int, chunk_w: int) -> tuple[int, int, int, int]:
    """Widths ``(CW0, CW1, CW2, CW3)`` of the chunks covering ``span`` words (``0`` = unused chunk).

    Greedy powers of two of at most ``chunk_w`` words (``chunk_w`` 0: one chunk, the next power of two of
    ``span``). When the span needs more than four, the fourth is the next power of two of the rest (its lanes past
    the span are masked). Example: ``span_chunks(82, 128) == (64, 16, 2, 0)``; ``span_chunks(144, 64) == (64, 64,
    16, 0)``; ``span_chunks(5248, 1024) == (1024, 1024, 1024, 4096)``.
    """
    if span < 1:
        raise ValueError(f"span must be >= 1 word, got span={span}")
    if chunk_w < 0 or chunk_w & (chunk_w - 1):
        raise ValueError(f"chunk_w must be 0 or a power of two, got chunk_w={chunk_w}")
    if chunk_w == 0:
        return (1 << (span - 1).bit_length(), 0, 0, 0)
    widths: list[int] = []
    rest = span
    while rest and len(widths) < MAX_CHUNKS - 1:
        w = min(chunk_w, 1 << (rest.bit_length() - 1))
        widths.append(w)
        rest -= w
    if rest:
        widths.append(1 << (rest - 1).bit_length())
    return (*widths, *([0] * (MAX_CHUNKS - len(widths))))  # type: ignore[return-value]


def vector_words(word_bytes: int, *multiples: int) -> int:
    """Words per 16-byte vector (``16 // word_bytes``), halved until it divides every one of ``multiples`` (row
    width, strides and chunk widths of a flat tile, in words); 1 at least."""
    vec = max(1, 16 // word_bytes)
    while vec > 1 and any(m % vec for m in multiples):
        vec //= 2
    return vec


def needs_int64(*extents: int) -> bool:
    """Whether a kernel's word offsets may reach 2**31 (then its offset arithmetic is int64, else int32)."""
    return max(extents, default=0) >= 2**31 - 1


if HAS_TRITON:

    @triton.jit
    def _chunk(ptr, base, mask, C: tl.constexpr, CW: tl.constexpr, SPAN: tl.constexpr):
        """Pointers ``[R, CW]`` of words ``[C, C + CW)`` of each row's span and their mask (past the span: off)."""
        cols = C + tl.arange(0, CW)
        if C + CW > SPAN:
            m = mask[:, None] & (cols < SPAN)[None, :]
        else:
            m = mask[:, None]
        return ptr + base[:, None] + cols[None, :], m

    @triton.jit
    def load_span(
        src_ptr,  # words
        src_base,  # [R] word offset of each row's span
        mask,  # [R] rows to read (others give zeros)
        SPAN: tl.constexpr,
        CW0: tl.constexpr,
        CW1: tl.constexpr,
        CW2: tl.constexpr,
        CW3: tl.constexpr,
    ):
        """The span's chunks ``[R, CWk]``, every load issued before any use (unused chunks repeat chunk 0)."""
        p, m = _chunk(src_ptr, src_base, mask, 0, CW0, SPAN)
        v0 = tl.load(p, mask=m, other=0, eviction_policy="evict_first")
        v1 = v0
        v2 = v0
        v3 = v0
        if CW1 > 0:
            p, m = _chunk(src_ptr, src_base, mask, CW0, CW1, SPAN)
            v1 = tl.load(p, mask=m, other=0, eviction_policy="evict_first")
        if CW2 > 0:
            p, m = _chunk(src_ptr, src_base, mask, CW0 + CW1, CW2, SPAN)
            v2 = tl.load(p, mask=m, other=0, eviction_policy="evict_first")
        if CW3 > 0:
            p, m = _chunk(src_ptr, src_base, mask, CW0 + CW1 + CW2, CW3, SPAN)
            v3 = tl.load(p, mask=m, other=0, eviction_policy="evict_first")
        return v0, v1, v2, v3

    @triton.jit
    def store_span(
        dst_ptr,  # words, the dtype of the loaded chunks
        dst_base,  # [R] word offset of each row's span
        mask,  # [R] rows to write
        v0,
        v1,
        v2,
        v3,
        SPAN: tl.constexpr,
        CW0: tl.constexpr,
        CW1: tl.constexpr,
        CW2: tl.constexpr,
        CW3: tl.constexpr,
    ):
        """Store the chunks of :func:`load_span` at ``dst_base`` (same widths)."""
        p, m = _chunk(dst_ptr, dst_base, mask, 0, CW0, SPAN)
        tl.store(p, v0, mask=m)
        if CW1 > 0:
            p, m = _chunk(dst_ptr, dst_base, mask, CW0, CW1, SPAN)
            tl.store(p, v1, mask=m)
        if CW2 > 0:
            p, m = _chunk(dst_ptr, dst_base, mask, CW0 + CW1, CW2, SPAN)
            tl.store(p, v2, mask=m)
        if CW3 > 0:
            p, m = _chunk(dst_ptr, dst_base, mask, CW0 + CW1 + CW2, CW3, SPAN)
            tl.store(p, v3, mask=m)

    @triton.jit
    def flat_rows(first, step, count, C: tl.constexpr, CW: tl.constexpr, SPAN: tl.constexpr, W: tl.constexpr):
        """``(row, col, valid)`` of words ``[C, C + CW)`` of a flat tile: word ``e`` is word ``col = e % W`` of tile
        row ``j = e // W``, which is row ``first + j * step`` of the source; ``valid``: ``j < count`` and ``e <
        SPAN`` (other lanes get row ``first``)."""
        e = C + tl.arange(0, CW)
        j = e // W
        col = e - j * W
        valid = j < count
        if C + CW > SPAN:
            valid = valid & (e < SPAN)
        return first + tl.where(valid, j, 0) * step, col, valid

    @triton.jit
    def row_dst(local, off, page_stride, ROW_STRIDE: tl.constexpr, OFF64: tl.constexpr):
        """Offset of each destination row, in the pool pointer's elements: ``local * page_stride + off * ROW_STRIDE``
        (int32 arithmetic unless ``OFF64``)."""
        if OFF64:
            local = local.to(tl.int64)
            off = off.to(tl.int64)
        return local * page_stride + off * ROW_STRIDE

else:  # pragma: no cover
    load_span = store_span = row_dst = flat_rows = None
