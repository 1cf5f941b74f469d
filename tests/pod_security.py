"""Pod Security Standards, the "restricted" level (which includes "baseline"), as the
Kubernetes documentation publishes them for 1.30-1.33 (concepts/security/pod-security-standards):
every rule is checked here against a pod template, by its field paths, the way the
PodSecurity admission plugin reads them. `violations` names each broken rule and where."""

from __future__ import annotations

from collections.abc import Iterator

SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
VOLUME_TYPES = {  # restricted: the only volume sources allowed
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}


def _containers(spec: dict) -> Iterator[dict]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(kind, [])


def _apparmor_ok(profile: dict | None) -> bool:
    return profile is None or profile.get("type") in ("RuntimeDefault", "Localhost")


def _selinux_ok(options: dict | None) -> bool:
    options = options or {}
    return (
        options.get("type", "") in SELINUX_TYPES
        and not options.get("user")
        and not options.get("role")
    )


def violations(spec: dict, annotations: dict | None = None) -> list[str]:
    """The rules a pod spec (and its annotations) breaks; [] when it meets "restricted"."""
    found: list[str] = []
    pod = spec.get("securityContext", {})
    # --- baseline ---------------------------------------------------------------------------
    if pod.get("windowsOptions", {}).get("hostProcess"):
        found.append("hostProcess: spec.securityContext.windowsOptions.hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"host namespaces: spec.{field}")
    for volume in spec.get("volumes", []):
        if "hostPath" in volume:
            found.append(f"hostPath volumes: {volume['name']}")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            found.append(f"AppArmor: annotation {key}: {value}")
    if not _apparmor_ok(pod.get("appArmorProfile")):
        found.append("AppArmor: spec.securityContext.appArmorProfile")
    if not _selinux_ok(pod.get("seLinuxOptions")):
        found.append("SELinux: spec.securityContext.seLinuxOptions")
    if pod.get("seccompProfile", {}).get("type") == "Unconfined":
        found.append("seccomp: spec.securityContext.seccompProfile Unconfined")
    for sysctl in pod.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"sysctls: {sysctl['name']}")
    # --- restricted -------------------------------------------------------------------------
    for volume in spec.get("volumes", []):
        if not set(volume) - {"name"} <= VOLUME_TYPES:
            found.append(f"volume types: {volume['name']} ({sorted(set(volume) - {'name'})})")
    if pod.get("runAsUser") == 0:
        found.append("non-root user: spec.securityContext.runAsUser 0")
    for c in _containers(spec):
        where, context = c["name"], c.get("securityContext", {})
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"hostProcess: {where}")
        if context.get("privileged"):
            found.append(f"privileged: {where}")
        capabilities = context.get("capabilities", {})
        if added := set(capabilities.get("add", [])) - ADDABLE_CAPABILITIES:
            found.append(f"capabilities: {where} adds {sorted(added)}")
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"capabilities: {where} does not drop ALL")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"host ports: {where}")
        if not _apparmor_ok(context.get("appArmorProfile")):
            found.append(f"AppArmor: {where}")
        if not _selinux_ok(context.get("seLinuxOptions")):
            found.append(f"SELinux: {where}")
        if context.get("procMount", "Default") != "Default":
            found.append(f"/proc mount: {where}")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"privilege escalation: {where} does not set it false")
        non_root = context.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            found.append(f"non-root: {where} (runAsNonRoot not true, in the pod or here)")
        if context.get("runAsUser") == 0:
            found.append(f"non-root user: {where} runAsUser 0")
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"seccomp: {where} ({seccomp or 'unset'}; RuntimeDefault or Localhost)")
    return found
