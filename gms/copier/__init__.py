"""The copier: a process per server that moves bytes between the host tier and the GPU.

The server owns every byte of both tiers but has no CUDA context, and mapping
host memory for a GPU is dear (8 to 10 ms per GiB of set-access on the H100
host, against 0.1 ms for device memory).  The copier is the one process that
maps the host tier, once per chunk for the chunk's life, and copies between
it and device allocations the server exports to it: a restore's host to
device copy (the reader just waits for its lock) and a publish's device to
host copy (the writer just commits).  docs/architecture.md ("The copier").

* ``messages``: the link (a socketpair, small frames, fds by SCM_RIGHTS);
* ``engine`` / ``cuda_engine``: mapping and copying (memmove, or CUDA streams);
  ``engines``: which one a backend copies with;
* ``process``: the process's loop; ``selftest``: the engine alone, once.

Nothing here is imported by the server: it starts ``python -m gms.copier``.
"""
