"""direct_init (kvgate/frozen_values.py): the per-request frozen dataclasses it builds are the
values dataclasses' own generated __init__ builds, and shapes it cannot build are refused."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import InitVar, dataclass, field
from typing import Any

import pytest

from kvgate.frozen_values import direct_init
from kvgate.memory.ceiling import Ceiling
from kvgate.memory.footprint import Footprint
from kvgate.memory.kv import PrefixKeys
from kvgate.preparation import Prepared
from kvgate.request import ChatInput, ParsedRequest, ValidRequest
from kvgate.sampling_params import SamplingParams
from kvgate.vllm_routes import Translated

DIRECT = [
    SamplingParams,
    Footprint,
    ValidRequest,
    ChatInput,
    ParsedRequest,
    Translated,
    PrefixKeys,
    Prepared,
    Ceiling,
]


def _generated_twin(cls: type) -> type:
    """The same fields as a frozen dataclass with dataclasses' own __init__."""
    specs = [(f.name, f.type, field(default=f.default, kw_only=f.kw_only)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, specs, frozen=True)


@pytest.mark.parametrize("cls", DIRECT, ids=lambda c: c.__name__)
def test_the_request_values_take_direct_init(cls: type) -> None:
    assert cls.__init__.__code__.co_filename == f"<direct_init of {cls.__qualname__}>"


@pytest.mark.parametrize("cls", DIRECT, ids=lambda c: c.__name__)
def test_direct_init_builds_what_the_generated_init_builds(cls: type) -> None:
    twin = _generated_twin(cls)
    ours, theirs = inspect.signature(cls).parameters, inspect.signature(twin).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]
    fields = dataclasses.fields(cls)
    values = {f.name: object() for f in fields}
    required = {f.name: values[f.name] for f in fields if f.default is dataclasses.MISSING}
    for kwargs in (values, required):  # every field given; only those without a default
        made, expected = cls(**kwargs), twin(**kwargs)
        assert vars(made) == vars(expected)
        assert made == cls(**kwargs)
        assert hash(made) == hash(cls(**kwargs))
        assert repr(made) == repr(expected)
    positional = [values[f.name] for f in fields if not f.kw_only]
    keyword = {f.name: values[f.name] for f in fields if f.kw_only}
    assert vars(cls(*positional, **keyword)) == vars(twin(*positional, **keyword))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cls(**values), fields[0].name, None)
    with pytest.raises(TypeError):
        cls(**values, not_a_field=1)


def test_direct_init_refuses_what_it_cannot_build() -> None:
    @dataclass(frozen=True)
    class WithPostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True)
    class WithFactory:
        a: list[int] = field(default_factory=list)

    @dataclass(frozen=True)
    class WithInitVar:
        a: int
        b: InitVar[int]

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    @dataclass
    class NotFrozen:
        a: int

    for cls in (WithPostInit, WithFactory, WithInitVar, Slotted, NotFrozen, object):
        with pytest.raises(TypeError):
            direct_init(cls)


def test_direct_init_keeps_defaults_and_keyword_only_fields() -> None:
    @direct_init
    @dataclass(frozen=True)
    class Shape:
        a: int
        b: Any = "b"
        c: int = field(default=3, kw_only=True)

    assert vars(Shape(1)) == {"a": 1, "b": "b", "c": 3}
    assert vars(Shape(1, 2, c=4)) == {"a": 1, "b": 2, "c": 4}
    with pytest.raises(TypeError):
        Shape(1, 2, 4)  # c is keyword-only
