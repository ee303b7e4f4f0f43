"""Strict decoding of the Prometheus Operator's objects and of the Grafana dashboard ConfigMap.

kubernetes-asyncio has no models for custom resources, so the `monitoring.coreos.com/v1`
objects manifests/observability/ ships (ServiceMonitor, PodMonitor, PrometheusRule) are
decoded against the table below: the fields of the operator's CRDs that a manifest of ours
may use, with their types. As with the built-in kinds, a key the table does not declare is
reported (the API server's strict field validation would refuse it, or the operator would
ignore it), and so is a value of the wrong type or a missing required field. The table is a
subset: using another field of the CRDs means declaring it here first.

A dashboard ConfigMap (label `grafana_dashboard`) must hold JSON that Grafana imports as it
is: a `datasource` variable, every panel and query reading from it (no hard-coded data
source UID), every panel with at least one query, and small enough for `kubectl apply`'s
last-applied annotation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Final

GROUP: Final = "monitoring.coreos.com"
DASHBOARD_LABEL: Final = "grafana_dashboard"
# kubectl apply (client side) stores the object in an annotation, bounded at 256 KiB.
DASHBOARD_MAX_BYTES: Final = 256 * 1024 - 4096
DATASOURCE_REF: Final = "${datasource}"
# Prometheus durations: 0, or units from years down to milliseconds (`1h30m`, `15s`).
_DURATION: Final = re.compile(r"0|(\d+(ms|s|m|h|d|w|y))+")
SEVERITIES: Final = frozenset({"critical", "warning", "info"})


@dataclass(frozen=True)
class Fields:
    """An object: its declared fields, the required ones among them."""

    of: dict[str, Any]
    required: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class MapOf:
    """A mapping from strings to values of one type."""

    of: Any


_SELECTOR: Final = Fields(
    {
        "matchLabels": MapOf("str"),
        "matchExpressions": [
            Fields({"key": "str", "operator": "str", "values": ["str"]}, frozenset({"key"}))
        ],
    }
)
_RELABEL: Final = Fields(
    {
        "sourceLabels": ["str"],
        "separator": "str",
        "targetLabel": "str",
        "regex": "str",
        "modulus": "int",
        "replacement": "str",
        "action": "str",
    }
)
_SECRET_KEY: Final = Fields({"name": "str", "key": "str", "optional": "bool"}, frozenset({"key"}))
_ENDPOINT: Final = {
    "port": "str",
    "path": "str",
    "scheme": "str",
    "params": MapOf(["str"]),
    "interval": "duration",
    "scrapeTimeout": "duration",
    "honorLabels": "bool",
    "honorTimestamps": "bool",
    "followRedirects": "bool",
    "enableHttp2": "bool",
    "authorization": Fields({"type": "str", "credentials": _SECRET_KEY}),
    "relabelings": [_RELABEL],
    "metricRelabelings": [_RELABEL],
}
_NAMESPACES: Final = Fields({"any": "bool", "matchNames": ["str"]})
SPECS: Final[dict[str, Fields]] = {
    "ServiceMonitor": Fields(
        {
            "selector": _SELECTOR,
            "namespaceSelector": _NAMESPACES,
            "endpoints": [Fields({**_ENDPOINT, "targetPort": "intstr"})],
            "jobLabel": "str",
            "targetLabels": ["str"],
            "podTargetLabels": ["str"],
            "sampleLimit": "int",
        },
        frozenset({"selector"}),
    ),
    "PodMonitor": Fields(
        {
            "selector": _SELECTOR,
            "namespaceSelector": _NAMESPACES,
            "podMetricsEndpoints": [Fields({**_ENDPOINT, "portNumber": "int"})],
            "jobLabel": "str",
            "podTargetLabels": ["str"],
            "sampleLimit": "int",
        },
        frozenset({"selector"}),
    ),
    "PrometheusRule": Fields(
        {
            "groups": [
                Fields(
                    {
                        "name": "str",
                        "interval": "duration",
                        "limit": "int",
                        "rules": [
                            Fields(
                                {
                                    "alert": "str",
                                    "record": "str",
                                    "expr": "intstr",
                                    "for": "duration",
                                    "keep_firing_for": "duration",
                                    "labels": MapOf("str"),
                                    "annotations": MapOf("str"),
                                },
                                frozenset({"expr"}),
                            )
                        ],
                    },
                    frozenset({"name"}),
                )
            ]
        }
    ),
}

_SCALARS: Final = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: type(v) is int,
    "bool": lambda v: type(v) is bool,
    "intstr": lambda v: type(v) is int or isinstance(v, str),
    "duration": lambda v: isinstance(v, str) and _DURATION.fullmatch(v) is not None,
}


def decode(value: Any, schema: Any, path: str, problems: list[str]) -> None:
    """Append a line to `problems` for every way `value` departs from `schema`."""
    if value is None:
        return
    if isinstance(schema, str):
        if not _SCALARS[schema](value):
            problems.append(f"{path}: expected {schema}, got {type(value).__name__} {value!r}")
    elif isinstance(schema, list):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            decode(item, schema[0], f"{path}[{i}]", problems)
    elif isinstance(schema, MapOf):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return
        for key, item in value.items():
            decode(item, schema.of, f"{path}.{key}", problems)
    else:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return
        for key, item in value.items():
            if key not in schema.of:
                problems.append(f"{path}: unknown field {key!r}")
            else:
                decode(item, schema.of[key], f"{path}.{key}", problems)
        problems += [
            f"{path}: required field {name!r} is missing"
            for name in sorted(schema.required - value.keys())
        ]


def spec_problems(kind: str, obj: dict[str, Any], label: str) -> list[str]:
    """Problems decoding a monitoring.coreos.com/v1 object's top level and spec."""
    if kind not in SPECS:
        return [f"{label}: {GROUP} kind {kind} is not one these checks know"]
    problems = [
        f"{label}: unknown field {key!r}"
        for key in obj
        if key not in ("apiVersion", "kind", "metadata", "spec")
    ]
    if "spec" not in obj:
        return [*problems, f"{label}: required field 'spec' is missing"]
    decode(obj["spec"], SPECS[kind], f"{label}.spec", problems)
    return problems


def rule_problems(obj: dict[str, Any], label: str) -> list[str]:
    """Every alert of a PrometheusRule carries a known severity and a summary."""
    problems = []
    for group in obj["spec"].get("groups") or []:
        for rule in group.get("rules") or []:
            name = rule.get("alert")
            if name is None:
                continue
            severity = (rule.get("labels") or {}).get("severity")
            if severity not in SEVERITIES:
                problems.append(
                    f"{label}: alert {name} has severity {severity!r}, not one of "
                    f"{sorted(SEVERITIES)}"
                )
            if not (rule.get("annotations") or {}).get("summary"):
                problems.append(f"{label}: alert {name} has no summary annotation")
    return problems


def _datasource_refs(node: Any, path: str) -> list[tuple[str, Any]]:
    """Every `datasource` value in a dashboard, with where it is."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                found.append((f"{path}.{key}", value))
            found += _datasource_refs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _datasource_refs(value, f"{path}[{i}]")
    return found


def dashboard_problems(configmap: dict[str, Any], label: str) -> list[str]:
    """A dashboard ConfigMap holds one importable dashboard that names no data source UID."""
    data = configmap.get("data") or {}
    files = [name for name in data if name.endswith(".json")]
    if len(files) != 1 or len(data) != 1:
        return [f"{label}: expected exactly one .json file, got {sorted(data)}"]
    text = data[files[0]]
    problems = []
    if len(text.encode()) > DASHBOARD_MAX_BYTES:
        problems.append(f"{label}: {len(text.encode())} bytes, above kubectl apply's bound")
    try:
        board = json.loads(text)
    except ValueError as exc:
        return [*problems, f"{label}: {files[0]} is not JSON: {exc}"]
    if board.get("id") is not None:
        problems.append(f"{label}: the dashboard's id must be null (Grafana assigns it)")
    variables = {v.get("name"): v for v in (board.get("templating") or {}).get("list") or []}
    source = variables.get("datasource") or {}
    if (source.get("type"), source.get("query")) != ("datasource", "prometheus"):
        problems.append(f"{label}: no `datasource` variable of Prometheus data sources")
    for where, ref in _datasource_refs(board, "dashboard"):
        uid = ref.get("uid") if isinstance(ref, dict) else ref
        if uid != DATASOURCE_REF:
            problems.append(f"{label}: {where} is {ref!r}, not the {DATASOURCE_REF} variable")
    for panel in board.get("panels") or []:
        if panel.get("type") == "row":
            continue
        exprs = [t.get("expr") for t in panel.get("targets") or []]
        if not exprs or not all(exprs):
            problems.append(f"{label}: panel {panel.get('title')!r} has a target with no query")
    return problems
