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

from collections.abc import Callable
from typing import TypeVar

import attrs

T = TypeVar("T")

# Per class, checked once: the setter of its instances' ``__dict__`` (the slot's
# own descriptor: a third cheaper than ``object.__setattr__``, which looks it up).
_SETTERS: dict[type, Callable[[object, dict], None]] = {}


def _setter(cls: type) -> Callable[[object, dict], None]:
    """Once per class: is it one this module copies correctly?"""
    fields = attrs.fields(cls)
    if any(f.validator or f.converter for f in fields) or "__slots__" in vars(cls):
        raise TypeError(f"replace() needs a dict-backed attrs class without validators: {cls.__name__}")
    slot = next(vars(base)["__dict__"] for base in cls.__mro__ if "__dict__" in vars(base))
    setter = _SETTERS[cls] = slot.__set__
    return setter


def _unknown(value: object, changes: dict) -> TypeError:
    names = {f.name for f in attrs.fields(type(value))}
    return TypeError(f"{type(value).__name__} has no field(s) {sorted(changes.keys() - names)}")


_new = object.__new__  # a frozen class refuses its own __setattr__: its dict is set whole


def replace(value: T, **changes: object) -> T:
    cls = type(value)
    setter = _SETTERS.get(cls) or _setter(cls)
    state = value.__dict__.copy()
    size = len(state)
    state.update(changes)
    if len(state) != size:
        raise _unknown(value, changes)
    new = _new(cls)
    setter(new, state)
    return new


def rebuilt(value: T, state: dict) -> T:
    """A new value of ``value``'s class whose fields are ``state``: a copy of
    ``value.__dict__`` with fields set by item, which on the fold's hottest
    paths costs less than the call with keywords :func:`replace` is.  A name
    that is no field makes ``state`` grow, and is refused here."""
    if len(state) != len(value.__dict__):
        raise _unknown(value, state)
    cls = type(value)
    new = _new(cls)
    (_SETTERS.get(cls) or _setter(cls))(new, state)
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
