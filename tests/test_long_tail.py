"""The quick subset's long tail (``tests/_long_tail.py``): which collected tests :func:`mark` makes ``slow``."""

from __future__ import annotations

import pytest

from tests import _long_tail as L


class _Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid, self.marks = nodeid, []

    def add_marker(self, mark) -> None:
        self.marks.append(mark.name)


def test_larger_worlds_are_slow_only_beside_a_two_rank_twin(monkeypatch):
    monkeypatch.setattr(L, "LONG_TAIL", {})
    ids = ["tests/t.py::f[world2-a]", "tests/t.py::f[world3-a]", "tests/t.py::f[world4-a]",  # twin collected
           "tests/t.py::g[world4]",  # no 2-rank case: stays quick
           "tests/t.py::h[x-world3-b]", "tests/t.py::h[x-world2-b]", "tests/t.py::k[world30]"]  # fmt: skip
    items = [_Item(n) for n in ids]
    L.mark(items, [])
    assert [i.marks for i in items] == [[], ["slow"], ["slow"], [], ["slow"], [], []]


def test_an_entry_that_names_no_collected_test_of_a_collected_file_stops_the_run(monkeypatch):
    monkeypatch.setattr(L, "LONG_TAIL", {"tests/t.py::gone": "renamed", "tests/t.py::f[a]": "kept"})
    items = [_Item("tests/t.py::f[a]"), _Item("tests/t.py::f[b]")]
    with pytest.raises(pytest.UsageError, match="gone"):
        L.mark(items, [])
    L.mark(items, ["tests/t.py::f"])  # a run of chosen tests names only some: no complaint
    assert items[0].marks == ["slow", "slow"] and items[1].marks == []
