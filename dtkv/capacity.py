"""Capacity planning without allocation: GiB per rank of replicated vs sharded KV, and the view's scratch.

The question most people ask -- *model M at cp N with a context of T tokens: how much KV does each rank hold,
replicated or sharded?* -- is :func:`context_capacity` (``dtkv capacity --model glm5 --cp 8 --context 1048576``):
the replicated pool holds every page on every rank, the sharded pools ``1 / cp`` of them, and full-view
materialization adds its scratch (the per-layer view of the largest request, double-buffered for layer-ahead
prefetch, plus the pack buffer). Models: the presets (:data:`PRESETS`; the names people type, ``glm-5`` or
``deepseek-v3.2``, are accepted) or any DSA ``config.json`` (:func:`geometry_from_config`).

Two more questions, for a fixed per-rank budget: :func:`capacity` (``--tokens B``: each rank has the bytes of a
replicated pool of ``B`` tokens; how many logical tokens do the sharded pools hold in the same bytes, after the
scratch?) and the shared-prefix scenario (:func:`shared_prefix_capacity`, ``--shared-prefix-tokens P
--suffix-tokens S``): many concurrent requests that start with the same prefix and each add their own suffix;
with a prefix cache (:class:`dtkv.PrefixCache`) the prefix's full pages are stored once and counted once, each
request storing only its suffix and the prefix's partial last page.

Everything is arithmetic on plain ints and meta tensors: this module imports no kernels, no Triton and no
materializer. The command line is :mod:`dtkv._capacity_cli` (``dtkv capacity --help``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass

from dtkv._checks import check_int
from dtkv._names import canonical_name
from dtkv._scratch import scratch_bytes
from dtkv._util import cdiv
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout, total_page_bytes
from dtkv.ownership import PageOwnership
from dtkv.pool import ShardedKVPool

__all__ = [
    "PRESETS",
    "CapacityReport",
    "ContextReport",
    "ModelGeometry",
    "SharedPrefixReport",
    "capacity",
    "context_capacity",
    "geometry_from_config",
    "main",
    "preset_name",
    "shared_prefix_capacity",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelGeometry:
    """The KV geometry of a model: layers and stored layouts."""

    name: str
    """Preset name (or, for a ``config.json``, its path)."""
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
        return total_page_bytes(lay for _, lay in self.layouts)


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


def preset_name(text: str) -> str | None:
    """The :data:`PRESETS` key that ``text`` spells (``"GLM-5"``, ``"deepseek-v3.2"``), or ``None``."""
    return canonical_name(text, PRESETS)


def _geometry(preset: str | ModelGeometry) -> ModelGeometry:
    if isinstance(preset, str):
        preset = preset_name(preset) or preset
    geo = PRESETS[preset] if isinstance(preset, str) and preset in PRESETS else preset
    if not isinstance(geo, ModelGeometry):
        raise ValueError(f"preset must be one of {sorted(PRESETS)} or a ModelGeometry, got preset={preset!r}")
    return geo


_CONFIG_KEYS = ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim")


def geometry_from_config(path: str | os.PathLike, *, kv_dtype: str = "fp8", page_size: int = 64) -> ModelGeometry:
    """The KV geometry of a DSA model from its ``config.json`` (a file, or the directory holding it).

    Reads ``num_hidden_layers`` (each layer holds KV), ``kv_lora_rank``, ``qk_rope_head_dim`` and
    ``index_head_dim``. ``kv_dtype="fp8"``: :class:`MLAFp8Layout` rows (e4m3 latent, an fp32 scale per 128 dims,
    bf16 rope) and the :class:`IndexerFp8Layout` page; ``"bf16"``: bf16 :class:`MLALatentLayout` rows and the same
    fp8 indexer page (as the ``deepseek-v32-bf16`` preset).

    Raises:
        ValueError: the file is missing or unreadable, not a JSON object, or lacks one of the keys (a model
            without MLA and an indexer is not a DSA model); ``kv_dtype`` or ``page_size`` is out of range.
    """
    if kv_dtype not in ("fp8", "bf16"):
        raise ValueError(f"kv_dtype must be 'fp8' or 'bf16', got kv_dtype={kv_dtype!r}")
    check_int("page_size", page_size, min_value=1)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"config must be a readable config.json (or a directory holding one), got {file}: {e}"
        ) from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config {file} must hold a JSON object, got a {type(cfg).__name__}")
    bad = [k for k in _CONFIG_KEYS if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int) or cfg[k] < 1]
    if bad:
        raise ValueError(
            f"config {file} must give {', '.join(_CONFIG_KEYS)} as positive ints (a DSA model: MLA latent KV and an "
            f"indexer), got {', '.join(f'{k}={cfg.get(k)!r}' for k in bad)}"
        )
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    index = IndexerFp8Layout(page_size=page_size, head_dim=cfg["index_head_dim"])
    if kv_dtype == "fp8":
        kv: KVLayout = MLAFp8Layout(
            page_size=page_size, kv_lora_rank=rank, rope_dim=rope, quant_block=math.gcd(128, rank)
        )
    else:
        kv = MLALatentLayout(page_size=page_size, kv_lora_rank=rank, rope_dim=rope)
    return ModelGeometry(name=file, num_layers=cfg["num_hidden_layers"], layouts=(("kv", kv), ("index", index)))


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextReport:
    """What :func:`context_capacity` measured: bytes per rank for one context (sizes in bytes, counts in tokens)."""

    model: str
    """The preset's name, or the ``config.json`` path."""
    num_layers: int
    page_size: int
    cp_size: int
    """CP group size."""
    context_tokens: int
    """Tokens of KV the CP group holds (one request's context, or several requests' together)."""
    max_request_tokens: int
    """The longest request the view's scratch is sized for."""
    replicated_bytes_per_rank: int
    """Replicated KV: every page of the context on every rank."""
    sharded_bytes_per_rank: int
    """Sharded KV: the pages one rank owns (the most any rank owns)."""
    scratch_bytes_per_rank: int
    """The view's scratch: two layers of full view of the longest request (layer-ahead prefetch) plus the pack
    buffer."""

    @property
    def sharded_total_bytes_per_rank(self) -> int:
        """Sharded KV plus the view's scratch: what a rank needs instead of :attr:`replicated_bytes_per_rank`."""
        return self.sharded_bytes_per_rank + self.scratch_bytes_per_rank

    def to_json(self) -> dict[str, object]:
        """The report as a JSON-able dict (``--json``): one key per quantity, sizes in bytes."""
        out = asdict(self)
        out["sharded_total_bytes_per_rank"] = self.sharded_total_bytes_per_rank
        return out


def context_capacity(
    preset: str | ModelGeometry = "glm5", *, cp_size: int, context_tokens: int, max_request_tokens: int | None = None
) -> ContextReport:
    """Bytes per rank of ``context_tokens`` tokens of KV, replicated vs sharded over ``cp_size`` ranks, and the
    view's scratch (pure arithmetic).

    Args:
        preset: a key of :data:`PRESETS` (as :func:`preset_name` reads it), or a :class:`ModelGeometry` (e.g.
            from :func:`geometry_from_config`).
        cp_size: CP group size (>= 1).
        context_tokens: tokens of KV held (>= 1).
        max_request_tokens: the longest request the scratch must materialize (default and at most
            ``context_tokens``).
    """
    geo = _geometry(preset)
    check_int("cp_size", cp_size, min_value=1)
    check_int("context_tokens", context_tokens, min_value=1)
    max_req = (
        context_tokens
        if max_request_tokens is None
        else check_int("max_request_tokens", max_request_tokens, min_value=1)
    )
    max_req = min(max_req, context_tokens)
    ps, per_page = geo.page_size, geo.num_layers * geo.page_bytes_per_layer
    own = PageOwnership(cp_size, cdiv(context_tokens, ps))
    most = max(own.num_local_pages(r) for r in range(cp_size))
    return ContextReport(
        model=geo.name,
        num_layers=geo.num_layers,
        page_size=ps,
        cp_size=cp_size,
        context_tokens=context_tokens,
        max_request_tokens=max_req,
        replicated_bytes_per_rank=own.num_pages * per_page,
        sharded_bytes_per_rank=most * per_page,
        scratch_bytes_per_rank=scratch_bytes(dict(geo.layouts), max_pages=cdiv(max_req, ps), cp=cp_size, prefetch=True),
    )


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
    def scratch_takes_the_budget(self) -> bool:
        """True when the view's scratch leaves no room for a single page (the multiplier is 0)."""
        return self.sharded_pages == 0

    def to_json(self) -> dict[str, object]:
        """The report as a JSON-able dict (what ``--tokens ... --json`` prints): one key per quantity."""
        return asdict(self)


def capacity(
    preset: str | ModelGeometry = "glm5",
    *,
    cp_size: int,
    tokens: int,
    max_request_tokens: int | None = None,
) -> CapacityReport:
    """Per-rank bytes and capacity multiplier of sharded vs replicated KV, computed on meta tensors.

    Args:
        preset: a key of :data:`PRESETS` (as :func:`preset_name` reads it) or a :class:`ModelGeometry`.
        cp_size: CP group size (>= 1).
        tokens: the per-rank budget, in tokens: each rank has the bytes of a replicated pool of ``tokens``
            tokens (every rank holding every page), which the sharded pools then fill.
        max_request_tokens: the longest request the scratch must materialize (default ``tokens``).
    """
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


if __name__ == "__main__":  # python -m dtkv.capacity: the command line (dtkv._capacity_cli) runs, not this module
    from dtkv._capacity_cli import main

    sys.exit(main())
