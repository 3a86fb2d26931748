"""Shadow-engine failover: a serving lock, engine sets, and the coordinator.

* ``lock``: the :class:`ServingLock` protocol and :class:`FileServingLock`
  (one node: a kernel file lock, released when its holder dies).
* ``coreapi``: the core calls this package and the example engine make, kept
  in one place (layouts on a per-GPU server, the admin ``revoke``).
* ``sets``: engine sets, one engine per rank: local processes or Kubernetes pods.
* ``coordinator``: watches the serving set and fails over to the shadow set.
"""
