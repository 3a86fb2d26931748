"""Byte counts, and the operator's policy file: what is accepted and how errors read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gms.operator.policy import OPEN_POLICY, PolicyError, parse_policy
from gms.units import format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("1073741824", 1 << 30), ("512MiB", 512 << 20), ("20GiB", 20 << 30), ("20GB", 20 * 10**9),
     ("8Gi", 8 << 30), ("1.5GiB", 3 << 29), ("16 MB", 16 * 10**6), (4096, 4096), ("0.5B", 1)],
)
def test_byte_counts(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["20G", "1g", "-1", "lots", "", "1 zb", -5, True])
def test_ambiguous_or_wrong_byte_counts_are_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_budgets_are_bytes_or_a_fraction_of_the_device():
    assert parse_budget("0.5", 80 << 30) == 40 << 30
    assert parse_budget("1", 80 << 30) == 80 << 30
    assert parse_budget("60GiB", 80 << 30) == 60 << 30
    with pytest.raises(ValueError, match="known size"):
        parse_budget("0.9", None)
    assert format_bytes(3 << 30) == "3.0 GiB" and format_bytes(None) == "-"


POLICY = """
# two teams and an operator
[[tenant]]
name = "inference"
uids = [1000, 1001]
quota = "40GiB"
read = ["shared-*"]
write = ["llama-*", "kv-*"]

[[tenant]]
name = "batch"
gids = [3000]
quota = 0
read = ["llama-*"]

[[tenant]]
name = "ops"
uids = [1500]
admin = true
"""


def test_a_policy_maps_kernel_identities_to_tenants_and_rights():
    policy = parse_policy(POLICY, "policy.toml")
    inference = policy.tenant_for(1001, 9)
    assert inference.name == "inference" and inference.quota_bytes == 40 << 30
    assert inference.may_write("llama-8b") and inference.may_read("shared-x") and not inference.may_write("shared-x")
    assert not inference.may_read("other")
    assert policy.tenant_for(4242, 3000).name == "batch"  # by gid
    assert policy.tenant_for(1000, 3000).name == "inference"  # a uid match wins over a gid
    assert policy.tenant_for(4242, 4242) is None
    assert policy.is_admin(1500, 0, server_uid=7) and policy.is_admin(0, 0, 7) and policy.is_admin(7, 7, 7)
    assert not policy.is_admin(1000, 0, server_uid=7)
    assert policy.quotas() == {"inference": 40 << 30, "batch": 0, "ops": None}
    default = OPEN_POLICY.tenant_for(12345, 12345)
    assert default.name == "default" and default.may_write("anything") and not OPEN_POLICY.is_admin(12345, 1, 7)


@pytest.mark.parametrize(
    "text, line, message",
    [
        ('[[tenant]]\nname = "a"\nuids = [1]\nquota = "lots"\n', 4, "quota"),
        ('[[tenant]]\nname = "a"\nuids = [1]\n\n[[tenant]]\nname = "a"\nuids = [2]\n', 6, "defined twice"),
        ('[[tenant]]\nname = "a"\nuids = [1]\n[[tenant]]\nname = "b"\nuids = [1]\n', 6, "belongs to both"),
        ('[[tenant]]\nname = "a"\nuid = [1]\n', 3, "unknown key 'uid'"),
        ('[[tenant]]\nname = "a"\nuids = [1]\nwrite = "m-*"\n', 4, "list of layout name patterns"),
        ('[[tenant]]\nname = "a"\n', 2, "no uids or gids"),
        ('[server]\nx = 1\n', 1, "unknown table"),
        ('[[tenant]]\nname = "a"\nuids = [1]\nadmin = "yes"\n', 4, "true or false"),
    ],
)
def test_policy_errors_name_the_line(text, line, message):
    with pytest.raises(PolicyError) as error:
        parse_policy(text, "policy.toml")
    assert str(error.value).startswith(f"policy.toml:{line}: ") and message in str(error.value)


def test_a_server_refuses_to_start_on_a_bad_policy(tmp_path):
    def serve_with(text: str) -> subprocess.CompletedProcess:
        policy = tmp_path / "policy.toml"
        policy.write_text(text)
        return subprocess.run(
            [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", str(tmp_path / "s.sock"),
             "--policy", str(policy)],
            capture_output=True, text=True, timeout=60,
        )

    run = serve_with('[[tenant]]\nname = "a"\nuids = [1]\nquota = -3\n')
    assert run.returncode == 78
    assert f"{tmp_path / 'policy.toml'}:4: quota" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "s.sock").exists()
    run = serve_with("[[tenant]\n")
    assert run.returncode == 78 and "not valid TOML" in run.stderr and "line 1" in run.stderr
