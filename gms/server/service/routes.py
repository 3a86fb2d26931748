"""Every request a session answers, and who answers it: one table.

A row says which room answers a request type and how the session runs it:
``waits`` (it may wait for a lock, memory or the copier: awaited; else it is
answered at once, in one step of the core), ``admin`` (only the server's uid,
root or a policy admin: checked once, before it runs), ``describes`` (a probe:
it changes nothing, so its answer waits for nothing to be durable) and
``only_if`` (taken only where the server can: a take-over).  A type with no
row is refused here, once (``UnknownRequest``).  What the request may do is
then the rules' to say (``gms.fsm.rules``); its shape was the wire's
(``gms.wire.messages.SHAPES``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from ...fsm import OverLimit, QuotaExceeded, Rejection
from ...handover.words import Waiting
from ...wire import UnknownMessageType
from ...wire import messages as m
from ...wire.connection import Refused
from ..edge.reply import Reply, UnknownRequest, error_reply
from . import handshake
from .requests import Requests
from .served import Served


class TakeOverAsked(Exception):
    """A connection asked for this server's place: the conversation is the take-over's."""

    def __init__(self, request: m.TakeOverRequest) -> None:
        self.request = request


@attrs.frozen
class Route:
    answer: Callable  # (Served, request) -> Reply, or (waits) an awaitable of one
    waits: bool = False
    admin: bool = False
    describes: bool = False
    only_if: Callable[[Served], bool] | None = None


def _requests(name: str) -> Route:
    """Answered at once by the requests room (``gms.server.service.requests``)."""
    method = getattr(Requests, name)
    return Route(lambda s, request: method(s.core.requests, s.conn, request))


async def _allocate(s: Served, request: m.AllocateRequest) -> Reply:
    placement = s.core.placement
    with s.waiting_for(Waiting.ALLOCATE), s.metrics.allocate_seconds.time():
        response = await placement.with_memory(
            s.conn, lambda: placement.allocate(s.conn, request.size, request.tag),
            request.size, request.tag, s.until_gone, s.quiesce.interruptible,
        )
    return Reply(response)


async def _commit(s: Served, request: m.CommitRequest) -> Reply:
    if s.core.transfers is not None:  # the copier fills the host copies a residency needs
        return await s.core.transfers.commit(s.conn, request)
    return s.core.requests.commit(s.conn, request)


async def _host_copies(s: Served, request: m.ExportHostCopiesRequest) -> Reply:
    return await s.core.host_tier.export_copies(s.conn, request.allocation_ids)


async def _runtime_state(s: Served, request: m.GetRuntimeStateRequest) -> Reply:
    probes = s.core.probes
    return Reply(await probes.runtime_state(probes.view_for(s.peer)))


def _history(s: Served, request: m.GetEventHistoryRequest) -> Reply:
    probes = s.core.probes
    return Reply(probes.history(request.since_seq, request.limit, request.layout, probes.view_for(s.peer)))


def _take_over(s: Served, request: m.TakeOverRequest) -> Reply:
    raise TakeOverAsked(request)


ROUTES: dict[type, Route] = {
    # answered at once, in one step of the core
    m.ExportAllocationRequest: _requests("export"),
    m.ExportAllocationsRequest: _requests("export_many"),
    m.GetAllocationRequest: _requests("get_allocation"),
    m.ListAllocationsRequest: _requests("list_allocations"),
    m.FreeAllocationRequest: _requests("free"),
    m.AbortRequest: _requests("abort"),
    m.MetadataPutRequest: _requests("metadata_put"),
    m.MetadataPutManyRequest: _requests("metadata_put_many"),
    m.MetadataGetRequest: _requests("metadata_get"),
    m.MetadataDeleteRequest: _requests("metadata_delete"),
    m.MetadataListRequest: _requests("metadata_list"),
    m.MetadataScanRequest: _requests("metadata_scan"),
    m.GetStateHashRequest: _requests("state_hash"),
    m.ExportHostChunksRequest: Route(lambda s, r: s.core.host_tier.export_chunks(s.conn, r.allocation_ids, r.start)),
    m.RestoreDoneRequest: Route(lambda s, r: Reply(m.RestoreDoneResponse(s.core.finish_restore(s.conn)))),
    # may wait: for the lock (and a restore), for memory, for the copier
    m.HandshakeRequest: Route(handshake.handshake, waits=True),
    m.AllocateRequest: Route(_allocate, waits=True),
    m.CommitRequest: Route(_commit, waits=True),
    m.ExportHostCopiesRequest: Route(_host_copies, waits=True),
    # probes: they describe
    m.GetRuntimeStateRequest: Route(_runtime_state, waits=True, describes=True),
    m.GetEventHistoryRequest: Route(_history, describes=True),
    # admin verbs
    m.RevokeRequest: Route(lambda s, r: Reply(m.RevokeResponse(s.core.revoke(s.conn, r.layout, s.peer))), admin=True),
    m.EvictRequest: Route(lambda s, r: s.core.evict(s.conn, r.layout), admin=True),
    m.DeleteRequest: Route(lambda s, r: s.core.delete(s.conn, r.layout, s.peer), admin=True),
    m.PinRequest: Route(lambda s, r: s.core.pin(s.conn, r.layout, r.residency), admin=True),
    # another server asks for this one's place (the session hands the connection on)
    m.TakeOverRequest: Route(_take_over, only_if=lambda s: s.on_take_over is not None),
}
DESCRIBES = frozenset(kind for kind, route in ROUTES.items() if route.describes)


async def answer(s: Served, request: object) -> Reply:
    """The reply to one request the wire handed out: its refusal (the wire's, the
    table's, the admin check's, the rules'), or its room's answer."""
    if isinstance(request, Refused):
        return Reply(request.reply())
    if isinstance(request, UnknownMessageType):
        return Reply(m.ErrorResponse(str(request), "UNKNOWN_MESSAGE"))
    try:
        route = ROUTES.get(type(request))
        if route is None or (route.only_if is not None and not route.only_if(s)):
            raise UnknownRequest(f"{type(request).__name__} is not a request this server takes")
        if route.admin:
            s.core.require_admin(s.peer, request)
        return await route.answer(s, request) if route.waits else route.answer(s, request)
    except Rejection as rejection:
        if isinstance(rejection, (OverLimit, QuotaExceeded)) and (delay := s.core.refusal_delay(s.peer)):
            await trio.sleep(delay)  # a uid that keeps asking past its limits (gms.server.edge.tarpit)
        return error_reply(rejection)
