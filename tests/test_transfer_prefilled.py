"""Handing a runtime's prefilled requests to a decode runtime (:mod:`dtkv.runtime.pd` over
:mod:`dtkv.transfer.prefilled`), the reference model and a transformers DSA model, in one process over the
``LocalEngine``. The metadata row from the prefill side is checked before it is trusted, and a send that cannot finish
sends nothing."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime
from dtkv.runtime import pd as runtime_pd
from dtkv.transfer import Bootstrap, DecodeReceiver, LocalEngine, PrefillSender, TransferError

CFG = ModelConfig(kv_dtype="fp8", page_size=4, num_layers=2)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3]]


def _runtime(adapter: str, prefilled: bool):
    if adapter == "reference":
        rt = Runtime(ReferenceAdapter(CFG), num_pages=24)
    else:
        from dtkv.integrations.transformers import TransformersAdapter
        from dtkv.integrations.transformers.reference import tiny_model

        rt = Runtime(TransformersAdapter(tiny_model("deepseek-v32", seed=0), kv_dtype="fp8", page_size=4),
                         num_pages=24)  # fmt: skip
    if prefilled:
        for p in PROMPTS:
            rt.add_request(p)
        rt.prefill(8)
    return rt


def _adapters():
    yield pytest.param("reference", id="reference-model")
    try:
        import transformers  # noqa: F401
    except ImportError:  # transformers is an optional extra
        return
    yield pytest.param("transformers", id="transformers")


def _hand_off(prefill, decode, prompts):
    """Run ``send_prefilled`` in a thread and ``receive_prefilled`` here; the receive's result or error."""
    bootstrap = Bootstrap(dist.HashStore(), namespace="prefilled")
    sender = PrefillSender(runtime_pd.shard_for(prefill), bootstrap, engine=LocalEngine(), timeout_s=10.0)
    receiver = DecodeReceiver(runtime_pd.shard_for(decode), bootstrap, engine=LocalEngine(), timeout_s=10.0)

    def send():
        try:
            runtime_pd.send_prefilled(prefill, sender, timeout_s=2.0)
        except TransferError:  # decode gave up on a request: the send of the next one times out (2 s, waited out)
            pass

    try:
        sender.connect()
        receiver.connect()
        t = threading.Thread(target=send, daemon=True)
        t.start()
        try:
            return runtime_pd.receive_prefilled(decode, receiver, prompts)
        finally:
            t.join(timeout=20)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("adapter", list(_adapters()))
def test_decode_receives_the_prompt_kv_and_first_token(adapter):
    prefill, decode = _runtime(adapter, True), _runtime(adapter, False)
    reports = _hand_off(prefill, decode, PROMPTS)
    assert len(reports) == len(PROMPTS)
    lens = [len(p) for p in PROMPTS]
    want = runtime_pd.kv_digest([prefill.kv_bytes(r.rid) for r in prefill.requests], lens)
    assert runtime_pd.kv_digest([decode.kv_bytes(r.rid) for r in decode.requests], lens) == want
    assert [r.output for r in decode.requests] == [r.output[:1] for r in prefill.requests]


@pytest.mark.parametrize("adapter", list(_adapters()))
@pytest.mark.parametrize("first", [-1, 10**6])
def test_a_first_token_outside_the_vocabulary_is_a_transfer_error(adapter, first):
    prefill, decode = _runtime(adapter, True), _runtime(adapter, False)
    prefill.requests[1].output[0] = first  # what a faulty or hostile prefill peer would send
    with pytest.raises(TransferError, match=rf"first token {first}, outside \[0, \d+\)"):
        _hand_off(prefill, decode, PROMPTS)
    bad = decode.requests[1]
    assert bad.output == [] and bad.finished and bad.pages == []  # never made ready to decode; pages held
    held = decode.transfer_held[runtime_pd.request_id(1)]
    assert len(held) == 1 and decode.allocator.refcount(held[0]) == 1


@pytest.mark.parametrize("adapter", list(_adapters()))
@pytest.mark.parametrize("how", ["another_order", "same_length"])
def test_a_prompt_that_is_not_the_prefilled_one_is_a_transfer_error(adapter, how):
    """The decode side given its prompts in another order, or another prompt of the same length, used to receive
    every request "successfully" and decode one request's KV under another prompt; the metadata row now carries
    the prompt's digest, and a mismatch fails that request like any other failed receive."""
    prefill, decode = _runtime(adapter, True), _runtime(adapter, False)
    prompts = [list(p) for p in PROMPTS]
    if how == "another_order":  # two prompts of the same length, swapped
        prefill = _runtime(adapter, False)
        for p in ([1, 2, 3], [3, 2, 1], [5]):
            prefill.add_request(p)
        prefill.prefill(8)
        prompts = [[3, 2, 1], [1, 2, 3], [5]]
        bad_rid = 0
    else:
        prompts[1] = [6, 6]
        bad_rid = 1
    with pytest.raises(TransferError, match=r"prompt digest .* is not that of the prompt given for this request"):
        _hand_off(prefill, decode, prompts)
    bad = decode.requests[bad_rid]
    assert bad.output == [] and bad.finished and bad.pages == []  # never made ready; its pages held for reclaim
    assert [r.rid for r in decode.requests if not r.finished] == list(range(bad_rid))
    assert sorted(decode.transfer_held) == [runtime_pd.request_id(bad_rid)]


def test_the_metadata_row_names_the_prompt_and_is_checked_field_by_field():
    from dtkv.transfer.prefilled import META_ROW_BYTES, meta_row, prompt_digest, read_meta

    row = meta_row([4, 5, 6], 7)
    assert len(row) == META_ROW_BYTES == 48 and row[16:] == prompt_digest([4, 5, 6]) != prompt_digest([4, 5, 7])
    assert read_meta(row, prompt=[4, 5, 6], vocab_size=8, request_id="r") == 7
    for prompt, vocab, rule in (
        ([4, 5], 8, "metadata row says 3 tokens, the prompt has 2"),
        ([4, 6, 5], 8, "prompt digest"),
        ([4, 5, 6], 7, r"first token 7, outside \[0, 7\)"),
    ):
        with pytest.raises(TransferError, match=rule):
            read_meta(row, prompt=prompt, vocab_size=vocab, request_id="r")
    with pytest.raises(TransferError, match="metadata row holds 16 bytes, expected 48"):
        read_meta(row[:16], prompt=[4, 5, 6], vocab_size=8, request_id="r")


class _RecordingSender:
    def __init__(self):
        self.sent = []

    def send_request(self, rid, pages, **kwargs):
        self.sent.append(rid)


@pytest.mark.parametrize("adapter", list(_adapters()))
def test_an_unfinished_request_is_rejected_before_anything_is_sent(adapter):
    prefill = _runtime(adapter, True)
    prefill.add_request([7, 7, 7])  # added after prefill: not computed
    sender = _RecordingSender()
    with pytest.raises(ValueError, match=r"must finish prefill before it is sent, got num_computed=0 of 3"):
        runtime_pd.send_prefilled(prefill, sender)
    assert sender.sent == []


def test_request_bytes_fits_the_largest_prompt():
    rt = _runtime("reference", False)
    spec = rt.model_spec
    per_page = spec.num_layers * sum(lay.page_bytes for lay in spec.layouts.values())
    ps = spec.page_size
    assert runtime_pd.request_bytes(rt, [2 * ps + 1, 2, ps]) == 3 * per_page
    assert runtime_pd.request_bytes(rt, []) == 0
