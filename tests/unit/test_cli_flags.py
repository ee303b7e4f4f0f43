"""`kvrouter serve` settings: flags, KVROUTER_ variables, and the refusals before start.

In-process (`parse_args` + `serve_config`, the whole validation path): the full matrix of
invalid settings runs in milliseconds here. `tests/component/test_cli.py` checks the same
contract on a real process for a representative few.
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path

import pytest

from peer.origin import AllowList
from router.auth import PLACEHOLDER_TOKEN
from router.cli import build_parser, parse_args, serve_config
from router.replica import ServeConfig, snapshot_body_bound


@pytest.fixture(autouse=True)
def no_kvrouter_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("KVROUTER_")]:
        monkeypatch.delenv(name)


def config_of(*argv: str) -> ServeConfig:
    return serve_config(parse_args(["serve", *argv]))


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one stderr line of a refused command line (asserts exit code 2 and one line)."""
    with pytest.raises(SystemExit) as exit_:
        config_of(*argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvrouter: error: ")
    return lines[0]


# --- invalid settings -----------------------------------------------------------------------


def invalid_settings(tmp: Path) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """name -> (serve args, env, a word the error line must contain)."""
    (tmp / "empty").mkdir()
    (tmp / "broken").mkdir()
    (tmp / "broken" / "tokenizer.json").write_text("{not json")
    return {
        "port 0": (["--port", "0"], {}, "--port"),
        "port not an int": (["--port", "abc"], {}, "--port"),
        "port too high": (["--port", "70000"], {}, "--port"),
        "dp-size 0": (["--dp-size", "0"], {}, "--dp-size"),
        "block-size negative": (["--block-size", "-1"], {}, "--block-size"),
        "block-size past belief": (["--block-size", str(10**30)], {}, "--block-size"),
        "max-attempts 0": (["--max-attempts", "0"], {}, "--max-attempts"),
        "cooldown above max": (
            ["--breaker-cooldown-s", "10", "--breaker-max-cooldown-s", "5"],
            {},
            "--breaker-cooldown-s",
        ),
        "cooldown 0": (["--breaker-cooldown-s", "0"], {}, "--breaker-cooldown-s"),
        "load interval 0": (["--load-interval-ms", "0"], {}, "--load-interval-ms"),
        "health interval 0": (["--health-interval-s", "0"], {}, "--health-interval-s"),
        "drain timeout negative": (["--drain-timeout-s", "-1"], {}, "--drain-timeout-s"),
        "request bytes 0": (["--max-request-bytes", "0"], {}, "--max-request-bytes"),
        "connections 0": (["--max-connections", "0"], {}, "--max-connections"),
        "header count 0": (["--max-header-count", "0"], {}, "--max-header-count"),
        "head bytes tiny": (["--max-head-bytes", "100"], {}, "--max-head-bytes"),
        "header timeout 0": (["--client-header-timeout-s", "0"], {}, "--client-header-timeout"),
        "body timeout 0": (["--client-body-timeout-s", "0"], {}, "--client-body-timeout-s"),
        "keep-alive 0": (["--keepalive-timeout-s", "0"], {}, "--keepalive-timeout-s"),
        "connect timeout 0": (["--upstream-connect-timeout-s", "0"], {}, "--upstream-connect"),
        "head timeout 0": (["--upstream-head-timeout-s", "0"], {}, "--upstream-head-timeout-s"),
        "stream idle 0": (["--stream-idle-timeout-s", "0"], {}, "--stream-idle-timeout-s"),
        "write stall 0": (["--client-write-timeout-s", "0"], {}, "--client-write-timeout-s"),
        "idle expiry 0": (["--upstream-idle-expiry-s", "0"], {}, "--upstream-idle-expiry-s"),
        "per-worker 0": (["--upstream-connections-per-worker", "0"], {}, "--upstream-connections"),
        "control port = port": (["--port", "9000", "--control-port", "9000"], {}, "--control-port"),
        "control port too big": (["--control-port", "70000"], {}, "--control-port"),
        "unknown event loop": (["--event-loop", "trio"], {}, "--event-loop"),
        "env unknown event loop": ([], {"KVROUTER_EVENT_LOOP": "trio"}, "KVROUTER_EVENT_LOOP"),
        "kv port base 0": (["--kv-events-port-base", "0"], {}, "--kv-events-port-base"),
        "kv events neither on, off nor auto": (["--kv-events", "maybe"], {}, "--kv-events"),
        "kv ports past 65535": (
            ["--kv-events-port-base", "65535", "--dp-size", "2"],
            {},
            "--kv-events-port-base",
        ),
        "negative replay port base": (
            ["--kv-events-replay-port-base", "-1"],
            {},
            "--kv-events-replay-port-base",
        ),
        "worker not http": (["--worker", "ftp://x"], {}, "ftp://x"),
        "worker without a scheme": (["--worker", "localhost:8000"], {}, "localhost:8000"),
        "worker without a host": (["--worker", "http://"], {}, "no host"),
        "worker with a broken host": (["--worker", "http://[bad"], {}, "http://[bad"),
        "worker port out of range": (["--worker", "http://h:99999"], {}, "http://h:99999"),
        "unknown policy": (["--policy", "nope"], {}, "nope"),
        "bool not a bool": (["--expose-route-headers", "maybe"], {}, "'maybe' is not a boolean"),
        "unknown log level": (["--log-level", "verbose"], {}, "--log-level"),
        "unknown flag": (["--wrker", "http://x"], {}, "--wrker"),
        "env int not an int": ([], {"KVROUTER_PORT": "abc"}, "KVROUTER_PORT='abc'"),
        "env float not a float": ([], {"KVROUTER_DRAIN_TIMEOUT_S": "soon"}, "KVROUTER_DRAIN"),
        "env bool not a bool": ([], {"KVROUTER_EXPOSE_ROUTE_HEADERS": "maybe"}, "KVROUTER_EXP"),
        "env unknown policy": ([], {"KVROUTER_POLICY": "nope"}, "KVROUTER_POLICY='nope'"),
        "env unknown log level": ([], {"KVROUTER_LOG_LEVEL": "loud"}, "KVROUTER_LOG_LEVEL"),
        "env worker not http": ([], {"KVROUTER_WORKER": "http://a:1,ftp://b"}, "ftp://b"),
        "tokenizer path missing": (["--tokenizer", str(tmp / "missing")], {}, "no such model"),
        "tokenizer dir without tokenizer.json": (
            ["--tokenizer", str(tmp / "empty")],
            {},
            "has no tokenizer.json",
        ),
        "tokenizer file broken": (["--tokenizer", str(tmp / "broken")], {}, "cannot load"),
        "unknown chat rules": (["--chat-rules", "tgi"], {}, "--chat-rules"),
        "env unknown chat rules": ([], {"KVROUTER_CHAT_RULES": "tgi"}, "KVROUTER_CHAT_RULES"),
        "negative tokenize cache": (["--tokenize-cache-mb", "-1"], {}, "--tokenize-cache-mb"),
        # Not finite, or past a timer's reach: a bound turned off, or a crash when first armed.
        "infinite timeout": (["--client-header-timeout-s", "inf"], {}, "not a finite number"),
        "nan cooldown": (["--breaker-cooldown-s", "nan"], {}, "not a finite number"),
        "huge stream gap": (["--stream-idle-timeout-s", "1e300"], {}, "not a finite number"),
        "env infinite drain": ([], {"KVROUTER_DRAIN_TIMEOUT_S": "inf"}, "KVROUTER_DRAIN"),
        "huge int": (["--load-interval-ms", "1" + "0" * 400], {}, "not an integer up to"),
        "env huge int": ([], {"KVROUTER_BOOKING_TTL_MS": "1" + "0" * 400}, "KVROUTER_BOOKING"),
        "placeholder token": (["--internal-token", PLACEHOLDER_TOKEN], {}, "placeholder"),
        "env placeholder token": (
            [],
            {"KVROUTER_INTERNAL_TOKEN": PLACEHOLDER_TOKEN},
            "placeholder",
        ),
        "token with a space": (["--internal-token", "two words"], {}, "whitespace"),
        "peer without a token": (["--peer", "http://p:1"], {}, "--internal-token"),
        "peer selector without a token": (["--kv-peer-selector", "a=b"], {}, "--internal-token"),
        "worker with a path": (["--worker", "http://h:1/latest/meta-data"], {}, "path"),
        "worker with a query": (["--worker", "http://h:1?x=1"], {}, "query"),
        "worker with a fragment": (["--worker", "http://h:1#"], {}, "fragment"),
        "worker with credentials": (["--worker", "http://u:p@h:1"], {}, "credentials"),
        "peer with a path": (
            ["--peer", "http://p:1/x", "--internal-token", "t" * 20],
            {},
            "path",
        ),
        # Shorthand IPv4: reachable by a plain connect, refused by aiohttp (peer.origin);
        # the error names the dotted quad to write instead.
        "worker at a shorthand IPv4 host": (["--worker", "http://127.1:1"], {}, "127.0.0.1"),
        # Where an engine listens, not where anyone connects: no one worker.
        "worker at the unspecified address": (
            ["--worker", "http://0.0.0.0:8000"],
            {},
            "unspecified address",
        ),
        "peer at a decimal IPv4 host": (
            ["--peer", "http://2130706433:1", "--internal-token", "t" * 20],
            {},
            "127.0.0.1",
        ),
        "self-url at a zero-padded IPv4 host": (
            ["--self-url", "http://127.000.000.001:1"],
            {},
            "127.0.0.1",
        ),
        "allow-cidr not a network": (["--worker-allow-cidr", "10.0.0.0/33"], {}, "33"),
        "cors origin with a path": (
            ["--cors-allow-origin", "https://app.example/ui"],
            {},
            "--cors-allow-origin",
        ),
        "negative placement timeout": (
            ["--placement-timeout-ms", "-1"],
            {},
            "--placement-timeout-ms",
        ),
        "env placement timeout too long": (
            [],
            {"KVROUTER_PLACEMENT_TIMEOUT_MS": "5000"},
            "--placement-timeout-ms",
        ),
        # A bound of 0 would kill every ingest process between two heartbeats.
        "zero ingest silence": (["--kv-ingest-silence-s", "0"], {}, "--kv-ingest-silence-s"),
    }


def test_every_invalid_setting_is_refused_with_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = {}
    for name, (args, env, word) in invalid_settings(tmp_path).items():
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            try:
                line = refusal(capsys, *args)
            except (AssertionError, pytest.fail.Exception) as exc:
                wrong[name] = f"not refused properly: {exc}"
                continue
            if word not in line:
                wrong[name] = f"{line!r} does not name {word!r}"
    assert wrong == {}, "\n".join(f"{k}: {v}" for k, v in wrong.items())


def test_a_tokenizer_without_the_hf_extra_is_refused_with_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # type: ignore[arg-type]
    line = refusal(capsys, "--tokenizer", str(tmp_path))
    assert "pip install 'kvrouter[hf]'" in line


# --- the environment and the command line ---------------------------------------------------


def test_the_environment_sets_every_kind_of_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTER_PORT", "9001")
    monkeypatch.setenv("KVROUTER_WORKER", "http://a:1,,http://b:2,")
    monkeypatch.setenv("KVROUTER_POLICY", "round_robin")
    monkeypatch.setenv("KVROUTER_BREAKER_COOLDOWN_S", "1.5")
    monkeypatch.setenv("KVROUTER_EXPOSE_ROUTE_HEADERS", "yes")
    monkeypatch.setenv("KVROUTER_INTERNAL_TOKEN", "s3cret")
    monkeypatch.setenv("KVROUTER_LOG_LEVEL", "DEBUG")
    args = parse_args(["serve"])
    config = serve_config(args)
    assert config.port == 9001
    assert config.workers == ["http://a:1", "http://b:2"]
    assert config.policy == "round_robin"
    assert config.breaker_cooldown_s == 1.5
    assert config.expose_route_headers is True
    assert config.internal_token == "s3cret"
    assert args.log_level == "debug"


def test_a_flag_on_the_command_line_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTER_PORT", "9001")
    monkeypatch.setenv("KVROUTER_WORKER", "http://from-env:1")
    config = config_of("--port", "9002", "--worker", "http://a:1", "--worker", "http://b:2")
    assert config.port == 9002
    # Repeatable: the command line's list replaces the environment's, it does not extend it.
    assert config.workers == ["http://a:1", "http://b:2"]
    assert config_of().workers == ["http://from-env:1"]


def test_a_flag_on_the_command_line_makes_an_unparsable_variable_harmless(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # What the kubelet injects beside a Service named kvrouter (docker-link variables).
    monkeypatch.setenv("KVROUTER_PORT", "tcp://10.96.0.10:8080")
    assert config_of("--port", "8080").port == 8080
    assert "KVROUTER_PORT='tcp://10.96.0.10:8080'" in refusal(capsys)


def test_help_says_the_token_is_set_but_never_prints_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --help is run inside pods and CI jobs with the Secret mounted: its output reaches logs.
    monkeypatch.setenv("KVROUTER_INTERNAL_TOKEN", "s3cr3t-token-do-not-print")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    assert "s3cr3t" not in shown
    assert "set from KVROUTER_INTERNAL_TOKEN, value not shown" in shown
    monkeypatch.delenv("KVROUTER_INTERNAL_TOKEN")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    assert "KVROUTER_INTERNAL_TOKEN; default unset]" in " ".join(capsys.readouterr().out.split())


def test_an_ipv4_mapped_allow_cidr_flag_is_read_as_the_ipv4_network_it_maps() -> None:
    """`--worker-allow-cidr ::ffff:10.0.0.0/104` was taken and matched nothing: a worker at
    10.1.2.3 (or at ::ffff:10.1.2.3, checked as 10.1.2.3) was refused by the list meant for it."""
    config = config_of(
        "--worker-allow-cidr", "::ffff:10.0.0.0/104", "--worker-allow-cidr", "fd00::/8"
    )
    allow = AllowList.parse(config.worker_allow_cidr)
    assert allow.networks == (IPv4Network("10.0.0.0/8"), IPv6Network("fd00::/8"))
    assert allow.refusal("w", ["10.1.2.3", "::ffff:10.1.2.4", "fd00::1"]) is None


def test_defaults_without_flags_or_environment() -> None:
    config = config_of()
    assert (config.port, config.workers, config.policy) == (8080, [], "cache_aware")
    assert (config.block_size, config.internal_token) == (None, None)  # "learn" and "open"


def test_every_flag_but_the_process_ones_reaches_the_serve_config() -> None:
    # `serve_config` keeps only the arguments that name a ServeConfig field: a flag whose
    # name does not match one would be parsed, documented, and silently ignored. The log
    # level and the event loop are the process's, set before the replica exists.
    _, flags = build_parser()
    config_fields = {f.name for f in fields(ServeConfig)}
    dests = {"workers" if n == "worker" else n.replace("-", "_") for n in flags.names}
    assert dests - {"log_level", "event_loop"} <= config_fields


@pytest.mark.parametrize(
    ("flags", "bound"),
    [
        ([], 4_000_000 * 48),  # the default cap: a full index fits as columns
        (["--kv-index-max-blocks", "5000000"], 5_000_000 * 48),  # the manifests' cap
        (["--kv-index-max-blocks", "100000"], 24 << 20),  # never under 24 MiB
        (["--kv-bootstrap-max-body-mb", "7"], 7 << 20),  # an explicit bound wins
    ],
)
def test_the_sibling_snapshot_bound_follows_the_index_cap_unless_given(
    flags: list[str], bound: int
) -> None:
    config = serve_config(parse_args(["serve", *flags]))
    assert snapshot_body_bound(config) == bound


def test_a_serve_configs_repr_never_holds_the_token() -> None:
    config = ServeConfig(internal_token="s3cr3t-token-do-not-print")
    assert "s3cr3t" not in repr(config)
    assert config.internal_token == "s3cr3t-token-do-not-print"
