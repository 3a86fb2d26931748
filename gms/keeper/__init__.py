"""The keeper: a small process with no CUDA that holds what must outlive a gms
server (its memory's fds, its listening socket, its journal) and hands it to
the next one.  ``store`` is what it holds, ``run`` the process, ``systemd``
the same held by systemd's fd store where systemd runs it."""
