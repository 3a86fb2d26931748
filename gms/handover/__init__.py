"""Handing a node over: the state image and its versions, and the frames (with
fds) that carry it between a server, its keeper and the server taking over."""
