"""Backend choice of ``dtkv.ops``: ``auto`` / ``torch`` / ``triton``, ``DTKV_BACKEND``, and life without Triton."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from dtkv import default_backend
from dtkv.ops._common import resolve_backend, word_view
from tests.ops_reference import backend_ok


def test_auto_picks_torch_on_cpu_and_triton_on_cuda():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    expect = "triton" if backend_ok("triton", "cuda") else "torch"
    assert resolve_backend("auto", torch.device("cuda", 0)) == expect


def test_default_backend_overrides_auto():
    with default_backend("torch"):
        assert resolve_backend("auto", torch.device("cuda", 0)) == "torch"
        assert resolve_backend("torch", torch.device("cuda", 0)) == "torch"


def test_rejects_unknown_backend():
    with pytest.raises(
        ValueError, match=re.escape("backend must be one of ('auto', 'torch', 'triton'), got backend='x'")
    ):
        resolve_backend("x", torch.device("cpu"))


def test_word_view_picks_widest_words():
    assert word_view(torch.zeros(2, 3, 656, dtype=torch.uint8)).dtype == torch.int64
    assert word_view(torch.zeros(2, 3, 576, dtype=torch.bfloat16)).dtype == torch.int64
    assert word_view(torch.zeros(2, 3, 6, dtype=torch.uint8)).dtype == torch.int16
    assert word_view(torch.zeros(4, 12, dtype=torch.uint8)[:, 1:9]).dtype == torch.uint8  # odd offset


def test_imports_and_falls_back_without_triton():
    """With ``triton`` unimportable, ``dtkv.ops`` imports, ``auto`` runs torch, ``triton`` names what is missing."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None
        import torch
        from dtkv import PageOwnership
        from dtkv.ops import HAS_TRITON, write_owned
        assert not HAS_TRITON
        pool = torch.zeros(2, 2, 4)
        write_owned(pool, torch.ones(1, 4), torch.tensor([2]), PageOwnership(1, 2), 0)
        assert pool[1, 0].sum() == 4
        try:
            write_owned(pool, torch.ones(1, 4), torch.tensor([2]), PageOwnership(1, 2), 0, backend="triton")
        except NotImplementedError as e:
            print("NIE:", e)
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "NIE: backend='triton' is unavailable: the 'triton' package could not be imported" in res.stdout
