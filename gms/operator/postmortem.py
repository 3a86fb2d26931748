"""Saved logs: events as JSON lines, and replaying them offline.

``gms history --json`` writes one object per event: ``seq``, ``kind``,
``time``, ``conn``, ``layout`` and the event's own fields (bytes as hex).
:func:`replay_rows` turns such a file back into events, folds them with the
server's own pure core from the empty state and checks every invariant.  A
log is replayable only whole: where retention dropped its beginning (the
first event is not ``SERVER_STARTED`` at sequence 1) or a filter left gaps,
it says so instead of guessing.

A journal a restarted server could not rebuild (``gms.server.restart.resume.save_journal``)
is such a file too: its first rows say why it was saved (``GMS_JOURNAL``) and
hold the state the events start from (``STATE_IMAGE``, the keeper's base image
in hex), so replay starts there instead of at ``SERVER_STARTED``; entries the
server could not decode are kept as ``RAW_ENTRIES`` and replay stops at them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import attrs

from ..fsm import (
    EMPTY_NODE,
    EVENT_TYPES,
    Event,
    InvariantViolation,
    NodeState,
    Rejection,
    check_invariants,
    fold,
    shown_kind,
)
from ..fsm.events import ServerStarted, kind_columns
from ..store.log import restart_gap
from ..wire import messages as m
from .status import layout_rows, tenant_rows


class LogFileError(ValueError):
    """The file is not a whole, well-formed gms event log."""


def _bytes_fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in attrs.fields(cls) if f.type in ("bytes", bytes))


_BYTES = {kind: _bytes_fields(cls) for kind, cls in EVENT_TYPES.items()}
# What each field of an event may hold, by its annotation (a saved log is JSON anyone
# may have edited: every value is checked here, once, before the core sees it).
_ALLOWED = {
    "int": (int,), "str": (str,), "bytes": (bytes,), "dict": (dict,), "int | None": (int, type(None)), "bool": (bool,),
    "list": (list,),
}
# The rows of list fields (LAYOUT_RECOVERED's), column by column; a bytes column is hex in the file.
_ROWS = {
    ("LAYOUT_RECOVERED", "allocations"): (str, int, int, str, int),
    ("LAYOUT_RECOVERED", "metadata"): (str, str, int, bytes),
}
_FIELD_TYPES = {
    kind: {f.name: _ALLOWED[str(f.type).strip()] for f in attrs.fields(cls)} for kind, cls in EVENT_TYPES.items()
}


def _well_typed(kind: str, fields: dict) -> None:
    for name, value in fields.items():
        allowed = _FIELD_TYPES[kind].get(name)
        if allowed is None:
            continue  # an unknown name: the event's own init refuses it
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise LogFileError(f"bad {kind} event: {name} is a {type(value).__name__}")
        if isinstance(value, dict) and not _plain_dict(value):
            raise LogFileError(f"bad {kind} event: {name} holds something other than names and numbers")
        if isinstance(value, list) and not _rows_of(value, _ROWS.get((kind, name), ())):
            raise LogFileError(f"bad {kind} event: {name} holds rows of another shape")


def _rows_of(rows: list, columns: tuple[type, ...]) -> bool:
    return bool(columns) and all(
        isinstance(row, list) and len(row) == len(columns) and all(
            isinstance(v, t) and (t is int or not isinstance(v, bool)) and not (t is int and isinstance(v, bool))
            for v, t in zip(row, columns)
        )
        for row in rows
    )


def _hex_rows(rows: list, to_hex: bool) -> list:
    """A list field's bytes columns as hex (for the file), or back."""
    return [[(v.hex() if to_hex else bytes.fromhex(v)) if isinstance(v, (bytes, str)) and n == 3 else v
             for n, v in enumerate(row)] if isinstance(row, list) else row for row in rows]


def _plain_dict(value: dict, depth: int = 0) -> bool:
    """Names to integers, None or (one level down) such dicts: what quotas and limits are."""
    return all(
        isinstance(k, str) and (
            v is None or (isinstance(v, int) and not isinstance(v, bool))
            or (depth == 0 and isinstance(v, dict) and _plain_dict(v, 1))
        )
        for k, v in value.items()
    )


def event_row(seq: int, time: float, event: Event) -> dict:
    """A saved log's row: the event in the seed's words, as the history probe shows it."""
    row = {"seq": seq, **kind_columns(event.KIND), "time": time}
    for key, value in attrs.asdict(event).items():
        if (event.KIND, key) == ("LAYOUT_RECOVERED", "metadata"):
            value = _hex_rows(value, True)
        row[key] = value.hex() if isinstance(value, bytes) else value
    return row


def row_event(row: dict) -> Event:
    """The event a saved row records: its ``logged_as`` kind where the row shows another."""
    kind = row.get("logged_as") or row.get("kind")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise LogFileError(f"unknown event kind {kind!r}")
    if "logged_as" in row and shown_kind(kind) != row.get("kind"):
        raise LogFileError(f"a {kind} event shown as {row.get('kind')!r}")
    fields = {k: v for k, v in row.items() if k not in ("seq", "kind", "time", "mono_ns", "logged_as")}
    try:
        for key in _BYTES[kind]:
            if key in fields:
                fields[key] = bytes.fromhex(fields[key])
        if kind == "LAYOUT_RECOVERED" and isinstance(fields.get("metadata"), list):
            fields["metadata"] = _hex_rows(fields["metadata"], False)
        _well_typed(kind, fields)
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, LogFileError):
            raise
        raise LogFileError(f"bad {kind} event: {exc}") from exc


@attrs.frozen
class Replayed:
    state: NodeState
    started: ServerStarted
    count: int
    last_seq: int

    def runtime_state(self) -> m.GetRuntimeStateResponse:
        """What ``gms status`` showed at the log's end, less what only a live server knows."""
        state = self.state
        return m.GetRuntimeStateResponse(
            backend=self.started.backend,
            device=self.started.device,
            device_uuid=self.started.device_uuid,
            capacity_bytes=state.capacity_bytes,
            budget_bytes=state.budget_bytes,
            used_bytes=state.gpu_bytes,
            host_budget_bytes=state.host_budget_bytes,
            host_used_bytes=state.host_bytes,
            sessions=len(state.sessions),
            metadata_bytes=state.metadata_bytes,
            max_metadata_bytes=state.limits.max_metadata_bytes,
            disk_budget_bytes=state.disk_budget_bytes,
            disk_used_bytes=state.disk_bytes,
            first_event_seq=1,
            last_event_seq=self.last_seq,
            layouts=layout_rows(state),
            tenants=tenant_rows(state),
        )


def _image_row(row: dict):
    """The state a saved journal starts from, and its sequence number."""
    from ..handover.image import ImageError, decode_image

    try:
        image = decode_image(bytes.fromhex(row["image"]))
    except (ImageError, ValueError, KeyError, TypeError) as exc:
        raise LogFileError(f"the journal's state image cannot be read: {exc}") from None
    return image


def replay_rows(lines: Iterable[str]) -> Replayed:
    """Fold a saved log; raises LogFileError (not replayable) or InvariantViolation."""
    state = EMPTY_NODE
    started = None
    count = last_seq = 0
    from_image = False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            kind = row.get("kind")
        except (ValueError, AttributeError) as exc:
            raise LogFileError(f"line {number}: not an event row: {exc}") from None
        if kind == "GMS_JOURNAL":
            continue
        if kind == "STATE_PARTS":
            raise LogFileError(f"line {number}: the keeper's base in parts that do not make up a state")
        if kind == "RAW_ENTRIES":
            raise LogFileError(f"line {number}: log entries the server could not decode; replay stops here")
        if kind == "STATE_IMAGE" and count == 0 and not from_image:
            image = _image_row(row)
            state, last_seq, from_image = image.state, image.last_seq, True
            info = image.server
            started = ServerStarted(
                0, state.capacity_bytes, state.budget_bytes, state.host_budget_bytes, {}, {},
                backend=info.backend, device=info.device, device_uuid=info.device_uuid, layout="",
            )
            continue
        seq = row.get("seq") if isinstance(row, dict) else None
        if type(seq) is not int:
            raise LogFileError(f"line {number}: not an event row (its seq is {seq!r})")
        if count == 0 and not from_image and seq != 1:
            raise LogFileError(
                f"the log starts at event {seq}: events 1..{seq - 1} were dropped by the server's "
                "retention (--event-log-retain) or not saved, and the state before them is not in "
                "the file, so it cannot be rebuilt"
            )
        event = row_event(row)
        if (count or from_image) and seq != last_seq + 1 and not restart_gap(seq, event, last_seq):
            raise LogFileError(
                f"line {number}: event {seq} follows {last_seq}: the file is filtered (--layout) "
                "or incomplete"
            )
        try:
            state = fold(state, event)
        except Rejection as refused:  # a server never logs what its rules refuse
            raise InvariantViolation(f"event {seq} ({event.KIND}) breaks a rule: {refused.message}") from None
        except InvariantViolation:
            raise
        except Exception as exc:  # noqa: BLE001 - a value no server writes (an edited file): said, not a traceback
            raise LogFileError(
                f"line {number}: event {seq} ({event.KIND}) cannot be folded: {type(exc).__name__}: {exc}"
            ) from None
        if started is None:
            started = event
        count, last_seq = count + 1, seq
    if started is None:
        raise LogFileError("the log holds no events")
    try:
        check_invariants(state)
    except InvariantViolation:
        raise
    except Exception as exc:  # noqa: BLE001 - as above
        raise LogFileError(f"the state the log folds to cannot be checked: {type(exc).__name__}: {exc}") from None
    return Replayed(state, started, count, last_seq)
