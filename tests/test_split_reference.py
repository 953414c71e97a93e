"""Brute-force, per-token Python references for ``dtkv.split`` (imported by the other ``test_split*`` files).

Written independently of the library: every token is visited one by one, page-aligned boundaries are placed by
a sequential loop (the library uses a clipped running max), and pages touched are counted with a set. The tests
at the bottom pin the references themselves on hand-worked cases.
"""

from __future__ import annotations

from dataclasses import dataclass


def ref_boundaries(prefix: int, n: int, cp: int, ps: int, page_aligned: bool) -> tuple[list[int], bool]:
    """Zigzag segment boundaries (extend-relative, ``2cp+1``) and whether the request is page-aligned."""
    segs = 2 * cp
    sizes = [n // segs + (1 if j < n % segs else 0) for j in range(segs)]
    balanced = [sum(sizes[:j]) for j in range(segs + 1)]
    touched = len({(prefix + o) // ps for o in range(n)})
    if not page_aligned or touched < segs:
        return balanced, False
    last_edge = ((prefix + n - 1) // ps) * ps  # largest page edge strictly before the extend's end
    prev = (prefix // ps) * ps
    out = [0]
    for j in range(1, segs):
        a = prefix + balanced[j]
        below = (a // ps) * ps
        above = below + ps
        nearest = below if a - below < above - a else above
        m = min(max(nearest, prev + ps), last_edge - (segs - 1 - j) * ps)
        out.append(m - prefix)
        prev = m
    out.append(n)
    return out, True


def ref_rank_of_offset(offset: int, bounds: list[int] | None, cp: int, start: int = 0) -> int:
    """Rank computing extend offset ``offset`` (zigzag when ``bounds`` is given, else round-robin, where
    ``start`` is the request's first row in the batch: batch row ``start + offset`` goes to rank
    ``(start + offset) % cp``)."""
    if bounds is None:
        return (start + offset) % cp
    seg = max(j for j in range(2 * cp) if bounds[j] <= offset < bounds[j + 1])
    return seg if seg < cp else 2 * cp - 1 - seg


@dataclass
class RefSplit:
    boundaries: list[list[int]] | None
    aligned: list[bool]
    local_tokens: list[list[int]]  # per rank, natural rows in local order
    positions: list[list[int]]  # per rank, absolute positions in local order
    req_of: list[list[int]]  # per rank, request of each local row
    q_prev: list[list[int]]  # per rank, per request
    q_next: list[list[int]]
    kv_prev: list[list[int]]
    kv_next: list[list[int]]
    max_local: int
    restore: list[int]
    gather: list[int]


def ref_split(
    prefix_lens: list[int], extend_lens: list[int], cp: int, ps: int, mode: str = "zigzag", page_aligned: bool = True
) -> RefSplit:
    bounds_all = [] if mode == "zigzag" else None
    aligned = []
    local = [[] for _ in range(cp)]
    positions = [[] for _ in range(cp)]
    req_of = [[] for _ in range(cp)]
    q_prev = [[] for _ in range(cp)]
    q_next = [[] for _ in range(cp)]
    kv_prev = [[] for _ in range(cp)]
    kv_next = [[] for _ in range(cp)]
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        if mode == "zigzag":
            b, al = ref_boundaries(p, n, cp, ps, page_aligned)
            bounds_all.append(b)
        else:
            b, al = None, False
        aligned.append(al)
        for r in range(cp):
            if b is not None:
                prev = [o for o in range(n) if b[r] <= o < b[r + 1]]
                nxt = [o for o in range(n) if b[2 * cp - 1 - r] <= o < b[2 * cp - r]]
                kv_prev[r].append(p + b[r + 1])
                kv_next[r].append(p + b[2 * cp - r])
            else:
                prev = [o for o in range(n) if (start + o) % cp == r]  # rotation across the batch
                nxt = []
                kv = p + (prev[-1] + 1 if prev else 0)
                kv_prev[r].append(kv)
                kv_next[r].append(kv)
            q_prev[r].append(len(prev))
            q_next[r].append(len(nxt))
            for o in prev + nxt:
                assert ref_rank_of_offset(o, b, cp, start) == r
                local[r].append(start + o)
                positions[r].append(p + o)
                req_of[r].append(i)
        start += n
    max_local = max((len(t) for t in local), default=0)
    restore = [0] * start
    gather = [-1] * (cp * max_local)
    for r in range(cp):
        for q, t in enumerate(local[r]):
            restore[t] = r * max_local + q
            gather[r * max_local + q] = t
    return RefSplit(
        bounds_all, aligned, local, positions, req_of, q_prev, q_next, kv_prev, kv_next, max_local, restore, gather
    )


def assert_split_matches(split, ref: RefSplit, cp: int) -> None:
    """A :class:`dtkv.split.CPSplit` agrees with :func:`ref_split`: alignment, boundaries, the gather and restore
    maps, and every rank's rows (tokens, positions, requests, segment lengths, KV lengths)."""
    assert split.page_aligned.tolist() == ref.aligned
    assert split.all_page_aligned == (bool(ref.aligned) and all(ref.aligned))
    assert (None if split.boundaries is None else split.boundaries.tolist()) == ref.boundaries
    assert split.max_local_tokens == ref.max_local
    assert split.num_local_tokens == tuple(len(t) for t in ref.local_tokens)
    assert split.restore_index.tolist() == ref.restore
    assert split.gather_index.tolist() == ref.gather
    for r in range(cp):
        loc = split.local(r)
        assert loc.token_index.tolist() == ref.local_tokens[r]
        assert loc.positions.tolist() == ref.positions[r]
        assert loc.req_idx.tolist() == ref.req_of[r]
        assert list(loc.actual_seq_q_prev) == ref.q_prev[r]
        assert list(loc.actual_seq_q_next) == ref.q_next[r]
        assert list(loc.kv_len_prev) == ref.kv_prev[r]
        assert list(loc.kv_len_next) == ref.kv_next[r]


def ref_slot_ranks(
    prefix: int, n: int, cp: int, ps: int, bounds: list[int] | None, start: int = 0
) -> dict[int, set[int]]:
    """Page slot -> ranks computing at least one of its extend tokens (only touched slots appear); ``start``
    is the request's first batch row (round-robin)."""
    out: dict[int, set[int]] = {}
    for o in range(n):
        out.setdefault((prefix + o) // ps, set()).add(ref_rank_of_offset(o, bounds, cp, start))
    return out


# ----------------------------------------------------------------------------------------------- the references
def test_ref_boundaries_hand_worked():
    # prefix 5, extend 23, cp 2, page 4: balanced 0 6 12 18 23 -> abs 11 17 23 -> nearest edges 12 16 24
    assert ref_boundaries(5, 23, 2, 4, True) == ([0, 7, 11, 19, 23], True)
    assert ref_boundaries(5, 23, 2, 4, False) == ([0, 6, 12, 18, 23], False)
    # abs [2, 9) touches pages 0, 1, 2: three < 2cp = 4 -> token-balanced fallback
    assert ref_boundaries(2, 7, 2, 4, True) == ([0, 2, 4, 6, 7], False)
    # exactly 2cp pages touched: one page a segment (the tie at abs 10 goes up to 12)
    assert ref_boundaries(0, 13, 2, 4, True) == ([0, 4, 8, 12, 13], True)
    assert ref_boundaries(3, 0, 2, 4, True) == ([0, 0, 0, 0, 0], False)


def test_ref_split_round_robin_hand_worked():
    # batch rows 0..6: request 0 = rows 0-4 -> ranks 0 1 0 1 0; request 1 = rows 5-6 -> ranks 1 0 (no restart)
    ref = ref_split([3, 0], [5, 2], 2, 4, "round_robin")
    assert ref.local_tokens == [[0, 2, 4, 6], [1, 3, 5]]
    assert ref.kv_prev == [[8, 2], [7, 1]]  # prefix + 1 + offset of the last local token
    assert ref.restore == [0, 4, 1, 5, 2, 6, 3]
    assert ref.gather == [0, 2, 4, 6, 1, 3, 5, -1]
    # eight one-token requests at cp=8: one token a rank
    assert ref_split([0] * 8, [1] * 8, 8, 4, "round_robin").local_tokens == [[r] for r in range(8)]
