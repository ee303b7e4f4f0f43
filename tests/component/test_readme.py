"""The README cannot rot: every shell block it shows is run here, and its tables are checked.

Each ```bash block in README.md is preceded by `<!-- readme-test: LABEL -->`; a block without a
label fails `test_every_readme_shell_block_is_run_by_a_test`. The `by-hand` blocks run as one
bash script, exactly as written except that their port numbers are swapped for free ones (so
the test cannot collide with anything else on the machine). The flags and metric names the
README's tables promise are checked against the real parser and a real replica's `/metrics`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from peer.tracker import SEED_GATE_MIN_S, seed_gate_timeout
from router.cli import build_parser
from router.placement import MAX_TIMEOUT_MS as MAX_PLACEMENT_TIMEOUT_MS
from tests.support.fake_apiserver import FakeApiServer
from tests.support.model_dirs import build_fixture_model
from tests.support.ports import free_port_range, listening
from tests.support.processes import run_to_end
from tests.support.router import router_in_process

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LABELED_BLOCK = re.compile(r"<!-- readme-test: ([a-z-]+) -->\n```bash\n(.*?)```", re.S)
ANY_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
# A port the README names -> how many consecutive ports it stands for (dp ranks, replay).
README_PORTS = {8001: 1, 8002: 1, 8080: 1, 8081: 1, 5557: 1, 5567: 2, 5600: 2}


def labeled_blocks(label: str) -> list[str]:
    return [body for found, body in LABELED_BLOCK.findall(README) if found == label]


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def test_every_readme_shell_block_is_run_by_a_test() -> None:
    labels = [label for label, _ in LABELED_BLOCK.findall(README)]
    assert len(labels) == len(ANY_BLOCK.findall(README)), "a ```bash block has no readme-test label"
    assert set(labels) == {"commands", "by-hand"}


def test_the_readme_test_command_is_what_ci_runs() -> None:
    (commands,) = labeled_blocks("commands")
    lines = [line for line in commands.splitlines() if line and not line.startswith("#")]
    assert lines == ["./scripts/demo", "./scripts/test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\s*(exec\s+)?\./scripts/test\b", ci, re.M), ci


@pytest.mark.timeout(180)
async def test_the_readme_demo_command_runs_the_demo_to_a_verdict() -> None:
    code, text, err = await run_to_end(["./scripts/demo"], within_s=150)
    assert code == 0, f"{text}\n{err}"
    # The demo checks itself (cache_aware beats round_robin, views agree, same routing);
    # test_demo.py pins each of those checks on a smaller workload.
    assert "views: agree (3 replicas" in text, text
    assert "all checks passed" in text, text


def _with_free_ports(script: str) -> tuple[str, dict[int, int]]:
    mapping = {port: free_port_range(count) for port, count in README_PORTS.items()}
    for readme_port, count in README_PORTS.items():
        for offset in range(count):
            script = re.sub(
                rf"(?<![0-9]){readme_port + offset}(?![0-9])",
                str(mapping[readme_port] + offset),
                script,
            )
    return script, mapping


def json_documents(text: str) -> list[dict]:
    """The JSON objects curl printed; its bodies carry no trailing newline, so they abut."""
    decoder = json.JSONDecoder()
    found: list[dict] = []
    at = text.find("{")
    while at != -1:
        try:
            document, end = decoder.raw_decode(text, at)
        except ValueError:
            end = at + 1
        else:
            found.append(document)
        at = text.find("{", end)
    return found


@pytest.mark.timeout(120)
async def test_the_readme_by_hand_session_works_as_shown() -> None:
    script, ports = _with_free_ports("\n".join(labeled_blocks("by-hand")))
    code, text, err = await run_to_end(["bash", "-euo", "pipefail", "-c", script], within_s=100)
    assert code == 0, f"exit {code}\n{text}\n{err[-4000:]}"

    worker_a = f"http://127.0.0.1:{ports[8001]}"
    worker_b = f"http://127.0.0.1:{ports[8002]}"
    assert "HTTP/1.1 200 OK" in text
    routed = re.search(r"^X-Kvrouter-Worker: (\S+)", text, re.M | re.I)
    assert routed is not None and routed.group(1) in (worker_a, worker_b), text
    documents = json_documents(text)
    listing = next(d for d in documents if "workers" in d)
    assert sorted(w["url"] for w in listing["workers"]) == sorted([worker_a, worker_b])
    assert sum(len(w["ranks"]) for w in listing["workers"]) == 3
    # Two full 16-token blocks (bytes tokenizer) from the routed prompt, one from each direct one;
    # where the routed one went is the policy's (random) tie-break.
    blocks = re.findall(r"^kvrouter_tree_blocks\{.*\} (\S+)", text, re.M)
    assert sum(float(b) for b in blocks) == 4.0, text
    assert re.search(r'^kvrouter_kv_peer_snapshot_total\{outcome="accepted"\} 1\.0', text, re.M)
    assert "agree" in text and "differ" not in text, text
    assert {"removed": worker_b} in documents
    assert any(d.get("url") == worker_b and len(d["ranks"]) == 2 for d in documents)
    # The cursor table alone: no nodes, and only this replica's workers named.
    table = next(d for d in documents if "cursors" in d)
    assert table["format"] == 1 and table["nodes"] == [], table
    assert {w["url"] for w in table["workers"]} <= {worker_a, worker_b}, table
    # `kill $(jobs -p); wait` stopped every process the session started.
    assert not any(listening(port) for port in ports.values())


def test_every_flag_in_the_readme_table_is_a_serve_flag() -> None:
    parser, _ = build_parser()
    serve = parser.parse_args(["serve"])
    known = {"--" + name.replace("_", "-") for name in vars(serve)}
    table = section("Flags that matter")
    named = set(re.findall(r"`(--[a-z][a-z-]*)", table))
    assert len(named) >= 12
    for flag in named:
        if flag.endswith("-"):
            assert any(k.startswith(flag) for k in known), flag
        else:
            assert flag in known, flag


def test_the_flags_table_states_the_placement_timeouts_cap() -> None:
    """A --placement-timeout-ms over MAX_TIMEOUT_MS is refused at start; the row did not say
    there was a cap."""
    row = next(
        line
        for line in section("Flags that matter").splitlines()
        if line.startswith("| `--placement-timeout-ms`")
    )
    assert f"at most {MAX_PLACEMENT_TIMEOUT_MS:,} (a longer one is refused at start)" in row


def test_the_readme_and_the_alert_state_the_seed_gates_hard_bound() -> None:
    """`--kv-bootstrap-seed-required` holds /readyz for at most max(3 x timeout, 60 s); the
    flags table, the readiness paragraph and the alert said only that it holds it."""
    bound = "max(3 x `--kv-bootstrap-timeout-ms`, 60 s)"
    assert seed_gate_timeout(0) == SEED_GATE_MIN_S == 60 and seed_gate_timeout(100) == 300
    flag_row = next(
        line
        for line in section("Flags that matter").splitlines()
        if line.startswith("| `--kv-bootstrap-seed-required`")
    )
    assert bound in flag_row
    readiness = section("Peer bootstrap")
    assert bound in readiness and "6 min at the default" in readiness
    assert seed_gate_timeout(120) == 360  # the default timeout (120 s): 6 min
    # What the settled gauge and readiness each mean, where they can disagree.
    assert "can read 1 while `/readyz` answers 503" in readiness
    alerts = (ROOT / "manifests/observability/alerts.yaml").read_text()
    assert "max(3 x the bootstrap timeout, 60 s)" in alerts


def test_the_ranks_cold_alert_row_says_an_engine_restart_is_an_expected_abandoned() -> None:
    """An evicted engine registered anew after its restart settles `abandoned` (its siblings
    all hold nothing of it: the reference's per-rank cold settle), firing
    KvrouterBootstrapRanksCold; the row said `abandoned` was expected only at a fleet's start."""
    row = next(
        line
        for line in section("Alerts").splitlines()
        if line.startswith("| `KvrouterBootstrapRanksCold`")
    )
    assert "evicted (`KvrouterWorkerEvicted`) and registered anew after a restart" in row
    assert "`kvrouter_index_rank_cold`" in row


async def test_every_metric_the_readme_names_is_exported(tmp_path: Path) -> None:
    # Bootstrap, discovery, ingest processes, prefix homes and a model tokenizer (its segment
    # cache) on, so that their series are exported too.
    async with (
        FakeApiServer() as api,
        router_in_process(
            workers=[],
            tokenizer=str(build_fixture_model(tmp_path / "model", "qwen3.jinja")),
            kv_peer_selector="kubernetes.io/service-name=kvrouter",
            kube_api_server=api.url,
            namespace="default",
            kv_ingest_processes=1,
            prefix_homes=True,
        ) as rt,
    ):
        status, exposition = await rt.text("/metrics")
    assert status == 200
    exported = set(re.findall(r"^# HELP (\S+)", exposition, re.M))
    named = set(re.findall(r"`(kvrouter_[a-z_]+)`", README))
    assert len(named) >= 15
    missing = sorted(name for name in named if name not in exported)
    assert not missing, missing
