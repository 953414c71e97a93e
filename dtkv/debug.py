"""``DTKV_DEBUG`` checks that need the whole CP group: every rank learns every rank's verdict, so a fault on one
rank raises the same error on all of them instead of leaving the others blocked in the next collective.

These checks synchronize (host reads and a collective); they run only when :func:`dtkv.debug_enabled` is True,
in eager code. Never leave ``DTKV_DEBUG`` on for measurements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_rows
from dtkv.ownership import PageOwnership

__all__ = ["OwnershipError", "check_write_ownership"]


class OwnershipError(ValueError):
    """A rank was about to write a page that another rank stores."""


def check_write_ownership(
    locs: torch.Tensor,
    ownership: PageOwnership,
    rank: int,
    page_size: int,
    group: dist.ProcessGroup | None,
    *,
    what: str,
) -> None:
    """Raise :class:`OwnershipError` on every rank if any rank's ``locs`` touch a page it does not own.

    Collective over ``group`` (every rank must call it, also with no rows).

    Args:
        locs: int ``[n]`` logical token locations this rank is about to write (``-1`` ignored).
        ownership, rank, page_size: the page map, this rank and the tokens per page.
        group: the CP group; ``None`` checks this process only.
        what: names the write in the message (e.g. ``"direct write of 'kv', layer 3"``).
    """
    locs = locs.detach().to("cpu", torch.int64).flatten()
    pages = torch.where(locs >= 0, locs // page_size, torch.full_like(locs, -1))
    owners = ownership.owner(pages)
    bad = (locs >= 0) & (owners != rank)
    mine = torch.tensor([0, -1, -1, -1], dtype=torch.int64)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        mine = torch.tensor([1, int(locs[i]), int(pages[i]), int(owners[i])], dtype=torch.int64)
    verdicts = mine[None] if group is None else all_gather_rows(mine[None], group)
    faulty = torch.nonzero(verdicts[:, 0]).flatten().tolist()
    if not faulty:
        return
    r = faulty[0] if group is not None else rank
    _, loc, page, owner = (int(v) for v in verdicts[faulty[0]])
    raise OwnershipError(
        f"DTKV_DEBUG: {what}: rank {r} would write token location {loc} in logical page {page}, which is owned by "
        f"rank {owner}, not by rank {r} (ranks at fault: {faulty if group is not None else [rank]}); "
        "a direct write may only target the writer's own pages"
    )
