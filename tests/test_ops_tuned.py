"""``ops/_tuned.py`` (launch configurations per op and size) and ``ops/_copy.py``'s chunk plan; the table writer of
``benchmarks/tune_ops.py``.

Contract: on the tuned device an op gets the entry tuned at the size nearest on a log scale (ties: the larger),
with missing keys from ``DEFAULTS``; anywhere else ``DEFAULTS``; ``override`` wins everywhere, nests and restores
(also on error); unknown ops and keys are refused by name. ``--write-table`` merges a sweep's winners into the TUNED
block (other ops and sizes keep their entries) and refuses ops or keys the table does not know.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from dtkv.ops import _tuned
from dtkv.ops._copy import needs_int64, span_chunks, vector_words

ROOT = Path(__file__).resolve().parent.parent
SIZES = {4194304: {"block": 2048}, 16777216: {"block": 4096, "map16": "always"}, 67108864: {"num_warps": 8}}


@pytest.fixture
def tuned_device(monkeypatch):
    """A fake TUNED table for ``remap`` and every device named the tuned device."""
    monkeypatch.setattr(_tuned, "TUNED", {"remap": SIZES})
    monkeypatch.setattr(_tuned, "_device_name", lambda device: _tuned.TUNED_DEVICE)


@pytest.mark.parametrize(
    "size,want",
    [(1, 4194304), (4194304, 4194304), (2**23 - 1, 4194304), (2**23, 16777216), (16777216, 16777216),
     (2**25, 67108864), (2**40, 67108864)],
)  # fmt: skip
def test_picks_the_nearest_tuned_size_on_a_log_scale(tuned_device, size, want):
    assert _tuned.launch_config("remap", size, torch.device("cuda", 0)) == {**_tuned.DEFAULTS["remap"], **SIZES[want]}


def test_other_devices_and_untuned_ops_get_the_defaults(monkeypatch):
    monkeypatch.setattr(_tuned, "TUNED", {"remap": SIZES})
    assert _tuned.launch_config("remap", 2**24, torch.device("cpu")) == _tuned.DEFAULTS["remap"]
    monkeypatch.setattr(_tuned, "_device_name", lambda device: "NVIDIA H100 PCIe")  # other SMs: the defaults
    assert _tuned.launch_config("remap", 2**24, torch.device("cuda", 0)) == _tuned.DEFAULTS["remap"]
    monkeypatch.setattr(_tuned, "_device_name", lambda device: _tuned.TUNED_DEVICE)
    assert _tuned.launch_config("direct_write", 5, torch.device("cuda", 0)) == _tuned.DEFAULTS["direct_write"]


def test_a_sibling_of_the_tuned_device_takes_the_table(monkeypatch):
    """An H100 SXM (the H200's SMs) takes the tuned entries; the table names it."""
    monkeypatch.setattr(_tuned, "TUNED", {"remap": SIZES})
    monkeypatch.setattr(_tuned, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert "NVIDIA H100 80GB HBM3" in _tuned.TUNED_SIBLINGS
    assert _tuned.launch_config("remap", 2**24, torch.device("cuda", 0)) == {
        **_tuned.DEFAULTS["remap"],
        **SIZES[16777216],
    }


def test_launch_config_returns_a_fresh_dict():
    cfg = _tuned.launch_config("remap", 1, torch.device("cpu"))
    cfg["block"] = -1
    assert _tuned.launch_config("remap", 1, torch.device("cpu"))["block"] == _tuned.DEFAULTS["remap"]["block"]


def test_override_wins_nests_and_restores_on_error(tuned_device):
    dev = torch.device("cuda", 0)
    with _tuned.override("remap", block=8):
        assert _tuned.launch_config("remap", 2**24, dev)["block"] == 8
        assert _tuned.launch_config("remap", 2**24, dev)["map16"] == "always"  # the tuned entry below it
        with pytest.raises(RuntimeError), _tuned.override("remap", block=16, idx_cg=1):
            assert _tuned.launch_config("remap", 1, dev)["block"] == 16
            raise RuntimeError("boom")
        assert _tuned.launch_config("remap", 1, dev) == {**_tuned.DEFAULTS["remap"], **SIZES[4194304], "block": 8}
    assert _tuned.launch_config("remap", 1, dev) == {**_tuned.DEFAULTS["remap"], **SIZES[4194304]}
    assert not _tuned._OVERRIDES


def test_rejects_unknown_ops_and_keys():
    with pytest.raises(ValueError, match=re.escape("op must be one of [") + ".*" + re.escape("got op='copy'")):
        _tuned.launch_config("copy", 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=re.escape("override of 'remap' got unknown keys ['blocks']; its keys are")):
        with _tuned.override("remap", blocks=8):
            pass
    assert not _tuned._OVERRIDES


def test_tuned_table_is_well_formed():
    """Whatever a sweep wrote: known ops, known keys, positive sizes; a run of the writer records its origin."""
    for op, entries in _tuned.TUNED.items():
        assert op in _tuned.DEFAULTS, op
        for size, cfg in entries.items():
            assert isinstance(size, int) and size > 0
            assert set(cfg) <= set(_tuned.DEFAULTS[op]), (op, size, cfg)
    assert bool(_tuned.TUNED) == bool(_tuned.TUNED_ON)


# ----------------------------------------------------------------------------------------- chunk plan
@pytest.mark.parametrize(
    "span,chunk_w,want",
    [(82, 128, (64, 16, 2, 0)), (82, 64, (64, 16, 2, 0)), (144, 64, (64, 64, 16, 0)), (144, 128, (128, 16, 0, 0)),
     (5248, 4096, (4096, 1024, 128, 0)), (5248, 2048, (2048, 2048, 1024, 128)),
     (5248, 1024, (1024, 1024, 1024, 4096)), (31, 128, (16, 8, 4, 4)), (15, 128, (8, 4, 2, 1)), (1, 8, (1, 0, 0, 0)),
     (82, 0, (128, 0, 0, 0)), (1, 0, (1, 0, 0, 0)), (7, 2, (2, 2, 2, 1))],
)  # fmt: skip
def test_span_chunks(span, chunk_w, want):
    got = span_chunks(span, chunk_w)
    assert got == want
    nonzero = [w for w in got if w]
    assert sum(nonzero) >= span and sum(nonzero[:-1]) < span  # covers the span; only the last chunk may overhang
    assert all(w & (w - 1) == 0 for w in nonzero)


def test_span_chunks_rejects_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("span must be >= 1 word, got span=0")):
        span_chunks(0, 64)
    with pytest.raises(ValueError, match=re.escape("chunk_w must be 0 or a power of two, got chunk_w=48")):
        span_chunks(82, 48)


@pytest.mark.parametrize(
    "word_bytes,multiples,want",
    [(8, (82, 5248, 82, 512, 128, 16), 2), (8, (82, 5248, 82, 512, 128, 16, 1), 1), (4, (3, 24, 3), 1),
     (4, (144, 9216, 144, 1024, 128), 4), (1, (656, 41984, 656), 16), (1, (5, 40, 5), 1), (2, (6, 48), 2),
     (16, (4,), 1)],
)  # fmt: skip
def test_vector_words(word_bytes, multiples, want):
    """Words of a 16-byte vector that divide the row width, the strides and every chunk of a flat tile."""
    assert vector_words(word_bytes, *multiples) == want


def test_needs_int64():
    assert not needs_int64(2**31 - 2, 5)
    assert needs_int64(3, 2**31 - 1)
    assert not needs_int64()


# ----------------------------------------------------------------------------------------- the table writer
def _tune_ops():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("tune_ops", ROOT / "benchmarks" / "tune_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("tuned_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOC = {
    "device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "date": "2026-12-02", "commit": "abc1234",
    "tuned": {
        "write_owned": {
            "262144": {"variant": "window", "layout": "flat", "block_r": 16, "window": 64, "chunk_w": 1024,
                       "num_warps": 4},
            "4194304": {"variant": "tile", "layout": "rows", "block_r": 64, "window": 128, "chunk_w": 128,
                        "num_warps": 8},
        },
        "remap": {"67108864": {"block": 2048, "num_warps": 8, "map16": "always", "idx_cg": 1}},
    },
}  # fmt: skip
BEFORE = {
    "write_owned": {1048576: {"block_r": 8}, 4194304: {"block_r": 32}},
    "direct_write": {65536: {"layout": "flat", "block_r": 4}},
    "remap": {4194304: {"block": 512}},
}
"""The table a sweep is merged into (its origin: ``"earlier sweep"``)."""


def _table_with(tmp_path: Path, tuned: dict, tuned_on: str) -> Path:
    T = _tune_ops()
    table = tmp_path / "_tuned.py"
    text = (ROOT / "ops" / "_tuned.py").read_text()
    i, j = text.index(T.BEGIN), text.index(T.END)
    table.write_text(text[:i] + T.render_table(tuned, tuned_on) + text[j + len(T.END) :])
    return table


def test_write_table_merges_a_sweep_into_the_table(tmp_path):
    """The sweep's winners replace the entries of their op and size; every other op and size keeps its entry; the
    origin of each sweep is kept; writing the same JSON again changes nothing."""
    T = _tune_ops()
    table = _table_with(tmp_path, BEFORE, "earlier sweep")
    assert _load(table).TUNED == BEFORE
    (tmp_path / "tuned.json").write_text(json.dumps(DOC))
    T.write_table(str(tmp_path / "tuned.json"), table)
    m = _load(table)
    want = {op: dict(entries) for op, entries in BEFORE.items()}
    for op, entries in DOC["tuned"].items():
        want[op].update({int(s): cfg for s, cfg in entries.items()})
    assert m.TUNED == want
    assert m.TUNED["write_owned"][1048576] == {"block_r": 8} and m.TUNED["direct_write"] == BEFORE["direct_write"]
    assert m.TUNED_ON == ("earlier sweep; NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-12-02 (dtkv abc1234): "
                          "remap, write_owned")  # fmt: skip
    assert m.DEFAULTS == _tuned.DEFAULTS
    assert all(len(line) <= 120 for line in table.read_text().splitlines())
    before = table.read_text()
    T.write_table(str(tmp_path / "tuned.json"), table)  # again: the block is replaced, not appended
    assert table.read_text() == before and table.read_text().count(T.BEGIN) == 1


def test_write_table_into_an_empty_table(tmp_path):
    T = _tune_ops()
    table = _table_with(tmp_path, {}, "")
    (tmp_path / "tuned.json").write_text(json.dumps(DOC))
    T.write_table(str(tmp_path / "tuned.json"), table)
    m = _load(table)
    assert m.TUNED == {op: {int(s): cfg for s, cfg in e.items()} for op, e in DOC["tuned"].items()}
    assert m.TUNED_ON == "NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-12-02 (dtkv abc1234): remap, write_owned"


def test_the_repository_table_merges_into_itself_unchanged(tmp_path):
    """The table in the repository is one ``--write-table`` leaves as it is when a sweep tunes nothing."""
    T = _tune_ops()
    table = tmp_path / "_tuned.py"
    table.write_text((ROOT / "ops" / "_tuned.py").read_text())
    (tmp_path / "tuned.json").write_text(json.dumps({**DOC, "tuned": {}}))
    T.write_table(str(tmp_path / "tuned.json"), table)
    assert _load(table).TUNED == _tuned.TUNED and _load(table).TUNED_ON == _tuned.TUNED_ON
    assert table.read_text() == (ROOT / "ops" / "_tuned.py").read_text()
    assert [line for line in table.read_text().splitlines() if T.BEGIN in line or T.END in line] == [
        f"{T.BEGIN}: written by `python benchmarks/tune_ops.py --write-table <json>`; do not edit by hand",
        T.END,
    ], "one BEGIN and one END marker line"


@pytest.mark.parametrize(
    "tuned,message",
    [({"copy": {"1": {}}}, "tuned op 'copy' is not an op of ops/_tuned.py"),
     ({"remap": {"1": {"blocks": 8}}}, "tuned config of 'remap' at 1 has unknown keys ['blocks']")],
)  # fmt: skip
def test_write_table_rejects_unknown_ops_and_keys(tmp_path, tuned, message):
    T = _tune_ops()
    table = tmp_path / "_tuned.py"
    before = (ROOT / "ops" / "_tuned.py").read_text()
    table.write_text(before)
    (tmp_path / "tuned.json").write_text(json.dumps({**DOC, "tuned": tuned}))
    with pytest.raises(ValueError, match=re.escape(message)):
        T.write_table(str(tmp_path / "tuned.json"), table)
    assert table.read_text() == before


def test_write_table_refuses_a_table_entry_with_a_stale_key(tmp_path):
    """An entry the table kept from an older schema (a key DEFAULTS no longer has) is named, not carried on."""
    T = _tune_ops()
    table = _table_with(tmp_path, {"write_owned": {65536: {"programs_per_sm": 4}}}, "old sweep")
    before = table.read_text()
    (tmp_path / "tuned.json").write_text(json.dumps(DOC))
    with pytest.raises(ValueError, match=re.escape("tuned config of 'write_owned' at 65536 has unknown keys")):
        T.write_table(str(tmp_path / "tuned.json"), table)
    assert table.read_text() == before
