"""The runtime's input rules, written once: what a prompt, a request id and a step's batch must be (plan phase).

:class:`dtkv.runtime.Runtime` (every model) and :mod:`dtkv.runtime.pd` call these before they change anything, so a
refused call leaves requests, pages, the allocator, the prefix cache and the pools as they were:

- :func:`check_prompt` (``add_request``): token ids as Python ints in ``[0, vocab_size)``, at least one, and few
  enough that their pages fit the pool at all (a prompt that can never be prefilled is refused here instead of
  holding pages forever and blocking every later ``prefill()``).
- :func:`check_rid` (``finish_request`` / ``kv_bytes``): an int naming a request of the runtime,
  live unless told otherwise.
- :func:`check_batch` (``plan_step`` / ``step`` / ``decode_step``): a non-empty batch of the runtime's own live
  requests, each once, each with an extend length in ``[1, tokens not yet computed]``.
- :func:`check_capacity`: the step's new pages fit the free pages plus the cached pages eviction could free; an
  allocation that cannot succeed is refused before any eviction or allocation.
- :func:`admit_prefill` (``prefill``): which requests a prefill step runs, so that each one it starts can finish
  its prompt (the others wait for a later step or call).
- :func:`agreed_step`: runs a step's checks on every rank and fails on every rank together
  (:func:`dtkv._agree.agree` on the CP group's CPU channel: one 48-byte all-gather per step that never waits for
  the GPU), also comparing the ranks' batches and where each request stands (:func:`batch_value`: the SPMD
  contract), so a rank that refuses its input never leaves the others waiting in the step's first collective, and
  ranks whose state diverged raise before any collective.

A step that fails after its checks (its run raised on some rank) is undone on every rank together by
:class:`dtkv.runtime._outcome.StepOutcome`.

Requests are the runtime's :class:`dtkv.runtime.Request` objects (their tokens are prompt + output).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch.distributed as dist

from dtkv._agree import agree
from dtkv._checks import check_int
from dtkv._collectives import cpu_channel
from dtkv._util import as_int_array, cdiv
from dtkv.allocator import AllocationError, PageAllocator

__all__ = [
    "admit_prefill",
    "agreed_step",
    "batch_value",
    "check_batch",
    "check_capacity",
    "check_prompt",
    "check_rid",
    "new_pages",
]

T = TypeVar("T")


def check_prompt(prompt: object, *, vocab_size: int, page_size: int, num_pages: int) -> list[int]:
    """A prompt as a list of Python ints, or an error naming the argument, the value and the rule.

    Args:
        prompt: token ids: a sequence of ints, an integer numpy array or an integer tensor (1-D); bools, floats
            and strings are refused, never truncated.
        vocab_size: ids must be in ``[0, vocab_size)``.
        page_size: tokens per page.
        num_pages: pages the allocator can ever hand out (the pool less its reserved pages).

    Raises:
        TypeError: an entry is not an int.
        ValueError: empty, an id outside the vocabulary, or more pages than ``num_pages``.
    """
    ids = as_int_array("prompt", prompt, shape_hint="[num_tokens]").tolist()
    if not ids:
        raise ValueError("prompt must hold at least one token id, got an empty prompt")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {ids[bad]} at prompt[{bad}]")
    need = cdiv(len(ids), page_size)
    if need > num_pages:
        raise ValueError(
            f"prompt must fit the pool: its {len(ids)} tokens need {need} pages of {page_size} tokens, the pool can "
            f"hand out {num_pages}; a longer prompt could never be prefilled"
        )
    return ids


def check_rid(rid: object, requests: Sequence, *, live: bool = True, finished_rule: str | None = None):
    """The request ``requests[rid]``, or an error naming ``rid`` and the rule.

    Args:
        rid: a request id (an int; not a bool).
        requests: the runtime's requests, in id order.
        live: refuse a finished (freed) request.
        finished_rule: the message for a finished request (default: "rid must name a live request ...").

    Raises:
        TypeError: ``rid`` is not an int.
        ValueError: out of range (negative ids never wrap), or finished while ``live``.
    """
    check_int("rid", rid)
    rid = cast(int, rid)
    if not 0 <= rid < len(requests):
        raise ValueError(f"rid must name a request in [0, {len(requests)}), got rid={rid}")
    req = requests[rid]
    if live and req.finished:
        raise ValueError(finished_rule or f"rid must name a live request, got rid={rid}, which is finished already")
    return req


def check_batch(requests: Sequence, reqs: object, extend_lens: object, *, decode: bool = False) -> list[int]:
    """Check one step's batch; returns the extend lengths as Python ints (nothing is changed).

    Args:
        requests: the runtime's requests, in id order.
        reqs: the step's requests: a non-empty sequence of the runtime's own live request objects, each once.
        extend_lens: per request, tokens to compute: ints in ``[1, len(tokens) - num_computed]``; ``None``: one
            token each.
        decode: the batch of a decode step (every length 1): the message for a request with no token left says
            to append one.

    Raises:
        TypeError: ``reqs`` is not a sequence, or a length is not an int (bools and floats are refused).
        ValueError: empty batch, a request not of this runtime, finished, or repeated, ``extend_lens`` of another
            length than ``reqs``, a length < 1 (a zero-length extend has no logits of its own) or past the
            request's known tokens.
    """
    if isinstance(reqs, (str, bytes)) or not isinstance(reqs, Sequence):
        raise TypeError(f"reqs must be a sequence of requests, got {type(reqs).__name__}")
    if not reqs:
        raise ValueError(
            "reqs must hold at least one request, got an empty batch (nothing to compute: skip the step; "
            "decode() with nothing to decode is a no-op)"
        )
    seen: dict[int, int] = {}
    for i, r in enumerate(reqs):
        rid = getattr(r, "rid", None)
        if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < len(requests) or requests[rid] is not r:
            raise ValueError(
                f"reqs[{i}] must be one of this runtime's requests (runtime.requests[r.rid] is r), got {r!r:.80}"
            )
        if r.finished:
            raise ValueError(
                f"reqs[{i}] must be a live request, got request {rid}, which is finished (its pages were released)"
            )
        if rid in seen:
            raise ValueError(
                f"reqs must hold each request once per step, got request {rid} at reqs[{seen[rid]}] and reqs[{i}]"
            )
        seen[rid] = i
    if extend_lens is None:
        lens = [1] * len(reqs)
    else:
        lens = as_int_array("extend_lens", extend_lens, shape_hint="[len(reqs)]").tolist()
    if len(lens) != len(reqs):
        raise ValueError(
            f"extend_lens must hold one length per request of a non-empty batch, got {len(lens)} for {len(reqs)}"
        )
    for i, (r, n) in enumerate(zip(reqs, lens)):
        known = len(r.prompt) + len(r.output)  # len(r.tokens) without building the list
        left = known - r.num_computed
        if decode and left < 1:
            raise ValueError(
                f"request {r.rid} has no token to decode (num_computed={r.num_computed}, {known} tokens): "
                "append the next token to its output first"
            )
        if not 1 <= n <= left:
            raise ValueError(
                f"extend_lens must be ints in [1, tokens not yet computed], got {n} at extend_lens[{i}] for request "
                f"{r.rid} ({r.num_computed} of {known} tokens computed)"
            )
    return lens


def new_pages(reqs: Sequence, lens: Sequence[int], page_size: int) -> int:
    """Pages a step of ``reqs`` extended by ``lens`` adds (a request's pages cover its computed tokens)."""
    return sum(max(0, cdiv(r.num_computed + n, page_size) - len(r.pages)) for r, n in zip(reqs, lens))


def check_capacity(
    reqs: Sequence,
    lens: Sequence[int],
    *,
    page_size: int,
    allocator: PageAllocator,
    evictable: Callable[[], int] | None = None,
) -> None:
    """Refuse a step whose new pages exceed the free pages plus what eviction could free (nothing changes).

    ``evictable`` (the prefix cache's :meth:`dtkv.PrefixCache.num_evictable`) is only called when the free pages
    alone fall short.

    Raises:
        AllocationError: the step cannot get its pages.
    """
    need, free = new_pages(reqs, lens, page_size), allocator.num_free()
    if need <= free:
        return
    extra = evictable() if evictable is not None else 0
    if need > free + extra:
        cached = f" and {extra} cached pages eviction could free" if evictable is not None else ""
        raise AllocationError(
            f"the step needs {need} new pages, the pool has {free} free{cached}; nothing was allocated "
            "(finish or free requests, or step fewer tokens)"
        )


def admit_prefill(
    todo: Sequence, *, page_size: int, allocator: PageAllocator, evictable: Callable[[], int] | None = None
) -> tuple[list, str]:
    """The requests a prefill step runs, so that every request it starts can finish its prompt.

    Requests under way (some of their own tokens computed) come first, then the rest in request order; each is
    admitted while the pages it still needs to finish its prompt fit beside those of the requests admitted before
    it, within the free pages plus what eviction could free (``evictable``, called only when the free pages fall
    short). Pages are taken chunk by chunk, so without this rule requests that each fit but not together took pages
    until no step could get its own, and no request could ever finish.

    Returns:
        ``(admitted in request order, why nothing was admitted)``: the reason is ``""`` when some request was.
    """
    ps = page_size
    need = {r.rid: max(0, cdiv(len(r.prompt), ps) - len(r.pages)) for r in todo}
    order = sorted(todo, key=lambda r: (r.num_computed <= getattr(r, "cached_tokens", 0), r.rid))
    free = allocator.num_free()
    extra = None
    budget, admitted = free, set()
    for r in order:
        if need[r.rid] > budget and extra is None and evictable is not None:
            extra = evictable()
            budget += extra
        if need[r.rid] <= budget:
            admitted.add(r.rid)
            budget -= need[r.rid]
    if admitted:
        return [r for r in todo if r.rid in admitted], ""
    first = order[0]
    cached = f" and {extra} cached pages eviction could free" if extra is not None else ""
    why = (
        f"no request can finish its prompt: request {first.rid} needs {need[first.rid]} more pages of {ps} tokens, "
        f"the pool has {free} free{cached}; nothing was allocated (finish requests to make room)"
    )
    return [], why


def agreed_step(
    group: dist.ProcessGroup | None, *, what: str, check: Callable[[], T], value: Callable[[T], object] | None = None
) -> T:
    """Run ``check()`` (this rank's checks of a collective call's inputs) and fail on every rank of ``group`` together.

    Collective over ``group``'s CPU channel (:func:`dtkv._collectives.cpu_channel`: one 48-byte
    all-gather that never waits for the GPU) whatever the local outcome; without a group (or with one rank) a
    local error is raised as it is. With ``value`` the ranks also compare ``value(check())`` (JSON-able: the
    batch's request ids and lengths), so inputs that differ between ranks (a broken SPMD contract) raise
    :class:`dtkv._agree.ConfigMismatchError` on every rank instead of a collective hanging or mixing rows later.

    Returns:
        ``check()``'s result.
    """
    result, error = None, None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - exchanged with the other ranks, then raised on every rank
        error = e
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return cast("T", result)
    agreed = value(cast("T", result)) if error is None and value is not None else None
    agree(error, cpu_channel(group), what=what, value=agreed)
    return cast("T", result)


def batch_value(reqs: Sequence, lens: Sequence[int], *, allocator: PageAllocator | None = None) -> dict[str, object]:
    """What the ranks of a step compare (:func:`agreed_step`): the request ids and extend lengths, and where each
    request stands (``num_computed``, its page count) -- ranks whose state diverged would otherwise step the same
    request from different positions with no error -- and, with ``allocator``, its free pages."""
    value: dict[str, object] = {
        "rids": [int(r.rid) for r in reqs],
        "extend_lens": list(lens),
        "num_computed": [int(r.num_computed) for r in reqs],
        "num_pages": [len(r.pages) for r in reqs],
    }
    if allocator is not None:
        value["free_pages"] = allocator.num_free()
    return value
