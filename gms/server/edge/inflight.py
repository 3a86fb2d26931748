"""Bytes a uid's connections make the server buffer: big frames a few at a time.

A connection reads a request whole before it is served, and reads ahead
while one waits: up to two frames (``--max-frame-bytes`` each, 16 MiB by
default) that the server holds in RAM until they are complete.  An answer
is encoded whole before it is sent (a metadata scan's is as big as the
layout's metadata) and held until the client has read it.  A tenant with a
few hundred connections half-sending big frames, or asking for big answers
and never reading them, would make the server hold gigabytes no quota
counts.  So past ``SMALL`` bytes a connection must hold one of its uid's
``SLOTS`` slots, to read on or to encode and send a big answer; the others
wait (their clients' sends block, or their answers wait unencoded: their
values are the state's own objects) until a slot frees, which happens when
a holder's frame is served or its answer sent.  A holder waits only for its
own client, so nothing waits in a circle, and a uid that stalls its own
slots stalls only itself.  What one uid can make the server buffer is then
about ``SLOTS`` x 2 frames plus ``SMALL`` per connection.
"""

from __future__ import annotations

import trio

from ...wire import messages as m

SMALL = 128 << 10
SLOTS = 2


class InFlight:
    def __init__(self, slots: int = SLOTS, small: int = SMALL) -> None:
        self.slots = slots
        self.small = small
        self._uids: dict[int, list] = {}  # uid -> [its semaphore, its connections]

    def slot(self, uid: int) -> FrameSlot:
        entry = self._uids.get(uid)
        if entry is None:
            entry = self._uids[uid] = [trio.Semaphore(self.slots), 0]
        entry[1] += 1
        return FrameSlot(self, uid, entry[0])

    def gone(self, uid: int) -> None:
        """One of ``uid``'s slots closed (FrameSlot.close)."""
        entry = self._uids[uid]
        entry[1] -= 1
        if not entry[1]:
            del self._uids[uid]

    def holders(self, uid: int) -> int:
        entry = self._uids.get(uid)
        return 0 if entry is None else self.slots - entry[0].value


class FrameSlot:
    """One connection's claim on its uid's slots."""

    def __init__(self, owner: InFlight, uid: int, semaphore: trio.Semaphore) -> None:
        self.owner = owner
        self.uid = uid
        self.semaphore = semaphore
        self.held = False
        self.closed = False

    async def before_read(self, buffered: int) -> None:
        """Wait for a slot if the connection holds more than ``SMALL`` bytes already."""
        if buffered > self.owner.small and not self.held:
            await self.semaphore.acquire()
            self.held = True

    async def before_send(self, size: int) -> None:
        """Wait for a slot before encoding an answer of about ``size`` bytes, if big."""
        if size > self.owner.small and not self.held:
            await self.semaphore.acquire()
            self.held = True

    def read_size(self, buffered: int, wanted: int) -> int:
        """How much the next read may take of the ``wanted`` bytes a frame lacks:
        all of them with a slot, else no more than keeps it within ``SMALL``."""
        return wanted if self.held else min(wanted, max(0, self.owner.small - buffered))

    def settle(self, buffered: int) -> None:
        """Give the slot back once what is buffered is small again."""
        if self.held and buffered <= self.owner.small:
            self.held = False
            self.semaphore.release()

    async def read(self, protocol, channel) -> None:
        """Read what comes next into the connection (``gms.wire.connection``) from its
        channel: past a small frame's worth held, only with a slot, which lets the
        rest of a big frame go straight into a buffer of its own."""
        buffered = protocol.buffered
        await self.before_read(buffered)
        wanted = self.read_size(buffered, protocol.wanted)
        space = protocol.body_space() if self.held else None
        if space is None:
            protocol.receive_data(await channel.receive(wanted))
        else:
            protocol.wrote(await channel.receive_into(space))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.settle(0)
        self.owner.gone(self.uid)


def answer_bytes(message: object) -> int:
    """About what encoding ``message`` will take (cheap: no encoding)."""
    if isinstance(message, m.MetadataScanResponse):
        return sum(map(len, message.keys)) + sum(map(len, message.values)) + 48 * len(message.keys)
    if isinstance(message, m.MetadataListResponse):
        return sum(map(len, message.keys)) + 8 * len(message.keys)
    if isinstance(message, m.MetadataGetResponse):
        return len(message.value)
    if isinstance(message, m.ListAllocationsResponse | m.ExportAllocationsResponse | m.ExportHostCopiesResponse):
        return 96 * len(message.allocations)
    if isinstance(message, m.GetEventHistoryResponse):
        return sum(96 + sum(len(v) for v in row.values() if isinstance(v, str | bytes)) for row in message.events)
    if isinstance(message, m.GetRuntimeStateResponse):
        return 256 * (len(message.layouts) + len(message.tenants))
    return 0
