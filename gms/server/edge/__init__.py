"""The socket edge: what a connection meets before any state does.

The boundary where OS errors become the server's own (``netio``), who may
connect and the fds the server may spend on them (``admission``: connections
per uid, the fd budget the memory tables are given), a request's frame in
flight (``inflight``), refusals answered late to a uid that keeps asking
(``tarpit``), repeated log lines summed (``ratelimit``), and the reply a room
hands back (``reply``).  Imports nothing else of the server.
"""
