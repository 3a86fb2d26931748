"""deploy/: every manifest validated offline against the Kubernetes schemas, and
the checks a schema cannot make.

The schemas are the ones kubernetes-validate ships (strict: unknown fields are
errors). They are checked against the oldest Kubernetes with the DRA API the
manifests use (resource.k8s.io/v1, 1.34) and the newest the package knows.
No cluster is involved, and an audit hook proves no network is either.
"""

from __future__ import annotations

import copy
import functools
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install 'gms[test]'")
yaml = pytest.importorskip("yaml")

from gms.failover import config as failover_config

from .helpers import wait_until

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
VERSIONS = ("1.34.0", kubernetes_validate.latest_version())
GMS_IMAGE = "registry.example.com/gms"
ENGINE_IMAGE = "registry.example.com/gms-engine"

# -- no network: every socket connection or name lookup while validating is recorded

_NETWORK_EVENTS = ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "http.client.connect",
                   "urllib.Request")
_recording: list | None = None


def _audit(event: str, args) -> None:
    if _recording is not None and event in _NETWORK_EVENTS:
        _recording.append((event, args))


sys.addaudithook(_audit)  # cannot be removed: it records only while a test asks


def validate(doc: dict, version: str) -> None:
    """kubernetes-validate, strict; a kind it has no schema for is a failure, not a warning."""
    global _recording
    _recording = []
    try:
        kubernetes_validate.validate(doc, version, strict=True)
        assert _recording == [], f"validation touched the network: {_recording}"
    finally:
        _recording = None


# -- the manifests


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d]


@functools.cache
def all_documents() -> tuple[tuple[Path, dict], ...]:
    """Parsed once; tests copy before they change anything."""
    return tuple((p, d) for p in manifest_files() for d in documents(p))


def find(kind: str, name: str | None = None, under: str | None = None) -> list[dict]:
    return [d for p, d in all_documents()
            if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
            and (under is None or p.parent.name == under)]


def one(kind: str, name: str | None = None, under: str | None = None) -> dict:
    (doc,) = find(kind, name, under)
    return doc


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def containers(spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def mounts(container: dict) -> dict[str, str]:
    """volume name -> mount path"""
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def volumes(spec: dict) -> dict[str, dict]:
    return {v["name"]: v for v in spec.get("volumes", [])}


def command(container: dict) -> list[str]:
    return container.get("command", []) + container.get("args", [])


IDS = [f"{p.relative_to(DEPLOY)}:{d['kind']}/{d['metadata']['name']}" for p, d in all_documents()]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", [d for _, d in all_documents()], ids=IDS)
def test_every_manifest_validates(doc, version):
    validate(doc, version)


def test_there_are_manifests_for_every_part():
    kinds = {(p.parent.name, d["kind"]) for p, d in all_documents()}
    for part in [("node-daemon", "DaemonSet"), ("sidecar", "StatefulSet"), ("separate-pods", "StatefulSet"),
                 ("separate-pods", "ResourceClaim"), ("coordinator", "Deployment"), ("coordinator", "Role"),
                 ("coordinator", "RoleBinding"), ("coordinator", "ServiceAccount")]:
        assert part in kinds


def test_the_validator_is_strict_and_knows_no_more_than_it_says():
    good = one("StatefulSet", "gms-rank")
    validate(good, VERSIONS[0])
    typo = copy.deepcopy(good)
    pod_spec(typo)["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(typo, VERSIONS[0])
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(wrong_type, VERSIONS[0])
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({**one("ResourceClaim"), "apiVersion": "resource.k8s.io/v9"}, VERSIONS[0])


def test_the_claims_also_validate_as_v1beta2_on_kubernetes_1_33():
    """docs/deploy.md tells 1.33 users to change only the apiVersion."""
    claims = find("ResourceClaim") + find("ResourceClaimTemplate")
    assert claims
    for claim in claims:
        validate({**claim, "apiVersion": "resource.k8s.io/v1beta2"}, "1.33.0")


def test_kustomizations_list_every_manifest_and_nothing_missing():
    listed: set[Path] = set()
    for kust in DEPLOY.rglob("kustomization.yaml"):
        for entry in yaml.safe_load(kust.read_text())["resources"]:
            target = (kust.parent / entry).resolve()
            assert target.exists(), f"{kust}: {entry} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists()
            else:
                listed.add(target)
    assert set(manifest_files()) == listed


# -- the sidecar pattern


def test_sidecar_engines_share_the_gms_socket_volume_and_the_gpus():
    spec = pod_spec(one("StatefulSet", "gms-rank"))
    cs = containers(spec)
    gms, primary, shadow = cs["gms"], cs["primary"], cs["shadow"]
    assert gms["restartPolicy"] == "Always"  # a native sidecar: up before the engines
    (socket_volume,) = [v for v in mounts(gms) if "emptyDir" in volumes(spec)[v]]
    path = mounts(gms)[socket_volume]
    for c in (gms, primary, shadow):
        assert mounts(c)[socket_volume] == path
        assert env(c)["GMS_SOCKET_DIR"] == path
        assert c["resources"]["claims"] == [{"name": spec["resourceClaims"][0]["name"]}]
    assert (env(primary)["GMS_MODE"], env(shadow)["GMS_MODE"]) == ("primary", "shadow")
    assert one("ResourceClaimTemplate", spec["resourceClaims"][0]["resourceClaimTemplateName"])


# -- the separate-pods pattern


def engine_sets() -> dict[tuple[str, str], dict]:
    """(set, rank) -> StatefulSet, in the separate-pods pattern"""
    out = {}
    for doc in find("StatefulSet", under="separate-pods"):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        out[(labels["gms.failover/set"], labels["gms.failover/rank"])] = doc
    return out


def test_separate_pods_primary_and_shadow_share_one_resource_claim():
    sets = engine_sets()
    ranks = {rank for _, rank in sets}
    assert ranks and set(sets) == {(s, r) for s in ("a", "b") for r in ranks}
    claims = {c["metadata"]["name"] for c in find("ResourceClaim", under="separate-pods")}
    for rank in ranks:
        a, b = pod_spec(sets[("a", rank)]), pod_spec(sets[("b", rank)])
        names = {spec["resourceClaims"][0]["resourceClaimName"] for spec in (a, b)}
        assert len(names) == 1 and names <= claims  # the SAME, existing claim
        modes = {env(containers(spec)["engine"])["GMS_MODE"] for spec in (a, b)}
        assert modes == {"primary", "shadow"}


def test_separate_pods_engines_mount_the_daemonsets_socket_folder():
    daemon = pod_spec(one("DaemonSet", "gms-server"))
    gms = containers(daemon)["gms"]
    (host_volume,) = [v for v in mounts(gms) if "hostPath" in volumes(daemon)[v]]
    host_path = volumes(daemon)[host_volume]["hostPath"]["path"]
    assert env(gms)["GMS_SOCKET_DIR"] == mounts(gms)[host_volume]
    assert mounts(containers(daemon)["socket-dir"])[host_volume] == mounts(gms)[host_volume]
    for doc in engine_sets().values():
        spec = pod_spec(doc)
        engine = containers(spec)["engine"]
        (vol,) = [v for v in mounts(engine) if "hostPath" in volumes(spec)[v]]
        assert volumes(spec)[vol]["hostPath"]["path"] == host_path
        assert env(engine)["GMS_SOCKET_DIR"] == mounts(engine)[vol]


def test_separate_pods_needs_privileged_pod_security_and_says_so():
    assert one("Namespace", "gms")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    kust = yaml.safe_load((DEPLOY / "separate-pods" / "kustomization.yaml").read_text())
    (patch,) = [p for p in kust["patches"] if p["target"]["kind"] == "Namespace"]
    ops = yaml.safe_load(patch["patch"])
    assert {"op": "replace", "path": "/metadata/labels/pod-security.kubernetes.io~1enforce",
            "value": "privileged"} in ops


# -- gms, the engines, probes, metrics


def gms_containers() -> list[tuple[dict, dict]]:
    """(pod template's metadata, gms container) for every gms server."""
    return [(doc["spec"]["template"]["metadata"], containers(pod_spec(doc))["gms"])
            for doc in find("DaemonSet") + find("StatefulSet", "gms-rank")]


def test_gms_serves_every_gpu_with_metrics_and_status_probes():
    for meta, gms in gms_containers():
        argv = command(gms)
        assert argv[:4] == ["gms", "serve", "--devices", "all"]
        port = int(argv[argv.index("--metrics-port") + 1])
        assert {"name": "metrics", "containerPort": port} in gms["ports"]
        assert meta["annotations"]["prometheus.io/port"] == str(port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            script = gms[probe]["exec"]["command"]
            assert script[:2] == ["sh", "-c"] and "gms status --socket" in script[2]
            shlex.split(script[2])  # well-formed shell words


def test_engines_probe_health_on_a_port_they_expose():
    engines = [c for doc in find("StatefulSet") for n, c in containers(pod_spec(doc)).items() if n != "gms"]
    assert len(engines) == 4
    for c in engines:
        port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
        argv = command(c)
        assert argv[argv.index("--host") + 1] == "0.0.0.0"  # reachable by the kubelet
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health"
            assert port_names[get["port"]] == int(argv[argv.index("--port") + 1])


def test_images_are_the_placeholders_the_kustomizations_set():
    images = {c["image"].rsplit(":", 1)[0] for _, d in all_documents() if "template" in d.get("spec", {})
              for c in containers(pod_spec(d)).values()}
    assert images == {GMS_IMAGE, ENGINE_IMAGE}
    for pattern in ("sidecar", "separate-pods"):
        kust = yaml.safe_load((DEPLOY / pattern / "kustomization.yaml").read_text())
        assert {i["name"] for i in kust["images"]} == images


def test_restricted_pods_meet_pod_security_restricted_essentials():
    for doc in (one("Deployment", "gms-failover-coordinator"), one("StatefulSet", "gms-rank")):
        spec = pod_spec(doc)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not any("hostPath" in v for v in volumes(spec).values())
        for c in containers(spec).values():
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


# -- the coordinator


def rules_by_resource(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_coordinator_role_grants_exactly_lease_and_pod_verbs():
    role = one("Role", "gms-failover-coordinator")
    assert rules_by_resource(role) == {
        ("coordination.k8s.io", "leases"): {"get", "create", "update", "delete"},
        ("", "pods"): {"get", "list", "watch", "delete"},
    }
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]


def test_coordinator_runs_as_its_bound_service_account():
    deployment = one("Deployment", "gms-failover-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    account = pod_spec(deployment)["serviceAccountName"]
    binding = one("RoleBinding", "gms-failover-coordinator")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": one("Role")["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": deployment["metadata"]["namespace"]}]
    assert one("ServiceAccount", account)
    (config_volume,) = [v for v in volumes(pod_spec(deployment)).values() if "configMap" in v]
    assert config_volume["configMap"]["name"] == "gms-failover-config"


@pytest.mark.parametrize("pattern", ["sidecar", "separate-pods"])
def test_coordinator_config_names_the_lease_the_role_grants(pattern):
    config_map = one("ConfigMap", "gms-failover-config", under=pattern)
    config = tomllib.loads(config_map["data"]["failover.toml"])
    parsed = failover_config.parse(config)  # what `gms failover` itself would read
    assert parsed.revoke == "engines", "the coordinator's pod cannot reach the GPUs' sockets"
    kind, _, where = config["lock"].partition(":")
    namespace, _, name = where.partition("/")
    assert kind == "lease" and namespace == one("Role")["metadata"]["namespace"]
    named = [r for r in one("Role")["rules"] if "resourceNames" in r]
    assert all(r["resourceNames"] == [name] for r in named) and named
    assert set(config["sets"]) == {"a", "b"} and config["initial"] in config["sets"]
    # the selectors find the pods the pattern runs
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in find("StatefulSet", under=pattern)]
    for s in config["sets"].values():
        wanted = dict(term.split("=") for term in s["selector"].split(","))
        assert any(wanted.items() <= labels.items() for labels in pods)


def test_the_gms_probe_script_runs_against_a_real_server(tmp_path):
    """The probes' shell, run as the kubelet would, on a real `gms serve` (host backend)."""
    daemon_readiness = containers(pod_spec(one("DaemonSet", "gms-server")))["gms"]["readinessProbe"]
    scripts = {gms[probe]["exec"]["command"][2] for _, gms in gms_containers()
               for probe in ("startupProbe", "readinessProbe", "livenessProbe")
               if gms[probe] is not daemon_readiness}
    (script,) = scripts  # one status probe everywhere (but the DaemonSet's readiness: below)
    bin_dir, sockets = tmp_path / "bin", tmp_path / "sockets"
    bin_dir.mkdir()
    sockets.mkdir()
    shim = bin_dir / "gms"  # `gms` on PATH, as in the image
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gms "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GMS_SOCKET_DIR": str(sockets)}

    def probe() -> int:
        return subprocess.run(["sh", "-c", script], env=env, capture_output=True, timeout=60).returncode

    assert probe() != 0  # no server yet
    # The server alone (a keeper would start another when it is killed below).
    server = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--no-keeper", "--backend", "host",
                               "--log-level", "warning"], env=env)
    try:
        wait_until(lambda: len(list(sockets.glob("gms_*.sock"))) == 1, timeout=30, what="the socket")
        wait_until(lambda: probe() == 0, timeout=30, what="the probe to pass")
    finally:
        server.kill()  # SIGKILL: the sockets stay behind, answered by nobody
        server.wait(30)
    assert list(sockets.glob("gms_*.sock")) and probe() != 0


# -- rolling gms without losing a byte (docs/deploy.md, "Updates")


def test_the_daemonset_starts_the_new_pod_before_the_old_one_goes():
    daemon = one("DaemonSet", "gms-server")
    assert daemon["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    spec = pod_spec(daemon)
    for c in containers(spec).values():
        assert all("hostPort" not in p for p in c.get("ports", [])), "a hostPort would keep the surge pod out"
    socket_dir = containers(spec)["socket-dir"]
    assert "rm " not in command(socket_dir)[-1], "the old pod serves on the sockets during a rollout"


def test_keeper_and_server_are_separate_containers_sharing_only_the_keeper_socket():
    spec = pod_spec(one("DaemonSet", "gms-server"))
    cs = containers(spec)
    keeper, gms = cs["keeper"], cs["gms"]
    assert keeper["restartPolicy"] == "Always", "a native sidecar: up before the servers, down after them"
    argv = command(keeper)
    assert argv[:2] == ["gms", "keeper"]
    keeper_socket = argv[argv.index("--keeper-socket") + 1]
    serve = command(gms)
    assert serve[serve.index("--keeper-socket") + 1] == keeper_socket and "--take-over" in serve
    (shared,) = [v for v in mounts(keeper) if v in mounts(gms)]
    assert "emptyDir" in volumes(spec)[shared] and mounts(keeper)[shared] == mounts(gms)[shared]
    assert os.path.dirname(keeper_socket) == mounts(keeper)[shared]
    assert not any("hostPath" in volumes(spec)[v] for v in mounts(keeper)), "the keeper sees no socket folder"
    assert " -S " in " ".join(keeper["startupProbe"]["exec"]["command"]) or keeper["startupProbe"]["exec"][
        "command"][:2] == ["test", "-S"]


def test_the_readiness_probe_waits_for_this_pod_s_own_servers(tmp_path):
    """During a rollout both pods' probes reach the same sockets: the new pod is
    ready only once its own servers serve them (they took over), not while the
    old pod's do."""
    gms = containers(pod_spec(one("DaemonSet", "gms-server")))["gms"]
    script = gms["readinessProbe"]["exec"]["command"][2]
    serve = command(gms)
    ready_dir = serve[serve.index("--ready-dir") + 1]
    bin_dir, sockets, ready = tmp_path / "bin", tmp_path / "sockets", tmp_path / "ready"
    bin_dir.mkdir()
    sockets.mkdir()
    shim = bin_dir / "gms"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gms "$@"\n')
    shim.chmod(0o755)
    script = script.replace(ready_dir, str(ready))  # this "pod's" /tmp
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GMS_SOCKET_DIR": str(sockets)}

    def probe() -> int:
        return subprocess.run(["sh", "-c", script], env=env, capture_output=True, timeout=60).returncode

    old = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", "host", "--log-level", "warning"],
                           env=env)
    new = None
    try:
        wait_until(lambda: len(list(sockets.glob("gms_*.sock"))) == 1, timeout=30, what="the old pod's socket")
        time.sleep(1)
        assert probe() != 0, "the old pod's server serves: not ready"
        new = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", "host", "--log-level", "warning",
                                "--take-over", "--ready-dir", str(ready)], env=env)
        wait_until(lambda: probe() == 0, timeout=60, what="the new pod ready")
        assert old.wait(30) == 0, "taken over: the old pod's keeper is done"
    finally:
        for proc in (new, old):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
