"""Who gets a connection, and the server's file descriptors.

A connection costs the server an fd (and a task, and a read buffer) from the
moment it is accepted, before anyone knows what it wants, so it is judged
then, on the kernel's word of who the peer is:

* **admins** (root, the server's own uid, a policy admin) are always let in:
  ``gms status`` and ``gms revoke`` must work while others flood the server;
* **everyone else** is held to ``max_connections_per_uid`` open connections
  per uid, and refused once the server's fds reach its **budget**: the fd
  limit (RLIMIT_NOFILE) less a **reserve** that only admins' connections use.

The fd count is kept, not asked of the kernel (listing /proc/self/fd costs
O(fds)): the fds open when serving began, one per connection, one per
allocation and per chunk of host memory (each holds the fd every export
dups), and one per fd lent to a reply (or to the copier) until it is sent.
A server that took a node over counts what it adopted and was handed the
same way (:func:`open_admission`, :meth:`Admission.enter`).  Memory may hold at most three quarters
of the budget, so a writer making tiny allocations can never take the fds
that readers' exports and new connections need; past it an allocation is
RESOURCE_EXHAUSTED at once (never a wait for memory, which would never come).
The first request's deadline and its size cap live in the session
(``gms.server.service.session``) and the wire (``gms.wire.connection``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator

import attrs
import trio

from ...fsm import OverLimit
from ...operator.policy import Policy
from ...system.peer import Peer, peer_of
from ...wire import encode
from ...wire import messages as m
from .reply import error_reply

log = logging.getLogger("gms.server")

# Connections the kernel holds for the server before it accepts them.  Each
# waits behind all the others: a flood keeps the queue full, so it is short
# (16 refusals take the server about half a millisecond), and clients wait
# for room in the kernel, in line, rather than in it
# (gms.client.transport._connect).  At 64, a tenant's connect under a
# stranger's flood waited behind 64 refusals: its reads' p50 went from 0.74
# to 2.42 ms; at 16, to 1.19 ms (2-core host, docs/reliability.md).
LISTEN_BACKLOG = 16


class FdsExhausted(OverLimit):
    """The server's fds are at their budget: refused now, nothing waits."""

    code = "RESOURCE_EXHAUSTED"


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def default_reserve(limit: int) -> int:
    """Room kept for admins' connections and what the server opens on its own."""
    return min(256, max(16, limit // 8))


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return 64


class FdBudget:
    """The server's fd count against its limit (see the module's doc).

    Made before the memory tables, which are given it; it binds once the
    server has taken its node (:meth:`settle`: what is open then, less what
    the tables count).  Until then (adopting a node's memory) nothing is refused."""

    def __init__(self, limit: int, reserve: int, base: int | None = None,
                 memory: Callable[[], int] = lambda: 0) -> None:
        self.limit = limit
        self.reserve = reserve
        self.base = base  # None: not bound yet
        self.memory = memory  # fds held by allocations and host copies, counted by their tables
        self.connections = 0
        self.lent = 0

    @classmethod
    def for_config(cls, config, memory: Callable[[], int]) -> FdBudget:
        limit = fd_limit()
        return cls(limit, config.fd_reserve if config.fd_reserve is not None else default_reserve(limit),
                   memory=memory)

    def settle(self, uncounted: int = 0) -> None:
        """Bind the budget: the fds open now, less the memory tables' (counted by
        them) and ``uncounted`` others that will be counted as they are used (a
        take-over's clients' sockets, counted by their sessions' tickets)."""
        self.base = max(0, open_fds() - self.memory() - uncounted)

    @property
    def budget(self) -> int:
        """What non-admins may take the count to."""
        return max(0, self.limit - self.reserve)

    @property
    def memory_budget(self) -> int:
        return self.budget * 3 // 4

    def used(self, memory: int | None = None) -> int:
        """Fds in use; ``memory``: the memory tables' count, if the caller has it already."""
        return (self.base or 0) + self.connections + self.lent + (self.memory() if memory is None else memory)

    def room(self, more: int = 1) -> bool:
        return self.base is None or self.used() + more <= self.budget

    def check_memory(self, more: int) -> None:
        if self.base is None:
            return
        held = self.memory()
        used = self.used(held)  # the tables summed once
        if held + more <= self.memory_budget and used + more <= self.budget:
            return  # the common case: no message made
        why = f"the server has no file descriptor to spare for more memory (its fd limit is {self.limit})"
        if held + more > self.memory_budget:
            raise FdsExhausted(
                "fds", "node", held, more, self.memory_budget,
                f"{why}: every allocation and host copy holds one, and memory may hold three quarters "
                "of what is not kept for admins",
            )
        raise FdsExhausted("fds", "node", used, more, self.budget, why)

    def lend(self, count: int) -> None:
        """Fds an export is about to dup; give them back with :meth:`returned`."""
        if count and not self.room(count):
            raise FdsExhausted(
                "fds", "node", self.used(), count, self.budget,
                f"the server has no file descriptor to spare for an export (its fd limit is {self.limit})",
            )
        self.lent += count

    def returned(self, count: int) -> None:
        self.lent -= count


@contextlib.contextmanager
def lending(budget: FdBudget | None, count: int) -> Iterator[None]:
    """Fds an export dups for a reply, lent from the budget (the session gives them
    back once sent); given back at once if the export fails."""
    if budget is None:
        yield
        return
    budget.lend(count)
    try:
        yield
    except BaseException:
        budget.returned(count)
        raise


@attrs.frozen
class Ticket:
    """An admitted connection: give it back with :meth:`Admission.leave`."""

    uid: int
    admin: bool


class Admission:
    def __init__(
        self,
        policy: Policy,
        server_uid: int,
        fds: FdBudget,
        *,
        max_connections_per_uid: int | None = 256,
    ) -> None:
        self.policy = policy
        self.server_uid = server_uid
        self.fds = fds
        self.max_per_uid = max_connections_per_uid
        self.by_uid: Counter[int] = Counter()
        self.frames = _Frames()
        self.refusals = _Refusals()

    def admit(self, peer: Peer) -> Ticket:
        """Count the connection in, or raise the OverLimit that refuses it."""
        admin = self.policy.is_admin(peer.uid, peer.gid, self.server_uid)
        if not admin:
            held = self.by_uid[peer.uid]
            if self.max_per_uid is not None and held >= self.max_per_uid:
                raise OverLimit(
                    "max_connections_per_uid", "uid", held, 1, self.max_per_uid,
                    f"uid {peer.uid} already has {held} connections open to this server",
                )
            # The accepted socket is open already: it is the one asked for.
            if self.fds.used() + 1 > self.fds.budget:
                raise FdsExhausted(
                    "fds", "node", self.fds.used(), 1, self.fds.budget,
                    "the server's file descriptors are at their budget (the rest is kept for admins)",
                )
        return self.enter(peer, admin)

    def enter(self, peer: Peer, admin: bool | None = None) -> Ticket:
        """Count in a connection that is not judged: one a take-over handed over, or
        a parked one going on after a take-over that did not happen.  Its client
        was served a moment ago; refusing it now would be the one thing a
        take-over promises not to do.  It counts against its uid's cap and the
        fds like any other (a uid over its cap then opens no more until under)."""
        if admin is None:
            admin = self.policy.is_admin(peer.uid, peer.gid, self.server_uid)
        self.by_uid[peer.uid] += 1
        self.fds.connections += 1
        return Ticket(peer.uid, admin)

    def leave(self, ticket: Ticket) -> None:
        self.fds.connections -= 1
        self.by_uid[ticket.uid] -= 1
        if not self.by_uid[ticket.uid]:
            del self.by_uid[ticket.uid]


_ACCEPT_CAPACITY = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)
# A connection that went wrong before it was accepted: the next one is
# waiting (the errors Trio's SocketListener skips, for the same reasons).
_ACCEPT_SKIPPED = frozenset(
    getattr(errno, name) for name in ("EPERM", "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN",
                                      "ENONET", "EHOSTUNREACH", "EOPNOTSUPP", "ENETUNREACH") if hasattr(errno, name)
)


async def serve(
    admission: Admission,
    listener: socket.socket,
    admitted: Callable[[socket.socket, Peer, Ticket], None],
    on_refused: Callable[[str], None] = lambda limit: None,
) -> None:
    """Accept until cancelled; judge each connection before it costs a task.

    Trio's ``serve_listeners`` starts a task per connection, and a refusal then
    cost a task's start and end: a stranger opening connections as fast as it
    can kept the listen queue full, and everyone else's connect waited behind
    it.  Here a refusal is a few system calls in the accept loop (the error
    written, the socket closed) and only admitted connections get a task:
    ``admitted`` starts it, and makes the session at once (a take-over's
    quiet point then counts it, though its task has not run yet).

    The accept is the system call itself on the (non-blocking) listener:
    Trio's own accept yields to the scheduler twice per connection it takes
    and wraps it in a stream the session unwraps again (a connect, a round
    trip and a close: 175 against 69 µs for a bare echo server, 2-core host,
    docs/results/rpc_floors_2core.json).  After each connection it waits for the
    listener to be readable: one pass through the scheduler per connection,
    as fair as Trio's; it is a cancellation point each time round, as Trio's is."""
    while True:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        except OSError as exc:
            if exc.errno in _ACCEPT_SKIPPED:
                continue
            if exc.errno not in _ACCEPT_CAPACITY:
                raise
            log.error("accept failed: %s; retrying in 0.1 s", os.strerror(exc.errno))
            await trio.sleep(0.1)
            continue
        _judge(admission, sock, admitted, on_refused)
        # One pass through the scheduler per connection, admitted or refused: the
        # session just started runs before the next accept is tried (its client
        # waits for it), and a flood of strangers cannot keep the loop to itself.
        await trio.lowlevel.wait_readable(listener)


def _judge(admission: Admission, sock: socket.socket, admitted, on_refused) -> None:
    """Admit the connection (``admitted`` starts its session) or refuse it at once."""
    try:
        peer = peer_of(sock)
    except OSError:  # the peer left before we asked who it was
        sock.close()
        return
    try:
        ticket = admission.admit(peer)
    except OverLimit as refused:  # answered before the close, as if to its first request
        try:
            os.write(sock.fileno(), admission.frames.get(refused))
        except OSError:
            pass
        sock.close()
        on_refused(refused.limit)
        admission.refusals.note(peer.uid, refused)
        return
    admitted(sock, peer, ticket)


def refusal_frame(refused: OverLimit) -> bytes:
    """The answer a refused connection finds before its close (as the answer to its first request)."""
    message = error_reply(refused).message
    assert isinstance(message, m.ErrorResponse)
    return encode(message)


class _Frames:
    """Refusals' frames, encoded once: a flood gets the same answer thousands of times."""

    def __init__(self, size: int = 64) -> None:
        self._frames: dict[tuple, bytes] = {}
        self._size = size

    def get(self, refused: OverLimit) -> bytes:
        key = (refused.limit, refused.scope, refused.used, refused.asked, refused.bound, refused.message)
        frame = self._frames.get(key)
        if frame is None:
            if len(self._frames) >= self._size:
                self._frames.clear()
            frame = self._frames[key] = refusal_frame(refused)
        return frame


class _Refusals:
    """One log line per uid and interval, counting the refusals since the last:
    a flood must not cost a log record per connection (even one a filter drops)."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._since: dict[int, tuple[float, int]] = {}  # uid -> (last line, refusals since)

    def note(self, uid: int, refused: OverLimit) -> None:
        now = self.clock()
        last, held = self._since.get(uid, (-self.interval, 0))
        if now - last < self.interval:
            self._since[uid] = (last, held + 1)
            return
        more = f" (and {held} more since the last line)" if held else ""
        log.warning("refused a connection from uid %d: %s%s", uid, refused.message, more)
        if len(self._since) > 4096:
            self._since.clear()
        self._since[uid] = (now, 0)


def open_admission(fds: FdBudget, config, server_uid: int, *, uncounted: int = 0) -> Admission:
    """The server's admission, once its node is taken: the fd budget bound.

    A server that took a node over holds fds already: the memory it adopted
    (counted by the tables, so left out of the base) and ``uncounted`` others
    open now (:meth:`FdBudget.settle`).  The keeper's fds are in the keeper's
    table, not this one: it holds one per fd the memory tables hold (and the
    listener), under the same limit (``gms serve`` raises both to the hard
    limit), so the memory bound here keeps it within its own."""
    fds.settle(uncounted)
    return Admission(config.policy, server_uid, fds, max_connections_per_uid=config.max_connections_per_uid)
