"""The OS edge: what the kernel says and does for every gms process, standard library only.

Who is on the other end of a socket (``peer``), room in the fd table (``fds``), a
process's state (``procs``), the heap (``heap``) and the collector (``cyclegc``) of a
long-lived server, systemd's notify protocol (``sdnotify``), files written following no
link (``files``), how gms starts gms (``launch``), where a server listens (``paths``).
Every floor may import these; they import nothing of gms but ``errors``.
"""
