"""The Kubernetes manifests in deploy/kubernetes/, checked offline (no cluster, no network).

Every document is validated against the Kubernetes API schemas of a pinned version in strict mode
(kubernetes-validate: an unknown or misspelt field fails). The proxy config the ConfigMap carries
goes through the real `check-config`, with exactly the environment the Deployment gives the
container (the Secret's placeholder values, a pod IP). Then the parts that must agree across files:
the shutdown arithmetic (terminationGracePeriodSeconds against the preStop sleep and the drain
durations of the config, read with the project's own loader), probes, ports, replicas, the rollout,
the PodDisruptionBudget's selector, the security contexts against the Dockerfile's user, and every
Secret, ConfigMap and Service a manifest names.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from proxy.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are written for; kubernetes-validate>=1.30 (pyproject's test
# extra) ships its schemas, so the check is the same on every machine.
K8S_VERSION = "1.30.0"
# Applied by hand (placeholders), never through kustomization.yaml: see secret.yaml.
SECRET_FILE = "secret.yaml"
POD_IP = "10.1.2.3"  # stands in for the downward API's status.podIP


def _documents(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def _manifest_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


def _all_documents() -> list[dict[str, Any]]:
    return [doc for path in _manifest_files() for doc in _documents(path)]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in _all_documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _proxy_container() -> dict[str, Any]:
    containers = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _secret_values() -> dict[str, str]:
    """The Secret's keys and (placeholder) values, from stringData (or base64 data)."""
    secret = _one("Secret")
    values = dict(secret.get("stringData", {}))
    for key, encoded in secret.get("data", {}).items():
        values[key] = base64.b64decode(encoded).decode()
    return values


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment Kubernetes would give `container`: literal values, Secret keys (the
    placeholders of secret.yaml) and the pod IP from the downward API."""
    secrets = _secret_values()
    secret_name = _one("Secret")["metadata"]["name"]
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref["name"] == secret_name, f"{var['name']} names Secret {ref['name']}"
            env[var["name"]] = secrets[ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = POD_IP
        else:
            raise AssertionError(f"env {var['name']}: no stand-in for {source}")
    return env


def _mounted_config() -> tuple[str, str]:
    """(path inside the container, text) of the config file the proxy is started with: the
    `--config` argument, resolved through the volume mounts to the ConfigMap key behind it."""
    deployment = _one("Deployment")
    container = _proxy_container()
    args = container.get("args", [])
    config_path = args[args.index("--config") + 1]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not config_path.startswith(prefix):
            continue
        source = volumes[mount["name"]]["configMap"]
        configmap = _one("ConfigMap", source["name"])
        relative = config_path[len(prefix) :]
        items = {item["path"]: item["key"] for item in source.get("items", [])} or {
            key: key for key in configmap["data"]
        }
        return config_path, configmap["data"][items[relative]]
    raise AssertionError(f"--config {config_path} is on no volume mount")


def _load_proxy_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    """The ConfigMap's config as the proxy reads it (project loader, the container's environment)."""
    _, text = _mounted_config()
    file = tmp_path / "proxy.yaml"
    file.write_text(text, encoding="utf-8")
    for name, value in _container_env(_proxy_container()).items():
        monkeypatch.setenv(name, value)
    return load_config(file)


def _pre_stop_seconds(container: dict[str, Any]) -> int:
    """Seconds the preStop hook waits: `exec: [sleep, N]` or the `sleep: {seconds: N}` action."""
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def _quantity(value: str | int) -> float:
    """A Kubernetes quantity as a number: bytes for memory (Ki, Mi, Gi, k, M, G), cores for CPU (m)."""
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _port_number(container: dict[str, Any], port: str | int) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_every_manifest_is_valid_kubernetes_in_strict_mode():
    """Each document of each file validates against the pinned Kubernetes version's schemas, with
    unknown fields refused; and the set of kinds is the one the README describes."""
    kinds = []
    for path in _manifest_files():
        for doc in _documents(path):
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path.name}: {doc.get('kind')} {doc['metadata'].get('name')}: {exc}")
            kinds.append(doc["kind"])
    assert sorted(set(kinds)) == [
        "ConfigMap",
        "Deployment",
        "Namespace",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "StatefulSet",
    ]


def test_kustomization_lists_every_manifest_except_the_placeholder_secret():
    """`kubectl apply -k` applies every file, but never secret.yaml, so a deploy cannot overwrite the
    real Secret with placeholders; the namespace it sets is the Namespace the manifests create."""
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text(encoding="utf-8"))
    listed = kustomization["resources"]
    expected = [p.name for p in _manifest_files() if p.name != SECRET_FILE]
    assert sorted(listed) == sorted(expected)
    assert SECRET_FILE not in listed
    assert kustomization["namespace"] == _one("Namespace")["metadata"]["name"]
    assert _one("Secret")["metadata"]["namespace"] == kustomization["namespace"]


def test_the_configmap_config_passes_check_config(tmp_path):
    """The real `mcp-tasks-proxy check-config` accepts the ConfigMap's file with only the variables
    the Deployment sets (so a ${VAR} nobody provides would fail here), and sees a replica on Redis
    advertised at the pod's IP; the placeholder password is not printed."""
    _, text = _mounted_config()
    file = tmp_path / "proxy.yaml"
    file.write_text(text, encoding="utf-8")
    env = {"PATH": os.environ.get("PATH", ""), **_container_env(_proxy_container())}
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", str(file)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"{file}: valid" in out.stdout
    assert "store redis://mcp-tasks-proxy-redis:6379/0" in out.stdout
    assert f"advertised as http://{POD_IP}:8080" in out.stdout
    assert _secret_values()["redis-password"] not in out.stdout + out.stderr


def test_the_grace_period_outlasts_the_prestop_and_the_drain(tmp_path, monkeypatch):
    """Kubernetes never SIGKILLs a draining proxy: terminationGracePeriodSeconds (which counts from
    before the preStop hook) exceeds the preStop sleep + listen.drain_detached + listen.drain_timeout
    (both in full, the worst case) + a margin for the Redis-bounded steps of the shutdown (marking
    the replica draining, closing the store: store.timeout each) and 5 s of process stops. The
    durations come from the ConfigMap through the proxy's own config loader."""
    config = _load_proxy_config(tmp_path, monkeypatch)
    assert config.replicas is not None and config.store.redis, "drain_detached applies to replicas only"
    spec = _one("Deployment")["spec"]["template"]["spec"]
    grace = spec["terminationGracePeriodSeconds"]
    pre_stop = _pre_stop_seconds(_proxy_container())
    drain = config.listen.drain_detached + config.listen.drain_timeout
    margin = 2 * config.store.timeout + 5
    assert grace > pre_stop + drain + margin, (
        f"terminationGracePeriodSeconds {grace} <= preStop {pre_stop} + drain {drain:g} + margin {margin:g}"
    )
    # The preStop sleep gives the endpoint update time to reach kube-proxy and ingresses, and is not
    # a large part of the grace period.
    assert 5 <= pre_stop <= 30


def test_the_deployment_runs_three_replicas_that_roll_without_loss(tmp_path, monkeypatch):
    """Three replicas; a rollout adds one pod before it removes one; readiness on /readyz (with a
    timeout above its 1.5 s bound), liveness on /healthz, both on the config's listen port, which
    the Service and the scrape annotations use too; pods spread across nodes."""
    config = _load_proxy_config(tmp_path, monkeypatch)
    deployment = _one("Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    container = _proxy_container()
    port = config.listen.port
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["httpGet"]["path"] == "/readyz"
    assert liveness["httpGet"]["path"] == "/healthz"
    assert readiness["timeoutSeconds"] >= 2
    for probe in (readiness, liveness):
        assert _port_number(container, probe["httpGet"]["port"]) == port
    assert config.listen.host == "0.0.0.0"  # the kubelet and the other replicas reach the pod IP
    template = spec["template"]
    labels = template["metadata"]["labels"]
    assert _selects(spec["selector"]["matchLabels"], labels)
    service = _one("Service", "mcp-tasks-proxy")
    assert _selects(service["spec"]["selector"], labels)
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == port and _port_number(container, service_port["targetPort"]) == port
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port
    spread = template["spec"]["topologySpreadConstraints"]
    by_node = [c for c in spread if c["topologyKey"] == "kubernetes.io/hostname"]
    assert by_node and by_node[0]["whenUnsatisfiable"] == "DoNotSchedule"
    assert all(_selects(c["labelSelector"]["matchLabels"], labels) for c in spread)


def test_the_disruption_budget_selects_the_proxy_pods_only():
    """The PodDisruptionBudget lets one proxy pod go at a time, and its selector matches the
    Deployment's pods and not Redis's."""
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert _selects(selector, _one("Deployment")["spec"]["template"]["metadata"]["labels"])
    assert not _selects(selector, _one("StatefulSet")["spec"]["template"]["metadata"]["labels"])


def test_pods_run_unprivileged_on_a_read_only_root():
    """Every pod: non-root with a numeric user (the proxy's is the Dockerfile's `--uid`), no service
    account token, seccomp RuntimeDefault; every container: read-only root filesystem, no privilege
    escalation, every capability dropped, writable only where a volume is mounted."""
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    image_uid = int(re.search(r"useradd\b[^\n]*--uid (\d+)", dockerfile).group(1))
    assert re.search(r"^USER ", dockerfile, re.MULTILINE)
    for workload in (_one("Deployment"), _one("StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        name = workload["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, name
        pod_security = pod["securityContext"]
        assert pod_security["runAsNonRoot"] is True, name
        assert isinstance(pod_security["runAsUser"], int) and pod_security["runAsUser"] > 0, name
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        if workload["kind"] == "Deployment":
            assert pod_security["runAsUser"] == image_uid
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in security["capabilities"], name
            assert security.get("runAsUser", pod_security["runAsUser"]) != 0, name
            for mount in container.get("volumeMounts", []):
                if mount.get("readOnly"):
                    continue
                volume = volumes.get(mount["name"], {})
                assert "emptyDir" in volume or mount["name"] in claims, (name, mount)


def test_resources_follow_the_bench_figures():
    """Requests and limits are set, requests within limits, and the proxy's memory request holds the
    measured base (~80 MB RSS) plus 2,000 detached calls at ~20 KB each (bench/README.md)."""
    for workload in (_one("Deployment"), _one("StatefulSet")):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            resources = container["resources"]
            requests, limits = resources["requests"], resources["limits"]
            assert {"cpu", "memory"} <= set(requests) and "memory" in limits
            for key in limits:
                assert _quantity(requests[key]) <= _quantity(limits[key]), (container["name"], key)
    proxy = _proxy_container()["resources"]
    assert _quantity(proxy["requests"]["memory"]) >= 80e6 + 2000 * 20e3
    assert _quantity(proxy["limits"]["memory"]) >= 2 * _quantity(proxy["requests"]["memory"])


def test_every_secret_configmap_and_service_named_exists(tmp_path, monkeypatch):
    """Every secretKeyRef (proxy and Redis) names the Secret and one of its keys, every ConfigMap
    volume an existing ConfigMap and key; the config's store.url points at the Redis Service and
    port, and that Service selects the Redis pods; the StatefulSet's serviceName exists; the
    NetworkPolicy admits the proxy pods to Redis."""
    secret = _one("Secret")
    secret_keys = set(_secret_values())
    configmaps = {d["metadata"]["name"]: d for d in _all_documents() if d["kind"] == "ConfigMap"}
    referenced: set[str] = set()
    for workload in (_one("Deployment"), _one("StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["name"] == secret["metadata"]["name"], var
                    assert ref["key"] in secret_keys, var
                    referenced.add(ref["key"])
            assert "envFrom" not in container
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                source = volume["configMap"]
                assert source["name"] in configmaps, volume
                for item in source.get("items", []):
                    assert item["key"] in configmaps[source["name"]]["data"], item
            assert "secret" not in volume
    assert referenced == secret_keys, f"Secret keys nobody reads: {secret_keys - referenced}"

    config = _load_proxy_config(tmp_path, monkeypatch)
    store = urlsplit(config.store.url)
    redis_service = _one("Service", store.hostname)
    redis = _one("StatefulSet")
    assert redis["spec"]["serviceName"] == redis_service["metadata"]["name"]
    assert _selects(redis_service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"])
    assert store.port in [p["port"] for p in redis_service["spec"]["ports"]]
    redis_args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert redis_args[redis_args.index("--appendonly") + 1] == "yes"
    assert redis_args[redis_args.index("--appendfsync") + 1] == "always"
    policy = _one("NetworkPolicy")
    assert _selects(
        policy["spec"]["podSelector"]["matchLabels"], redis["spec"]["template"]["metadata"]["labels"]
    )
    (rule,) = policy["spec"]["ingress"]
    proxy_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert any(_selects(peer["podSelector"]["matchLabels"], proxy_labels) for peer in rule["from"])
