"""What a client manager holds: its mappings and reservations, the server's
connection and the backend's mapper, released together (also by the garbage
collector, through a finalizer that holds only this)."""

from __future__ import annotations

import itertools

import attrs

from ..cuda import Mapper, align_up
from ..errors import GMSUsageError
from ..wire import messages as m
from .transport import RpcTransport, _close_all

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

    # -- address space (the manager holds its lock around each) ----------------------

    def need_mapper(self) -> Mapper:
        if self.mapper is None:
            raise GMSUsageError("no backend yet: connect() once before mapping")
        return self.mapper

    def reserve(self, size: int) -> int:
        size = align_up(size, self.need_mapper().granularity)
        va = self.mapper.reserve(size)
        self.reservations[va] = Reservation(va, size)
        return va

    def map_at(self, fd: int, va: int, size: int, info: HandleInfo, tag: str, writable: bool) -> object:
        """Map ``fd`` (consumed) for ``info``'s allocation in the unused reservation at ``va``."""
        reservation = self.reservations.get(va)
        if reservation is None or reservation.members or reservation.size < size:
            raise GMSUsageError(f"no free reservation of {size} bytes at {va:#x}")
        handle = self.need_mapper().map(fd, va, reservation.size, writable)
        reservation.members = 1
        self.mappings[va] = Mapping(
            va, reservation.size, info.allocation_id, info.size, tag, info.layout_slot, va, handle, True
        )
        return handle

    def map_together(self, exported: list[tuple[HandleInfo, int]], writable: bool) -> list[int]:
        """Map each (info, fd) back to back in one new reservation (the driver grants
        access once for all); every fd is consumed, whatever happens.  Their VAs."""
        infos = [info for info, _ in exported]
        try:
            total = sum(info.aligned_size for info in infos)
            base = self.need_mapper().reserve(total)
            self.reservations[base] = Reservation(base, total, len(infos))
            vas = list(itertools.accumulate((i.aligned_size for i in infos[:-1]), initial=base))
            items = [(fd, va, info.aligned_size) for (info, fd), va in zip(exported, vas)]
            exported = []  # map_many consumes every fd, whatever happens
            handles = self.mapper.map_many(items, writable)
        finally:
            _close_all([fd for _, fd in exported])
        for info, va, handle in zip(infos, vas, handles):
            self.mappings[va] = Mapping(
                va, info.aligned_size, info.allocation_id, info.size, info.tag, info.layout_slot, base, handle, True,
            )
        return vas

    def map_again(self, pending: list[Mapping], exported: list[tuple[HandleInfo, int]], writable: bool) -> None:
        """Map each unmapped mapping's (new) allocation back at its own address (fds consumed)."""
        items = [(fd, mp.va, mp.size) for mp, (_, fd) in zip(pending, exported)]
        handles = self.need_mapper().map_many(items, writable)
        for mapping, handle in zip(pending, handles):
            mapping.handle, mapping.mapped = handle, True

    def mapping(self, va: int) -> Mapping:
        try:
            return self.mappings[va]
        except KeyError:
            raise GMSUsageError(f"no mapping at {va:#x}") from None

    def unmap_at(self, va: int) -> None:
        """Unmap and release the memory at ``va``; the reservation stays."""
        mapping = self.mapping(va)
        if mapping.mapped:
            self.mapper.synchronize()
            self.unmap([mapping])

    def free_at(self, va: int) -> None:
        """Forget the mapping at ``va`` (unmapping it) and give its reservation back
        once nothing else lies in it; or free an unused reservation."""
        mapping = self.mappings.get(va)
        if mapping is not None:
            self.unmap_at(va)
            del self.mappings[va]
            reservation = self.reservations[mapping.reservation]
            reservation.members -= 1
        else:
            reservation = self.reservations.get(va)
            if reservation is None or reservation.members:
                raise GMSUsageError(f"no mapping or unused reservation at {va:#x}")
        if reservation.members == 0:
            del self.reservations[reservation.va]
            self.mapper.free(reservation.va, reservation.size)

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
