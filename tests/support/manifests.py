"""Render `manifests/` with `kubectl kustomize` and check the objects offline.

Two layers, both reporting problems as one line each (an empty list means deployable):

- **Schema.** Every object is decoded strictly against kubernetes-asyncio's generated models:
  each key must be a field the model declares (`attribute_map`), recursively; each value must
  have the declared type (`openapi_types`: a string is not an int, an int is not a bool);
  the models' own client-side validation rejects a missing required field. A typo'd field
  that the API server would drop or refuse fails here, without a server.
- **Project rules.** What a schema cannot know: the timings that must hang together (the
  readiness budget against the bootstrap timeout, the grace period against preStop plus
  drain), surge-only rollouts, RBAC limited to reading EndpointSlices, Services that select
  the pods and ports they mean, selectors that name those Services' EndpointSlices, a token
  taken from a Secret, non-root read-only containers, and command lines the programs accept.
  The router's command line is parsed by `router.cli`'s own parser, in the environment the
  kubelet would give the container (downward API, Secret values, service links), so a flag
  or environment variable `kvrouter serve` does not know, or a value it refuses, fails here.

The Prometheus Operator's objects (custom resources, no model) are decoded against the table
in tests/support/monitoring_schema.py, and their rules are checked here: the ServiceMonitor
scrapes the routers' Service on its HTTP port, the PodMonitor the workers' pods, every alert
has a severity and a summary, and the dashboard ConfigMap holds importable JSON.
`render_with_observability` renders the base with its optional component switched on, the
way README tells a user to.

Flags that issue 6's EndpointSlice watch adds (`ISSUE_6_FLAGS`) are reported apart by
`unknown_issue_6_flags` until that code is on the branch; see tests/unit/test_manifests.py.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import math
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.client import models as k8s_models

from fake_kv_worker.__main__ import parse_args as fake_worker_args
from router.cli import build_parser, serve_config
from tests.support import monitoring_schema

REPO: Final = Path(__file__).resolve().parents[2]
MANIFESTS: Final = REPO / "manifests"

ROUTER_PROGRAM: Final = "kvrouter"
WORKER_PROGRAM: Final = "fake-kv-worker"
# Flags `kvrouter serve` gains with issue 6 sections 1-2 (the EndpointSlice watch).
ISSUE_6_FLAGS: Final = frozenset(
    {"kv-peer-selector", "worker-selector", "worker-port", "namespace"}
)
# Kinds without a namespace (those a kustomization of ours could plausibly hold).
CLUSTER_SCOPED: Final = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding"})
SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", "[::]"})
# What the kubelet would fill in from the downward API (`fieldRef.fieldPath`), for parsing.
SAMPLE_POD_IP: Final = "10.244.1.7"

Obj = dict[str, Any]


class RenderError(RuntimeError):
    """`kubectl kustomize` failed; the message carries its stderr."""


def kubectl() -> str | None:
    return shutil.which("kubectl")


# The base's commented include of the observability component, and the same lines switched on.
OBSERVABILITY_OFF: Final = "# components:\n#   - observability\n"
OBSERVABILITY_ON: Final = "components:\n  - observability\n"


def render_with_observability(scratch: Path) -> list[Obj]:
    """The base with the component included as README says (uncommented), rendered.

    The manifests are copied under `scratch` first; the checked-in kustomization is not
    touched. RenderError when the commented include is not where README says it is.
    """
    copied = scratch / "manifests"
    shutil.copytree(MANIFESTS, copied)
    kustomization = copied / "kustomization.yaml"
    text = kustomization.read_text()
    if text.count(OBSERVABILITY_OFF) != 1:
        raise RenderError(f"{kustomization} has no commented include of observability")
    kustomization.write_text(text.replace(OBSERVABILITY_OFF, OBSERVABILITY_ON))
    return render(copied)


def render(directory: Path = MANIFESTS) -> list[Obj]:
    """The objects `kubectl kustomize DIRECTORY` renders, in its order."""
    binary = kubectl()
    if binary is None:
        raise RenderError("kubectl is not on PATH")
    done = subprocess.run(
        [binary, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


# -- schema ---------------------------------------------------------------------------------

# The models' client-side validation (required fields) is on in a fresh Configuration.
_VALIDATING: Final = Configuration()
_PRIMITIVES: Final[dict[str, Callable[[Any], bool]]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: type(v) is int,
    "float": lambda v: type(v) in (int, float),
    "bool": lambda v: type(v) is bool,
    # Timestamps arrive as strings in YAML and JSON.
    "datetime": lambda v: isinstance(v, str),
    "date": lambda v: isinstance(v, str),
}


def model_name(api_version: str, kind: str) -> str:
    """`apps/v1` + `Deployment` -> `V1Deployment`, as kubernetes-asyncio names its models."""
    version = api_version.rsplit("/", 1)[-1]
    return version[:1].upper() + version[1:] + kind


def _decode(value: Any, type_name: str, path: str, problems: list[str]) -> Any:
    if value is None:  # null is "unset" to the API server
        return None
    if type_name.startswith("list[") and type_name.endswith("]"):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return None
        inner = type_name[5:-1]
        return [_decode(v, inner, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if type_name.startswith("dict(str, ") and type_name.endswith(")"):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return None
        inner = type_name[len("dict(str, ") : -1]
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(f"{path}: key {key!r} is not a string")
                continue
            out[key] = _decode(item, inner, f"{path}.{key}", problems)
        return out
    if type_name == "object":  # IntOrString, raw extensions: the project rules look closer
        return value
    if type_name in _PRIMITIVES:
        if not _PRIMITIVES[type_name](value):
            problems.append(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return value
    model = getattr(k8s_models, type_name, None)
    if model is None:
        problems.append(f"{path}: no model {type_name} in kubernetes-asyncio")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path}: expected a {type_name} mapping, got {type(value).__name__}")
        return None
    attribute_of = {json_key: attr for attr, json_key in model.attribute_map.items()}
    kwargs = {}
    for key, item in value.items():
        attr = attribute_of.get(key)
        if attr is None:
            problems.append(f"{path}: unknown field {key!r} in {type_name}")
            continue
        kwargs[attr] = _decode(item, model.openapi_types[attr], f"{path}.{key}", problems)
    try:
        return model(**kwargs, local_vars_configuration=_VALIDATING)
    except ValueError as exc:  # a required field missing, in the model's own words
        problems.append(f"{path}: {exc}")
        return None


def schema_problems(obj: Obj) -> list[str]:
    """Problems decoding one object strictly as its kubernetes-asyncio model."""
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    name = (obj.get("metadata") or {}).get("name")
    label = f"{kind}/{name}"
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return [f"{label}: apiVersion and kind must be strings"]
    if api_version == f"{monitoring_schema.GROUP}/v1":
        problems = monitoring_schema.spec_problems(kind, obj, label)
        _decode(obj.get("metadata"), "V1ObjectMeta", f"{label}.metadata", problems)
        return problems + ([] if name else [f"{label}: metadata.name is missing"])
    type_name = model_name(api_version, kind)
    if getattr(k8s_models, type_name, None) is None:
        return [f"{label}: {api_version} {kind} is not a Kubernetes type (no {type_name})"]
    problems: list[str] = []
    _decode(obj, type_name, label, problems)
    if not name:
        problems.append(f"{label}: metadata.name is missing")
    return problems


# -- reading the rendering ------------------------------------------------------------------


def _name(obj: Obj) -> str:
    return obj["metadata"]["name"]


def label_of(obj: Obj) -> str:
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


@dataclass
class Workload:
    """A Deployment and its one container, known by the program it runs."""

    deployment: Obj
    program: str

    @property
    def label(self) -> str:
        return label_of(self.deployment)

    @property
    def pod_spec(self) -> Obj:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def container(self) -> Obj:
        return self.pod_spec["containers"][0]

    @property
    def pod_labels(self) -> dict[str, str]:
        return self.deployment["spec"]["template"].get("metadata", {}).get("labels") or {}

    def container_port(self, ref: int | str) -> int | None:
        """The container port a Service's targetPort or a probe's port names (number or name)."""
        for port in self.container.get("ports") or []:
            if ref in (port.get("name"), port.get("containerPort")):
                return port.get("containerPort")
        return None


@dataclass
class Rendering:
    objects: list[Obj]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o.get("kind") == kind]

    def find(self, kind: str, name: str) -> Obj | None:
        return next((o for o in self.of_kind(kind) if _name(o) == name), None)

    def namespace(self) -> str | None:
        spaces = {
            o["metadata"].get("namespace") for o in self.objects if o["kind"] not in CLUSTER_SCOPED
        }
        return spaces.pop() if len(spaces) == 1 else None

    def workload(self, program: str) -> Workload | None:
        for deployment in self.of_kind("Deployment"):
            containers = deployment["spec"]["template"]["spec"].get("containers") or []
            if containers and (containers[0].get("command") or [None])[0] == program:
                return Workload(deployment, program)
        return None

    def services_selecting(self, workload: Workload) -> list[Obj]:
        return [
            s
            for s in self.of_kind("Service")
            if _selects(s["spec"].get("selector") or {}, workload.pod_labels)
        ]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def slice_labels(service: Obj) -> dict[str, str]:
    """The labels the EndpointSlice controller puts on a Service's slices."""
    return {
        **(service["metadata"].get("labels") or {}),
        SERVICE_NAME_LABEL: _name(service),
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    }


def equality_selector(selector: str) -> dict[str, str] | None:
    """`k=v,k2==v2` as a mapping; None for set-based selectors, which these checks do not read."""
    out: dict[str, str] = {}
    for term in selector.split(","):
        key, sep, value = term.partition("==") if "==" in term else term.partition("=")
        if not sep or not key.strip() or "!" in key:
            return None
        out[key.strip()] = value.strip()
    return out


def int_or_percent(value: int | str | None, total: int, default: str, round_up: bool) -> int:
    """A rolling-update bound as the Deployment controller resolves it."""
    value = default if value is None else value
    if isinstance(value, int):
        return value
    if not re.fullmatch(r"\d+%", value):
        raise ValueError(f"{value!r} is neither a number nor a percentage")
    percent = int(value[:-1]) * total / 100
    return math.ceil(percent) if round_up else math.floor(percent)


# -- the kubelet's view of a container ------------------------------------------------------


def _service_link_env(services: list[Obj]) -> dict[str, str]:
    """The docker-link variables the kubelet adds for each Service (`enableServiceLinks`)."""
    env: dict[str, str] = {}
    for i, service in enumerate(services):
        prefix = _name(service).upper().replace("-", "_")
        ports = service["spec"].get("ports") or []
        ip = f"10.96.0.{10 + i}"
        if not ports:
            continue
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
        for port in ports:
            proto = port.get("protocol", "TCP")
            if port.get("name"):
                key = port["name"].upper().replace("-", "_")
                env[f"{prefix}_SERVICE_PORT_{key}"] = str(port["port"])
            base = f"{prefix}_PORT_{port['port']}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{port['port']}"
            env[f"{base}_PROTO"] = proto.lower()
            env[f"{base}_PORT"] = str(port["port"])
            env[f"{base}_ADDR"] = ip
    return env


def container_env(rendering: Rendering, workload: Workload) -> tuple[dict[str, str], list[str]]:
    """The environment the kubelet would give the container, and what it could not resolve."""
    problems: list[str] = []
    env: dict[str, str] = {}
    if workload.pod_spec.get("enableServiceLinks", True):
        env.update(_service_link_env(rendering.of_kind("Service")))
    fields = {
        "metadata.name": f"{_name(workload.deployment)}-7d9f8c6b5-x2k4q",
        "metadata.namespace": workload.deployment["metadata"].get("namespace", "default"),
        "status.podIP": SAMPLE_POD_IP,
    }
    for var in workload.container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = var.get("value") or ""
        elif "fieldRef" in source and source["fieldRef"].get("fieldPath") in fields:
            env[name] = fields[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            value = _secret_value(rendering, source["secretKeyRef"])
            if value is None:
                ref = source["secretKeyRef"]
                problems.append(
                    f"{workload.label}: env {name} names Secret {ref.get('name')} "
                    f"key {ref.get('key')!r}, which the rendering does not hold"
                )
            else:
                env[name] = value
        else:
            problems.append(f"{workload.label}: env {name} has a source these checks cannot read")
    return env, problems


def _secret_value(rendering: Rendering, ref: Obj) -> str | None:
    secret = rendering.find("Secret", ref.get("name", ""))
    if secret is None:
        return None
    if ref.get("key") in (secret.get("stringData") or {}):
        return secret["stringData"][ref["key"]]
    raw = (secret.get("data") or {}).get(ref.get("key"))
    return None if raw is None else base64.b64decode(raw).decode()


_VAR_REF: Final = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """`$(VAR)` as the kubelet expands it in command and args (`$$` escapes, unknown stays)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(one, arg)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[io.StringIO]:
    """os.environ as the container would have it (no KVROUTER_* of ours); stderr captured.

    `router.cli` reads its defaults from os.environ while it builds the parser, so the
    environment is swapped for the duration and restored after.
    """
    saved = dict(os.environ)
    stderr = io.StringIO()
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith("KVROUTER_")})
    os.environ.update(env)
    try:
        with contextlib.redirect_stderr(stderr):
            yield stderr
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class RouterCommand:
    """`kvrouter serve` as the container runs it: parsed flags, and names serve does not know.

    `unknown` holds flags as written (`--worker-port`) and `KVROUTER_` variables; a flag
    must be spelled out in full (argparse would take `--kv-bootstrap-timeout` for
    `--kv-bootstrap-timeout-ms`, until another flag makes the abbreviation ambiguous).
    """

    args: argparse.Namespace | None
    unknown: list[str]
    problems: list[str]


def flag_of(name: str) -> str:
    """`--worker-port` and `KVROUTER_WORKER_PORT` both as `worker-port`."""
    if name.startswith("--"):
        return name[2:]
    return name.removeprefix("KVROUTER_").lower().replace("_", "-")


def parse_router_command(rendering: Rendering, workload: Workload) -> RouterCommand:
    env, problems = container_env(rendering, workload)
    argv = [expand(a, env) for a in workload.container.get("args") or []]
    if argv[:1] != ["serve"]:
        return RouterCommand(None, [], [f"{workload.label}: args must start with 'serve'"])
    with _environment(env) as stderr:
        try:
            parser, flags = build_parser()
            args, extras = parser.parse_known_args(argv)
            flags.apply_defaults(args)
        except SystemExit:
            message = stderr.getvalue().strip()
            problems.append(f"{workload.label}: kvrouter refuses its command line: {message}")
            return RouterCommand(None, [], problems)
    known = set(flags.names)
    if workload.pod_spec.get("enableServiceLinks", True):
        # kvrouter ignores a variable whose flag is on the command line, but a link variable
        # becomes the flag's value as soon as someone drops the flag from the manifest.
        for name, value in _service_link_env(rendering.of_kind("Service")).items():
            if name.startswith("KVROUTER_") and flag_of(name) in known:
                problems.append(
                    f"{workload.label}: the kubelet's service link {name}={value!r} is read as "
                    f"--{flag_of(name)}; set enableServiceLinks: false"
                )
    unknown = [f"--{name}" for name in raw_flags(argv[1:]) if name not in known]
    unknown += [
        v["name"]
        for v in workload.container.get("env") or []
        if v["name"].startswith("KVROUTER_") and flag_of(v["name"]) not in known
    ]
    # What parse_known_args left over that is neither an unknown flag nor its value.
    for before, token in zip([None, *extras], extras, strict=False):
        takes_value = before is not None and before.startswith("--") and "=" not in before
        if not token.startswith("--") and not takes_value:
            problems.append(f"{workload.label}: argument {token!r} belongs to no flag")
    return RouterCommand(args, unknown, problems)


def serve_config_problems(
    rendering: Rendering, workload: Workload, args: argparse.Namespace
) -> str:
    """What `kvrouter serve` says about the parsed values before it listens ('' if nothing)."""
    env, _ = container_env(rendering, workload)
    with _environment(env) as stderr:
        try:
            serve_config(args)
        except SystemExit:
            return stderr.getvalue().strip()
    return ""


def unknown_issue_6_flags(rendering: Rendering) -> list[str]:
    """Issue-6 flags (and their KVROUTER_ variables) the router passes but serve does not know."""
    router = rendering.workload(ROUTER_PROGRAM)
    if router is None:
        return []
    command = parse_router_command(rendering, router)
    return [name for name in command.unknown if flag_of(name) in ISSUE_6_FLAGS]


# -- project rules --------------------------------------------------------------------------


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def console_scripts() -> set[str]:
    return set(pyproject()["project"]["scripts"])


def _rule_objects(r: Rendering) -> list[str]:
    problems = []
    namespace = r.namespace()
    if namespace is None:
        problems.append("the namespaced objects must share one namespace")
    elif r.find("Namespace", namespace) is None:
        problems.append(f"no Namespace object for {namespace!r}")
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        problems += [f"{label_of(o)}: nothing cluster-wide is needed" for o in r.of_kind(kind)]
    scripts = console_scripts()
    for deployment in r.of_kind("Deployment"):
        containers = deployment["spec"]["template"]["spec"].get("containers") or []
        if len(containers) != 1:
            problems.append(f"{label_of(deployment)}: expected exactly one container")
        for c in containers:
            if (c.get("command") or [None])[0] not in scripts:
                problems.append(
                    f"{label_of(deployment)}: command {c.get('command')} is not one of the "
                    f"image's programs {sorted(scripts)}"
                )
    for program in (ROUTER_PROGRAM, WORKER_PROGRAM):
        if r.workload(program) is None:
            problems.append(f"no Deployment runs {program}")
    return problems


def _rule_pod(w: Workload) -> list[str]:
    """Image, hardening and requests: the same for every workload."""
    problems = []
    image = w.container.get("image", "")
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    if not tag or tag == "latest":
        problems.append(f"{w.label}: image {image!r} needs a tag other than latest (kind load)")
    if w.container.get("imagePullPolicy") not in ("IfNotPresent", "Never"):
        problems.append(f"{w.label}: imagePullPolicy must be IfNotPresent or Never (kind load)")
    pod_sc = w.pod_spec.get("securityContext") or {}
    sc = w.container.get("securityContext") or {}
    if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        problems.append(f"{w.label}: runAsNonRoot must be true")
    if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
        problems.append(f"{w.label}: runAsUser must not be 0")
    if sc.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{w.label}: readOnlyRootFilesystem must be true")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{w.label}: allowPrivilegeEscalation must be false")
    requests = (w.container.get("resources") or {}).get("requests") or {}
    problems += [f"{w.label}: no {res} request" for res in ("cpu", "memory") if res not in requests]
    match = w.deployment["spec"].get("selector", {}).get("matchLabels") or {}
    if not _selects(match, w.pod_labels):
        problems.append(f"{w.label}: selector {match} does not match pod labels {w.pod_labels}")
    return problems


def _rule_services(r: Rendering, workloads: list[Workload]) -> list[str]:
    """Each Service selects one workload's pods, and each of its ports reaches a container port."""
    problems = []
    for service in r.of_kind("Service"):
        selected = [w for w in workloads if service in r.services_selecting(w)]
        if len(selected) != 1:
            problems.append(
                f"{label_of(service)}: selects {len(selected)} workloads' pods, not exactly one"
            )
            continue
        for port in service["spec"].get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            if selected[0].container_port(target) is None:
                problems.append(
                    f"{label_of(service)}: port {port.get('name')} targets {target!r}, "
                    f"which is no container port of {selected[0].label}"
                )
    return problems


def _rule_rbac(r: Rendering, router: Workload) -> list[str]:
    problems = []
    wanted = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"]}
    for role in r.of_kind("Role"):
        for rule in role.get("rules") or []:
            shape = {k: rule.get(k) for k in wanted}
            verbs = sorted(rule.get("verbs") or [])
            extra = set(rule) - {"apiGroups", "resources", "verbs"}
            if shape != wanted or verbs != ["get", "list", "watch"] or extra:
                problems.append(
                    f"{label_of(role)}: a rule grants {rule}; only get/list/watch on "
                    "discovery.k8s.io endpointslices is needed"
                )
    account = router.pod_spec.get("serviceAccountName", "default")
    if r.find("ServiceAccount", account) is None:
        problems.append(f"{router.label}: ServiceAccount {account!r} is not in the rendering")
    bound = False
    for binding in r.of_kind("RoleBinding"):
        ref = binding.get("roleRef") or {}
        if ref.get("kind") != "Role" or r.find("Role", ref.get("name", "")) is None:
            problems.append(f"{label_of(binding)}: roleRef {ref} names no Role in the rendering")
            continue
        for subject in binding.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount" and subject.get("name") == account:
                if subject.get("namespace") != router.deployment["metadata"].get("namespace"):
                    problems.append(f"{label_of(binding)}: subject {account} in another namespace")
                else:
                    bound = True
    if not bound:
        problems.append(f"no RoleBinding grants the router's ServiceAccount {account!r} its Role")
    return problems


def raw_flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` pairs as written, for flags the parser may not know."""
    out: dict[str, str] = {}
    for i, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, sep, value = token[2:].partition("=")
        if not sep and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        out[name] = value
    return out


def _probe_problems(w: Workload, kind: str, path: str, port: int) -> list[str]:
    probe = w.container.get(kind) or {}
    get = probe.get("httpGet") or {}
    if get.get("path") != path or w.container_port(get.get("port")) != port:
        return [f"{w.label}: {kind} must be an httpGet of {path} on port {port}, not {get}"]
    return []


def _prestop_sleep_s(w: Workload) -> int:
    handler = (w.container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in handler:
        return int(handler["sleep"].get("seconds", 0))
    command = (handler.get("exec") or {}).get("command") or []
    if len(command) == 2 and command[0] == "sleep" and command[1].isdigit():
        return int(command[1])
    return 0


def _selected_services(r: Rendering, selector: str, flag: str) -> tuple[list[Obj], list[str]]:
    if not selector:
        return [], [f"--{flag} is not set, so the routers cannot find these pods"]
    terms = equality_selector(selector)
    if terms is None:
        return [], [f"--{flag} {selector!r}: only k=v selectors can be checked here"]
    matched = [s for s in r.of_kind("Service") if _selects(terms, slice_labels(s))]
    if not matched:
        return [], [f"--{flag} {selector!r} matches no Service's EndpointSlices"]
    return matched, []


def _rule_router(r: Rendering, router: Workload, worker: Workload | None) -> list[str]:
    command = parse_router_command(r, router)
    problems = list(command.problems)
    problems += [
        f"{router.label}: kvrouter serve does not know {name}"
        for name in command.unknown
        if flag_of(name) not in ISSUE_6_FLAGS
    ]
    args = command.args
    if args is None:
        return problems
    if message := serve_config_problems(r, router, args):
        problems.append(f"{router.label}: kvrouter serve refuses its settings: {message}")
    env, _ = container_env(r, router)
    raw = raw_flags([expand(a, env) for a in router.container.get("args") or []])
    spec = router.deployment["spec"]
    bootstrap_s = args.kv_bootstrap_timeout_ms / 1000

    if args.host not in WILDCARD_HOSTS:
        problems.append(f"{router.label}: --host {args.host} is unreachable from other pods")
    if router.container_port(args.port) is None:
        problems.append(f"{router.label}: --port {args.port} is not a container port")
    if spec.get("replicas", 1) < 2:
        problems.append(f"{router.label}: one replica has no sibling to bootstrap from")
    strategy = spec.get("strategy") or {}
    rolling = strategy.get("rollingUpdate") or {}
    replicas = spec.get("replicas", 1)
    try:
        surge = int_or_percent(rolling.get("maxSurge"), replicas, "25%", round_up=True)
        unavailable = int_or_percent(rolling.get("maxUnavailable"), replicas, "25%", False)
    except ValueError as exc:
        return [*problems, f"{router.label}: rollingUpdate: {exc}"]
    if strategy.get("type", "RollingUpdate") != "RollingUpdate" or surge < 1 or unavailable:
        problems.append(
            f"{router.label}: the rollout must surge (maxSurge >= 1, maxUnavailable 0, "
            f"got {surge} and {unavailable}) so new replicas have warm siblings"
        )
    if spec.get("progressDeadlineSeconds", 600) <= bootstrap_s:
        problems.append(f"{router.label}: progressDeadlineSeconds must outlast the bootstrap")

    problems += _probe_problems(router, "readinessProbe", "/readyz", args.port)
    problems += _probe_problems(router, "livenessProbe", "/healthz", args.port)
    readiness = router.container.get("readinessProbe") or {}
    budget_s = readiness.get("periodSeconds", 10) * readiness.get("failureThreshold", 3)
    if budget_s <= bootstrap_s:
        problems.append(
            f"{router.label}: the readiness failure budget ({budget_s} s) must be longer than "
            f"--kv-bootstrap-timeout-ms ({bootstrap_s:g} s)"
        )
    grace_s = router.pod_spec.get("terminationGracePeriodSeconds", 30)
    prestop_s = _prestop_sleep_s(router)
    if grace_s <= prestop_s + args.drain_timeout_s:
        problems.append(
            f"{router.label}: terminationGracePeriodSeconds ({grace_s}) must exceed the preStop "
            f"sleep ({prestop_s} s) plus --drain-timeout-s ({args.drain_timeout_s:g} s)"
        )

    downward = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    downward["POD_IP"] = "status.podIP"
    by_name = {v["name"]: v for v in router.container.get("env") or []}
    for name, path in downward.items():
        field = ((by_name.get(name) or {}).get("valueFrom") or {}).get("fieldRef") or {}
        if field.get("fieldPath") != path:
            problems.append(f"{router.label}: env {name} must come from the downward API {path}")
    token = by_name.get("KVROUTER_INTERNAL_TOKEN") or {}
    if "secretKeyRef" not in (token.get("valueFrom") or {}):
        problems.append(f"{router.label}: KVROUTER_INTERNAL_TOKEN must come from a Secret")
    elif not env.get("KVROUTER_INTERNAL_TOKEN"):
        problems.append(f"{router.label}: the internal token resolves to nothing")

    peers, found = _selected_services(r, raw.get("kv-peer-selector", ""), "kv-peer-selector")
    problems += found
    for service in peers:
        if service not in r.services_selecting(router):
            problems.append(f"--kv-peer-selector names {label_of(service)}, not the routers'")
        elif not any(
            router.container_port(p.get("targetPort", p.get("port"))) == args.port
            for p in service["spec"].get("ports") or []
        ):
            problems.append(f"{label_of(service)}: no port reaches the routers' --port")
    if worker is not None:
        problems += _router_finds_workers(r, router, worker, raw)
    return problems


def _router_finds_workers(
    r: Rendering, router: Workload, worker: Workload, raw: dict[str, str]
) -> list[str]:
    services, problems = _selected_services(r, raw.get("worker-selector", ""), "worker-selector")
    try:
        worker_port = int(raw.get("worker-port", ""))
    except ValueError:
        return [*problems, f"{router.label}: --worker-port must be a port number"]
    for service in services:
        if service not in r.services_selecting(worker):
            problems.append(f"--worker-selector names {label_of(service)}, not the workers'")
        elif not any(
            worker.container_port(p.get("targetPort", p.get("port"))) == worker_port
            for p in service["spec"].get("ports") or []
        ):
            problems.append(
                f"{label_of(service)}: no port reaches --worker-port {worker_port}, so the "
                "workers' EndpointSlices do not list it"
            )
    return problems


def _monitor_target_problems(monitor: Obj, endpoints_key: str, ports: set[str]) -> list[str]:
    """Each scrape endpoint names one of `ports` and reads /metrics."""
    problems = []
    endpoints = monitor["spec"].get(endpoints_key) or []
    if not endpoints:
        problems.append(f"{label_of(monitor)}: no {endpoints_key}: it scrapes nothing")
    for endpoint in endpoints:
        if endpoint.get("port") not in ports:
            problems.append(
                f"{label_of(monitor)}: port {endpoint.get('port')!r} is not one of {sorted(ports)}"
            )
        if endpoint.get("path", "/metrics") != "/metrics":
            problems.append(f"{label_of(monitor)}: path {endpoint.get('path')!r} is not /metrics")
    return problems


def _namespace_problems(monitor: Obj, namespace: str | None) -> list[str]:
    chosen = monitor["spec"].get("namespaceSelector")
    if chosen is None or chosen.get("any") or namespace in (chosen.get("matchNames") or []):
        return []
    return [f"{label_of(monitor)}: its namespaceSelector leaves out {namespace!r}"]


def _rule_monitoring(r: Rendering, router: Workload, worker: Workload | None) -> list[str]:
    """The Prometheus Operator's objects scrape what the dashboard and the alerts read."""
    monitoring = [o for o in r.objects if o["apiVersion"].startswith(monitoring_schema.GROUP)]
    dashboards = [
        o
        for o in r.of_kind("ConfigMap")
        if monitoring_schema.DASHBOARD_LABEL in (o["metadata"].get("labels") or {})
    ]
    if not monitoring and not dashboards:
        return []
    problems = []
    routers_scraped = False
    for monitor in r.of_kind("ServiceMonitor"):
        terms = monitor["spec"]["selector"].get("matchLabels") or {}
        services = [
            s for s in r.of_kind("Service") if _selects(terms, s["metadata"].get("labels") or {})
        ]
        if not services:
            problems.append(f"{label_of(monitor)}: selects no Service")
        for service in services:
            ports = {p.get("name") for p in service["spec"].get("ports") or []}
            problems += _monitor_target_problems(monitor, "endpoints", ports)
            routers_scraped |= service in r.services_selecting(router)
        problems += _namespace_problems(monitor, r.namespace())
    if not routers_scraped:
        problems.append("no ServiceMonitor scrapes the router replicas' Service")
    for monitor in r.of_kind("PodMonitor"):
        terms = monitor["spec"]["selector"].get("matchLabels") or {}
        if worker is None or not _selects(terms, worker.pod_labels):
            problems.append(f"{label_of(monitor)}: selects no worker pods")
            continue
        ports = {p.get("name") for p in worker.container.get("ports") or []}
        problems += _monitor_target_problems(monitor, "podMetricsEndpoints", ports)
        problems += _namespace_problems(monitor, r.namespace())
    for rule in r.of_kind("PrometheusRule"):
        problems += monitoring_schema.rule_problems(rule, label_of(rule))
    for configmap in dashboards:
        problems += monitoring_schema.dashboard_problems(configmap, label_of(configmap))
    return problems


def _rule_worker(w: Workload) -> list[str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            config, _ = fake_worker_args(list(w.container.get("args") or []))
        except SystemExit:
            message = "".join(stderr.getvalue().strip().splitlines()[-1:])
            return [f"{w.label}: fake-kv-worker refuses its command line: {message}"]
    problems = []
    if config.host not in WILDCARD_HOSTS:
        problems.append(f"{w.label}: --host {config.host} is unreachable from the routers")
    wanted = {config.port: "--port"}
    wanted |= {config.kv_port_base + i: f"dp rank {i}'s KV events" for i in range(config.dp_size)}
    if config.replay_port_base:
        wanted |= {config.replay_port_base + i: f"rank {i}'s replay" for i in range(config.dp_size)}
    for port, what in wanted.items():
        if w.container_port(port) is None:
            problems.append(f"{w.label}: {what} ({port}) is not a container port")
    problems += _probe_problems(w, "readinessProbe", "/health", config.port)
    if w.pod_spec.get("automountServiceAccountToken") is not False:
        problems.append(f"{w.label}: does not talk to the API server; mount no token")
    return problems


def problems(objects: list[Obj]) -> list[str]:
    """Everything wrong with a rendering, schema first; [] when it is deployable."""
    found = [p for obj in objects for p in schema_problems(obj)]
    if found:  # the rules assume well-formed objects
        return found
    r = Rendering(objects)
    found = _rule_objects(r)
    router, worker = r.workload(ROUTER_PROGRAM), r.workload(WORKER_PROGRAM)
    workloads = [w for w in (router, worker) if w is not None]
    for w in workloads:
        found += _rule_pod(w)
    found += _rule_services(r, workloads)
    if router is not None:
        found += _rule_rbac(r, router)
        found += _rule_router(r, router, worker)
        found += _rule_monitoring(r, router, worker)
    if worker is not None:
        found += _rule_worker(worker)
    return found
