"""What a client manager holds: its mappings and reservations, the server's
connection and the backend's mapper, released together (also by the garbage
collector, through a finalizer that holds only this)."""

from __future__ import annotations

import attrs

from ..cuda import Mapper
from ..wire import messages as m
from .transport import RpcTransport

HandleInfo = m.GetAllocationResponse


@attrs.define
class Mapping:
    """An address range and the allocation it holds (or held, while unmapped)."""

    va: int
    size: int  # the allocation's aligned size
    allocation_id: str
    alloc_size: int
    tag: str
    layout_slot: int
    reservation: int  # base address of the reservation it lies in
    handle: object = None
    mapped: bool = False


@attrs.define
class Reservation:
    """Reserved address space; one for a batch of mappings made together, so
    their access is granted in one call.  Freed when its last mapping goes."""

    va: int
    size: int
    members: int = 0


class Resources:
    """Everything that must be released, reachable without the manager (for GC)."""

    def __init__(self) -> None:
        self.transport: RpcTransport | None = None
        self.mapper: Mapper | None = None
        self.mappings: dict[int, Mapping] = {}
        self.reservations: dict[int, Reservation] = {}

    def unmap(self, mappings) -> None:
        live = [mp for mp in mappings if mp.mapped]
        if live:
            self.mapper.unmap_many([(mp.va, mp.size, mp.handle) for mp in live])
        for mp in live:
            mp.mapped, mp.handle = False, None

    def release(self) -> None:
        if self.mapper is not None:
            self.unmap(self.mappings.values())
            for reservation in self.reservations.values():
                self.mapper.free(reservation.va, reservation.size)
        self.mappings.clear()
        self.reservations.clear()
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def handle_info(response) -> HandleInfo:
    return HandleInfo(
        response.allocation_id, response.size, response.aligned_size, response.tag, response.layout_slot
    )
