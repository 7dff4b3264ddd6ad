"""EncoderItemSpec and check_positive_int: positive ints in, everything else out, naming the field.

Hypothesis settings come from the conftest profiles: ``dev`` runs 200 examples per property,
``ci`` (when ``CI`` is set) 300, derandomized.
"""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vit_graph_backend import specs
from vit_graph_backend.errors import InvalidOptionError, VitGraphError
from vit_graph_backend.specs import EncoderItemSpec, check_positive_int

FIELDS = ("input_size", "output_tokens", "frames")

positive = st.integers(min_value=1, max_value=2**70)  # no upper limit: Python ints are exact
#: Values that are never a positive integer: zero, negatives, bools, floats (even integral ones),
#: strings and None.
not_positive_int = st.one_of(
    st.integers(max_value=0),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.just(1.0),
)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(positive, positive, positive)
def test_positive_ints_are_accepted(input_size, output_tokens, frames):
    spec = EncoderItemSpec(input_size, output_tokens, frames)
    assert (spec.input_size, spec.output_tokens, spec.frames) == (input_size, output_tokens, frames)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(st.sampled_from(FIELDS), not_positive_int)
def test_bad_field_is_rejected_by_name(field, value):
    kwargs = dict(input_size=4, output_tokens=1, frames=1)
    kwargs[field] = value
    with pytest.raises(InvalidOptionError, match=rf"^{field}=") as info:
        EncoderItemSpec(**kwargs)
    assert isinstance(info.value, ValueError)
    assert repr(value) in str(info.value)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(positive)
def test_check_positive_int_returns_its_value(value):
    assert check_positive_int("x", value) is value


def test_frames_defaults_to_one():
    assert EncoderItemSpec(1024, 256).frames == 1


def test_spec_is_frozen_and_hashable():
    spec = EncoderItemSpec(4, 1)
    with pytest.raises(AttributeError):
        spec.frames = 2  # type: ignore[misc]
    assert hash(spec) == hash(EncoderItemSpec(4, 1))


# Every message check_positive_int (and so EncoderItemSpec) can raise.
BAD_SPECS = [
    (dict(input_size=0, output_tokens=1), r"^input_size=0 is invalid: must be a positive integer \(>= 1\)$"),
    (dict(input_size=4, output_tokens=-3), r"^output_tokens=-3 is invalid: must be a positive integer \(>= 1\)$"),
    (dict(input_size=4, output_tokens=1, frames=0), r"^frames=0 is invalid: must be a positive integer \(>= 1\)$"),
    (dict(input_size=True, output_tokens=1), r"^input_size=True is invalid: must be a positive integer, got bool$"),
    (dict(input_size=4, output_tokens=1.0), r"^output_tokens=1\.0 is invalid: must be a positive integer, got float$"),
    (dict(input_size=4, output_tokens=1, frames="2"), r"^frames='2' is invalid: must be a positive integer, got str$"),
    (dict(input_size=None, output_tokens=1), r"^input_size=None is invalid: must be a positive integer, got NoneType$"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_SPECS)
def test_bad_spec_messages(kwargs, match):
    with pytest.raises(InvalidOptionError, match=match) as info:
        EncoderItemSpec(**kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, VitGraphError)


def test_docstring_examples():
    result = doctest.testmod(specs, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
