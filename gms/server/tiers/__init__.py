"""Memory and its tiers: the tables of what the server holds, and the threads that make it.

One table per tier (``memory``: GPU allocations, each an fd; ``host_memory``:
host copies as chunks, and the pool), each calling its backend from a lane
thread of its own (``lanes``); the signal that memory was released
(``memory_signal``); the copier process's supervisor (``copier_link``).  No
state machine here: the tables hold what the log says, and are told by the
service's write path.  Imports ``edge`` (the fd budget) and nothing above.
"""
