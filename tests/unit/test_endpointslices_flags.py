"""The discovery flags of `kvrouter serve`: names, KVROUTER_ variables, refusals."""

from __future__ import annotations

import pytest

# The same helpers and the same clean environment as the other flag tests.
from tests.unit.test_cli_flags import config_of, no_kvrouter_env, refusal  # noqa: F401


def test_discovery_is_off_and_the_namespace_unset_by_default() -> None:
    config = config_of()
    assert config.worker_selector is None and config.kv_peer_selector is None
    assert config.namespace is None and config.kube_api_server is None
    assert config.worker_port == 0


def test_the_flags_fill_the_config() -> None:
    config = config_of(
        "--worker-selector",
        "app=fake-kv-worker",
        "--worker-port",
        "8000",
        "--kv-peer-selector",
        "kubernetes.io/service-name=kvrouter",
        "--namespace",
        "serving",
        "--kube-api-server",
        "http://127.0.0.1:8001",
        "--internal-token",  # siblings found by selector are asked with it
        "a-token-for-the-siblings-0123456789",
    )
    assert config.worker_selector == "app=fake-kv-worker" and config.worker_port == 8000
    assert config.kv_peer_selector == "kubernetes.io/service-name=kvrouter"
    assert config.namespace == "serving"
    assert config.kube_api_server == "http://127.0.0.1:8001"


def test_the_environment_sets_them_and_an_empty_namespace_means_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTER_WORKER_SELECTOR", "app=w")
    monkeypatch.setenv("KVROUTER_WORKER_PORT", "9000")
    monkeypatch.setenv("KVROUTER_NAMESPACE", "")
    config = config_of()
    assert (config.worker_selector, config.worker_port, config.namespace) == ("app=w", 9000, "")
    assert config_of("--namespace", "flag-wins").namespace == "flag-wins"


@pytest.mark.parametrize(
    "argv,word",
    [
        (["--worker-port", "70000"], "--worker-port"),
        (["--worker-port", "-1"], "--worker-port"),
        (["--kube-api-server", "ftp://x"], "--kube-api-server"),
        (["--peer", "http://10.0.0.2:8080", "--kv-peer-selector", "app=r"], "not both"),
    ],
)
def test_bad_discovery_settings_stop_it_with_one_line(
    argv: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert word in refusal(capsys, *argv)
