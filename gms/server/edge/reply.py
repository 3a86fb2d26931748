"""What the shell sends back: a message, the fds that ride with it, whether it is the last."""

from __future__ import annotations

import attrs

from ...fsm import OverLimit, QuotaExceeded, Rejection
from ...wire import messages as m


@attrs.frozen
class Reply:
    message: object
    fds: tuple[int, ...] = ()
    close_after: bool = False


def error_reply(rejection: Rejection, *, close_after: bool = False) -> Reply:
    if isinstance(rejection, QuotaExceeded):
        message = m.ErrorResponse(
            rejection.message, rejection.code, rejection.scope, rejection.used, rejection.asked, rejection.quota
        )
    elif isinstance(rejection, OverLimit):
        message = m.ErrorResponse(
            rejection.message, rejection.code, rejection.scope, rejection.used, rejection.asked, rejection.bound,
            rejection.limit,
        )
    else:
        message = m.ErrorResponse(rejection.message, rejection.code)
    return Reply(message, close_after=close_after)


class UnknownRequest(Rejection):
    code = "UNKNOWN_MESSAGE"


def allocation_info(allocation, cls: type = m.AllocationInfo, aligned: int | None = None):
    a = allocation
    return cls(a.allocation_id, a.size, a.aligned_size if aligned is None else aligned, a.tag, a.layout_slot)
