"""The reference model's indexer top-k (:meth:`dtkv.model.TinyDSA.select`): bounded blocks of queries, the packed
selection keys, bit for bit the stable sort it replaced, and no ``[N, S]`` temporary when the blocks are smaller.

The scores are float64 products rounded to float32 (the model's rule). A BLAS product's last float64 bits can
depend on its row count, so blocks of queries are compared with the stable sort of the same blocks.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

import dtkv.model.model as model_mod
from dtkv.model import ModelConfig
from dtkv.model.model import TinyDSA


def _stable_select(model: TinyDSA, q, pos_N, index_keys_SJ):
    """The selection before bounded blocks: ``[N, I, S]`` scores, an ``[N, S]`` causal mask, a stable sort."""
    s = index_keys_SJ.shape[0]
    causal_NS = torch.arange(s)[None, :] <= pos_N[:, None]
    score_NS = (torch.relu(torch.einsum("nij,sj->nis", q["iq"], index_keys_SJ)) * q["iw"][:, :, None]).sum(1)
    score_NS = score_NS.to(torch.float32).masked_fill(~causal_NS, float("-inf"))
    k = min(model.cfg.index_topk, s)
    top_val, top_idx = torch.sort(score_NS, dim=-1, descending=True, stable=True)
    return top_idx[:, :k], top_val[:, :k] > float("-inf")


def _inputs(seed: int, n: int, s: int):
    cfg = ModelConfig(page_size=4, num_layers=1)
    model = TinyDSA(cfg)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (s,), generator=g)
    tokens[s // 2 :: 3] = tokens[1]  # repeated tokens: equal index keys, exact ties
    rows = model.project(0, model.embed_tokens(tokens), torch.arange(s))
    index_keys = rows["index_k"].double()
    pos = torch.arange(s - n, s)
    q = {k: rows[k][s - n :] for k in ("iq", "iw")}
    return model, q, pos, index_keys


class _Sizes(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.numels: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None:
                self.numels.append(t.numel())
        return out


def test_select_is_the_stable_sort_in_any_blocks(monkeypatch):
    """Queries at the end of a request (with ``n = s`` the first ones see fewer than ``index_topk`` keys; five
    keys: fewer than ``index_topk`` in all): one block, and blocks of 3 queries, give the stable sort's positions
    (``-1`` where it has none) and masks."""
    for seed, n, s in ((0, 9, 70), (1, 70, 70), (2, 1, 5)):
        model, q, pos, keys = _inputs(seed, n, s)
        want_idx, want_valid = _stable_select(model, q, pos, keys)
        idx, valid = model.select(q, pos, keys)
        assert torch.equal(valid, want_valid) and torch.equal(idx, torch.where(want_valid, want_idx, -1))
        monkeypatch.setattr(model_mod, "SELECT_BLOCK_BYTES", 3 * (8 * q["iq"].shape[1] + 48) * s)
        idx, valid = model.select(q, pos, keys)
        monkeypatch.undo()
        for b0 in range(0, n, 3):
            qb = {k: v[b0 : b0 + 3] for k, v in q.items()}
            want_idx, want_valid = _stable_select(model, qb, pos[b0 : b0 + 3], keys)
            assert torch.equal(valid[b0 : b0 + 3], want_valid)
            assert torch.equal(idx[b0 : b0 + 3], torch.where(want_valid, want_idx, -1))


def test_select_never_allocates_n_by_s(monkeypatch):
    model, q, pos, keys = _inputs(3, 64, 70)
    n, s, heads = 64, 70, q["iq"].shape[1]
    monkeypatch.setattr(model_mod, "SELECT_BLOCK_BYTES", 3 * (8 * heads + 48) * s)
    got, old = _Sizes(), _Sizes()
    with got:
        model.select(q, pos, keys)
    with old:
        _stable_select(model, q, pos, keys)
    assert max(got.numels) < n * s, max(got.numels)
    assert max(old.numels) >= n * heads * s  # the check catches the dense selection's [N, I, S] scores
