"""``replace(value, **changes)``: ``attrs.evolve`` for the fold's state classes.

Every event folds into a new node, layout and tenant value, so building them
is the core's hot path.  ``attrs.evolve`` walks every field and calls
``__init__``; these classes are frozen, keep their fields in a ``__dict__``
(``slots=False``) and have no validators or converters, so a copy of that
dict with the changes applied is the same value, made in C.  Misspelt
field names are refused, as ``attrs.evolve`` would.
"""

from __future__ import annotations

from typing import TypeVar

import attrs

T = TypeVar("T")

_FIELDS: dict[type, frozenset[str]] = {}


def _fields(cls: type) -> frozenset[str]:
    names = _FIELDS.get(cls)
    if names is None:
        fields = attrs.fields(cls)
        if any(f.validator or f.converter for f in fields) or "__slots__" in vars(cls):
            raise TypeError(f"replace() needs a dict-backed attrs class without validators: {cls.__name__}")
        names = _FIELDS[cls] = frozenset(f.name for f in fields)
    return names


_set = object.__setattr__  # a frozen class refuses its own __setattr__


def replace(value: T, **changes: object) -> T:
    cls = type(value)
    fields = _FIELDS.get(cls) or _fields(cls)
    if not fields.issuperset(changes):
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(changes.keys() - _fields(cls))}")
    state = value.__dict__.copy()
    state.update(changes)
    new = object.__new__(cls)
    _set(new, "__dict__", state)
    return new


def stamp(new: T, original: object, **changes: object) -> T:
    """``replace(new, **changes)``, in place when ``new`` is a value a step has
    just made (not ``original``, nor anything else yet): nobody can see it
    change, and the fold saves a copy of every field."""
    if new is original:
        return replace(new, **changes)
    fields = _FIELDS.get(type(new)) or _fields(type(new))
    if not fields.issuperset(changes):
        raise TypeError(f"{type(new).__name__} has no field(s) {sorted(changes.keys() - fields)}")
    new.__dict__.update(changes)
    return new

