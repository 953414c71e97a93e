"""The backend contract: index preparation plus a kernel call, one contract for every backend.

Legend: ``N`` query rows, ``H`` heads per rank, ``C = R + E`` query/key dims, ``R`` latent dims (``kv_lora_rank``),
``E`` rope dims, ``P`` pages of the KV read, ``S`` page size, ``W`` index width (a multiple of
:attr:`AttentionBackend.index_multiple`), ``K`` selected keys per query.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dtkv import _env, ops
from dtkv._checks import check_int, check_tensor
from dtkv._util import cdiv
from dtkv.attention._spec import AttentionFitError, AttentionSpec

__all__ = ["AttentionBackend", "DecodeSchedule"]


@dataclass(eq=False)
class DecodeSchedule:
    """What a backend keeps per decode batch shape (plan phase; from :meth:`AttentionBackend.plan_decode`).

    Reuse one schedule for every layer and step of that shape (FlashMLA: its tile-scheduler metadata, built on the
    device by the first call and reused after). Warm it up (one eager :meth:`AttentionBackend.decode`) before
    capturing a CUDA graph.
    """

    backend: str
    """Name of the backend that planned it."""
    num_queries: int
    """``N``: query rows of every call."""
    width: int
    """``W``: index width of every call."""
    merge_lse: bool = True
    """``lse`` is for merging partials: an empty query's is ``-inf`` (FlashMLA's ``+inf`` rewritten, one elementwise
    launch). ``False`` (decode whose ``lse`` nobody merges: a full view, a replicated pool) skips the rewrite; an empty
    query's ``lse`` is then whatever the kernel returns (FlashMLA: ``+inf``), ``out`` is 0 either way."""
    state: dict[str, Any] = field(default_factory=dict)
    """Backend-private (FlashMLA: ``"meta"``, its ``FlashMLASchedMeta``)."""

    @property
    def ready(self) -> bool:
        """True once a call has built what the backend needs on the device (always, for torch and Triton)."""
        return bool(self.state.get("ready", self.backend != "flashmla"))


class AttentionBackend(ABC):
    """One sparse-MLA backend bound to one :class:`AttentionSpec` (see :mod:`dtkv.attention`).

    Every backend has the same two run entry points, :meth:`prefill` and :meth:`decode`: queries ``q [N, H, C]``,
    the pages a view, a replicated pool or a rank's own shard holds (``kv [P, S, *row]`` in ``spec.layout``'s format)
    and int32 token slots ``indices [N, W]`` into them (``-1`` skipped), returning ``(out [N, H, R], lse [N, H])``:
    softmax-weighted latent rows and the natural-log log-sum-exp of the scaled logits. A query with no valid index
    gets ``out = 0`` and ``lse = -inf`` on every backend, so it weighs nothing in
    :func:`dtkv.decode.combine_partials` / :func:`dtkv.decode.merge_partials`.

    Attributes:
        spec: the geometry the backend was checked against.
        device: where it runs.
        reason: why this backend was chosen (the resolver's verdict; see :func:`dtkv.attention.resolve_attention`).
    """

    name: ClassVar[str] = "abstract"
    index_multiple: int = 1
    """Index widths must be a multiple of this (FlashMLA: 64)."""

    def __init__(self, spec: AttentionSpec, device: torch.device | str, *, reason: str = "") -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        self.spec, self.device, self.reason = spec, torch.device(device), reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, spec={self.spec!r}, device={str(self.device)!r})"

    def cast_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` in a dtype this backend takes (FlashMLA: bf16; Triton: float64 as float32; torch: as is)."""
        return q

    # ------------------------------------------------------------------------------------------ indices (run)
    def index_width(self, topk: int) -> int:
        """Index width for ``topk`` keys: the next multiple of :attr:`index_multiple`."""
        check_int("topk", topk, min_value=0)
        return cdiv(max(topk, 1), self.index_multiple) * self.index_multiple

    def indices(
        self,
        locs: torch.Tensor,
        kv: torch.Tensor,
        *,
        page_map: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int32 token slots ``[N, W]`` into ``kv`` from logical token locations (run phase: one launch, no sync).

        Args:
            locs: int32/int64 ``[N, K]`` logical token locations (:mod:`dtkv.page_table`), ``-1`` padding; slots of
                ``kv`` already when ``page_map`` is None (a pool read directly).
            kv: the pages ``[P, S, *row]`` the kernel will read: bounds every slot (``< P * S``).
            page_map: int32/int64 ``[num_pages]`` logical page -> page of ``kv``: a view's
                ``MaterializePlan.page_map``, or :func:`dtkv.attention.owned_page_map` for a rank's own pages.
            page_table: int32/int64 ``[N, M]`` each query's request pages (``-1`` padded): ``locs`` are then key
                positions in the request (an indexer's top-k), turned into locations in the same launch; a
                rank-local table (its local page where it owns the slot's page, else ``-1``, such as
                :attr:`dtkv.decode.DecodePlan.slot_local_page`) gives own-page slots directly.

        Returns:
            ``dtkv.ops.sparse_indices(...)``: ``W = index_width(K)``, ``-1`` preserved and padded.
        """
        check_tensor("locs", locs, dtype=(torch.int32, torch.int64), ndim=2, device=kv.device)
        page_size = kv.shape[1] if kv.dim() >= 2 else 1
        return ops.sparse_indices(
            locs,
            num_slots=kv.shape[0] * page_size,
            page_map=page_map,
            page_size=page_size,
            width=self.index_width(locs.shape[1]),
            page_table=page_table,
        )

    # ------------------------------------------------------------------------------------------ plan
    def plan_decode(self, num_queries: int, width: int, *, merge_lse: bool = True) -> DecodeSchedule:
        """A :class:`DecodeSchedule` for decode calls of ``num_queries`` rows and index width ``width`` (plan).

        ``merge_lse=False`` for decode whose ``lse`` is not merged (see :attr:`DecodeSchedule.merge_lse`).
        """
        check_int("num_queries", num_queries, min_value=0)
        check_int("width", width, min_value=1)
        self._check_width(width)
        return DecodeSchedule(backend=self.name, num_queries=num_queries, width=width, merge_lse=bool(merge_lse))

    # ------------------------------------------------------------------------------------------ run
    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse attention of ``N`` queries over the rows a view or replicated pool holds (run phase, eager).

        Args:
            q: ``[N, H, C]``: the absorbed latent query then the rope query (FlashMLA: bf16).
            kv: ``[P, S, *row]`` pages in ``spec.layout``'s format (pages contiguous).
            indices: int32 ``[N, W]`` token slots ``page * S + offset`` into ``kv`` (``-1`` skipped), e.g. from
                :meth:`indices`; every entry is ``-1`` or below ``P * S``.
            softmax_scale: multiplies the logits.

        Returns:
            ``(out [N, H, R], lse [N, H])``: see the class docstring for dtypes and empty queries.
        """
        self._check(q, kv, indices)
        return self._run(q, kv, indices, float(softmax_scale), None, decode=False)

    def decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        *,
        softmax_scale: float,
        schedule: DecodeSchedule | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse attention of ``N`` decode queries over fp8 (or latent) pages (run phase; CUDA-graph capturable).

        The pages may be a view, a replicated pool, or a rank's own pages in sharded decode: pass the slots of the
        selected rows it owns and ``-1`` for the others (:func:`dtkv.attention.owned_page_map`), then merge the
        ranks' ``(out, lse)`` with :func:`dtkv.decode.merge_partials`. Arguments as :meth:`prefill`, plus:

        Args:
            schedule: from :meth:`plan_decode` for this ``N`` and ``W`` (required to capture FlashMLA: warm it up
                with one eager call first; without it each call plans afresh).
        """
        self._check(q, kv, indices)
        if schedule is not None:
            if schedule.backend != self.name or (schedule.num_queries, schedule.width) != tuple(indices.shape):
                raise ValueError(
                    f"schedule was planned for backend {schedule.backend!r} with [N, W] = "
                    f"[{schedule.num_queries}, {schedule.width}], got backend {self.name!r} and "
                    f"indices.shape={list(indices.shape)}"
                )
            if not schedule.ready and q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "schedule is not warmed up: run one eager decode() with it before capturing a CUDA graph"
                )
        return self._run(q, kv, indices, float(softmax_scale), schedule, decode=True)

    @abstractmethod
    def _run(self, q, kv, indices, softmax_scale: float, schedule: DecodeSchedule | None, *, decode: bool):
        """The kernel call (inputs checked)."""

    # ------------------------------------------------------------------------------------------ checks
    def _check_width(self, width: int) -> None:
        if width % self.index_multiple:
            raise AttentionFitError(
                f"{self.name} needs an index width that is a multiple of {self.index_multiple} (its top-k block), "
                f"got width={width}: build indices with backend.indices(...) or "
                f"dtkv.ops.sparse_indices(..., width=backend.index_width(topk)), which pad with -1"
            )

    def _q_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32, torch.float64)

    def _check(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> None:
        """Shapes, dtypes and devices only (metadata: no sync); the slots' range under ``DTKV_DEBUG`` (syncs)."""
        spec, lay = self.spec, self.spec.layout
        check_tensor("q", q, dtype=self._q_dtypes(), shape=(None, spec.num_heads, spec.head_dim))
        check_tensor("kv", kv, dtype=lay.dtype, shape=(None, *lay.page_shape), device=q.device)
        check_tensor("indices", indices, dtype=(torch.int32, torch.int64), shape=(q.shape[0], None), device=q.device)
        if q.device.type == "cuda" and (kv.device != q.device or indices.device != q.device):
            raise ValueError(f"q, kv and indices must be on one device, got {q.device}, {kv.device}, {indices.device}")
        self._check_width(indices.shape[1])
        if _env.debug_enabled() and indices.numel():
            bad = (indices < -1) | (indices >= kv.shape[0] * lay.page_size)
            if bool(bad.any()):
                raise ValueError(
                    f"indices must be -1 or token slots below P * S = {kv.shape[0] * lay.page_size}, got "
                    f"{int(indices[bad][0])} (DTKV_DEBUG check)"
                )

    def _empty(self, q: torch.Tensor, out_dtype: torch.dtype, lse_dtype: torch.dtype):
        """``(zeros [N, H, R], -inf [N, H])``: the result when no index can be valid (no query or no page)."""
        n, h = q.shape[0], q.shape[1]
        out = torch.zeros((n, h, self.spec.kv_lora_rank), dtype=out_dtype, device=q.device)
        return out, torch.full((n, h), float("-inf"), dtype=lse_dtype, device=q.device)
