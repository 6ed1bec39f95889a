"""The Kubernetes manifests of k8s/: every kustomize tree renders, every object is valid for
the pinned Kubernetes version, and the properties the deployment depends on hold.

Rendering and schema validation are k8s/validate.py's (kubectl's kustomize, pinned;
kubernetes-validate, strict). What schemas cannot see is checked here: the worker's FUSE
setup, RBAC, secrets handling, the scheduler extender configuration, the example Job, the
elastic overlay's HPA. Each check is a function that raises AssertionError; the tests at the
bottom feed broken copies to some of them, so the checks are known to bite.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from cachefs.cli import build_parser
from cachefs.csi import DATASET_ATTRIBUTE, DRIVER_NAME
from cachefs.csi.server import socket_path
from cachefs.protocol import check_dataset_name
from cachefs.units import parse_duration, parse_size

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"

_spec = importlib.util.spec_from_file_location("cachefs_k8s_validate", K8S / "validate.py")
kv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv)

NAMESPACE = "cachefs"
COORDINATOR_SERVICE = "cachefs-coordinator"
SCHEDULER_NAME = "cachefs-scheduler"
WORKER_LABEL = "cachefs.io/worker"
DATASET_LABEL = "cachefs.io/dataset"
CACHEFS_IMAGE = "ghcr.io/cachefs/cachefs"
OVERLAYS = ("overlays/dev", "overlays/production", "overlays/elastic")
DEPLOYABLE = ("base", *OVERLAYS)  # trees that deploy cachefs itself (examples is a user Job)
EXAMPLES = ("examples", "examples/hostpath")  # a training namespace; the hostPath fallback
EXAMPLE_NAMESPACE = "ml"
CSI_NODE = "cachefs-csi-node"  # the node plugin's DaemonSet

# The only RBAC rules cachefs grants itself (the scheduler binds built-in roles only).
SCALER_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
]
EXPECTED_BINDINGS = {
    # binding name -> (role kind, role name, service account)
    "cachefs-scaler": ("ClusterRole", "cachefs-scaler", "cachefs-scaler"),
    "cachefs-scheduler-as-kube-scheduler": (
        "ClusterRole",
        "system:kube-scheduler",
        "cachefs-scheduler",
    ),
    "cachefs-scheduler-as-volume-scheduler": (
        "ClusterRole",
        "system:volume-scheduler",
        "cachefs-scheduler",
    ),
}
# Pods that may talk to the Kubernetes API (everything else must not mount a token).
API_CLIENTS = {"cachefs-scaler", "cachefs-scheduler"}


# --- rendering ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {target: kv.render(target) for target in kv.TARGETS}


def find(objects, kind, name=None) -> list[dict]:
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objects, kind, name=None) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workers(objects) -> list[dict]:
    return [
        o
        for o in objects
        if o["kind"] in ("DaemonSet", "StatefulSet") and o["metadata"]["name"] == "cachefs-worker"
    ]


def pod_spec(workload: dict) -> dict:
    if workload["kind"] == "Pod":
        return workload["spec"]
    return workload["spec"]["template"]["spec"]


def pod_workloads(objects) -> list[dict]:
    kinds = ("Deployment", "DaemonSet", "StatefulSet", "Job", "Pod")
    return [o for o in objects if o["kind"] in kinds]


def container(workload: dict, name: str | None = None) -> dict:
    containers = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1, f"{kv.name_of(workload)}: expected one container"
        return containers[0]
    (found,) = [c for c in containers if c["name"] == name]
    return found


def k8s_quantity(text) -> float:
    """A Kubernetes quantity (``9Gi``, ``1536Mi``, ``500m``, ``2``) as a number of units."""
    text = str(text)
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    assert match, f"not a quantity: {text!r}"
    number, suffix = float(match[1]), match[2]
    factors = {
        "": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    }  # fmt: skip
    assert suffix in factors, f"unknown quantity suffix in {text!r}"
    return number * factors[suffix]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args; unknown variables fail the test."""

    def substitute(match):
        assert match[1] in env, f"$({match[1]}) is not defined in the container's env"
        return env[match[1]]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, value)


def literal_env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def field_env(c: dict) -> dict[str, str]:
    return {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in c.get("env", [])
        if "fieldRef" in e.get("valueFrom", {})
    }


def cli_args(c: dict) -> list[str]:
    """The container's command line after the program name, $(VARS) expanded (fieldRef
    variables get a stand-in value)."""
    env = {name: f"<{path}>" for name, path in field_env(c).items()}
    env.update(literal_env(c))
    return [expand(a, env) for a in c.get("args", [])]


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"expected one {name}=… in {args}"
    return values[0]


def parse_cli(argv: list[str]):
    """``argv`` parsed by the real ``cachefs`` command line; an error fails the test."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"`cachefs {' '.join(argv)}` is not a valid command line") from None


def volume(spec: dict, name: str) -> dict:
    (found,) = [v for v in spec.get("volumes", []) if v["name"] == name]
    return found


def mount_at(c: dict, path: str) -> dict:
    found = [m for m in c.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(found) == 1, f"{c['name']}: nothing (or several) mounted at {path}"
    return found[0]


def volume_under(spec: dict, c: dict, path: str) -> tuple[dict, dict]:
    """The (mount, volume) that holds ``path`` in container ``c``."""
    best = None
    for m in c.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and (
            best is None or len(root) > len(best["mountPath"])
        ):
            best = m
    assert best is not None, f"{path} is on no volume of {c['name']} (container filesystem)"
    return best, volume(spec, best["name"])


# --- checks (each raises AssertionError) ------------------------------------------------------


def check_worker(workload: dict) -> None:
    """The worker's FUSE, propagation, tiers, identity, probes, resources and arguments."""
    spec = pod_spec(workload)
    c = container(workload, "worker")
    where = kv.name_of(workload)

    assert c.get("securityContext", {}).get("privileged") is True, f"{where}: not privileged"
    fuse = mount_at(c, "/dev/fuse")
    fuse_volume = volume(spec, fuse["name"])
    assert fuse_volume.get("hostPath", {}).get("path") == "/dev/fuse", f"{where}: /dev/fuse"
    assert fuse_volume["hostPath"].get("type") == "CharDevice"

    assert c["command"] == ["cachefs", "worker"], f"{where}: command {c['command']}"
    args = cli_args(c)
    parsed = parse_cli(["worker", *args])  # the real CLI accepts every flag
    assert parsed.mount == "/mnt/cachefs"
    # The FUSE mount lands on a hostPath shared Bidirectional, at the host's /mnt/cachefs...
    mnt, mnt_volume = volume_under(spec, c, parsed.mount)
    assert mnt.get("mountPropagation") == "Bidirectional", f"{where}: /mnt/cachefs propagation"
    host_root = mnt_volume.get("hostPath", {}).get("path", "").rstrip("/")
    assert host_root + parsed.mount[len(mnt["mountPath"].rstrip("/")) :] == "/mnt/cachefs"
    # ...through its parent directory, so that a dead mount left by a killed worker cannot keep
    # the next worker container from starting (see base/worker.yaml).
    assert mnt["mountPath"].rstrip("/") != parsed.mount, f"{where}: volume at the mount point"
    assert parsed.coordinator == f"http://{COORDINATOR_SERVICE}:7700"
    assert field_env(c).get("NODE_NAME") == "spec.nodeName" and parsed.node == "<spec.nodeName>"
    assert field_env(c).get("POD_IP") == "status.podIP"
    assert parsed.listen == "<status.podIP>:7701", f"{where}: --listen {parsed.listen}"
    assert parsed.metrics == "<status.podIP>:9464", f"{where}: --metrics {parsed.metrics}"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"peer": 7701, "metrics": 9464}, f"{where}: ports {ports}"

    # Token from a mounted Secret; state, SSD and RAM tiers where they belong.
    token_mount, token_volume = volume_under(spec, c, parsed.token_file)
    assert token_mount.get("readOnly") is True
    assert token_volume["secret"]["secretName"] == "cachefs-api-token"
    state_volume = volume_under(spec, c, parsed.state)[1]
    assert "hostPath" in state_volume, f"{where}: state dir not on a hostPath (restarts lose it)"
    assert literal_env(c).get("CACHEFS_STATE") == parsed.state  # what the preStop hook reads
    ssd_dir, ssd_size = parsed.ssd.rsplit(":", 1)
    assert parse_size(ssd_size) > 0
    assert "hostPath" in volume_under(spec, c, ssd_dir)[1], f"{where}: SSD tier not on hostPath"

    ram = parse_size(parsed.ram)
    shm_mount, shm_volume = volume_under(spec, c, parsed.ram_dir)
    assert shm_mount["mountPath"].startswith("/dev/shm"), f"{where}: --ram-dir not on /dev/shm"
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    memory_limit = k8s_quantity(limits["memory"])
    if "emptyDir" in shm_volume:
        assert shm_volume["emptyDir"].get("medium") == "Memory", f"{where}: RAM tier not tmpfs"
        size_limit = k8s_quantity(shm_volume["emptyDir"]["sizeLimit"])
        assert ram + 256 * 2**20 <= size_limit, f"{where}: --ram {parsed.ram} too close to shm"
        assert size_limit + 512 * 2**20 <= memory_limit, f"{where}: memory limit below shm"
    else:
        assert shm_volume.get("hostPath", {}).get("path", "").startswith("/dev/shm/"), where
        assert ram + 1024 * 2**20 <= memory_limit, f"{where}: memory limit below --ram"
    assert k8s_quantity(requests["memory"]) <= memory_limit
    assert k8s_quantity(requests["cpu"]) > 0
    assert "cpu" not in limits, f"{where}: a CPU limit throttles the FUSE process"

    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe in c, f"{where}: no {probe}"
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ("metrics", 9464), f"{where}: {probe}"
    # Readiness: the cachefs FUSE mount itself (the hostPath bind mount under it is always a
    # mount point, so `mountpoint` alone would pass without the worker).
    readiness = " ".join(c["readinessProbe"]["exec"]["command"])
    assert "fuse.cachefs" in readiness and "/mnt/cachefs" in readiness, readiness
    pre_stop = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "cachefs down" in pre_stop, f"{where}: no clean unmount in preStop"
    down_timeout = float(re.search(r"cachefs down --timeout (\d+)", pre_stop)[1])
    grace = spec.get("terminationGracePeriodSeconds", 30)
    assert grace > down_timeout, f"{where}: grace period {grace}s < `cachefs down` timeout"

    assert spec["nodeSelector"] == {WORKER_LABEL: "true"}, f"{where}: nodeSelector"
    assert spec.get("priorityClassName") == "cachefs-worker"
    assert spec.get("automountServiceAccountToken") is False


def check_secrets_not_inlined(objects) -> None:
    """Credentials reach containers only by reference: no literal env value and no argument
    that looks like one, and every Secret reference names a Secret of the tree."""
    secret_names = {o["metadata"]["name"] for o in find(objects, "Secret")}
    secretish = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.I)
    for workload in pod_workloads(objects):
        spec = pod_spec(workload)
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{kv.name_of(workload)} {c['name']}"
            for e in c.get("env", []):
                if secretish.search(e["name"]):
                    assert "value" not in e, f"{where}: {e['name']} inlined as a literal value"
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["name"] in secret_names, f"{where}: Secret {ref['name']}"
            for source in c.get("envFrom", []):
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secret_names
            for arg in c.get("args", []) + c.get("command", []):
                assert not re.search(r"--token[= ](?!-?file)", arg), f"{where}: token in args"
                assert "AWS_SECRET_ACCESS_KEY=" not in arg and "OSS_ACCESS_KEY_SECRET=" not in arg
        for v in spec.get("volumes", []):
            if "secret" in v:
                assert v["secret"]["secretName"] in secret_names, f"{kv.name_of(workload)}"


def check_rbac(objects) -> None:
    """Exactly the scaler's rules (where the scaler is deployed) and the scheduler's built-in
    roles; no other role or binding, no wildcard."""
    roles = find(objects, "Role") + find(objects, "ClusterRole")
    assert [r["metadata"]["name"] for r in roles] in (["cachefs-scaler"], []), (
        "the only role cachefs defines is the scaler's; review any other for least privilege"
    )
    for role in roles:
        assert role["kind"] == "ClusterRole"
        rules = sorted(role["rules"], key=lambda r: r["resources"])
        assert rules == sorted(SCALER_RULES, key=lambda r: r["resources"]), rules
    seen = {}
    for binding in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding"):
        assert binding["kind"] == "ClusterRoleBinding", kv.name_of(binding)
        subjects = binding["subjects"]
        assert len(subjects) == 1 and subjects[0]["kind"] == "ServiceAccount", subjects
        assert subjects[0]["namespace"] == NAMESPACE
        ref = binding["roleRef"]
        seen[binding["metadata"]["name"]] = (ref["kind"], ref["name"], subjects[0]["name"])
    expected = {
        name: value
        for name, value in EXPECTED_BINDINGS.items()
        if value[1] != "cachefs-scaler" or roles
    }
    assert seen == expected, seen
    for obj in objects:  # no wildcard anywhere
        for rule in obj.get("rules", []):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), f"{kv.name_of(obj)}: wildcard {key}"


def check_service_accounts(objects) -> None:
    """Only the API clients mount a Kubernetes token."""
    for workload in pod_workloads(objects):
        spec = pod_spec(workload)
        account = spec.get("serviceAccountName", "default")
        if account in API_CLIENTS:
            assert spec.get("automountServiceAccountToken") is not False
            continue
        assert spec.get("automountServiceAccountToken") is False, (
            f"{kv.name_of(workload)} mounts a Kubernetes API token it does not need"
        )


def check_scheduler(objects) -> None:
    """The KubeSchedulerConfiguration names the coordinator's extender routes, is ignorable,
    and is what the scheduler Deployment runs with."""
    deployment = one(objects, "Deployment", "cachefs-scheduler")
    c = container(deployment)
    (config_arg,) = [a for a in c["command"] if a.startswith("--config=")]
    config_path = Path(config_arg.split("=", 1)[1])
    config_mount, config_volume = volume_under(pod_spec(deployment), c, str(config_path))
    (config_map,) = [
        o
        for o in find(objects, "ConfigMap")
        if o["metadata"]["name"] == config_volume["configMap"]["name"]
    ]
    key = str(config_path.relative_to(config_mount["mountPath"]))
    config = yaml.safe_load(config_map["data"][key])
    jsonschema.validate(config, KUBE_SCHEDULER_CONFIGURATION_SCHEMA)
    assert [p["schedulerName"] for p in config["profiles"]] == [SCHEDULER_NAME]

    service = one(objects, "Service", COORDINATOR_SERVICE)
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
    namespace = service["metadata"]["namespace"]
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == (
        f"http://{COORDINATOR_SERVICE}.{namespace}.svc:{port}/scheduler"
    ), extender["urlPrefix"]
    assert extender["filterVerb"] == "filter"
    assert extender["prioritizeVerb"] == "prioritize"
    assert extender["ignorable"] is True
    assert extender["nodeCacheCapable"] is False
    assert 0 < parse_duration(extender["httpTimeout"]) <= 5
    assert extender["weight"] > 0
    # The coordinator really serves those routes.
    from coordinator.extender import extender_router

    posts = {r.path for r in extender_router(None).routes if "POST" in r.methods}
    prefix = "/" + extender["urlPrefix"].split("/", 3)[3]
    for verb in (extender["filterVerb"], extender["prioritizeVerb"]):
        assert f"{prefix}/{verb}" in posts, f"the coordinator has no POST {prefix}/{verb}"
    # Leader election off needs exactly one replica.
    assert config["leaderElection"]["leaderElect"] is False
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def check_example_job(job: dict) -> None:
    template = job["spec"]["template"]
    spec = template["spec"]
    assert template["metadata"]["labels"].get(DATASET_LABEL) == "imagenet"
    locality = template["metadata"].get("annotations", {}).get("cachefs.io/locality")
    assert locality in (None, "required", "preferred")
    assert spec["schedulerName"] == SCHEDULER_NAME
    assert spec["nodeSelector"].get(WORKER_LABEL) == "true"
    for c in spec.get("initContainers", []) + spec["containers"]:
        m = mount_at(c, "/mnt/cachefs")
        assert m.get("mountPropagation") == "HostToContainer", f"{c['name']}: propagation"
        assert m.get("readOnly") is True, f"{c['name']}: /mnt/cachefs must be read-only"
        v = volume(spec, m["name"])
        assert v["hostPath"] == {"path": "/mnt/cachefs", "type": "Directory"}
    train = container(job, "train")
    assert any("/mnt/cachefs/imagenet" in part for part in train["command"])


def host_path(spec: dict, c: dict, path: str) -> str:
    """The host path that ``path`` in container ``c`` is, through its hostPath volume."""
    mount, source = volume_under(spec, c, path)
    assert "hostPath" in source, f"{c['name']}: {path} is not on a hostPath"
    return source["hostPath"]["path"].rstrip("/") + path[len(mount["mountPath"].rstrip("/")) :]


def check_csi_node(objects) -> None:
    """The CSIDriver, and the node plugin DaemonSet wired to the kubelet (socket, registration,
    pods directory) and to the worker (its mount and its control socket) of the same tree."""
    driver = one(objects, "CSIDriver", DRIVER_NAME)["spec"]
    assert driver["attachRequired"] is False  # no controller: nothing to attach
    assert driver["podInfoOnMount"] is True
    assert driver["requiresRepublish"] is True  # how a volume returns after a worker restart
    assert driver["fsGroupPolicy"] == "None"  # read-only data: never chowned
    assert set(driver["volumeLifecycleModes"]) == {"Persistent", "Ephemeral"}

    daemonset = one(objects, "DaemonSet", CSI_NODE)
    spec = pod_spec(daemonset)
    plugin = container(daemonset, "csi-node")
    assert plugin["command"] == ["cachefs", "csi"]
    parsed = parse_cli(["csi", *cli_args(plugin)])  # the real CLI accepts every flag
    assert field_env(plugin).get("NODE_NAME") == "spec.nodeName"
    assert parsed.node == "<spec.nodeName>"
    assert plugin["securityContext"]["privileged"] is True  # mount(2), Bidirectional
    # Target paths are host paths in the kubelet's pods directory: the plugin sees them at the
    # same path, shared Bidirectional so that its bind mounts reach the host and the pods.
    pods = parsed.kubelet_dir.rstrip("/") + "/pods"
    assert volume_under(spec, plugin, pods)[0].get("mountPropagation") == "Bidirectional"
    assert host_path(spec, plugin, pods) == pods
    # The kubelet calls the socket at the path the registrar registers; the sidecars reach
    # the very same file.
    socket = socket_path(parsed.endpoint)
    socket_on_host = host_path(spec, plugin, socket)
    assert socket_on_host == f"/var/lib/kubelet/plugins/{DRIVER_NAME}/{Path(socket).name}"
    registrar = container(daemonset, "node-driver-registrar")
    registrar_args = cli_args(registrar)
    assert flag(registrar_args, "--csi-address") == socket
    assert host_path(spec, registrar, socket) == socket_on_host
    assert flag(registrar_args, "--kubelet-registration-path") == socket_on_host
    assert host_path(spec, registrar, "/registration") == "/var/lib/kubelet/plugins_registry"
    registrar_port = flag(registrar_args, "--http-endpoint").rsplit(":", 1)[1]
    registrar_ports = {p["name"]: p["containerPort"] for p in registrar["ports"]}
    assert registrar_ports[registrar["livenessProbe"]["httpGet"]["port"]] == int(registrar_port)
    liveness = container(daemonset, "liveness-probe")
    liveness_args = cli_args(liveness)
    assert flag(liveness_args, "--csi-address") == socket
    assert host_path(spec, liveness, socket) == socket_on_host
    plugin_ports = {p["name"]: p["containerPort"] for p in plugin["ports"]}
    probe_port = plugin["livenessProbe"]["httpGet"]["port"]
    assert plugin_ports[probe_port] == int(flag(liveness_args, "--health-port"))
    for c in (registrar, liveness):
        assert not c["securityContext"].get("privileged"), c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]

    # The worker of the same tree: the plugin sees its FUSE mount at the path the worker
    # reports (HostToContainer: a later mount shows up) and its state directory (the control
    # socket) on the same host directories.
    (worker,) = workers(objects)
    worker_spec, worker_c = pod_spec(worker), container(worker, "worker")
    worker_args = parse_cli(["worker", *cli_args(worker_c)])
    mnt = volume_under(spec, plugin, worker_args.mount)[0]
    assert mnt.get("mountPropagation") in ("HostToContainer", "Bidirectional")
    assert host_path(spec, plugin, worker_args.mount) == host_path(
        worker_spec, worker_c, worker_args.mount
    )
    assert host_path(spec, plugin, parsed.state) == host_path(
        worker_spec, worker_c, worker_args.state
    )
    # Where the workers run.
    assert spec["nodeSelector"] == worker_spec["nodeSelector"]
    for toleration in worker_spec.get("tolerations", []):
        assert toleration in spec.get("tolerations", []), toleration


# The Pod Security Standards' baseline profile, as admission enforces it in the example's
# namespace: the capabilities a container may add and the sysctls a pod may set.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
BASELINE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
BASELINE_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                          "container_engine_t"}  # fmt: skip


def check_pod_security_baseline(spec: dict) -> None:
    """Every control of the baseline profile: no host namespaces, hostPath volumes, host
    ports, privileged containers, added capabilities beyond the default set, unsafe sysctls,
    unmasked /proc, Unconfined seccomp or AppArmor, custom SELinux users or roles, Windows
    host processes."""
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key), key
    assert not [v["name"] for v in spec.get("volumes", []) if "hostPath" in v], "hostPath"
    pod_context = spec.get("securityContext", {})
    sysctls = {sysctl["name"] for sysctl in pod_context.get("sysctls", [])}
    assert sysctls <= BASELINE_SYSCTLS, sysctls
    contexts = [pod_context]
    for c in spec.get("initContainers", []) + spec["containers"]:
        context = c.get("securityContext", {})
        assert not context.get("privileged"), f"{c['name']}: privileged"
        added = set(context.get("capabilities", {}).get("add", []))
        assert added <= BASELINE_CAPABILITIES, f"{c['name']}: adds {added}"
        assert context.get("procMount", "Default") == "Default", c["name"]
        assert not [p for p in c.get("ports", []) if p.get("hostPort")], f"{c['name']}: hostPort"
        contexts.append(context)
    for context in contexts:
        assert not context.get("windowsOptions", {}).get("hostProcess")
        assert context.get("seccompProfile", {}).get("type") != "Unconfined"
        assert context.get("appArmorProfile", {}).get("type") != "Unconfined"
        selinux = context.get("seLinuxOptions", {})
        assert selinux.get("type", "") in BASELINE_SELINUX_TYPES
        assert not selinux.get("user") and not selinux.get("role")


def check_cachefs_volume(pv: dict, claim: dict) -> str:
    """A statically provisioned cachefs PersistentVolume and its claim; the dataset it names."""
    csi = pv["spec"]["csi"]
    assert csi["driver"] == DRIVER_NAME
    assert csi.get("readOnly") is True
    assert pv["spec"]["accessModes"] == ["ReadOnlyMany"] == claim["spec"]["accessModes"]
    assert pv["spec"]["storageClassName"] == "" == claim["spec"]["storageClassName"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    ref = pv["spec"]["claimRef"]  # pre-bound: no other claim takes it
    assert (ref["namespace"], ref["name"]) == (
        claim["metadata"]["namespace"],
        claim["metadata"]["name"],
    )
    assert claim["spec"]["volumeName"] == pv["metadata"]["name"]
    requested = k8s_quantity(claim["spec"]["resources"]["requests"]["storage"])
    assert requested <= k8s_quantity(pv["spec"]["capacity"]["storage"])
    attributes = csi.get("volumeAttributes", {})
    assert set(attributes) <= {DATASET_ATTRIBUTE}, f"the plugin refuses attributes {attributes}"
    return check_dataset_name(attributes.get(DATASET_ATTRIBUTE, csi["volumeHandle"]))


def check_pvc_example(objects) -> None:
    """The training namespace under baseline Pod Security; the Job reads its dataset through
    a read-only claim of a cachefs PersistentVolume, and is admitted there."""
    namespace = one(objects, "Namespace", EXAMPLE_NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    (job,) = find(objects, "Job")
    template = job["spec"]["template"]
    spec = template["spec"]
    check_pod_security_baseline(spec)
    assert spec["schedulerName"] == SCHEDULER_NAME
    assert spec["nodeSelector"].get(WORKER_LABEL) == "true"
    train = container(job, "train")
    claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert claims, "the Job mounts no claim"
    for source in claims:
        ref = source["persistentVolumeClaim"]
        assert ref.get("readOnly") is True, source["name"]
        claim = one(objects, "PersistentVolumeClaim", ref["claimName"])
        pv = one(objects, "PersistentVolume", claim["spec"]["volumeName"])
        dataset = check_cachefs_volume(pv, claim)
        assert template["metadata"]["labels"].get(DATASET_LABEL) == dataset
        (mount,) = [m for m in train["volumeMounts"] if m["name"] == source["name"]]
        assert mount.get("readOnly") is True
        # So that the volume the plugin republishes after a worker restart reaches the pod.
        assert mount.get("mountPropagation") == "HostToContainer"
        assert any(f"{mount['mountPath']}/" in part for part in train["command"])


def check_images(objects) -> None:
    for workload in pod_workloads(objects):
        spec = pod_spec(workload)
        for c in spec.get("initContainers", []) + spec["containers"]:
            image = c["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, f"untagged {image}"
            if name == CACHEFS_IMAGE:
                assert tag == _project_version(), f"{image}: not the project's version"


def _project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M)[1]


# Strict subset schemas for what kubernetes-validate has no schema for. Fields are those of
# kubescheduler.config.k8s.io/v1 (KubeSchedulerConfiguration, Extender) and
# monitoring.coreos.com/v1 ServiceMonitor that these manifests may use; anything else fails.
KUBE_SCHEDULER_CONFIGURATION_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "profiles", "extenders"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubescheduler.config.k8s.io/v1"},
        "kind": {"const": "KubeSchedulerConfiguration"},
        "leaderElection": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "leaderElect": {"type": "boolean"},
                "resourceNamespace": {"type": "string"},
                "resourceName": {"type": "string"},
            },
        },
        "profiles": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["schedulerName"],
                "additionalProperties": False,
                "properties": {
                    "schedulerName": {"type": "string"},
                    "plugins": {"type": "object"},
                    "pluginConfig": {"type": "array"},
                    "percentageOfNodesToScore": {"type": "integer"},
                },
            },
        },
        "extenders": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["urlPrefix"],
                "additionalProperties": False,
                "properties": {
                    "urlPrefix": {"type": "string", "pattern": "^https?://"},
                    "filterVerb": {"type": "string"},
                    "preemptVerb": {"type": "string"},
                    "prioritizeVerb": {"type": "string"},
                    "bindVerb": {"type": "string"},
                    "weight": {"type": "integer", "minimum": 1},
                    "enableHTTPS": {"type": "boolean"},
                    "tlsConfig": {"type": "object"},
                    "httpTimeout": {"type": "string", "pattern": "^[0-9.]+(ms|s|m)$"},
                    "nodeCacheCapable": {"type": "boolean"},
                    "managedResources": {"type": "array"},
                    "ignorable": {"type": "boolean"},
                },
            },
        },
    },
}

_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array"},
    },
}
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m)$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array"},
                                        "targetLabel": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "action": {"type": "string"},
                                        "separator": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# --- tests: rendering and schemas --------------------------------------------------------------


def test_the_pinned_kubectl_renders():
    version = kv.kubectl_version()
    assert kv.KUBECTL_VERSION in version, version


@pytest.mark.parametrize("target", kv.TARGETS)
def test_every_object_is_valid_for_the_pinned_kubernetes_version(rendered, target):
    objects = rendered[target]
    assert objects, f"{target} rendered nothing"
    errors, skipped = [], []
    for obj in objects:
        error = kv.validate(obj)
        if error == "skipped":
            skipped.append(obj)
        elif error:
            errors.append(f"{kv.name_of(obj)}: {error}")
    assert not errors, "\n".join(errors)
    for obj in skipped:  # the CRD kinds, by their own schema
        assert (obj["apiVersion"], obj["kind"]) in kv.CRD_KINDS
        jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)


def test_the_validator_rejects_an_unknown_field_and_a_wrong_type(rendered):
    worker = copy.deepcopy(workers(rendered["overlays/dev"])[0])
    container(worker, "worker")["volumeMounts"][1]["mountPropogation"] = "Bidirectional"
    assert "mountPropogation" in (kv.validate(worker) or "")
    worker = copy.deepcopy(workers(rendered["overlays/dev"])[0])
    container(worker, "worker")["securityContext"]["privileged"] = "yes"
    assert kv.validate(worker) not in (None, "skipped")


@pytest.mark.parametrize("target", kv.TARGETS)
def test_names_are_unique_and_namespaced_objects_live_in_cachefs(rendered, target):
    objects = rendered[target]
    ids = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids))
    cluster_scoped = {
        "Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "CSIDriver",
        "PersistentVolume",
    }  # fmt: skip
    for o in objects:
        if o["kind"] in cluster_scoped:
            assert "namespace" not in o["metadata"], kv.name_of(o)
    if target == "examples/hostpath":
        assert all("namespace" not in o["metadata"] for o in objects)  # the user's namespace
        return
    if target == "examples":
        for o in objects:
            if o["kind"] not in cluster_scoped:
                assert o["metadata"].get("namespace") == EXAMPLE_NAMESPACE, kv.name_of(o)
        return
    for o in objects:
        if o["kind"] not in cluster_scoped:
            assert o["metadata"].get("namespace") == NAMESPACE, kv.name_of(o)
    ns = one(objects, "Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


# --- tests: the worker --------------------------------------------------------------------------


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_the_worker_mounts_fuse_with_bidirectional_propagation_and_sane_sizes(rendered, target):
    (worker,) = workers(rendered[target])
    check_worker(worker)


def test_the_base_runs_workers_as_a_daemonset_with_a_headless_service(rendered):
    objects = rendered["base"]
    worker = one(objects, "DaemonSet", "cachefs-worker")
    service = one(objects, "Service", "cachefs-worker")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_template_labels(worker).items()


def pod_template_labels(workload):
    return workload["spec"]["template"]["metadata"]["labels"]


def test_production_keeps_the_ram_tier_on_the_host_and_uses_host_networking(rendered):
    (worker,) = workers(rendered["overlays/production"])
    spec = pod_spec(worker)
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert volume(spec, "shm") == {
        "name": "shm",
        "hostPath": {"path": "/dev/shm/cachefs", "type": "DirectoryOrCreate"},
    }


@pytest.mark.parametrize(
    "breakage",
    [
        "not privileged",
        "no propagation",
        "volume at the mount point",
        "no /dev/fuse",
        "ram above shm",
        "no readiness probe",
        "no preStop",
        "unknown flag",
        "undefined variable",
        "no memory limit",
    ],
)
def test_the_worker_check_catches(rendered, breakage):
    (worker,) = copy.deepcopy(workers(rendered["base"]))
    c = container(worker, "worker")
    spec = pod_spec(worker)
    if breakage == "not privileged":
        c["securityContext"]["privileged"] = False
    elif breakage == "no propagation":
        mount_at(c, "/mnt").pop("mountPropagation")
    elif breakage == "volume at the mount point":
        mount_at(c, "/mnt")["mountPath"] = "/mnt/cachefs"
        volume(spec, "host-mnt")["hostPath"]["path"] = "/mnt/cachefs"
    elif breakage == "no /dev/fuse":
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/dev/fuse"]
    elif breakage == "ram above shm":
        volume(spec, "shm")["emptyDir"]["sizeLimit"] = "8Gi"
    elif breakage == "no readiness probe":
        del c["readinessProbe"]
    elif breakage == "no preStop":
        del c["lifecycle"]
    elif breakage == "unknown flag":
        c["args"].append("--ram-size=1GiB")
    elif breakage == "undefined variable":
        c["args"].append("--ssd=$(CACHEFS_NVME)")
    elif breakage == "no memory limit":
        c["resources"]["limits"].pop("memory")
    with pytest.raises((AssertionError, KeyError)):
        check_worker(worker)


# --- tests: coordinator, scaler, scheduler -----------------------------------------------------


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_the_coordinator_is_one_replica_on_its_pvc_with_health_probes(rendered, target):
    objects = rendered[target]
    deployment = one(objects, "Deployment", "cachefs-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    spec = pod_spec(deployment)
    c = container(deployment)
    assert c["command"] == ["cachefs", "coordinator"]
    parsed = parse_cli(["coordinator", *cli_args(c)])
    state_volume = volume_under(spec, c, parsed.state)[1]
    claim = state_volume["persistentVolumeClaim"]["claimName"]
    one(objects, "PersistentVolumeClaim", claim)
    token_volume = volume_under(spec, c, parsed.token_file)[1]
    assert token_volume["secret"]["secretName"] == "cachefs-api-token"
    host, port = parsed.listen.rsplit(":", 1)
    assert host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
    service = one(objects, "Service", COORDINATOR_SERVICE)
    assert service["spec"]["selector"].items() <= pod_template_labels(deployment).items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "resources" in c and "requests" in c["resources"]


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_no_hostpath_outside_the_worker_and_the_csi_node_plugin(rendered, target):
    for workload in pod_workloads(rendered[target]):
        if workload["metadata"]["name"] in ("cachefs-worker", CSI_NODE):
            continue  # checked by check_worker and check_csi_node
        spec = pod_spec(workload)
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], kv.name_of(workload)
        for c in spec["containers"]:
            assert not c.get("securityContext", {}).get("privileged"), kv.name_of(workload)
            assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_rbac_is_exactly_the_least_privilege_set(rendered, target):
    check_rbac(rendered[target])
    check_service_accounts(rendered[target])


@pytest.mark.parametrize(
    "breakage", ["extra verb", "wildcard", "secrets access", "extra binding", "token automount"]
)
def test_the_rbac_check_catches(rendered, breakage):
    objects = copy.deepcopy(rendered["base"])
    role = one(objects, "ClusterRole", "cachefs-scaler")
    if breakage == "extra verb":
        role["rules"][1]["verbs"].append("delete")
    elif breakage == "wildcard":
        role["rules"][0]["resources"] = ["*"]
    elif breakage == "secrets access":
        role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    elif breakage == "extra binding":
        binding = copy.deepcopy(one(objects, "ClusterRoleBinding", "cachefs-scaler"))
        binding["metadata"]["name"] = "cachefs-worker-admin"
        binding["roleRef"]["name"] = "cluster-admin"
        objects.append(binding)
    elif breakage == "token automount":
        pod_spec(one(objects, "Deployment", "cachefs-coordinator")).pop(
            "automountServiceAccountToken"
        )
    with pytest.raises(AssertionError):
        check_rbac(objects)
        check_service_accounts(objects)


@pytest.mark.parametrize("target", ("base", "overlays/dev", "overlays/production"))
def test_the_scaler_runs_with_its_own_account_and_flags_the_scaler_accepts(rendered, target):
    objects = rendered[target]
    deployment = one(objects, "Deployment", "cachefs-scaler")
    spec = pod_spec(deployment)
    assert spec["serviceAccountName"] == "cachefs-scaler"
    one(objects, "ServiceAccount", "cachefs-scaler")
    c = container(deployment)
    assert c["command"] == ["python", "-m", "coordinator.scaler"]
    args = cli_args(c)
    assert flag(args, "--coordinator") == f"http://{COORDINATOR_SERVICE}:7700"
    token_volume = volume_under(spec, c, flag(args, "--token-file"))[1]
    assert token_volume["secret"]["secretName"] == "cachefs-api-token"
    assert 0 < float(flag(args, "--metric-low")) < float(flag(args, "--metric-high")) <= 1


def test_the_scaler_module_accepts_the_manifest_flags(rendered):
    from coordinator.scaler.__main__ import parse_args

    c = container(one(rendered["base"], "Deployment", "cachefs-scaler"))
    try:
        args = parse_args(cli_args(c))
    except SystemExit:
        raise AssertionError(f"python -m coordinator.scaler rejects {c['args']}") from None
    assert args.coordinator == f"http://{COORDINATOR_SERVICE}:7700"
    assert args.namespace == []  # every namespace: what the ClusterRole grants
    # The label the scaler puts on nodes is the worker DaemonSet's nodeSelector.
    from coordinator.scaler.decide import DATASET_KEY, WORKER_LABEL, WORKER_LABEL_VALUE

    (worker,) = workers(rendered["base"])
    assert pod_spec(worker)["nodeSelector"] == {WORKER_LABEL: WORKER_LABEL_VALUE}
    assert DATASET_KEY == DATASET_LABEL


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_the_scheduler_configuration_enables_the_extender(rendered, target):
    check_scheduler(rendered[target])


@pytest.mark.parametrize(
    "breakage", ["not ignorable", "wrong verb", "wrong namespace", "unknown field"]
)
def test_the_scheduler_check_catches(rendered, breakage):
    objects = copy.deepcopy(rendered["base"])
    (config_map,) = [
        o for o in find(objects, "ConfigMap") if o["metadata"]["name"].startswith("cachefs-sch")
    ]
    (key,) = config_map["data"]
    config = yaml.safe_load(config_map["data"][key])
    extender = config["extenders"][0]
    if breakage == "not ignorable":
        extender["ignorable"] = False
    elif breakage == "wrong verb":
        extender["filterVerb"] = "filtr"
    elif breakage == "wrong namespace":
        extender["urlPrefix"] = extender["urlPrefix"].replace(".cachefs.svc", ".default.svc")
    elif breakage == "unknown field":
        extender["ignoreable"] = True
    config_map["data"][key] = yaml.safe_dump(config)
    with pytest.raises((AssertionError, jsonschema.ValidationError)):
        check_scheduler(objects)


# --- tests: secrets, images, monitoring ---------------------------------------------------------


@pytest.mark.parametrize("target", (*DEPLOYABLE, *EXAMPLES))
def test_secrets_are_referenced_never_inlined(rendered, target):
    check_secrets_not_inlined(rendered[target])


def test_the_secret_check_catches_an_inlined_key(rendered):
    objects = copy.deepcopy(rendered["overlays/dev"])
    (worker,) = workers(objects)
    container(worker, "worker")["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "x"})
    with pytest.raises(AssertionError):
        check_secrets_not_inlined(objects)


def test_the_base_secrets_fail_closed_and_overlays_fill_them(rendered):
    token = one(rendered["base"], "Secret", "cachefs-api-token")
    assert not token.get("data") and not token.get("stringData")  # no default token, ever
    for target in OVERLAYS:
        token = one(rendered[target], "Secret", "cachefs-api-token")
        assert set(token["data"]) == {"token"}, target
        store = one(rendered[target], "Secret", "cachefs-store-credentials")
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(store["data"]), target


def test_production_secret_files_stay_out_of_git():
    secrets = K8S / "overlays" / "production" / "secrets"
    ignore = (secrets / ".gitignore").read_text().split()
    assert "*" in ignore and "!*.example" in ignore
    kustomization = yaml.safe_load((K8S / "overlays/production/kustomization.yaml").read_text())
    files = [
        f for g in kustomization["secretGenerator"] for f in g.get("files", []) + g.get("envs", [])
    ]
    for entry in files:
        path = entry.split("=", 1)[-1]
        assert path.startswith("secrets/") and not path.endswith(".example"), path
        assert (secrets.parent / f"{path}.example").exists(), f"no template for {path}"
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", str(secrets.parent / path)],
            cwd=ROOT,
            capture_output=True,
        )
        assert tracked.returncode != 0, f"{path} is tracked by git"


@pytest.mark.parametrize("target", (*DEPLOYABLE, *EXAMPLES))
def test_images_are_pinned_and_cachefs_is_the_project_version(rendered, target):
    check_images(rendered[target])


@pytest.mark.parametrize("target", ("overlays/production", "overlays/elastic"))
def test_service_monitors_select_existing_services_and_ports(rendered, target):
    objects = rendered[target]
    monitors = find(objects, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"cachefs-coordinator", "cachefs-worker"}
    for monitor in monitors:
        services = [
            s
            for s in find(objects, "Service")
            if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert len(services) == 1, f"{monitor['metadata']['name']} selects {len(services)}"
        ports = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in ports
            assert endpoint["path"] == "/metrics"


def test_dev_needs_no_prometheus_operator(rendered):
    assert not find(rendered["overlays/dev"], "ServiceMonitor")
    assert not find(rendered["base"], "ServiceMonitor")


# --- tests: elastic overlay ----------------------------------------------------------------------


def test_elastic_scales_a_statefulset_with_an_hpa_on_the_cache_used_ratio(rendered):
    objects = rendered["overlays/elastic"]
    # The workers are no DaemonSet; the CSI node plugin still is (one per worker node).
    assert [d["metadata"]["name"] for d in find(objects, "DaemonSet")] == [CSI_NODE]
    assert not find(objects, "Deployment", "cachefs-scaler")  # one controller sizes the cache
    assert not find(objects, "ClusterRole")
    statefulset = one(objects, "StatefulSet", "cachefs-worker")
    assert "replicas" not in statefulset["spec"], "the HPA owns replicas"
    one(objects, "Service", statefulset["spec"]["serviceName"])
    hpa = one(objects, "HorizontalPodAutoscaler", "cachefs-worker")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "cachefs-worker",
    }
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "cachefs_cache_used_ratio"
    target = metric["external"]["target"]
    assert 0 < k8s_quantity(target.get("value", target.get("averageValue"))) <= 1
    # The coordinator exports the metric the HPA and the adapter rule name.
    server = (ROOT / "coordinator" / "server.py").read_text()
    assert '"cachefs_cache_used_ratio"' in server
    rules = yaml.safe_load((K8S / "overlays/elastic/prometheus-adapter-values.yaml").read_text())
    (rule,) = rules["rules"]["external"]
    assert rule["seriesQuery"].startswith("cachefs_cache_used_ratio{")
    assert rule["name"]["as"] == "cachefs_cache_used_ratio"
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    for label in metric["external"]["metric"]["selector"]["matchLabels"]:
        assert label in ("dataset", "copy"), f"the metric has no label {label}"


def test_elastic_workers_run_the_production_pod_one_per_node(rendered):
    statefulset = one(rendered["overlays/elastic"], "StatefulSet", "cachefs-worker")
    daemonset = one(rendered["overlays/production"], "DaemonSet", "cachefs-worker")
    template = copy.deepcopy(statefulset["spec"]["template"])
    affinity = template["spec"].pop("affinity")
    assert template == daemonset["spec"]["template"], "the two worker pod templates drifted"
    (term,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"], template["metadata"]["labels"])


# --- tests: the example Job ---------------------------------------------------------------------


def test_the_hostpath_example_job_reads_the_mount_with_host_to_container_propagation(rendered):
    (job,) = rendered["examples/hostpath"]
    assert job["kind"] == "Job"
    check_example_job(job)


@pytest.mark.parametrize("breakage", ["bidirectional", "writable", "no dataset label"])
def test_the_example_job_check_catches(rendered, breakage):
    (job,) = copy.deepcopy(rendered["examples/hostpath"])
    train = container(job, "train")
    if breakage == "bidirectional":
        mount_at(train, "/mnt/cachefs")["mountPropagation"] = "Bidirectional"
    elif breakage == "writable":
        mount_at(train, "/mnt/cachefs")["readOnly"] = False
    elif breakage == "no dataset label":
        del job["spec"]["template"]["metadata"]["labels"][DATASET_LABEL]
    with pytest.raises(AssertionError):
        check_example_job(job)


# --- tests: the CSI node plugin and the PersistentVolume example --------------------------------


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_the_csi_node_plugin_runs_beside_each_worker_wired_to_kubelet_and_worker(rendered, target):
    check_csi_node(rendered[target])


@pytest.mark.parametrize(
    "breakage",
    [
        "attach required",
        "no inline volumes",
        "no republish",
        "pods not bidirectional",
        "registration path elsewhere",
        "another worker state",
        "worker mount unseen",
        "unknown flag",
    ],
)
def test_the_csi_node_check_catches(rendered, breakage):
    objects = copy.deepcopy(rendered["base"])
    driver = one(objects, "CSIDriver", DRIVER_NAME)["spec"]
    daemonset = one(objects, "DaemonSet", CSI_NODE)
    plugin = container(daemonset, "csi-node")
    if breakage == "attach required":
        driver["attachRequired"] = True
    elif breakage == "no inline volumes":
        driver["volumeLifecycleModes"] = ["Persistent"]
    elif breakage == "no republish":
        driver["requiresRepublish"] = False
    elif breakage == "pods not bidirectional":
        mount_at(plugin, "/var/lib/kubelet/pods")["mountPropagation"] = "HostToContainer"
    elif breakage == "registration path elsewhere":
        registrar = container(daemonset, "node-driver-registrar")
        registrar["args"] = [
            a.replace("csi.cachefs.io/csi.sock", "cachefs/csi.sock") for a in registrar["args"]
        ]
    elif breakage == "another worker state":
        volume(pod_spec(daemonset), "worker-state")["hostPath"]["path"] = "/var/lib/other"
    elif breakage == "worker mount unseen":
        plugin["volumeMounts"] = [m for m in plugin["volumeMounts"] if m["mountPath"] != "/mnt"]
    elif breakage == "unknown flag":
        plugin["args"].append("--kubelet-root=/var/lib/kubelet")
    with pytest.raises(AssertionError):
        check_csi_node(objects)


def test_the_example_job_reads_a_cachefs_volume_under_baseline_pod_security(rendered):
    objects = rendered["examples"]
    assert sorted(o["kind"] for o in objects) == [
        "Job", "Namespace", "PersistentVolume", "PersistentVolumeClaim",
    ]  # fmt: skip
    check_pvc_example(objects)
    # The hostPath fallback needs more than baseline: the check bites on it.
    (fallback,) = rendered["examples/hostpath"]
    with pytest.raises(AssertionError, match="hostPath"):
        check_pod_security_baseline(pod_spec(fallback))


@pytest.mark.parametrize(
    "breakage",
    [
        "hostPath",
        "privileged",
        "host network",
        "writable claim",
        "writer access",
        "claim of another namespace",
        "another driver",
        "no propagation",
        "unknown attribute",
        "namespace not baseline",
    ],
)
def test_the_pvc_example_check_catches(rendered, breakage):
    objects = copy.deepcopy(rendered["examples"])
    (job,) = find(objects, "Job")
    spec = pod_spec(job)
    train = container(job, "train")
    pv = one(objects, "PersistentVolume")
    claim = one(objects, "PersistentVolumeClaim")
    if breakage == "hostPath":
        spec["volumes"].append({"name": "host", "hostPath": {"path": "/mnt/cachefs"}})
    elif breakage == "privileged":
        train["securityContext"]["privileged"] = True
    elif breakage == "host network":
        spec["hostNetwork"] = True
    elif breakage == "writable claim":
        volume(spec, "imagenet")["persistentVolumeClaim"]["readOnly"] = False
    elif breakage == "writer access":
        pv["spec"]["accessModes"] = claim["spec"]["accessModes"] = ["ReadWriteOnce"]
    elif breakage == "claim of another namespace":
        pv["spec"]["claimRef"]["namespace"] = "default"
    elif breakage == "another driver":
        pv["spec"]["csi"]["driver"] = "s3.csi.aws.com"
    elif breakage == "no propagation":
        mount_at(train, "/data/imagenet").pop("mountPropagation")
    elif breakage == "unknown attribute":
        pv["spec"]["csi"]["volumeAttributes"]["datset"] = "imagenet"
    elif breakage == "namespace not baseline":
        labels = one(objects, "Namespace")["metadata"]["labels"]
        labels["pod-security.kubernetes.io/enforce"] = "privileged"
    with pytest.raises(AssertionError):
        check_pvc_example(objects)


# --- tests: the image ---------------------------------------------------------------------------


def test_the_dockerfile_installs_fuse3_and_copies_only_what_the_dockerignore_lets_in():
    dockerfile = (K8S / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert len(froms) == 2, "a build stage and a runtime stage"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim-bookworm$", dockerfile, re.M)
    runtime = dockerfile.split("\nFROM ")[-1]
    assert re.search(r"apt-get install .*\bfuse3\b", runtime), "runtime stage lacks fuse3"
    assert "third_party/pyfuse3/build.py" in dockerfile
    assert '".[oss,k8s]"' in dockerfile  # the scaler needs the Kubernetes client
    assert re.search(r"useradd .*--uid 10001", dockerfile)  # runAsUser of coordinator/scaler
    ignore = [
        line.strip()
        for line in (K8S / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert ignore[0] == "*"
    sources = []
    for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile, re.M):
        sources += line.split()[:-1]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert source.rstrip("/") in allowed, f"COPY {source}: excluded by the dockerignore"
    for package in re.findall(r"^include = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M):
        for name in re.findall(r'"(\w+)\*"', package):
            if name != "bench":  # benchmarks are not part of the image
                assert name in allowed, f"package {name} is not copied into the image"
