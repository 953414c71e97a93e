"""The metadata row of a prefilled request, checked on arrival, and a digest of stored KV bytes.

A request handed from prefill to decode (:mod:`dtkv.runtime.pd`) travels as its prompt's pages (each prefill rank
sends the pages it owns) plus one metadata row from one rank, :func:`meta_row`: ``(num_tokens, first_token,
prompt digest)`` (:data:`META_ROW_BYTES`: two little-endian int64, then :func:`prompt_digest`, the sha256 of the
prompt's token ids). The decode side checks that row before it trusts it (:func:`read_meta`): the token count must
equal the prompt's, the digest must be that of the prompt it was given for the request (a decode side given its
prompts in another order, or another prompt of the same length, would otherwise decode one request's KV under
another prompt), the first token must lie in the vocabulary. :func:`kv_digest` hashes stored KV bytes (what tests
and the demo compare across the two sides).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np
import torch

from dtkv.transfer.errors import TransferError

__all__ = ["META_ROW_BYTES", "kv_digest", "meta_row", "prompt_digest", "read_meta"]

META_ROW_BYTES = 48
"""Metadata row of a request: ``struct.pack("<qq", num_tokens, first_token) + prompt_digest(prompt)`` (16 + 32)."""


def prompt_digest(prompt: Sequence[int]) -> bytes:
    """The 32-byte identity of a prompt in the metadata row: sha256 of its token ids as little-endian int64."""
    return hashlib.sha256(np.asarray(list(prompt), dtype="<i8").tobytes()).digest()


def meta_row(prompt: Sequence[int], first_token: int) -> bytes:
    """A request's metadata row (:data:`META_ROW_BYTES`)."""
    return struct.pack("<qq", len(prompt), int(first_token)) + prompt_digest(prompt)


def read_meta(row: bytes, *, prompt: Sequence[int], vocab_size: int, request_id: str) -> int:
    """The first token of a received metadata row (:func:`meta_row`), checked against ``prompt`` before it is
    trusted.

    Raises:
        TransferError: the row's token count is not the prompt's, its digest is not :func:`prompt_digest` of
            ``prompt`` (the prefill side sent another prompt under ``request_id``: prompts handed over in another
            order, or another prompt of the same length), or its first token is outside ``[0, vocab_size)``.
    """
    row = bytes(row[:META_ROW_BYTES])
    if len(row) != META_ROW_BYTES:
        raise TransferError(
            f"metadata row holds {len(row)} bytes, expected {META_ROW_BYTES}", request_id=request_id, peer="prefill"
        )
    got, first = struct.unpack("<qq", row[:16])
    if got != len(prompt):
        raise TransferError(
            f"metadata row says {got} tokens, the prompt has {len(prompt)}", request_id=request_id, peer="prefill"
        )
    if row[16:] != prompt_digest(prompt):
        raise TransferError(
            f"metadata row's prompt digest {row[16:24].hex()}... is not that of the prompt given for this request "
            f"({prompt_digest(prompt)[:8].hex()}...): the prefill side sent another prompt of {got} tokens under "
            "this request id (prompts handed over in another order?)",
            request_id=request_id, peer="prefill",
        )  # fmt: skip
    if not 0 <= first < vocab_size:
        raise TransferError(
            f"metadata row holds first token {first}, outside [0, {vocab_size})", request_id=request_id, peer="prefill"
        )
    return int(first)


def kv_digest(kv: Sequence[dict[str, torch.Tensor]], num_tokens: Sequence[int]) -> str:
    """Hash of ``kv[i][name][:, :num_tokens[i]]`` over requests and names (what :meth:`dtkv.runtime.Runtime.kv_bytes`
    gives per request)."""
    h = hashlib.blake2b(digest_size=16)
    for per_req, n in zip(kv, num_tokens):
        for name in sorted(per_req):
            h.update(per_req[name][:, :n].contiguous().numpy().tobytes())
    return h.hexdigest()
