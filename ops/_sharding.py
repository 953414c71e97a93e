"""DTensor support of the ops: ``register_sharding`` rules and the wrapper-side DTensor argument handling.

A pool DTensor carries the :class:`dtkv.PageOwnership` placement (global shape ``[num_pages, ...]``, local shape
``[num_local_pages(rank), ...]``). The rules below tell DTensor to run the op on the local shards without any
redistribution: the pool keeps its placement, the other tensors are ``Replicate()`` (the full chunk every rank
sees) or ``Shard(0)`` (each rank's own piece). DTensor derives output metadata by running the fake on global
shapes, which is right for these ops because each rank's local result is its piece of the global one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dtkv.ownership import PageOwnership

from ._common import OwnershipLike, ownership_spec

__all__ = ["bound_args", "dtensor_args", "register_pool_rule", "register_rule"]


def _dtensor_api():
    if not torch.distributed.is_available():  # pragma: no cover
        return None
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # pragma: no cover
        return None
    return DTensor, Replicate, Shard, register_sharding


def _placement(kind: str):
    _, Replicate, Shard, _ = _dtensor_api()
    return Replicate() if kind == "replicate" else Shard(0)


def register_rule(op, fn) -> None:
    """``register_sharding(op)(fn)`` when DTensor is available (a no-op otherwise)."""
    api = _dtensor_api()
    if api is not None:
        api[3](op)(fn)


def bound_args(op, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of ``op`` by schema name (positional and keyword alike)."""
    names = [a.name for a in op._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def register_pool_rule(
    op,
    inputs: Mapping[str, str] | Callable[[dict[str, Any]], Mapping[str, str]],
    outputs: Sequence[str] = (),
) -> None:
    """Rule for an op whose first argument, ``pool``, is a PageOwnership-placed pool.

    Args:
        inputs: placement kind (``"replicate"`` or ``"shard0"``) of each other tensor argument, by schema name,
            or a function of the call's arguments by name (:func:`bound_args`) returning that mapping.
        outputs: placement kind of each returned tensor (empty for mutating ops that return nothing).
    """
    names = [a.name for a in op._schema.arguments]

    def rule(pool, *args, **kwargs):
        placements = tuple(pool.placements)
        if len(placements) != 1 or not isinstance(placements[0], PageOwnership):
            raise ValueError(
                f"{op} needs a pool DTensor on a 1-D mesh with a PageOwnership placement, got placements={placements}"
            )
        kinds = inputs(bound_args(op, (pool, *args), kwargs)) if callable(inputs) else inputs
        ins = [placements[0]] + [_placement(kinds[n]) if n in kinds else None for n in names[1 : len(args) + 1]]
        return [([_placement(k) for k in outputs], ins)]

    register_rule(op, rule)


def dtensor_args(
    pool: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    ownership: OwnershipLike,
    rank: int,
    kind: str,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int]:
    """Prepare a wrapper's arguments when ``pool`` is a DTensor; a no-op for plain tensors.

    Checks that the pool's placement is ``ownership``, takes ``rank`` from its mesh, and wraps the plain tensors
    in ``tensors`` as DTensors of placement ``kind`` (``"replicate"`` or ``"shard0"``) on the same mesh.
    """
    api = _dtensor_api()
    if api is None or not isinstance(pool, api[0]):
        return pool, tensors, rank
    DTensor = api[0]
    placements = tuple(pool.placements)
    if (
        len(placements) != 1
        or not isinstance(placements[0], PageOwnership)
        or ownership_spec(placements[0]) != ownership_spec(ownership)
    ):
        raise ValueError(f"pool DTensor must have placements ({ownership!r},), got placements={placements}")
    mesh = pool.device_mesh
    wrapped = tuple(
        t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [_placement(kind)], run_check=False)
        for t in tensors
    )
    return pool, wrapped, mesh.get_local_rank()
