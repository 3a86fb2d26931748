"""The functional core: events, state, fold, decisions, invariants.

Pure by construction: nothing here does I/O, starts threads, reads a clock,
touches trio or CUDA.  ``tests/test_fsm_purity.py`` checks the imports.

One node (a GPU) holds many named layouts; each layout has the seed's lock
FSM, tables and hash (``state``, ``folding``, ``decide``, ``locks``,
``queries``); the node adds sessions, tenants, budgets and residency
(``node``, ``sessions``, ``accounting``, ``residency``).  Every rule of what
is legal lives in one table, ``rules``, which the fold consults before each
step; decisions only propose events.
"""

from . import rules
from .accounting import admit_allocation, admit_restore, gpu_shortfall, host_room
from .decide import (
    decide_allocate,
    decide_abort,
    decide_commit,
    decide_free,
    decide_host_copy,
    decide_metadata_delete,
    decide_metadata_put,
    decide_metadata_put_many,
)
from .effects import MemoryTier, Release, batch_effects, may_make_room, released_memory
from .errors import (
    BudgetExceeded,
    HostBudgetExceeded,
    HostCopyMissing,
    InvalidArgument,
    InvariantViolation,
    LimitExceeded,
    ModeViolation,
    NotConnected,
    NotEvictable,
    OffsetOutOfBounds,
    OverLimit,
    PermissionDenied,
    QuotaExceeded,
    Rejection,
    SnapshotUnreadable,
    StaleLayout,
    StateViolation,
    UnknownAllocation,
    UnknownLayout,
)
from .events import EVENT_TYPES, Event, shown_kind
from .invariants import check_invariants, layout_problems
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
    turned_away,
)
from .node import DEFAULT_TENANT, EMPTY_NODE, NodeState, SessionInfo, TenantState, fold, fold_all
from .residency import (
    decide_delete,
    decide_evict,
    decide_pin,
    decide_restore_finished,
    decide_restore_loading,
    decide_spill,
    eviction_candidates,
    plan_evictions,
    plan_spills,
    why_not_evictable,
)
from .resume import decide_resume, held_memory
from .rules import LASTING, RULES, Rule, Who, fold_layout, is_lasting, parse_residency
from .sessions import decide_disconnect, decide_revoke, decide_session, holders, opening, validate_layout_name
from .state import Allocation, LayoutState, LockState, MetadataEntry, Residency, Tier, lock_state

__all__ = [
    "DEFAULT_TENANT",
    "EMPTY_NODE",
    "EVENT_TYPES",
    "LASTING",
    "RULES",
    "Allocation",
    "BudgetExceeded",
    "Event",
    "Grant",
    "GrantedLockType",
    "HostBudgetExceeded",
    "HostCopyMissing",
    "InvalidArgument",
    "InvariantViolation",
    "LayoutState",
    "LimitExceeded",
    "Limits",
    "LockState",
    "MemoryTier",
    "MetadataEntry",
    "ModeViolation",
    "NodeState",
    "NotConnected",
    "NotEvictable",
    "OffsetOutOfBounds",
    "OverLimit",
    "PermissionDenied",
    "QuotaExceeded",
    "Rejection",
    "SnapshotUnreadable",
    "Release",
    "RequestedLockType",
    "Residency",
    "Rule",
    "SessionInfo",
    "StaleLayout",
    "StateViolation",
    "TenantState",
    "Tier",
    "UnknownAllocation",
    "UnknownLayout",
    "Who",
    "admit_allocation",
    "admit_restore",
    "batch_effects",
    "can_grant_ro",
    "can_grant_rw",
    "check_invariants",
    "compute_layout_hash",
    "decide_allocate",
    "decide_abort",
    "decide_commit",
    "decide_disconnect",
    "decide_revoke",
    "decide_delete",
    "decide_evict",
    "decide_spill",
    "decide_free",
    "decide_host_copy",
    "decide_metadata_delete",
    "decide_metadata_put",
    "decide_metadata_put_many",
    "decide_pin",
    "decide_restore_finished",
    "decide_restore_loading",
    "decide_resume",
    "decide_session",
    "eviction_candidates",
    "fold",
    "fold_all",
    "fold_layout",
    "gpu_shortfall",
    "grant_for",
    "held_memory",
    "holders",
    "host_room",
    "is_lasting",
    "layout_problems",
    "lock_state",
    "may_make_room",
    "opening",
    "parse_residency",
    "plan_evictions",
    "plan_spills",
    "released_memory",
    "resolve_rw_or_ro",
    "rules",
    "schedule",
    "shown_kind",
    "turned_away",
    "validate_layout_name",
    "why_not_evictable",
]
