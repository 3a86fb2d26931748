"""What a new server records when it takes a node's state over.

A server that resumes a node (from its keeper after a crash, or from a live
server handing over) records, in order:

* ``SERVER_RESUMED``: who it took over from, why, the hand-over format it read
  and its own configuration (which replaces the old one's);
* after a crash (``restart``), the dead server's connections as disconnects:
  each session's lock released (``RW_ABORT``: an uncommitted build dropped,
  ``RESTORE_ABORTED``) and the session closed, a reader both in one
  (``READER_LEFT``), in connection order, exactly as if each client had hung up;
* for every committed layout some of whose memory is gone (an fd that no
  longer imports): ``LAYOUT_FELL_TO_DISK`` if its snapshot holds it (the rest
  of its memory goes, the layout stays committed on the disk tier), else
  ``LAYOUT_LOST`` (dropped whole, whatever its residency).

After a take-over the sessions go on: nothing is disconnected, and the memory
was being served a moment before, so none is lost.  Pure: the shell checks the
memory and passes what it found lost.
"""

from __future__ import annotations

from collections.abc import Iterable

from .events import Event, LayoutFellToDisk, LayoutLost, ServerResumed
from .node import NodeState, fold_all
from .sessions import decide_disconnect


def decide_resume(
    node: NodeState,
    resumed: ServerResumed,
    lost: Iterable[tuple[str, str]] = (),
    reason: str = "its memory is gone",
) -> list[Event]:
    """The events that take ``node`` over; ``lost`` holds (tier, allocation id)
    pairs whose memory the shell found gone."""
    events: list[Event] = [resumed]
    state = fold_all(events, node)
    if resumed.mode == "restart":
        for conn in sorted(state.sessions):
            closing = decide_disconnect(state, conn)
            state = fold_all(closing, state)
            events += closing
    lost = list(lost)
    if lost:
        where, gone_already = _where(state), set()
        for tier, allocation_id in lost:
            name = where.get((tier, allocation_id))
            if name is None or name in gone_already:
                continue  # its layout went with a dead writer's build, or with an earlier loss
            gone_already.add(name)
            kind = LayoutFellToDisk if state.layouts[name].saved else LayoutLost
            gone = kind(0, reason, allocation_id, tier, layout=name)
            state = fold_all([gone], state)
            events.append(gone)
    return events


def _where(node: NodeState) -> dict[tuple[str, str], str]:
    """(tier, allocation id) -> layout, for the memory the node holds now."""
    found: dict[tuple[str, str], str] = {}
    for layout in node.layouts.values():
        if layout.gpu_bytes:
            for allocation_id in layout.allocations:
                found[("gpu", allocation_id)] = layout.name
        for allocation_id in layout.host_copies:
            found[("host", allocation_id)] = layout.name
    return found


def held_memory(node: NodeState) -> dict[tuple[str, str], int]:
    """Every (tier, allocation id) the node's state says server memory exists
    for, with the allocation's aligned size (a host tier with a coarser
    granularity made its copy larger: the shell aligns it)."""
    held: dict[tuple[str, str], int] = {}
    for layout in node.layouts.values():
        if layout.gpu_bytes:
            for allocation in layout.allocations.values():
                held[("gpu", allocation.allocation_id)] = allocation.aligned_size
        for allocation_id, size in layout.host_copies.items():
            held[("host", allocation_id)] = size
    return held
