"""Sessions, locks and the rooms that answer requests, over one write path.

``ledger`` is the one write path (record, release, grant, wake) and
``lock_queues`` who waits for which lock; the rooms answer requests:
``requests`` (the plain ones), ``placement`` (memory for an allocation or a
restore, waiting when there is none), ``host_tier`` and ``transfers`` (host
copies, the copier's publish and restore), ``probes`` (state and history);
``core`` (``ServiceCore``) holds them and the sessions' life; ``session`` is
one connection's Trio loop, over ``waits`` (what its request waits on, as data);
``quiesce`` pauses them all for a take-over.
Imports ``tiers`` and ``edge``.
"""
