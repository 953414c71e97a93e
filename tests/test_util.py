"""``dtkv._util``: the one home of cdiv, integer-array coercion, unique-in-order and deprecation warnings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_utils import TestCase

from dtkv._util import as_int_array, as_int_list, cdiv, first_occurrence, unique_in_order, warn_deprecated


@settings(max_examples=100, deadline=None)
@given(a=st.integers(0, 10**12), b=st.integers(1, 10**6))
def test_cdiv_is_ceil_division_for_ints_arrays_and_tensors(a, b):
    want = (a + b - 1) // b
    assert cdiv(a, b) == want
    assert cdiv(np.array([a]), b).tolist() == [want]
    assert cdiv(torch.tensor([a]), b).tolist() == [want]


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(-5, 5), max_size=30))
def test_unique_in_order_vs_reference(values):
    ref = list(dict.fromkeys(values))  # insertion order = first occurrence
    t = torch.tensor(values, dtype=torch.int64)
    assert unique_in_order(t).tolist() == ref
    seen: set[int] = set()
    mask = []
    for v in values:
        mask.append(v not in seen)
        seen.add(v)
    assert first_occurrence(t).tolist() == mask


@pytest.mark.parametrize(
    "values",
    [
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2], dtype=np.uint8),
        torch.tensor([3, 1, 2], dtype=torch.int32),
        iter([3, 1, 2]),
    ],
    ids=["list", "tuple", "numpy", "tensor", "iterator"],
)
def test_as_int_array_accepts_every_integer_form(values):
    arr = as_int_array("x", values)
    assert arr.dtype == np.int64 and arr.tolist() == [3, 1, 2]


def test_as_int_array_returns_a_copy():
    src = np.array([1, 2], dtype=np.int64)
    out = as_int_array("x", src)
    out[0] = 9
    assert src[0] == 1
    t = torch.tensor([1, 2])
    as_int_array("x", t)[0] = 9
    assert t[0] == 1


def test_as_int_list_flattens_any_shape():
    assert as_int_list("pages", torch.tensor([[1, -1], [2, 3]])) == [1, -1, 2, 3]
    assert as_int_list("pages", []) == []


class TestErrors(TestCase):
    def _msg(self, exc, *args, **kwargs) -> str:
        with self.assertRaises(exc) as ctx:
            as_int_array(*args, **kwargs)
        return str(ctx.exception)

    def test_error_text(self):
        self.assertExpectedInline(self._msg(TypeError, "x", [1, 1.5]), """x must hold ints, got 1.5 (float)""")
        self.assertExpectedInline(self._msg(TypeError, "x", [0, True]), """x must hold ints, got True (bool)""")
        self.assertExpectedInline(self._msg(TypeError, "x", ["a"]), """x must hold ints, got 'a' (str)""")
        self.assertExpectedInline(
            self._msg(TypeError, "x", 3), """x must be a sequence of ints or an integer tensor, got int"""
        )
        self.assertExpectedInline(
            self._msg(TypeError, "x", "12"), """x must be a sequence of ints or an integer tensor, got str"""
        )
        self.assertExpectedInline(
            self._msg(TypeError, "x", torch.tensor([1.0])), """x must be an integer tensor, got x.dtype=torch.float32"""
        )
        self.assertExpectedInline(
            self._msg(ValueError, "x", [[1]], shape_hint="[n]"),
            """x must be a flat sequence of ints ([n]), got shape [1, 1]""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, "x", torch.zeros(1, 1, dtype=torch.int64), shape_hint="[n]"),
            """x must have 1 dim ([n]), got x.shape=[1, 1]""",
        )
        self.assertExpectedInline(self._msg(ValueError, "x", [0, -2], min_value=0), """x must be >= 0, got x[1]=-2""")
        self.assertExpectedInline(
            self._msg(ValueError, "x", [2**64]), """x must fit in int64, got x=[18446744073709551616]"""
        )
        self.assertExpectedInline(
            self._msg(ValueError, "x", np.array([2**64 - 1], dtype=np.uint64)),
            """x must fit in int64, got x containing 18446744073709551615""",
        )


def test_warn_deprecated_names_old_and_new_in_dtkvs_category():
    """The one wording, in dtkv's own category: a ``DeprecationWarning`` for users' filters, an error in the suite
    (``pyproject.toml``'s ``filterwarnings``), so no dtkv call uses a name dtkv deprecated."""
    from dtkv._util import DtkvDeprecationWarning

    assert issubclass(DtkvDeprecationWarning, DeprecationWarning)
    with pytest.warns(
        DtkvDeprecationWarning, match=r"^old\(\) is deprecated and will be removed in the next release; use new\(\)$"
    ):
        warn_deprecated("old()", "new()", stacklevel=2)
    with pytest.raises(DtkvDeprecationWarning):  # the suite's filter: an error unless a test expects it
        warn_deprecated("old()", "new()", stacklevel=2)
