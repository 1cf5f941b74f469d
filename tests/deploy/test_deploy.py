"""The Kubernetes manifests, offline: each overlay renders (`kubectl kustomize`), every object
validates against the Kubernetes schemas, and the wiring holds (Services select pods, every
referenced ConfigMap and Secret key exists, ports agree with the config)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from pod_security import violations

from specserve.common.settings import SETTINGS_BY_SERVICE

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSIONS = ("1.30", "1.31", "1.32", "1.33")
# Created by deploy/k8s/dev-secrets.sh (or by whoever runs the cluster): name -> keys.
SECRETS = {
    "specserve-redis": {"url", "redis.conf", *(f"url-{s}" for s in SETTINGS_BY_SERVICE)},
    **{f"specserve-tls-{s}": {"ca.pem", f"{s}.pem", f"{s}-key.pem"} for s in SETTINGS_BY_SERVICE},
    "specserve-api-keys": {"keys.yaml"},
}
SERVICES = set(SETTINGS_BY_SERVICE)  # gateway, scheduler, verifier, drafter


def render(overlay: str | Path) -> list[dict]:
    """An overlay's objects (a name under overlays/, or a kustomization's folder)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the manifests (.ci/run installs it)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=["dev", "gpu", "gpu-tp", "canary", "gpu-canary"])
def objects(request) -> list[dict]:
    return render(request.param)


def pod_specs(objects):
    for obj in objects:
        template = obj.get("spec", {}).get("template")
        if template:
            yield obj, template


def test_every_object_validates_against_the_schemas(objects):
    kinds = {obj["kind"] for obj in objects}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler"} <= kinds
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_every_service_selects_a_pod_on_a_declared_port(objects):
    templates = [t for _, t in pod_specs(objects)]
    for svc in (o for o in objects if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        matching = [
            t for t in templates if selector.items() <= t["metadata"].get("labels", {}).items()
        ]
        assert matching, f"Service {svc['metadata']['name']} selects no pod"
        names = {
            p["name"] for t in matching for c in t["spec"]["containers"] for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def test_every_referenced_configmap_and_secret_key_exists(objects):
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    for owner, template in pod_specs(objects):
        spec = template["spec"]
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, volume
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                assert name in SECRETS, name
                for item in volume["secret"].get("items", []):
                    assert item["key"] in SECRETS[name], item
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in SECRETS[ref["name"]], (owner["metadata"]["name"], ref)


def test_the_config_loads_and_its_ports_match_the_manifests(objects):
    config = next(o for o in objects if o["metadata"]["name"].startswith("specserve-config"))
    text = config["data"]["specserve.yaml"]
    raw = yaml.safe_load(text)
    workloads = {owner["metadata"]["name"]: template for owner, template in pod_specs(objects)}
    for service, settings_cls in SETTINGS_BY_SERVICE.items():
        settings = settings_cls(**{**raw["common"], **raw[service]})
        container = workloads[service]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == settings.port and ports["metrics"] == settings.metrics_port
        if service == "gateway":
            assert ports["http"] == settings.http_port
        assert container["command"][-1] == service
        assert ports["health"] == settings.health_port  # the kubelet's gRPC probes
        probes = {
            k: container[k]["grpc"] for k in ("startupProbe", "livenessProbe", "readinessProbe")
        }
        assert {p["port"] for p in probes.values()} == {settings.health_port}
        assert probes["livenessProbe"]["service"] == probes["startupProbe"]["service"] == "liveness"
        assert probes["readinessProbe"]["service"] == "readiness"
        mounted = {m["mountPath"] for m in container["volumeMounts"]}
        for path in (settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file):
            assert str(Path(path).parent) in mounted, path
    scheduler = yaml.safe_load(text)["gateway"]["scheduler_address"]
    assert scheduler == f"scheduler:{raw['scheduler']['port']}"


def test_pods_run_unprivileged_with_limits(objects):
    for owner, template in pod_specs(objects):
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True, owner["metadata"]
        spec = template["spec"]
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["resources"]["limits"]["memory"], container["name"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
        for volume in spec.get("volumes", []):
            if "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory":
                assert volume["emptyDir"].get("sizeLimit") or volume["name"] == "tmp", volume


def test_every_pod_meets_pod_security_restricted(objects):
    """What the namespace's `restricted` level refuses at admission, checked here first with
    our own reading of the published rules (tests/pod_security.py)."""
    namespace = next(o for o in objects if o["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for owner, template in pod_specs(objects):
        spec, name = template["spec"], owner["metadata"]["name"]
        assert not violations(spec, template["metadata"].get("annotations")), name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"] + spec.get("initContainers", []):
            if container["image"].startswith("specserve"):
                assert container["imagePullPolicy"] == "IfNotPresent", (name, container["name"])


def test_the_pod_security_check_finds_what_restricted_refuses():
    """The check of the published rules catches each of them (and passes a clean pod)."""
    clean = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                },
            }
        ],
        "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "x"}}],
    }
    assert violations(clean) == []
    bad = {
        "hostNetwork": True,
        "securityContext": {
            "runAsUser": 0,
            "sysctls": [{"name": "kernel.msgmax", "value": "1"}],
            "seLinuxOptions": {"user": "root"},
        },
        "initContainers": [
            {
                "name": "i",
                "ports": [{"containerPort": 80, "hostPort": 80}],
                "securityContext": {
                    "privileged": True,
                    "procMount": "Unmasked",
                    "capabilities": {"add": ["SYS_ADMIN"]},
                    "seccompProfile": {"type": "Unconfined"},
                    "appArmorProfile": {"type": "Unconfined"},
                    "runAsNonRoot": False,
                },
            }
        ],
        "containers": clean["containers"],
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
    }
    rules = {v.split(":")[0] for v in violations(bad, {f"{APPARMOR}/c": "unconfined"})}
    assert rules == {
        "host namespaces",
        "hostPath volumes",
        "volume types",
        "non-root user",
        "sysctls",
        "SELinux",
        "privileged",
        "capabilities",
        "host ports",
        "/proc mount",
        "privilege escalation",
        "non-root",
        "seccomp",
        "AppArmor",
    }


APPARMOR = "container.apparmor.security.beta.kubernetes.io"


def test_models_are_fetched_once_by_a_job_into_a_shared_read_only_volume(objects):
    """The Job alone fetches; every other pod mounts the volume read-only and only waits."""
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    (claim,) = [c for c in claims if c["metadata"]["name"] == "specserve-models"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    (job,) = [o for o in objects if o["kind"] == "Job"]
    fetcher = job["spec"]["template"]["spec"]["containers"][0]
    assert "fetch" in fetcher["command"]
    assert fetcher["resources"]["requests"]["memory"] and fetcher["resources"]["limits"]["memory"]
    for owner, template in pod_specs(objects):
        spec, name = template["spec"], owner["metadata"]["name"]
        if owner["kind"] == "Job":
            continue
        for container in spec["containers"] + spec.get("initContainers", []):
            assert "fetch" not in container.get("command", []), (name, container["name"])
            for mount in container.get("volumeMounts", []):
                if mount["name"] == "models":
                    assert mount["readOnly"] is True, (name, container["name"])
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        if "models" in volumes:
            claim_ref = volumes["models"]["persistentVolumeClaim"]
            assert claim_ref == {"claimName": "specserve-models", "readOnly": True}, name
            (wait,) = spec["initContainers"]
            assert wait["command"][-2] == "wait", name
            assert set(wait["command"][-1:]) <= set(fetcher["command"]), name  # the Job's
        per_pod = {t["metadata"]["name"] for t in owner["spec"].get("volumeClaimTemplates", [])}
        assert "models" not in per_pod, name


def test_redis_is_never_evicted_by_a_voluntary_disruption(objects):
    (budget,) = [
        o
        for o in objects
        if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "redis"
    ]
    redis_pod = next(t for o, t in pod_specs(objects) if o["metadata"]["name"] == "redis")
    assert selects(budget["spec"]["selector"], redis_pod["metadata"]["labels"])
    assert budget["spec"]["maxUnavailable"] == 0


def test_air_gapped_clusters_fill_the_models_volume_from_an_image(tmp_path):
    """The component points the Job at the image holding the wheels; nothing else changes."""
    kustomization = {
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "air-gapped", tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects, plain = render(tmp_path), render("gpu")
    (job,) = [o for o in objects if o["kind"] == "Job"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "specserve-models:latest"
    dockerfile = (K8S.parent.parent / "Dockerfile.models").read_text()
    assert "PIP_NO_INDEX=1" in dockerfile and "PIP_FIND_LINKS" in dockerfile
    assert [o for o in objects if o["kind"] != "Job"] == [o for o in plain if o["kind"] != "Job"]


def test_each_pod_mounts_only_its_own_tls_key(objects):
    for owner, template in pod_specs(objects):
        container = template["spec"]["containers"][0]
        service = container["command"][-1] if "serve" in container.get("command", []) else None
        secrets = {
            v["secret"]["secretName"]
            for v in template["spec"].get("volumes", [])
            if "secret" in v and v["secret"]["secretName"].startswith("specserve-tls")
        }
        assert secrets == ({f"specserve-tls-{service}"} if service else set()), owner["metadata"]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) takes these labels."""
    ok = selector.get("matchLabels", {}).items() <= labels.items()
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        ok = ok and labels.get(expression["key"]) in expression["values"]
    return ok


def test_network_policies_let_in_only_the_gateway_and_keep_redis_to_the_services(objects):
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies)
    pods = {owner["metadata"]["name"]: t["metadata"]["labels"] for owner, t in pod_specs(objects)}
    for name, labels in pods.items():
        rules = [
            rule
            for p in policies
            if selects(p["spec"]["podSelector"], labels)
            for rule in p["spec"].get("ingress", [])
        ]
        open_ports = {p["port"] for r in rules if "from" not in r for p in r["ports"]}
        assert open_ports == ({"grpc", "http"} if name == "gateway" else set()), name
        for rule in rules:  # other namespaces (the scrapers) reach the metrics port only
            if any("namespaceSelector" in f for f in rule.get("from", [])):
                assert [p["port"] for p in rule["ports"]] == ["metrics"], name
        if name == "redis":
            (rule,) = [r for r in rules if r["ports"] != [{"port": "metrics"}]]
            callers = {
                n
                for n, other in pods.items()
                if any(selects(f["podSelector"], other) for f in rule["from"])
            }
            assert callers == {n for n in pods if n.split("-")[0] in SERVICES}, callers


def test_no_autoscaled_workload_sets_its_replicas(objects):
    """An HPA owns the count: a replicas field would reset it on every apply."""
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        workload = next(
            o
            for o in objects
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        )
        assert "replicas" not in workload["spec"], target["name"]


def test_the_gpu_overlay_gives_each_verifier_a_gpu():
    verifier = next(
        o
        for o in render("gpu")
        if o["metadata"]["name"] == "verifier" and o["kind"] == "StatefulSet"
    )
    container = verifier["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "SPECSERVE_VERIFIER_DEVICE", "value": "cuda"} in container["env"]


def test_the_tensor_parallel_overlay_gives_a_verifier_pod_a_gpu_per_rank():
    """One pod, N GPUs, N ranks: the GPU limit and verifier.tensor_parallel agree, the pod is
    on CUDA, and /dev/shm is memory (NCCL's buffers; a container's default is 64 MB)."""
    verifier = next(
        o
        for o in render("gpu-tp")
        if o["metadata"]["name"] == "verifier" and o["kind"] == "StatefulSet"
    )
    pod = verifier["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ranks = int(env["SPECSERVE_VERIFIER_TENSOR_PARALLEL"])
    assert ranks > 1 and container["resources"]["limits"]["nvidia.com/gpu"] == ranks
    assert env["SPECSERVE_VERIFIER_DEVICE"] == "cuda"
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"


def test_the_canary_overlay_adds_a_canary_pool_beside_the_stable_one():
    objects = render("canary")
    statefulsets = {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] == "StatefulSet" and o["metadata"]["name"].startswith("verifier")
    }
    env = {
        name: {
            e["name"]: e.get("value") for e in s["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        for name, s in statefulsets.items()
    }
    assert env["verifier-canary"]["SPECSERVE_VERIFIER_POOL"] == "canary"
    assert "SPECSERVE_VERIFIER_POOL" not in env["verifier"]  # stable: the default pool
    settings = SETTINGS_BY_SERVICE["verifier"]
    for key, value in env["verifier-canary"].items():  # each override is a valid setting
        field = key.removeprefix("SPECSERVE_VERIFIER_").lower()
        assert field in settings.model_fields or field in ("pod_name", "pod_ip"), key
        if field in ("pool", "speculation_policy", "verification_tree_size"):
            settings.model_validate({field: value})
    # Each pool has its own headless Service: its pods' names resolve (the advertised address).
    address = env["verifier-canary"]["SPECSERVE_VERIFIER_ADVERTISE_ADDRESS"]
    assert address.startswith("$(POD_NAME).verifier-canary.")
    canary = statefulsets["verifier-canary"]
    assert canary["spec"]["serviceName"] == "verifier-canary"
    service = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "verifier-canary"
    )
    assert service["spec"]["selector"] == canary["spec"]["selector"]["matchLabels"]
    assert (
        service["spec"]["selector"] != statefulsets["verifier"]["spec"]["selector"]["matchLabels"]
    )
    # Canary verifiers draft only with canary drafters: the overlay brings its own.
    drafter = next(
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "drafter-canary"
    )
    drafter_env = drafter["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "SPECSERVE_DRAFTER_POOL", "value": "canary"} in drafter_env


# --- monitoring -------------------------------------------------------------------------------
MONITORING = K8S.parent / "monitoring"


def exported_names() -> set[str]:
    """Every series name the services export (their metrics modules, process metrics)."""
    import prometheus_client

    for service in SETTINGS_BY_SERVICE:
        importlib.import_module(f"specserve.{service}.metrics")
    importlib.import_module("specserve.common.grpc_server")  # every service's readiness
    names = set()
    for family in prometheus_client.REGISTRY.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "histogram":
            names.update(f"{family.name}_{s}" for s in ("bucket", "sum", "count"))
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def referenced(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\b(?:specserve|process)_[a-z_]+", e)}


def test_alert_rules_are_complete_and_the_operator_copy_matches():
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    operator = yaml.safe_load((K8S / "optional" / "prometheus-rule.yaml").read_text())
    assert operator["kind"] == "PrometheusRule" and operator["spec"]["groups"] == rules["groups"]
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert len(alerts) >= 6
    for rule in alerts:
        assert rule["alert"] and rule["expr"] and rule["for"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
    missing = referenced([r["expr"] for r in alerts]) - exported_names()
    assert not missing, f"alerts use metrics nobody exports: {missing}"


def test_the_dashboard_shows_exported_metrics():
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(dashboard["panels"]) >= 10 and all(exprs)
    missing = referenced(exprs) - exported_names()
    assert not missing, f"the dashboard uses metrics nobody exports: {missing}"


def test_the_optional_ingresses_validate_and_point_at_the_gateway(objects):
    ingresses = list(yaml.safe_load_all((K8S / "optional" / "ingress.yaml").read_text()))
    gateway = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "gateway"
    )
    ports = set()
    for ingress in ingresses:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(ingress, version, strict=True)
        backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        assert backend["name"] == "gateway"
        assert backend["port"]["name"] in {p["name"] for p in gateway["spec"]["ports"]}
        ports.add(backend["port"]["name"])
    assert ports == {"grpc", "http"}  # gRPC and the OpenAI-compatible HTTP API


def test_the_canary_composes_with_the_gpu_overlay():
    """Stable and canary verifiers both on GPUs: the canary never turns stable pods to CPU."""
    for o in render("gpu-canary"):
        if o["kind"] == "StatefulSet" and o["metadata"]["name"].startswith("verifier"):
            container = o["spec"]["template"]["spec"]["containers"][0]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, o["metadata"]
            assert {"name": "SPECSERVE_VERIFIER_DEVICE", "value": "cuda"} in container["env"]


def test_keda_scales_drafters_on_demand_in_place_of_the_cpu_autoscaler(tmp_path):
    def rel(path: Path) -> str:  # (kustomize takes relative paths only)
        return os.path.relpath(path, tmp_path)

    kustomization = {
        "resources": [rel(K8S / "overlays" / "gpu")],
        "components": [rel(K8S / "components" / "keda")],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = render(tmp_path)
    assert not [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    (scaled,) = [o for o in objects if o["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "drafter"
    drafter = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "drafter"
    )
    assert "replicas" not in drafter["spec"]  # KEDA owns the count
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert not referenced(queries) - exported_names()  # on series the services export
    assert all("cpu" not in q for q in queries)


def test_the_pod_monitor_scrapes_every_metrics_port(objects):
    monitor = yaml.safe_load((K8S / "optional" / "pod-monitor.yaml").read_text())
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for owner, template in pod_specs(objects):
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        if "metrics" in ports:
            assert selects(monitor["spec"]["selector"], template["metadata"]["labels"]), owner


def test_torch_threads_follow_the_cpu_request(objects):
    """Unbounded, torch takes a thread per core of the node and inflates the CPU it reports."""
    for owner, template in pod_specs(objects):
        container = template["spec"]["containers"][0]
        service = owner["metadata"]["name"].split("-")[0]
        if service not in ("verifier", "drafter"):
            continue
        env = {e["name"]: e for e in container["env"]}
        ref = env[f"SPECSERVE_{service.upper()}_TORCH_THREADS"]["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "requests.cpu" and ref["containerName"] == container["name"]
        assert "cpu" in container["resources"]["requests"], owner["metadata"]["name"]


@pytest.mark.parametrize("overlay", ["gpu", "gpu-tp", "gpu-canary"])
def test_gpu_overlays_run_the_gpu_image_everywhere(overlay):
    """The CPU image (CPU-only torch) would refuse device: cuda, canary pods included."""
    for owner, template in pod_specs(render(overlay)):
        spec = template["spec"]
        for container in spec["containers"] + spec.get("initContainers", []):
            if container["image"].startswith("specserve"):
                assert container["image"] == "specserve:gpu", (owner["metadata"]["name"], container)
