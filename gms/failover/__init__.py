"""Shadow-engine failover: the serving lock and what acts on it.

``lease``: the cluster serving lock on a Kubernetes Lease (needs ``gms[k8s]``).
"""
