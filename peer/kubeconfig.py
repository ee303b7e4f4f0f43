"""Reaching the Kubernetes API: which server, with which credentials, in which namespace.

Sources, in order: `--kube-api-server URL` talks to that URL without credentials (`kubectl
proxy`, and how the tests reach their fake API server); else, inside a pod
(`KUBERNETES_SERVICE_HOST` set), the service account's in-cluster config, whose token is
re-read as it rotates; else the kubeconfig (`KUBECONFIG`, else `~/.kube/config`). Each replica
builds its own `Configuration`, never the library's global default.

kubernetes-asyncio is imported only when a client is made: it takes seconds to import, and a
replica without EndpointSlice discovery (or a command line that fails its checks) must not
pay for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(Exception):
    """No way to reach an API server; the message says what to set."""


def resolve_namespace(
    flag: str | None, environ: Mapping[str, str], service_account: Path = SERVICE_ACCOUNT
) -> tuple[str, str]:
    """The namespace to watch and where it came from; "" means every namespace.

    `--namespace` (empty included) wins; else the pod's own, from the downward API
    (`POD_NAMESPACE`) or the service-account file; else `default`, as kubectl would.
    """
    if flag is not None:
        return flag, "--namespace"
    if environ.get("POD_NAMESPACE"):
        return environ["POD_NAMESPACE"], "POD_NAMESPACE"
    sa_file = service_account / "namespace"
    try:
        from_file = sa_file.read_text().strip()
    except OSError:
        from_file = ""
    if from_file:
        return from_file, str(sa_file)
    return "default", "no --namespace, POD_NAMESPACE or service-account namespace file"


async def kube_api_client(
    api_server: str | None,
    environ: Mapping[str, str],
    service_account: Path = SERVICE_ACCOUNT,
) -> ApiClient:
    """An API client of its own (see the module's opening for the order of sources)."""
    import yaml  # kubernetes-asyncio's own dependency, which reads kubeconfigs
    from kubernetes_asyncio.client import ApiClient, Configuration
    from kubernetes_asyncio.config import (
        ConfigException,
        load_incluster_config,
        load_kube_config,
    )

    config = Configuration()
    try:
        if api_server:
            config.host = api_server.rstrip("/")
        elif environ.get("KUBERNETES_SERVICE_HOST"):
            load_incluster_config(
                client_configuration=config,
                try_refresh_token=True,
                token_filename=str(service_account / "token"),
                cert_filename=str(service_account / "ca.crt"),
                environ=environ,
            )
        else:
            await load_kube_config(
                config_file=_kubeconfig_path(environ), client_configuration=config
            )
        # Builds the TLS context: a CA file that holds no certificate fails here.
        return ApiClient(config)
    except (ConfigException, OSError, ValueError, TypeError, yaml.YAMLError) as exc:
        # A kubeconfig that is no YAML mapping, or certificate data that is not base64 or
        # no certificate (ssl.SSLError is an OSError), fails inside the library with one of
        # these: one line naming it, not a traceback.
        problem = " ".join(str(exc).split())  # YAML's errors span lines
        raise KubeConfigError(
            f"cannot reach the Kubernetes API: {type(exc).__name__}: {problem}; run in a pod "
            "with a service account, set KUBECONFIG, or pass --kube-api-server URL"
        ) from None


def _kubeconfig_path(environ: Mapping[str, str]) -> str:
    # Read here, not at import time as the library's own default is.
    return environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
