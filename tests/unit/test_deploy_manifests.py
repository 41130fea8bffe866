"""deploy/ checked by real validators: Kubernetes manifests against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict), the compose file against the compose-spec JSON schema (check-jsonschema's
vendored copy), systemd units with ``systemd-analyze verify``, Prometheus rules with ``promtool check rules``;
and every metric that the rules and the Grafana dashboard name is one the code defines."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")
BIN = Path(sys.executable).parent
METRIC_DEF = re.compile(r"\b(Counter|Gauge|Histogram|Summary)\(\s*\"(podbay_[a-z0-9_]+)\"", re.S)
BUILTIN = {"up"}  # series Prometheus makes itself


def defined_metrics() -> set[str]:
    """Every series name the code's prometheus_client metrics expose."""
    names: set[str] = set()
    for path in [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        for kind, name in METRIC_DEF.findall(path.read_text()):
            if kind == "Counter":
                names.add(name.removesuffix("_total") + "_total")
            elif kind in ("Histogram", "Summary"):
                names.update({f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "Histogram"
                             else {f"{name}_count", f"{name}_sum"})
            else:
                names.add(name)
    return names


def used_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression (podbay_* series and Prometheus' own ``up``)."""
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"\bpodbay_[a-z0-9_]+\b", no_strings)) | (
        {"up"} if re.search(r"\bup\s*[{\[]", no_strings) else set())


def _k8s_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "--quiet", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_kubernetes_manifest_is_valid(path: Path) -> None:
    p = _k8s_validate(path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_kubernetes_validator_rejects_a_wrong_manifest(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "api.yaml").read_text()))
    docs[0]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pathh"] = "/healthz"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    assert _k8s_validate(bad).returncode != 0


def test_kubernetes_shape_probes_resources_and_the_node_daemonset() -> None:
    docs = [d for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "podbay-api"), ("Deployment", "podbay-scheduler"), ("Deployment", "podbay-warmpool"),
            ("DaemonSet", "podbay-node"), ("ConfigMap", "podbay-config"), ("Secret", "podbay-secrets")} <= kinds
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S)
    for d in docs:
        if d["kind"] not in ("Deployment", "DaemonSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", c["name"]
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", c["name"]
            assert c["resources"]["requests"], c["name"]
            if d["kind"] == "Deployment":
                assert c["resources"]["limits"], c["name"]
    node = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in node["containers"]}
    assert set(containers) == {"nodeagent", "snapshotter", "gateway"}
    assert containers["nodeagent"]["securityContext"]["privileged"] is True
    host_paths = {v["hostPath"]["path"] for v in node["volumes"]}
    assert {"/dev/kvm", "/var/lib/podbay"} <= host_paths


def test_compose_file_matches_the_compose_spec() -> None:
    p = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                        str(DEPLOY / "compose.yaml")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert {"nats", "postgres", "seaweedfs", "api", "scheduler", "warmpool"} <= set(services)
    assert "nodeagent" not in services  # node-local services run on sandbox hosts


def test_compose_validator_rejects_a_wrong_file(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  api:\n    image: podbay\n    portz: [\"80:80\"]\n")
    p = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path: Path) -> None:
    units = sorted((DEPLOY / "systemd").glob("podbay*.service")) + [DEPLOY / "systemd" / "podbay.target"]
    names = {u.stem for u in units}
    assert {"podbay-api", "podbay-scheduler", "podbay-warmpool", "podbay-nodeagent", "podbay-snapshotter",
            "podbay-gateway"} <= names
    gateway_bin = Path(str(BIN).replace("/.venv/", "/.venv-gateway/"))
    for unit in units:
        # verify checks that ExecStart exists: point the install paths at this checkout's virtualenvs.
        text = unit.read_text().replace("/opt/podbay/venv-gateway/bin", str(gateway_bin if gateway_bin.exists()
                                                                             else BIN))
        text = text.replace("/opt/podbay/venv/bin", str(BIN))
        (tmp_path / unit.name).write_text(text)
    if not (gateway_bin / "podbay-gateway").exists():
        (tmp_path / "podbay-gateway.service").write_text(
            (tmp_path / "podbay-gateway.service").read_text().replace(f"{BIN}/podbay-gateway", f"{BIN}/podbay"))
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", *[str(tmp_path / u.name) for u in units]],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    problems = [line for line in (p.stdout + p.stderr).splitlines()
                if "podbay" in line and ("nknown" in line or "ignoring" in line or "ailed" in line
                                         or "not executable" in line)]
    assert p.returncode == 0 and not problems, p.stdout + p.stderr
    target = (DEPLOY / "systemd" / "podbay.target").read_text()
    assert all(f"{n}.service" in target for n in names - {"podbay"})


def _rules() -> list[dict[str, object]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "podbay-rules.yaml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_prometheus_rules_use_only_metrics_the_code_defines() -> None:
    defined = defined_metrics()
    assert {"podbay_hop_seconds_bucket", "podbay_warm_slots", "podbay_node_capacity",
            "podbay_snapshot_promotion_lag_seconds", "podbay_node_heartbeats_total"} <= defined
    rules = _rules()
    alerts = {str(r["alert"]) for r in rules}
    assert {"PodbayServiceDown", "PodbayNodeLost", "PodbayCreateSlow", "PodbayWarmPoolEmpty",
            "PodbayNodeMemoryNearlyFull", "PodbaySnapshotPromotionLag"} <= alerts
    for r in rules:
        used = used_metrics(str(r["expr"]))
        assert used, r["alert"]
        assert used <= defined | BUILTIN, (r["alert"], used - defined)


def test_metric_check_catches_a_name_the_code_does_not_define() -> None:
    assert used_metrics('rate(podbay_no_such_thing_total{kind="x"}[5m]) and up{job="a"} == 0') == {
        "podbay_no_such_thing_total", "up"}
    assert "podbay_no_such_thing_total" not in defined_metrics()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt: prometheus)")
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    p = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "podbay-rules.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: rate(podbay_hop_seconds_count[5m]\n")
    assert subprocess.run(["promtool", "check", "rules", str(bad)], capture_output=True, timeout=120).returncode != 0


def test_grafana_dashboard_parses_and_names_existing_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "podbay-dashboard.json").read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    defined = defined_metrics()
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    joined = " ".join(exprs)
    for wanted in ("podbay_lifecycle_operation_seconds_bucket", "podbay_warm_slots", "podbay_node_capacity",
                   "podbay_snapshot_promotion_lag_seconds"):
        assert wanted in joined
    for expr in exprs:
        used = used_metrics(expr)
        assert used and used <= defined | BUILTIN, (expr, used - defined)
    ids = [panel["id"] for panel in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_config_examples_name_only_real_settings() -> None:
    from podbay.config import Settings

    toml = tomllib.loads((DEPLOY / "config" / "podbay.toml.example").read_text())
    assert set(toml) <= set(Settings.model_fields)
    env_keys = {line.split("=", 1)[0].lstrip("#") for line in (DEPLOY / "systemd" / "podbay.env.example")
                .read_text().splitlines() if "=" in line and line.lstrip("#").startswith("PODBAY_")}
    fields = {f"PODBAY_{k.upper()}" for k in Settings.model_fields} | {"PODBAY_CONFIG_FILE"}
    assert env_keys <= fields, env_keys - fields
    cm = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "config.yaml").read_text())
              if d["kind"] == "ConfigMap")
    assert set(cm["data"]) <= fields, set(cm["data"]) - fields


def test_the_bus_is_a_three_server_cluster_in_kubernetes_and_compose() -> None:
    docs = [d for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]
    nats = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats")
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["volumeClaimTemplates"]
    conf = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config")
    assert all(f"nats-{i}.nats.podbay.svc.cluster.local:6222" in conf["data"]["nats.conf"] for i in range(3))
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "podbay-config")
    assert len(cm["data"]["PODBAY_NATS_URL"].split(",")) == 3
    for name in ("podbay-api", "podbay-scheduler", "podbay-warmpool"):
        assert next(d for d in docs if d["metadata"]["name"] == name)["spec"]["replicas"] >= 2, name
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert {"nats", "nats-2", "nats-3"} <= set(services)
    assert len(services["api"]["environment"]["PODBAY_NATS_URL"].split(",")) == 3
    for name in ("api", "scheduler", "warmpool"):
        assert services[name]["deploy"]["replicas"] >= 2, name
