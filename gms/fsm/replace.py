"""``replace(value, **changes)``: ``attrs.evolve`` for the fold's state classes.

Every event folds into a new node, layout and tenant value, so building them
is the core's hot path.  ``attrs.evolve`` walks every field and calls
``__init__``; these classes are frozen, keep their fields in a ``__dict__``
(``slots=False``) and have no validators or converters, so a copy of that
dict with the changes applied is the same value, made in C.  Misspelt
field names are refused, as ``attrs.evolve`` would: such a dict holds exactly
the fields, so a change that names anything else makes it grow.
"""

from __future__ import annotations

from typing import TypeVar

import attrs

T = TypeVar("T")

_CHECKED: set[type] = set()


def _check(cls: type) -> None:
    """Once per class: is it one this module copies correctly?"""
    fields = attrs.fields(cls)
    if any(f.validator or f.converter for f in fields) or "__slots__" in vars(cls):
        raise TypeError(f"replace() needs a dict-backed attrs class without validators: {cls.__name__}")
    _CHECKED.add(cls)


def _unknown(value: object, changes: dict) -> TypeError:
    names = {f.name for f in attrs.fields(type(value))}
    return TypeError(f"{type(value).__name__} has no field(s) {sorted(changes.keys() - names)}")


_set = object.__setattr__  # a frozen class refuses its own __setattr__
_new = object.__new__


def replace(value: T, **changes: object) -> T:
    cls = type(value)
    if cls not in _CHECKED:
        _check(cls)
    state = value.__dict__.copy()
    size = len(state)
    state.update(changes)
    if len(state) != size:
        raise _unknown(value, changes)
    new = _new(cls)
    _set(new, "__dict__", state)
    return new


def rebuilt(value: T, state: dict) -> T:
    """A new value of ``value``'s class whose fields are ``state``: a copy of
    ``value.__dict__`` with fields set by item, which on the fold's hottest
    paths costs less than the call with keywords :func:`replace` is.  A name
    that is no field makes ``state`` grow, and is refused here."""
    if len(state) != len(value.__dict__):
        raise _unknown(value, state)
    new = _new(type(value))
    _set(new, "__dict__", state)
    return new


def stamp(new: T, original: object, **changes: object) -> T:
    """``replace(new, **changes)``, in place when ``new`` is a value a step has
    just made (not ``original``, nor anything else yet): nobody can see it
    change, and the fold saves a copy of every field."""
    if new is original:
        return replace(new, **changes)
    state = new.__dict__
    size = len(state)
    state.update(changes)
    if len(state) != size:
        raise _unknown(new, changes)
    return new
