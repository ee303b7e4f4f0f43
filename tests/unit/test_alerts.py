"""The alert rules of manifests/observability/, checked and unit-tested by the real promtool.

`promtool check rules` on the PrometheusRule's groups; then `promtool test rules` on the
scenarios of tests/fixtures/alerts/scenarios.yaml (a healthy fleet, a worker killed, lost
batches, a replica that cannot reach its siblings, discovery failing, ...). At every
evaluation time a scenario lists, the alerts it names must fire with exactly those labels and
summaries, and every other alert must be quiet; every alert must fire in some scenario.
README's alert table must hold a runbook line, with the same severity, for every alert.

promtool comes with Debian's `prometheus` package, which `scripts/test` installs.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from tests.support.manifests import MANIFESTS, REPO
from tests.support.prometheus import NAMESPACE, binary, substitute

RULES: Final = MANIFESTS / "observability" / "alerts.yaml"
DASHBOARD: Final = MANIFESTS / "observability" / "dashboard.json"
SCENARIOS: Final = REPO / "tests" / "fixtures" / "alerts" / "scenarios.yaml"
COMMON_LABELS: Final = {"namespace": "kvrouter", "job": "kvrouter"}
RUNBOOK: Final = "README.md#alerts"
PROMTOOL_TIMEOUT_S: Final = 120


@pytest.fixture(scope="module")
def promtool() -> str:
    return binary("promtool")


def alert_rules() -> list[dict[str, Any]]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return [r for g in spec["groups"] for r in g["rules"] if "alert" in r]


def alert_names() -> list[str]:
    return [r["alert"] for r in alert_rules()]


def write_rules(directory: Path) -> Path:
    """The PrometheusRule's groups as a plain rule file, which is what Prometheus loads."""
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(RULES.read_text())["spec"]))
    return path


def promtool_run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
    )


def with_common_labels(series: str) -> str:
    common = ", ".join(f'{k}="{v}"' for k, v in COMMON_LABELS.items())
    name, brace, rest = series.partition("{")
    return f"{name}{{{common}, {rest}" if brace else f"{name}{{{common}}}"


def scenario_input(fixture: dict[str, Any], scenario: dict[str, Any]) -> list[dict[str, str]]:
    """The healthy fleet's series, with the scenario's replacing those of the same name."""
    series = {s["series"]: s["values"] for s in fixture["healthy"]}
    for s in scenario.get("series") or []:
        series[s["series"]] = s["values"]
    return [{"series": with_common_labels(k), "values": v} for k, v in series.items()]


def expected_alert(alert: dict[str, Any]) -> dict[str, Any]:
    return {
        "exp_labels": {**COMMON_LABELS, **alert["labels"]},
        "exp_annotations": {"summary": alert["summary"], "runbook": RUNBOOK},
    }


def promtool_tests(fixture: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The scenarios as a `promtool test rules` file: every alert checked at every time."""
    tests = []
    for scenario in fixture["scenarios"]:
        checks = []
        for at, firing in scenario["at"].items():
            unknown = set(firing) - set(names)
            assert not unknown, f"{scenario['name']} at {at}: no such alert {sorted(unknown)}"
            for name in names:
                alerts = [expected_alert(a) for a in firing.get(name) or []]
                checks.append({"eval_time": at, "alertname": name, "exp_alerts": alerts})
        tests.append(
            {
                "name": scenario["name"],
                "interval": "1m",
                "input_series": scenario_input(fixture, scenario),
                "alert_rule_test": checks,
            }
        )
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def test_the_rules_pass_promtool_check(promtool: str, tmp_path: Path) -> None:
    rules = write_rules(tmp_path)
    done = promtool_run(promtool, "check", "rules", str(rules), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in done.stdout


def test_each_alert_fires_in_its_fault_and_every_alert_is_quiet_elsewhere(
    promtool: str, tmp_path: Path
) -> None:
    fixture = yaml.safe_load(SCENARIOS.read_text())
    names = alert_names()
    write_rules(tmp_path)
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(promtool_tests(fixture, names)))
    done = promtool_run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    fired = {name for s in fixture["scenarios"] for firing in s["at"].values() for name in firing}
    assert fired == set(names), f"no scenario fires {sorted(set(names) - fired)}"
    healthy = next(s for s in fixture["scenarios"] if s["name"] == "a healthy fleet")
    assert not healthy.get("series") and all(not f for f in healthy["at"].values())


def test_a_scenario_that_expects_the_wrong_alert_fails_promtool(
    promtool: str, tmp_path: Path
) -> None:
    """The harness bites: a healthy fleet said to fire an alert is refused by promtool."""
    fixture = yaml.safe_load(SCENARIOS.read_text())
    healthy = next(s for s in fixture["scenarios"] if s["name"] == "a healthy fleet")
    healthy["at"]["10m"] = {
        "KvrouterPumpBacklog": [
            {"labels": {"instance": "a:8080", "severity": "warning"}, "summary": "x"}
        ]
    }
    fixture["scenarios"] = [healthy]
    write_rules(tmp_path)
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(promtool_tests(fixture, alert_names())))
    done = promtool_run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert done.returncode != 0
    assert "KvrouterPumpBacklog" in done.stdout + done.stderr


def readme_alert_rows() -> dict[str, list[str]]:
    """README's "## Alerts" table: alert name -> its other cells."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(Kvrouter\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells[1:]
    return rows


def test_readme_has_a_runbook_line_for_every_alert_with_its_severity() -> None:
    rows = readme_alert_rows()
    assert sorted(rows) == sorted(alert_names())
    for rule in alert_rules():
        severity, *rest = rows[rule["alert"]]
        assert severity == rule["labels"]["severity"], rule["alert"]
        assert all(rest), f"{rule['alert']}: an empty cell in README's alert table"
        assert rule["annotations"]["runbook"] == RUNBOOK


def test_the_dashboard_json_is_what_scripts_dashboard_generates() -> None:
    done = subprocess.run(
        ["python3", str(REPO / "scripts" / "dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def dashboard_panel(title: str) -> dict[str, Any]:
    board = json.loads(DASHBOARD.read_text())
    panels = [*board["panels"], *(p for row in board["panels"] for p in row.get("panels", []))]
    return next(p for p in panels if p.get("title") == title)


def test_the_breaker_panel_shows_an_open_breaker_beside_another_replicas_probe_due(
    promtool: str, tmp_path: Path
) -> None:
    """Probe due is 3, the highest state: `max by (worker)` drew one replica's harmless probe
    due over another's open breaker (1, refusing). Evaluated by promtool on two replicas:
    a holds w1 probe due, b holds it open; w2 is closed on both."""
    states = {("a", "w1"): 3, ("b", "w1"): 1, ("a", "w2"): 0, ("b", "w2"): 0}
    series = [
        {
            "series": f'kvrouter_breaker_state{{namespace="{NAMESPACE}", job="kvrouter", '
            f'instance="{replica}:8080", worker="http://{worker}:8000"}}',
            "values": f"{state}x5",
        }
        for (replica, worker), state in states.items()
    ]
    refusing, probe_due = (t["expr"] for t in dashboard_panel("Circuit breakers")["targets"])
    expected = {refusing: {"w1": 1, "w2": 0}, probe_due: {"w1": 1, "w2": 0}}
    tests = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": substitute(expr),
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": f'{{worker="http://{worker}:8000"}}', "value": value}
                            for worker, value in by_worker.items()
                        ],
                    }
                    for expr, by_worker in expected.items()
                ],
            }
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    done = promtool_run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_says_bootstrap_settled_can_read_1_while_the_seed_gate_holds_readyz() -> None:
    """README: settled is "every rank settled or the timeout passed" only; the panel said
    "1 once bootstrap settled", read as ready, beside a replica answering 503."""
    board = json.loads(DASHBOARD.read_text())
    panels = [*board["panels"], *(p for row in board["panels"] for p in row.get("panels", []))]
    (panel,) = [
        p
        for p in panels
        if any("kvrouter_kv_bootstrap_settled" in t["expr"] for t in p.get("targets", []))
    ]
    text = panel["description"]
    assert "--kv-bootstrap-timeout-ms" in text
    assert '/readyz is 503 "seed gate closed"' in text
    assert "kvrouter_kv_bootstrap_seed_failed" in text


# Series every replica counts for the whole fleet: it books its siblings' shared decisions as
# well as its own, so summed over replicas one prompt counts once per replica.
COUNTED_BY_EVERY_REPLICA: Final = ("kvrouter_bookings_total",)
_AGGREGATION: Final = re.compile(r"\b(sum|avg|max|min|count)\s*(by\s*\(([^)]*)\))?\s*\(")


def dashboard_targets() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    panels = [*board["panels"], *(p for row in board["panels"] for p in row.get("panels", []))]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


@pytest.mark.parametrize("series", COUNTED_BY_EVERY_REPLICA)
def test_no_panel_sums_a_series_every_replica_counts_over_the_replicas(series: str) -> None:
    """The Bookings panel summed kvrouter_bookings_total by outcome: 5 prompts to one of two
    replicas drew 10 bookings ended."""
    drawn = [(title, expr) for title, expr in dashboard_targets() if series in expr]
    assert drawn
    for title, expr in drawn:
        for _, by, labels in _AGGREGATION.findall(expr):
            assert by and "instance" in labels.replace(" ", "").split(","), (title, expr)
