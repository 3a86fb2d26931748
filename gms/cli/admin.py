"""``gms revoke | evict | delete | pin LAYOUT``: admin verbs (server's uid, root, or a policy admin)."""

from __future__ import annotations

import argparse
import sys

from ..errors import GMSError
from ..units import format_bytes
from .common import client_error, socket_of, target_args


def register(sub) -> None:
    revoke = sub.add_parser("revoke", help="take every lock on a layout away (its writer aborts)")
    target_args(revoke)
    revoke.add_argument("layout", help="the layout's name")
    revoke.set_defaults(handler=cmd_revoke)

    evict = sub.add_parser("evict", help="release an idle layout's GPU memory now")
    target_args(evict)
    evict.add_argument("layout", help="the layout's name")
    evict.set_defaults(handler=cmd_evict)

    delete = sub.add_parser(
        "delete", help="delete an idle committed layout from every tier, its snapshot on disk included",
    )
    target_args(delete)
    delete.add_argument("layout", help="the layout's name")
    delete.set_defaults(handler=cmd_delete)

    pin = sub.add_parser("pin", help="set a committed layout's residency (default: device, never evicted)")
    target_args(pin)
    pin.add_argument("layout", help="the layout's name")
    pin.add_argument(
        "--residency", default="device", choices=("device", "system", "unpinned"),
        help="device: never evicted; system: evicted to the host tier and restored on use; unpinned: evicted "
        "by dropping it (default device)",
    )
    pin.set_defaults(handler=cmd_pin)


def _run(args: argparse.Namespace, verb: str, action) -> int:
    try:
        print(action(socket_of(args)))
    except GMSError as exc:
        print(client_error(verb, exc), file=sys.stderr)
        return 1
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from ..client.admin import revoke

    def action(path: str) -> str:
        return f"{args.layout}: {revoke(path, args.layout, timeout=args.timeout)} sessions revoked"

    return _run(args, "revoke", action)


def cmd_evict(args: argparse.Namespace) -> int:
    from ..client.admin import evict

    def action(path: str) -> str:
        done = evict(path, args.layout, timeout=args.timeout)
        where = "dropped (unpinned)" if done.tier == "none" else f"now on tier {done.tier}"
        return f"{args.layout}: {format_bytes(done.freed_bytes)} of device memory released, {where}"

    return _run(args, "evict", action)


def cmd_delete(args: argparse.Namespace) -> int:
    from ..client.admin import delete

    def action(path: str) -> str:
        done = delete(path, args.layout, timeout=args.timeout)
        return (
            f"{args.layout}: deleted ({format_bytes(done.device_bytes)} of device memory, "
            f"{format_bytes(done.host_bytes)} of host copies, {format_bytes(done.disk_bytes)} of snapshot)"
        )

    return _run(args, "delete", action)


def cmd_pin(args: argparse.Namespace) -> int:
    from ..client.admin import pin

    def action(path: str) -> str:
        return f"{args.layout}: residency {pin(path, args.layout, args.residency, timeout=args.timeout)}"

    return _run(args, "pin", action)
