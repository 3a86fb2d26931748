"""The functional core: events, state, fold, decisions, invariants.

Pure by construction: nothing here does I/O, starts threads, touches trio or
CUDA.  ``tests/test_fsm_purity.py`` checks the imports.
"""

from .decide import (
    decide_allocate,
    decide_commit,
    decide_disconnect,
    decide_free,
    decide_metadata_delete,
    decide_metadata_put,
    decide_metadata_put_many,
    validate_allocate,
)
from .effects import released_allocations
from .errors import (
    InvalidArgument,
    InvariantViolation,
    LimitExceeded,
    ModeViolation,
    NotConnected,
    OffsetOutOfBounds,
    Rejection,
    StateViolation,
    UnknownAllocation,
)
from .events import EVENT_TYPES, Event
from .folding import fold, fold_all
from .invariants import check_invariants
from .layout_hash import compute_layout_hash
from .limits import Limits
from .locks import (
    Grant,
    GrantedLockType,
    RequestedLockType,
    can_grant_ro,
    can_grant_rw,
    grant_for,
    resolve_rw_or_ro,
    schedule,
)
from .state import EMPTY_STATE, Allocation, LockState, MetadataEntry, State, lock_state

__all__ = [
    "EMPTY_STATE",
    "EVENT_TYPES",
    "Allocation",
    "Event",
    "Grant",
    "GrantedLockType",
    "InvalidArgument",
    "InvariantViolation",
    "LimitExceeded",
    "Limits",
    "LockState",
    "MetadataEntry",
    "ModeViolation",
    "NotConnected",
    "OffsetOutOfBounds",
    "Rejection",
    "RequestedLockType",
    "State",
    "StateViolation",
    "UnknownAllocation",
    "can_grant_ro",
    "can_grant_rw",
    "check_invariants",
    "compute_layout_hash",
    "decide_allocate",
    "decide_commit",
    "decide_disconnect",
    "decide_free",
    "decide_metadata_delete",
    "decide_metadata_put",
    "decide_metadata_put_many",
    "fold",
    "fold_all",
    "grant_for",
    "lock_state",
    "released_allocations",
    "resolve_rw_or_ro",
    "schedule",
    "validate_allocate",
]
