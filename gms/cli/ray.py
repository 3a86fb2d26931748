"""``gms ray-resources``: this node's GPU memory as Ray resources (JSON for ``ray start --resources``)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import GMSError
from .common import BACKEND_HELP


def _device_list(text: str) -> list[int] | None:
    """``all`` (None) or ``0,1``."""
    if text == "all":
        return None
    try:
        devices = [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not 'all' or a list of devices: {text!r}") from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"devices must be distinct and >= 0: {text!r}")
    return devices


def register(sub) -> None:
    parser = sub.add_parser(
        "ray-resources",
        help="print this node's GPU memory as Ray resources (JSON for `ray start --resources`)",
    )
    parser.add_argument(
        "--devices", type=_device_list, default=None,
        help="'all' (default: every CUDA GPU; device 0 on the host backend) or a list like 0,1",
    )
    parser.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"), help=BACKEND_HELP)
    parser.set_defaults(handler=cmd_ray_resources)


def cmd_ray_resources(args: argparse.Namespace) -> int:
    from ..ray.node import node_resources  # gms.ray's node side: Ray itself is not needed here

    try:
        resources = node_resources(args.devices, args.backend)
    except GMSError as exc:
        print(f"gms ray-resources: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(resources))
    return 0
