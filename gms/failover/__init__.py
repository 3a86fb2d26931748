"""Shadow-engine failover: the serving lock, engine sets, and the coordinator.

* ``lock``: the :class:`ServingLock` protocol and :class:`FileServingLock`
  (one node: a kernel file lock, released when its holder dies).
* ``lease``: the cluster serving lock on a Kubernetes Lease (needs ``gms[k8s]``).
* ``sets``: engine sets, one engine per rank: local processes or Kubernetes pods.
* ``coordinator``: watches the serving set and fails over to the shadow set.
"""
