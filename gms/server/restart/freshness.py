"""A spare serves what is in force when it takes the node, not what was when it started.

A spare starts seconds (or days) before the server it replaces, and reads its
policy and loads its code then; the operator may have edited the policy or
upgraded gms since.  Handed the node, it reads the policy file again and
serves that (one that no longer loads stops it as it would stop a server
started cold: exit 78, the keeper keeping the node), and looks at its own
code on disk: if any module it loaded changed, it steps aside before taking
anything (``stopping: stale``) and its keeper starts a server at once, from
cold, with the code in force.  A server started cold passes at once.
"""

from __future__ import annotations

import logging

import attrs

from ...operator.policy import load_policy
from ...system.launch import code_stamp
from ..config import ServerConfig

log = logging.getLogger("gms.server.restart")


class StaleCode(Exception):
    """gms on disk is not the code this process runs: a server started now would differ."""


@attrs.frozen
class Started:
    """What a server read as it started: its code on disk."""

    code: tuple = attrs.field(factory=code_stamp)


def in_force(config: ServerConfig, started: Started) -> ServerConfig:
    """``config`` with the policy as its file says now; raises StaleCode if the
    code changed since ``started``, PolicyError if the policy no longer loads."""
    now = code_stamp([path for path, *_ in started.code])
    if now != started.code:
        changed = [a[0] for a, b in zip(started.code, now) if a != b]
        raise StaleCode(f"{len(changed)} of its files changed since it started ({changed[0]}, ...)")
    if config.policy_file is None:
        return config
    policy = load_policy(config.policy_file)
    if policy == config.policy:
        return config
    log.info("the policy %s changed since this server started: serving it as it is now", config.policy_file)
    return attrs.evolve(config, policy=policy)
