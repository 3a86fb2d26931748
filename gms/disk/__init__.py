"""The disk tier: a committed layout's snapshot on local disk, so it outlives the node.

``format`` is the file (pure: a layout's bytes, a manifest, a checksum per
chunk); ``store`` is the folder (made fresh, sealed atomically, found again at
start, released).  The copier moves the bytes (``gms.copier``); the server
decides when (``gms.server.service.snapshots``); the event log says what
exists (``SNAPSHOT_SAVED``, ``LAYOUT_RECOVERED``).
"""
