"""``dtkv._agree``: a collective step returns on every rank or raises the same error on every rank, in seconds."""

from __future__ import annotations

import time

import pytest

from dtkv._agree import MAX_PAYLOAD_BYTES, ConfigMismatchError, agree, agreement, digest_of, register_error
from dtkv.allocator import AllocationError


class PlanDigestError(RuntimeError):
    """A test-only error type, registered by the ranks that use it."""


def _agree_worker(rank, world, case):
    import torch.distributed as dist

    group = dist.group.WORLD
    if case == "ok":
        agree(None, group, what="step", value={"a": 1, "b": [1, 2]})
        with agreement(group, what="step") as a:
            a.value = b"same digest"
        return "returned"
    if case == "one_fails":
        err = ValueError(f"num_layers must be an int >= 1, got num_layers={rank - 1}") if rank == 1 else None
        agree(err, group, what="ShardedKVPool", value={"x": 1})
    if case == "several_fail":
        with agreement(group, what="plan") as a:
            if rank == 0:
                raise TypeError("pages must be an integer tensor, got pages.dtype=torch.float32")
            if rank >= 2:
                raise KeyError("name must be one of ['kv'], got name='v'")
            a.value = 3
    if case == "all_fail_same":
        with agreement(group, what="ShardedKVPool"):
            raise ValueError("layouts must name at least one KVLayout, got an empty mapping")
    if case == "unregistered_type":
        with agreement(group, what="step"):
            if rank == world - 1:
                raise ZeroDivisionError("division by zero")
    if case == "registered_type":
        register_error(PlanDigestError)
        with agreement(group, what="step"):
            if rank == 0:
                raise PlanDigestError("plan 3 is stale")
    if case == "allocation_error":
        with agreement(group, what="step"):
            if rank == world - 1:
                raise AllocationError("alloc_balanced(n=9) needs 9 free pages, only 3 are free")
    if case == "long_message":
        with agreement(group, what="step"):
            if rank == 0:
                raise ValueError("x" * (3 * MAX_PAYLOAD_BYTES))
    if case == "config_mismatch":
        agree(None, group, what="pool", value={"cp_size": world, "num_pages": 12 + (rank == world - 1) * 4})
    if case == "unserializable":
        value = {"ok": 1}
        if rank == 0:
            value["self"] = value  # json cannot encode a cycle: a local failure, not a skipped collective
        agree(None, group, what="step", value=value)
    if case == "malformed_length":
        import dtkv._agree as mod

        if rank == 1:  # fault injection: this rank announces an absurd payload length in its header
            real = mod._all_gather_bytes

            def lying(data, size, group_, world_):
                if size == mod._HEADER_BYTES:
                    data = data[:8] + (2**62).to_bytes(8, "little") + data[16:]
                return real(data, size, group_, world_)

            mod._all_gather_bytes = lying
        try:
            with agreement(group, what="step"):
                if rank == 1:
                    raise ValueError("bad")
        finally:
            if rank == 1:
                mod._all_gather_bytes = real
    if case == "digest_mismatch":
        register_error(PlanDigestError)
        plan = b"pages 1 2 3" if rank == 0 else b"pages 1 2 4"
        agree(None, group, what="materialization plan", value=digest_of(plan), mismatch_error=PlanDigestError)
    return "returned"


def _ready(rank, world):
    return rank


def _run(ranks, case):
    ranks.run(_ready)  # spawn the ranks first: the timing covers the agreement only
    t0 = time.perf_counter()
    out = ranks.run(_agree_worker, case, return_exceptions=True)
    return out, time.perf_counter() - t0


@pytest.mark.multirank
def test_agreeing_ranks_all_return(ranks):
    out, _ = _run(ranks, "ok")
    assert out == ["returned"] * len(out)


@pytest.mark.multirank
def test_one_rank_error_is_raised_on_every_rank_within_seconds(ranks):
    out, seconds = _run(ranks, "one_fails")
    world = len(out)
    assert all(type(e) is ValueError for e in out), out
    assert {str(e) for e in out} == {
        f"ShardedKVPool failed on 1 of {world} ranks; rank 1: ValueError: num_layers must be an int >= 1, got num_layers=0"
    }
    assert seconds < 10


@pytest.mark.multirank
def test_several_failures_are_listed_and_the_first_type_wins(ranks4):
    out, seconds = _run(ranks4, "several_fail")
    assert all(type(e) is TypeError for e in out), out
    assert len({str(e) for e in out}) == 1
    assert str(out[0]) == (
        "plan failed on 3 of 4 ranks; rank 0: TypeError: pages must be an integer tensor, got "
        "pages.dtype=torch.float32; ranks 2, 3: KeyError: name must be one of ['kv'], got name='v'"
    )
    assert seconds < 10


@pytest.mark.multirank
def test_same_error_everywhere_is_stated_once(ranks3):
    out, _ = _run(ranks3, "all_fail_same")
    assert all(type(e) is ValueError for e in out)
    assert {str(e) for e in out} == {
        "ShardedKVPool failed on every rank: layouts must name at least one KVLayout, got an empty mapping"
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    "case,kind", [("unregistered_type", RuntimeError), ("allocation_error", AllocationError)], ids=["other", "dtkv"]
)
def test_error_types(ranks2, case, kind):
    out, _ = _run(ranks2, case)
    assert all(type(e) is kind for e in out), out
    assert len({str(e) for e in out}) == 1


@pytest.mark.multirank
def test_registered_error_type_is_kept(ranks2):
    out, _ = _run(ranks2, "registered_type")
    assert all(type(e).__name__ == "PlanDigestError" for e in out), out
    assert str(out[1]) == "step failed on 1 of 2 ranks; rank 0: PlanDigestError: plan 3 is stale"


@pytest.mark.multirank
def test_long_messages_are_cut_to_the_bound(ranks2):
    out, _ = _run(ranks2, "long_message")
    assert all(type(e) is ValueError for e in out)
    assert str(out[0]) == str(out[1]) and str(out[0]).endswith("... [cut]")
    assert len(str(out[0])) < MAX_PAYLOAD_BYTES + 100


@pytest.mark.multirank
def test_a_value_that_cannot_be_serialized_fails_every_rank(ranks2):
    out, _ = _run(ranks2, "unserializable")
    assert all(type(e) is ValueError for e in out), out
    assert {str(e) for e in out} == {"step failed on 1 of 2 ranks; rank 0: ValueError: Circular reference detected"}


@pytest.mark.multirank
def test_an_absurd_announced_length_is_bounded(ranks2):
    """Fault injection: a header announcing 2**62 payload bytes makes no rank allocate more than the bound."""
    out, seconds = _run(ranks2, "malformed_length")
    assert all(type(e) is ValueError for e in out), out
    assert {str(e) for e in out} == {"step failed on 1 of 2 ranks; rank 1: ValueError: bad"}
    assert seconds < 10


@pytest.mark.multirank
def test_config_mismatch_names_the_field(ranks):
    out, _ = _run(ranks, "config_mismatch")
    world = len(out)
    assert all(type(e) is ConfigMismatchError for e in out)
    per_rank = ", ".join(f"rank {r}: {16 if r == world - 1 else 12}" for r in range(world))
    assert {str(e) for e in out} == {
        f"CP ranks disagree on the pool configuration: field 'num_pages' differs ({per_rank})"
    }


@pytest.mark.multirank
def test_digest_mismatch_raises_the_given_error_on_every_rank(ranks2):
    out, _ = _run(ranks2, "digest_mismatch")
    assert all(type(e).__name__ == "PlanDigestError" for e in out), out
    a, b = digest_of(b"pages 1 2 3").hex()[:16], digest_of(b"pages 1 2 4").hex()[:16]
    assert {str(e) for e in out} == {
        f"CP ranks disagree on the materialization plan: digests differ (rank 0: {a}, rank 1: {b})"
    }


def test_single_process_reraises_the_original_error():
    err = ValueError("bad")
    with pytest.raises(ValueError) as info:
        agree(err, None, what="step")
    assert info.value is err
    agree(None, None, what="step", value={"anything": 1})
    with pytest.raises(KeyError):
        with agreement(None, what="step"):
            raise KeyError("k")


def test_base_exceptions_are_never_swallowed():
    with pytest.raises(KeyboardInterrupt):
        agree(KeyboardInterrupt(), None, what="step")


def test_register_error_rejects_non_exceptions():
    with pytest.raises(TypeError, match="must be an Exception subclass"):
        register_error(int)


def _async_input_worker(rank, world):
    import torch.distributed as dist

    import dtkv._agree as mod

    seen = []
    real = mod.all_gather_into

    def spy(out, inp, group, async_op=False):
        seen.append(inp.untyped_storage().resizable())  # a storage torch owns (a Python buffer's is not resizable)
        return real(out, inp, group, async_op=async_op)

    mod.all_gather_into = spy
    try:
        mod.agree_async(None, dist.group.WORLD, what="step", value={"a": rank % 1}).wait()
    finally:
        mod.all_gather_into = real
    return seen


def test_the_async_header_owns_its_bytes(ranks2):
    """The header all-gather runs on the backend's thread and may release its input there: the input owns its
    storage (not a view of a Python ``bytearray``, whose release needs the GIL)."""
    assert ranks2.run(_async_input_worker) == [[True], [True]]
