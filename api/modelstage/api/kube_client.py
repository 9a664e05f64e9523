"""A thin, synchronous Kubernetes client for the handlers: paths in, JSON dicts out.

kopf runs synchronous handlers in worker threads; they talk to the API server through the
``kubernetes`` package's configuration loading (kubeconfig, in-cluster service account, token
refresh) and its HTTP layer, but with explicit content types: only JSON merge patches are sent
(never strategic merge: CRDs do not support it). Idempotence lives here too: "already exists" on
create and "not found" on read are answers, not errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from .objects import KubeObject

MERGE_PATCH = "application/merge-patch+json"


class Conflict(Exception):
    """The object changed since it was read (HTTP 409 on a resourceVersion precondition)."""


def resource_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """``/api/v1/namespaces/ns/pods/name/status`` and the like."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [base]
    if namespace is not None:
        parts.append(f"namespaces/{quote(namespace, safe='')}")
    parts.append(plural)
    if name is not None:
        parts.append(quote(name, safe=""))
    if subresource is not None:
        parts.append(subresource)
    return "/".join(parts)


def _message(data: bytes | None) -> str:
    """The ``message`` of a Kubernetes ``Status`` body, if there is one."""
    try:
        status = json.loads(data or b"")
    except ValueError:
        return ""
    return str(status.get("message") or "") if isinstance(status, dict) else ""


@dataclass
class KubeClient:
    api: k8s.ApiClient
    timeout: float = 10.0

    @classmethod
    def from_environment(cls, timeout: float = 10.0) -> KubeClient:
        """In-cluster credentials when running in a pod, else the kubeconfig (``KUBECONFIG``)."""
        configuration = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return cls(k8s.ApiClient(configuration), timeout)

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> KubeObject:
        if query:
            path = f"{path}?{urlencode(dict(query))}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        _, url, headers, body, _ = self.api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=body, _request_timeout=self.timeout
        )
        response.read()  # type: ignore[no-untyped-call]
        if not 200 <= response.status < 300:
            raise ApiException(
                status=response.status, reason=_message(response.data) or response.reason
            )
        data: KubeObject = json.loads(response.data or b"{}")
        return data

    def text(self, path: str, query: Mapping[str, str] | None = None) -> str:
        """A plain-text subresource (a pod's ``log``); errors raise ``ApiException``."""
        if query:
            path = f"{path}?{urlencode(dict(query))}"
        headers = {"Accept": "text/plain"}
        _, url, headers, _, _ = self.api.param_serialize(
            "GET", path, header_params=headers, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(
            "GET", url, header_params=headers, _request_timeout=self.timeout
        )
        response.read()  # type: ignore[no-untyped-call]
        if not 200 <= response.status < 300:
            raise ApiException(
                status=response.status, reason=_message(response.data) or response.reason
            )
        return bytes(response.data or b"").decode(errors="replace")

    def get(self, path: str) -> KubeObject | None:
        """The object, or None when it does not exist."""
        try:
            return self._call("GET", path)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: Mapping[str, str] | None = None) -> list[KubeObject]:
        query = {}
        if label_selector:
            query["labelSelector"] = ",".join(f"{k}={v}" for k, v in sorted(label_selector.items()))
        items: list[KubeObject] = self._call("GET", path, query=query).get("items") or []
        return items

    def watch(
        self, path: str, seconds: int = 300, field_selector: str | None = None
    ) -> Iterator[KubeObject]:
        """The events of one watch request of a collection (``{"type", "object"}`` each),
        lasting at most ``seconds`` on the server (``field_selector``: only the objects it
        selects, e.g. ``metadata.name=<name>``); errors raise ``ApiException``."""
        params = {"watch": "true", "timeoutSeconds": str(seconds)}
        if field_selector:
            params["fieldSelector"] = field_selector
        query = urlencode(params)
        _, url, headers, _, _ = self.api.param_serialize(
            "GET", f"{path}?{query}", header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )  # fmt: skip
        response = self.api.call_api(
            "GET", url, header_params=headers, _request_timeout=(self.timeout, seconds + 30)
        )
        raw = response.response
        try:
            if response.status != 200:
                raise ApiException(status=response.status, reason=response.reason)
            for line in raw:
                if line.strip():
                    event: KubeObject = json.loads(line)
                    yield event
        finally:
            raw.release_conn()

    def create(self, path: str, body: KubeObject) -> KubeObject | None:
        """The created object, or None when one of that name already exists."""
        try:
            return self._call("POST", path, body=body)
        except ApiException as error:
            if error.status == 409:
                return None
            raise

    def delete(self, path: str) -> bool:
        """Deletes with background propagation (a Job's pods go too); False when it was
        already gone."""
        try:
            self._call("DELETE", path, query={"propagationPolicy": "Background"})
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def merge_patch(self, path: str, patch: KubeObject) -> KubeObject:
        """Sends a JSON merge patch; ``Conflict`` when its resourceVersion precondition is stale."""
        try:
            return self._call("PATCH", path, body=patch, content_type=MERGE_PATCH)
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"{path}: {error.reason}") from error
            raise
