"""Capacity planning without allocation: per-rank bytes and the logical-capacity multiplier of sharded KV.

A replicated CP deployment gives every rank the bytes of the whole logical pool. With page-ownership sharding
the same per-rank budget holds ``cp`` times as many pages, minus the scratch that full-view materialization
needs (the per-layer view of the largest request, double-buffered for layer-ahead prefetch, plus the pack
buffer). :func:`capacity` builds the pools and scratch on the ``meta`` device (no memory is touched) and
reports the multiplier.

Run ``python -m dtkv.capacity --preset glm5 --cp 8 --tokens 1048576 --json`` (``--cp-size`` is a deprecated
alias of ``--cp``; presets ``glm5``, ``deepseek-v32``, ``deepseek-v32-bf16``, with ``dsv32`` / ``dsv32-bf16``
deprecated aliases). Arithmetic only: this module imports no kernels, no Triton and no materializer.

Shared-prefix scenario (:func:`shared_prefix_capacity`): many concurrent requests that start with the same
prefix (a system prompt, a document) and each add their own suffix. With a prefix cache
(:class:`dtkv.PrefixCache`) the prefix's full pages are stored once and counted once; each request stores only
its suffix and the prefix's partial last page (whose tokens it recomputes). ``--shared-prefix-tokens P
--suffix-tokens S`` reports how many such requests fit, replicated or sharded, with or without the cache.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass

from dtkv._checks import check_int
from dtkv._scratch import scratch_bytes
from dtkv._util import cdiv, warn_deprecated
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
from dtkv.ownership import PageOwnership
from dtkv.pool import ShardedKVPool

__all__ = [
    "PRESETS",
    "PRESET_ALIASES",
    "CapacityReport",
    "ModelGeometry",
    "SharedPrefixReport",
    "capacity",
    "main",
    "shared_prefix_capacity",
]


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
        """Tokens per page."""
        return self.layouts[0][1].page_size

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page of one layer, every layout together."""
        return sum(lay.page_bytes for _, lay in self.layouts)


PRESETS: dict[str, ModelGeometry] = {
    "glm5": ModelGeometry(
        name="glm5",
        num_layers=78,
        layouts=(("kv", MLAFp8Layout(page_size=64)), ("index", IndexerFp8Layout(page_size=64))),
    ),
    "deepseek-v32": ModelGeometry(
        name="deepseek-v32",
        num_layers=61,
        layouts=(("kv", MLAFp8Layout(page_size=64)), ("index", IndexerFp8Layout(page_size=64))),
    ),
    "deepseek-v32-bf16": ModelGeometry(
        name="deepseek-v32-bf16",
        num_layers=61,
        layouts=(("kv", MLALatentLayout(page_size=64)), ("index", IndexerFp8Layout(page_size=64))),
    ),
}
"""The model geometries by name (the names ``python -m dtkv.demo --model`` uses): GLM-5 (78 layers) and
DeepSeek-V3.2 (61 layers) with fp8 KV (656-byte MLA rows + the 8448-byte indexer page, page size 64), and
DeepSeek-V3.2 with bf16 latent rows."""

PRESET_ALIASES: dict[str, str] = {"dsv32": "deepseek-v32", "dsv32-bf16": "deepseek-v32-bf16"}
"""Deprecated preset names -> their names in :data:`PRESETS` (accepted with a ``DeprecationWarning``)."""


def _geometry(preset: str | ModelGeometry) -> ModelGeometry:
    if isinstance(preset, str) and preset in PRESET_ALIASES:
        warn_deprecated(f"preset {preset!r}", f"preset {PRESET_ALIASES[preset]!r}", stacklevel=4)
        preset = PRESET_ALIASES[preset]
    geo = PRESETS[preset] if isinstance(preset, str) and preset in PRESETS else preset
    if not isinstance(geo, ModelGeometry):
        raise ValueError(f"preset must be one of {sorted(PRESETS)} or a ModelGeometry, got preset={preset!r}")
    return geo


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
        preset: a key of :data:`PRESETS` (or a deprecated alias of :data:`PRESET_ALIASES`) or a
            :class:`ModelGeometry`.
        cp_size: CP group size (>= 1).
        tokens: the per-rank budget, in tokens: each rank has the bytes of a replicated pool of ``tokens``
            tokens (every rank holding every page), which the sharded pools then fill.
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
    geo = _geometry(preset)
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


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedPrefixReport:
    """Concurrent requests sharing one prefix that fit in the per-rank budget (:func:`shared_prefix_capacity`)."""

    pools: CapacityReport
    """The replicated and sharded pools (scratch sized for one ``prefix + suffix`` request)."""
    prefix_tokens: int
    """Tokens every request starts with."""
    suffix_tokens: int
    """Tokens each request adds after the prefix."""
    shared_pages: int
    """Full pages of the prefix: stored once with a prefix cache, counted once."""
    private_pages: int
    """Pages each request stores alone with a prefix cache: the prefix's partial last page and the suffix."""
    pages_per_request: int
    """Pages each request stores without a prefix cache."""
    requests_replicated: int
    """Requests the replicated pool holds without a prefix cache (today's baseline)."""
    requests_replicated_shared: int
    """Requests the replicated pool holds with a prefix cache."""
    requests_sharded: int
    """Requests the sharded pools hold without a prefix cache."""
    requests_sharded_shared: int
    """Requests the sharded pools hold with a prefix cache."""

    @property
    def multiplier(self) -> float:
        """``requests_sharded_shared / requests_replicated`` (inf when the baseline holds none)."""
        return self.requests_sharded_shared / self.requests_replicated if self.requests_replicated else float("inf")

    def to_json(self) -> dict[str, object]:
        """The report as a JSON-able dict (the pools under ``"pools"``)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "pools"}
        out["multiplier"] = self.multiplier
        out["pools"] = self.pools.to_json()
        return out


def shared_prefix_capacity(
    preset: str | ModelGeometry = "glm5", *, cp_size: int, tokens: int, prefix_tokens: int, suffix_tokens: int
) -> SharedPrefixReport:
    """How many requests of ``prefix_tokens`` shared + ``suffix_tokens`` own tokens fit in the per-rank budget.

    A shared page is counted once: with a prefix cache the ``prefix_tokens // page_size`` full pages of the
    prefix are stored once and every request adds ``ceil((prefix_tokens % page_size + suffix_tokens) /
    page_size)`` pages; without one each request stores ``ceil((prefix_tokens + suffix_tokens) / page_size)``.

    Args:
        preset, cp_size, tokens: as :func:`capacity` (``tokens``: the replicated pool that sets the budget).
        prefix_tokens: tokens of the shared prefix (>= 0).
        suffix_tokens: tokens each request adds (>= 1).
    """
    check_int("prefix_tokens", prefix_tokens, min_value=0)
    check_int("suffix_tokens", suffix_tokens, min_value=1)
    geo = _geometry(preset)
    pools = capacity(geo, cp_size=cp_size, tokens=tokens, max_request_tokens=prefix_tokens + suffix_tokens)
    ps = pools.page_size
    shared = prefix_tokens // ps
    private = cdiv(prefix_tokens % ps + suffix_tokens, ps)
    per_request = cdiv(prefix_tokens + suffix_tokens, ps)

    def fit(pool_pages: int, with_cache: bool) -> int:
        if not with_cache:
            return pool_pages // per_request
        return 0 if pool_pages < shared + private else (pool_pages - shared) // private

    replicated_pages = cdiv(tokens, ps)  # the replicated pool of the budget
    return SharedPrefixReport(
        pools=pools,
        prefix_tokens=prefix_tokens,
        suffix_tokens=suffix_tokens,
        shared_pages=shared,
        private_pages=private,
        pages_per_request=per_request,
        requests_replicated=fit(replicated_pages, False),
        requests_replicated_shared=fit(replicated_pages, True),
        requests_sharded=fit(pools.sharded_pages, False),
        requests_sharded_shared=fit(pools.sharded_pages, True),
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dtkv.capacity",
        description=__doc__.split("\n\n")[0],
        epilog="Sizes are computed on meta tensors: nothing is allocated. Output: GiB per rank, or --json (bytes).",
    )
    names = sorted(PRESETS) + sorted(PRESET_ALIASES)
    p.add_argument(
        "--preset",
        default="glm5",
        choices=names,
        metavar="MODEL",
        help=f"model geometry: {', '.join(sorted(PRESETS))} (deprecated aliases: "
        f"{', '.join(f'{k} = {v}' for k, v in sorted(PRESET_ALIASES.items()))}; default glm5)",
    )
    p.add_argument("--cp", type=int, default=8, metavar="N", help="CP group size, ranks (default 8)")
    p.add_argument("--cp-size", type=int, default=None, metavar="N", help="deprecated alias of --cp")
    p.add_argument(
        "--tokens",
        type=int,
        default=1 << 20,
        help="per-rank KV budget, in tokens: each rank gets the bytes a replicated pool of this many tokens needs "
        "(not a context length; default 1048576)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="longest request the materialization scratch is sized for, tokens (default: --tokens)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (sizes in bytes)")
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=None,
        help="shared-prefix scenario: tokens every request shares (default: off)",
    )
    p.add_argument(
        "--suffix-tokens",
        type=int,
        default=4096,
        help="shared-prefix scenario: tokens each request adds (default 4096)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m dtkv.capacity``: see ``--help``."""
    from dtkv._log import setup_cli_logging

    setup_cli_logging()
    args = _parser().parse_args(argv)
    log = logging.getLogger("dtkv.capacity")  # not __name__: that is "__main__" under python -m
    if args.cp_size is not None:
        log.warning("--cp-size is deprecated and will be removed in the next release; use --cp")
        args.cp = args.cp_size
    if args.preset in PRESET_ALIASES:
        log.warning("--preset %s is deprecated; use --preset %s", args.preset, PRESET_ALIASES[args.preset])
        args.preset = PRESET_ALIASES[args.preset]
    if args.shared_prefix_tokens is not None:
        return _shared_prefix_main(args)
    rep = capacity(args.preset, cp_size=args.cp, tokens=args.tokens, max_request_tokens=args.max_request_tokens)
    if args.json:
        print(json.dumps(rep.to_json()))
        return 0
    gib = 1 << 30
    print(f"preset {rep.preset}: {rep.num_layers} layers, page {rep.page_size}, cp {rep.cp_size}")
    print(f"  per-rank budget (replicated pool of {rep.tokens} tokens): {rep.kv_bytes_replicated / gib:9.2f} GiB")
    print(
        f"  materialization scratch (<= {rep.max_request_tokens} tokens):  {rep.scratch_bytes_per_rank / gib:9.2f} GiB"
    )
    print(f"  sharded pool per rank:                        {rep.kv_bytes_per_rank / gib:9.2f} GiB")
    print(f"  logical tokens held: {rep.sharded_tokens} -> capacity multiplier {rep.capacity_multiplier:.3f}x")
    return 0


def _shared_prefix_main(args: argparse.Namespace) -> int:
    rep = shared_prefix_capacity(
        args.preset,
        cp_size=args.cp,
        tokens=args.tokens,
        prefix_tokens=args.shared_prefix_tokens,
        suffix_tokens=args.suffix_tokens,
    )
    if args.json:
        print(json.dumps(rep.to_json()))
        return 0
    p = rep.pools
    print(f"preset {p.preset}: {p.num_layers} layers, page {p.page_size}, cp {p.cp_size}, budget {p.tokens} tokens")
    print(f"  requests of {rep.prefix_tokens} shared + {rep.suffix_tokens} own tokens:")
    print(f"  pages per request: {rep.pages_per_request} alone, {rep.private_pages} + {rep.shared_pages} shared once")
    print(f"  {'':24}{'no prefix cache':>16}{'prefix cache':>14}")
    print(f"  {'replicated pool':24}{rep.requests_replicated:>16}{rep.requests_replicated_shared:>14}")
    print(f"  {'sharded pools':24}{rep.requests_sharded:>16}{rep.requests_sharded_shared:>14}")
    print(f"  sharded + prefix cache vs replicated without: {rep.multiplier:.2f}x the concurrent requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
