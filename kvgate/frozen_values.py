"""Frozen dataclasses built at about a plain class's cost, for the values made on every request.

A frozen dataclass's generated `__init__` sets each field through `object.__setattr__(self,
name, value)` (CPython 3.11 dataclasses.py `_field_assign`), about twice what storing it in the
instance's dict costs: generated `__init__`s were 6 % of a chat request's py-spy samples
(bench/results/cpu-session38). `direct_init` gives such a class an `__init__` of the same
signature that stores each field in the instance's `__dict__`, which is all `object.__setattr__`
does for a field without a descriptor, so the instances are the same values: equal, hashed,
printed and immutable as before. Only for the simple shape: no `__post_init__`, no default
factory, no InitVar, no slots (anything else is refused at import, not silently mishandled).

The price: touching `__dict__` gives the instance a dict of its own instead of CPython 3.11's
inline values, so reading a field costs more (about 50 against 35 ns; a 12-field `==` 0.70 against
0.25 us, `hash` 0.42 against 0.20: bench/results/cpu-session38/read_micro.py). So it is for values built once a request and read a few times: the parse's
(Translated, SamplingParams, ChatInput, ValidRequest, ParsedRequest, Prepared), a footprint, its
prefix keys, the never-fits ceiling. Not for one hashed and compared every request (SamplingShape,
an lru_cache key in kvgate/predict.py) nor for those the gate reads over and over (Demand,
StepHoldings: with direct_init the admission stage of bench.stage_cpu cost ~1 us more).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")


def direct_init(cls: type[T]) -> type[T]:
    """`cls` (a frozen dataclass) with an `__init__` that stores its fields in `__dict__`."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: direct_init is for frozen dataclasses without slots or __post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [field.name for field in fields]
    if list(inspect.signature(cls.__init__).parameters)[1:] != names:  # an InitVar or a field init=False
        raise TypeError(f"{cls.__name__}: direct_init needs __init__'s parameters to be the fields")
    if any(field.default_factory is not dataclasses.MISSING for field in fields):
        raise TypeError(f"{cls.__name__}: direct_init takes no default factory")
    defaults: dict[str, Any] = {}
    positional: list[str] = []
    keyword_only: list[str] = []
    for field in fields:
        parameter = field.name
        if field.default is not dataclasses.MISSING:
            defaults[f"_default_{field.name}"] = field.default
            parameter += f"=_default_{field.name}"
        (keyword_only if field.kw_only else positional).append(parameter)
    signature = ", ".join(["self", *positional, *(["*", *keyword_only] if keyword_only else [])])
    body = "".join(f"\n    fields[{name!r}] = {name}" for name in names) or "\n    pass"
    source = f"def __init__({signature}):\n    fields = self.__dict__{body}"
    namespace: dict[str, Any] = {}
    # Named for profiles (py-spy shows the name); the source is built above from field names only.
    exec(compile(source, f"<direct_init of {cls.__qualname__}>", "exec"), defaults, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
