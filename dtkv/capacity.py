"""Capacity planning without allocation: per-rank bytes and the logical-capacity multiplier of sharded KV.

A replicated CP deployment gives every rank the bytes of the whole logical pool. With page-ownership sharding
the same per-rank budget holds ``cp`` times as many pages, minus the scratch that full-view materialization
needs (the per-layer view of the largest request, double-buffered for layer-ahead prefetch, plus the pack
buffer). :func:`capacity` builds the pools and scratch on the ``meta`` device (no memory is touched) and
reports the multiplier.

Run ``python -m dtkv.capacity --preset glm5 --cp-size 8 --tokens 1048576 --json`` (``--cp`` is an alias).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from dtkv._checks import check_int
from dtkv._util import cdiv, warn_deprecated
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
from dtkv.materialize import scratch_bytes
from dtkv.ownership import PageOwnership
from dtkv.pool import ShardedKVPool

__all__ = ["PRESETS", "CapacityReport", "ModelGeometry", "capacity"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelGeometry:
    """The KV geometry of a model: layers and stored layouts."""

    name: str
    """Preset name."""
    num_layers: int
    """Layers holding KV."""
    layouts: tuple[tuple[str, KVLayout], ...]
    """(name, layout) pairs stored per layer."""

    @property
    def page_size(self) -> int:
        return self.layouts[0][1].page_size

    @property
    def page_bytes_per_layer(self) -> int:
        return sum(lay.page_bytes for _, lay in self.layouts)


PRESETS: dict[str, ModelGeometry] = {
    "glm5": ModelGeometry(
        name="glm5",
        num_layers=78,
        layouts=(("kv", MLAFp8Layout(page_size=64)), ("index", IndexerFp8Layout(page_size=64))),
    ),
    "dsv32": ModelGeometry(
        name="dsv32",
        num_layers=61,
        layouts=(("kv", MLAFp8Layout(page_size=64)), ("index", IndexerFp8Layout(page_size=64))),
    ),
    "dsv32-bf16": ModelGeometry(
        name="dsv32-bf16",
        num_layers=61,
        layouts=(("kv", MLALatentLayout(page_size=64)), ("index", IndexerFp8Layout(page_size=64))),
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class CapacityReport:
    """What :func:`capacity` measured (every size in bytes, every count in tokens or pages)."""

    preset: str
    cp_size: int
    """CP group size."""
    tokens: int
    """Logical tokens the replicated baseline holds (each rank's budget is that pool's size)."""
    max_request_tokens: int
    """Largest request the materialization scratch is sized for."""
    page_size: int
    num_layers: int
    kv_bytes_replicated: int
    """Per-rank bytes of the replicated pool for ``tokens`` tokens: the per-rank budget."""
    scratch_bytes_per_rank: int
    """Materialization scratch (double-buffered view + pack buffer) charged to the budget."""
    kv_bytes_per_rank: int
    """Per-rank bytes of the sharded pool that fits in the budget after scratch."""
    sharded_pages: int
    """Logical pages the sharded pools hold together."""
    sharded_tokens: int
    capacity_multiplier: float
    """``sharded_tokens / tokens``."""

    @property
    def cp(self) -> int:
        """Deprecated name of :attr:`cp_size` (warns)."""
        warn_deprecated("CapacityReport.cp", "CapacityReport.cp_size")
        return self.cp_size

    def to_json(self) -> dict[str, object]:
        """The report as a JSON-able dict (what ``--json`` prints; ``"cp"`` repeats ``"cp_size"`` for one
        release, for scripts reading the old key)."""
        out = asdict(self)
        out["cp"] = self.cp_size
        return out


def capacity(
    preset: str | ModelGeometry = "glm5",
    *,
    cp_size: int | None = None,
    tokens: int,
    max_request_tokens: int | None = None,
    cp: int | None = None,
) -> CapacityReport:
    """Per-rank bytes and capacity multiplier of sharded vs replicated KV, computed on meta tensors.

    Args:
        preset: a key of :data:`PRESETS` or a :class:`ModelGeometry`.
        cp_size: CP group size (>= 1).
        tokens: tokens of the replicated baseline pool; each rank's budget is that pool's bytes.
        max_request_tokens: the longest request the scratch must materialize (default ``tokens``).
        cp: deprecated name of ``cp_size`` (warns).
    """
    if cp is not None:
        warn_deprecated("capacity(cp=...)", "capacity(cp_size=...)")
        if cp_size is not None and cp_size != cp:
            raise TypeError(f"capacity got cp_size={cp_size} and the deprecated cp={cp}; pass cp_size= only")
        cp_size = cp
    if cp_size is None:
        raise TypeError("capacity() missing required keyword argument: 'cp_size'")
    geo = PRESETS[preset] if isinstance(preset, str) and preset in PRESETS else preset
    if not isinstance(geo, ModelGeometry):
        raise ValueError(f"preset must be one of {sorted(PRESETS)} or a ModelGeometry, got preset={preset!r}")
    check_int("cp_size", cp_size, min_value=1)
    check_int("tokens", tokens, min_value=1)
    max_req = tokens if max_request_tokens is None else check_int("max_request_tokens", max_request_tokens, min_value=1)
    ps = geo.page_size
    layouts = dict(geo.layouts)
    replicated_pages = cdiv(tokens, ps)
    replicated = ShardedKVPool(layouts, PageOwnership(1, replicated_pages), num_layers=geo.num_layers, device="meta")
    budget = replicated.bytes_per_rank()
    scratch = scratch_bytes(layouts, max_pages=cdiv(max_req, ps), cp=cp_size, prefetch=True)
    per_page_all_layers = geo.num_layers * geo.page_bytes_per_layer
    local_pages = max(0, (budget - scratch) // per_page_all_layers)
    total_pages = local_pages * cp_size
    if total_pages:
        # Build the sharded pool on meta: rank 0 holds the most pages (interleave), so this is the per-rank peak.
        sharded = ShardedKVPool(layouts, PageOwnership(1, local_pages), num_layers=geo.num_layers, device="meta")
        per_rank = sharded.bytes_per_rank()
    else:
        per_rank = 0
    return CapacityReport(
        preset=geo.name,
        cp_size=cp_size,
        tokens=tokens,
        max_request_tokens=max_req,
        page_size=ps,
        num_layers=geo.num_layers,
        kv_bytes_replicated=budget,
        scratch_bytes_per_rank=scratch,
        kv_bytes_per_rank=per_rank,
        sharded_pages=total_pages,
        sharded_tokens=total_pages * ps,
        capacity_multiplier=total_pages * ps / tokens,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtkv.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="glm5", choices=sorted(PRESETS))
    parser.add_argument("--cp-size", "--cp", dest="cp_size", type=int, default=8, help="CP group size")
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--max-request-tokens", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rep = capacity(args.preset, cp_size=args.cp_size, tokens=args.tokens, max_request_tokens=args.max_request_tokens)
    if args.json:
        print(json.dumps(rep.to_json()))
        return 0
    gib = 1 << 30
    print(f"preset {rep.preset}: {rep.num_layers} layers, page {rep.page_size}, cp_size {rep.cp_size}")
    print(f"  per-rank budget (replicated pool of {rep.tokens} tokens): {rep.kv_bytes_replicated / gib:9.2f} GiB")
    print(
        f"  materialization scratch (<= {rep.max_request_tokens} tokens):  {rep.scratch_bytes_per_rank / gib:9.2f} GiB"
    )
    print(f"  sharded pool per rank:                        {rep.kv_bytes_per_rank / gib:9.2f} GiB")
    print(f"  logical tokens held: {rep.sharded_tokens} -> capacity multiplier {rep.capacity_multiplier:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
