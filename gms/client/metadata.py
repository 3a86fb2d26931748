"""The seed's Tier 1 metadata calls: keys that say where a layout's tensors lie
(allocation, offset) and carry small values.  A part of the manager
(``GMSClientMemoryManager``), kept apart: each call is one round trip over its
connection (``self._link``), under its lock (``self._lock``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..errors import GMSProtocolError
from ..wire import messages as m
from .link import ServerLink


class MetadataCalls:
    _lock: threading.RLock
    _link: ServerLink

    def metadata_put(self, key: str, allocation_id: str, offset_bytes: int, value: bytes) -> bool:
        with self._lock:
            request = m.MetadataPutRequest(key, allocation_id, offset_bytes, bytes(value))
            return self._link.call(request, m.MetadataPutResponse)[0].success

    def metadata_put_many(self, entries: Iterable[tuple[str, str, int, bytes]]) -> int:
        """Put many entries in one round trip, all or none; returns how many."""
        with self._lock:
            infos = [m.MetadataEntryInfo(k, a, o, bytes(v)) for k, a, o, v in entries]
            return self._link.call(m.MetadataPutManyRequest(infos), m.MetadataPutManyResponse)[0].count

    def metadata_get(self, key: str) -> tuple[str, int, bytes] | None:
        with self._lock:
            response, _ = self._link.call(m.MetadataGetRequest(key), m.MetadataGetResponse)
            if not response.found:
                return None
            return response.allocation_id, response.offset_bytes, response.value

    def metadata_list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return self._link.call(m.MetadataListRequest(prefix), m.MetadataListResponse)[0].keys

    def metadata_scan(self, prefix: str = "") -> dict[str, tuple[str, int, bytes]]:
        """Every entry under ``prefix`` in one round trip (sorted by key)."""
        with self._lock:
            response, _ = self._link.call(m.MetadataScanRequest(prefix), m.MetadataScanResponse)
            try:
                return {key: (alloc, offset, value) for key, alloc, offset, value in response.rows()}
            except ValueError as exc:
                raise GMSProtocolError(str(exc)) from exc

    def metadata_delete(self, key: str) -> bool:
        with self._lock:
            return self._link.call(m.MetadataDeleteRequest(key), m.MetadataDeleteResponse)[0].deleted
