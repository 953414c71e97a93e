"""Startup agreement check: every rank of a CP group must build the same pool.

Each rank hashes a canonical description of its configuration; the digests are all-gathered (one fixed-size
collective, so a mismatch can never hang). On a mismatch the full descriptions are exchanged and every rank
raises the same :class:`ConfigMismatchError`, naming the first differing field and each rank's value.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_into

__all__ = ["ConfigMismatchError", "check_agreement"]


class ConfigMismatchError(RuntimeError):
    """Ranks of one CP group disagree on the pool configuration."""


def _canonical(config: dict[str, object]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for k in sorted(value):
            _flatten(f"{prefix}.{k}" if prefix else str(k), value[k], out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(f"{prefix}[{i}]", v, out)
        out[f"{prefix}.len"] = len(value)
    else:
        out[prefix] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def check_agreement(config: dict[str, object], group: dist.ProcessGroup | None, *, what: str = "pool") -> None:
    """Raise :class:`ConfigMismatchError` on every rank unless all ranks of ``group`` pass equal ``config``.

    Collective over ``group``: every rank must call it. ``group=None`` (single process) is a no-op.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    digest = hashlib.sha256(_canonical(config).encode()).digest()
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    all_gather_into(gathered, mine, group)
    rows = gathered.view(world, -1).cpu()
    if bool((rows == rows[0]).all()):
        return
    configs: list[object] = [None] * world
    dist.all_gather_object(configs, config, group=group)
    flat = []
    for c in configs:
        f: dict[str, object] = {}
        _flatten("", c, f)
        flat.append(f)
    keys = sorted(set().union(*flat))
    for key in keys:
        values = [f.get(key, "<missing>") for f in flat]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ConfigMismatchError(
                f"CP ranks disagree on the {what} configuration: field {key!r} differs ({per_rank})"
            )
    raise ConfigMismatchError(f"CP ranks disagree on the {what} configuration (digests differ)")
