"""A Kubernetes API for live operator tests, in one of two tiers, behind one async client.

- **real**: when ``KUBEBUILDER_ASSETS`` names a folder holding ``kube-apiserver`` and ``etcd``
  (envtest's convention), ``ControlPlane`` starts them on 127.0.0.1 (and
  ``kube-controller-manager`` from the same folder when present, with only the garbage
  collector, namespace, PersistentVolume binder and protection controllers: the tests play the Job and
  Deployment controllers by patching statuses, so those controllers must not run) and applies
  the CRDs. Admission as a cluster has it by default (Pod Security, ValidatingAdmissionPolicy),
  but the ServiceAccount plugin (pods of the tests name accounts that no controller makes). The API server
  serves HTTPS only: the kubeconfig carries a static bearer token (``--token-auth-file``,
  group ``system:masters``) and skips TLS verification of the throw-away serving certificate.
- **kmock**: otherwise ``tests.support.kube_fake.FakeKubeAPI`` in the test's event loop, over
  plain HTTP on 127.0.0.1 with no authentication.

``KubeHTTP`` is the tests' own client (aiohttp, never blocking the loop that may be serving the
fake API).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

TEST_AGENT = "modelstage-tests"
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def write_kubeconfig(path: Path, server: str, token: str | None = None) -> Path:
    user: dict[str, Any] = {"token": token} if token else {}
    cluster: dict[str, Any] = {"server": server}
    if server.startswith("https://"):
        cluster["insecure-skip-tls-verify"] = True
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": "test", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def kubeconfig_token(path: Path) -> str | None:
    """The bearer token of a kubeconfig that ``write_kubeconfig`` wrote."""
    token: str | None = yaml.safe_load(path.read_text())["users"][0]["user"].get("token")
    return token


class ApiStatusError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


@dataclass
class KubeHTTP:
    """Minimal async Kubernetes client for the tests: paths in, dicts out."""

    server: str
    token: str | None = None
    session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeHTTP:
        headers = {"User-Agent": TEST_AGENT}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self.session = aiohttp.ClientSession(
            base_url=self.server,
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=False),
            timeout=aiohttp.ClientTimeout(total=15),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        **params: str,
    ) -> Any:
        assert self.session is not None
        async with self.session.request(
            method,
            path,
            json=body,
            params=params or None,
            headers={"Content-Type": content_type} if body is not None else None,
        ) as response:
            text = await response.text()
            try:
                data = json.loads(text) if text else None
            except json.JSONDecodeError:
                # A plain-text answer ("404 page not found" while a new API group is not yet
                # served): an error to the caller, not a parsing crash.
                if response.status < 300:
                    raise
                data = {"message": text.strip()}
            if response.status >= 300:
                raise ApiStatusError(response.status, data)
            return data

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self.request("GET", path)
        except ApiStatusError as error:
            if error.status == 404:
                return None
            raise
        return result

    async def list(self, path: str, **params: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = (await self.request("GET", path, **params)).get("items") or []
        return items

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("POST", path, body)
        return result

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch."""
        result: dict[str, Any] = await self.request(
            "PATCH", path, patch, content_type="application/merge-patch+json"
        )
        return result

    async def delete(self, path: str) -> None:
        await self.request("DELETE", path)


async def eventually(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout: float = 60.0,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Polls ``probe`` until it returns something truthy; its last value in the failure."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        last = await probe()
        if last:
            return last
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


# -- the real tier --------------------------------------------------------------------------------


def assets_folder() -> Path | None:
    """``KUBEBUILDER_ASSETS`` when it holds kube-apiserver and etcd, else None."""
    folder = os.environ.get("KUBEBUILDER_ASSETS")
    if not folder:
        return None
    path = Path(folder)
    if all(os.access(path / b, os.X_OK) for b in ("kube-apiserver", "etcd")):
        return path
    return None


def _service_account_keys(folder: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = folder / "sa.key"
    public = folder / "sa.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) from ``KUBEBUILDER_ASSETS``."""

    assets: Path
    workdir: Path
    apiserver_args: tuple[str, ...] = ()
    """Extra kube-apiserver flags (``--watch-cache=false`` for the watch-expiry tests)."""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    server: str = ""
    etcd: str = ""
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    kubeconfig: Path | None = None

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (lives with the process)
        process = subprocess.Popen(
            [str(self.assets / name), *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
        )
        self.processes.append(process)
        return process

    def start(self, timeout: float = 60.0) -> None:
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self._spawn(
            "etcd",
            [
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true",
            ],
        )
        self.etcd = f"http://127.0.0.1:{etcd_port}"
        (self.workdir / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        private, public = _service_account_keys(self.workdir)
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--secure-port={api_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--service-cluster-ip-range=10.0.0.0/24",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                # RBAC as clusters run it: the operator holds only the chart's permissions.
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={public}",
                f"--service-account-signing-key-file={private}",
                "--disable-admission-plugins=ServiceAccount",
                "--allow-privileged=true",
                *self.apiserver_args,
            ],
        )
        self.server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig = write_kubeconfig(self.workdir / "kubeconfig", self.server, self.token)
        self._wait_ready(timeout)
        if os.access(self.assets / "kube-controller-manager", os.X_OK):
            self._spawn(
                "kube-controller-manager",
                [
                    f"--kubeconfig={self.kubeconfig}",
                    f"--authentication-kubeconfig={self.kubeconfig}",
                    f"--authorization-kubeconfig={self.kubeconfig}",
                    # The PV binder binds the node-cache claims to their pre-bound PVs; the
                    # protection controllers let a PV and a claim nothing uses be deleted.
                    "--controllers=garbagecollector,namespace,persistentvolume-binder,"
                    "pv-protection,pvc-protection",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    "--use-service-account-credentials=false",
                ],
            )

    def compact(self) -> None:
        """Compacts etcd at its current revision: every older resourceVersion is forgotten
        (with ``--watch-cache=false`` a watch from one then gets 410 Expired)."""
        import base64
        import urllib.request

        def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
            request = urllib.request.Request(
                self.etcd + path, data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=10) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer

        revision = call("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]
        call("/v3/kv/compaction", {"revision": revision["revision"], "physical": True})

    @property
    def has_garbage_collector(self) -> bool:
        return any(Path(p.args[0]).name == "kube-controller-manager" for p in self.processes)  # type: ignore[index]

    def _wait_ready(self, timeout: float) -> None:
        import ssl
        import urllib.request

        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        deadline = time.monotonic() + timeout
        while True:
            request = urllib.request.Request(
                f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.token}"}
            )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(request, context=context, timeout=2) as response,
            ):
                if response.status == 200:
                    return
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited; see {self.workdir}/*.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready in {timeout} s; see {self.workdir}")
            time.sleep(0.2)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)


async def apply_crd(client: KubeHTTP, crd: dict[str, Any], timeout: float = 30.0) -> None:
    """Creates the CRD on a real API server and waits until it is served."""
    name = crd["metadata"]["name"]
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    if await client.get(f"{path}/{name}") is None:
        await client.create(path, crd)

    async def established() -> bool:
        current = await client.get(f"{path}/{name}") or {}
        conditions = (current.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    await eventually(established, timeout=timeout, what=f"CRD {name} established")
    group, version = crd["spec"]["group"], crd["spec"]["versions"][0]["name"]

    async def discovered() -> bool:
        return await client.get(f"/apis/{group}/{version}") is not None

    await eventually(discovered, timeout=timeout, what=f"{group}/{version} discovery")


# -- the operator's identity on the real tier: the chart's ServiceAccount and RBAC ------------

KIND_PATHS = {
    "Namespace": ("v1", "namespaces", False),
    "ServiceAccount": ("v1", "serviceaccounts", True),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ClusterKopfPeering": ("kopf.dev/v1", "clusterkopfpeerings", False),
    "KopfPeering": ("kopf.dev/v1", "kopfpeerings", True),
    "ValidatingAdmissionPolicy": (
        "admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def collection_path(doc: dict[str, Any]) -> str:
    version, plural, namespaced = KIND_PATHS[doc["kind"]]
    base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    if namespaced:
        return f"{base}/namespaces/{doc['metadata']['namespace']}/{plural}"
    return f"{base}/{plural}"


async def create_all(client: KubeHTTP, docs: list[dict[str, Any]]) -> None:
    """Creates each document (its namespace first, when missing); existing ones are kept."""
    for doc in docs:
        namespace = doc["metadata"].get("namespace")
        if namespace and await client.get(f"/api/v1/namespaces/{namespace}") is None:
            await client.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": namespace}})  # fmt: skip
        try:
            await client.create(collection_path(doc), doc)
        except ApiStatusError as error:
            if error.status != 409:
                raise


async def service_account_token(
    client: KubeHTTP,
    namespace: str,
    name: str,
    *,
    bound_pod: tuple[str, str] | None = None,
    audience: str | None = None,
) -> str:
    """A token of the ServiceAccount (the TokenRequest API, as the kubelet gets one); with
    ``bound_pod`` (name, uid) bound to that pod, so that it carries the pod's node (the
    node-name claim) and dies with the pod; ``audience`` for a projected token's."""
    spec: dict[str, Any] = {"expirationSeconds": 24 * 3600}
    if bound_pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": bound_pod[0],
                                  "uid": bound_pod[1]}  # fmt: skip
    if audience is not None:
        spec["audiences"] = [audience]
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
    answer = await client.create(path, request)
    token: str = answer["status"]["token"]
    return token


async def operator_kubeconfig(
    client: KubeHTTP, server: str, rbac: list[dict[str, Any]], path: Path
) -> Path:
    """Installs the chart's RBAC documents and writes a kubeconfig with a token of the chart's
    ServiceAccount: the operator then has exactly the chart's permissions."""
    docs = [d for d in rbac if d["kind"] in RBAC_KINDS]
    await create_all(client, docs)
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
    token = await service_account_token(client, account["namespace"], account["name"])
    return write_kubeconfig(path, server, token)


@dataclass
class Cluster:
    """What a test gets: the tier, the client, the operator's kubeconfig, and the fake."""

    tier: str
    client: KubeHTTP
    """The tests' own client: cluster admin (``system:masters``) on the real tier."""
    kubeconfig: Path
    """The operator's kubeconfig: on the real tier a token of the chart's ServiceAccount,
    bound by the chart's RBAC for the test's namespace (``namespace`` fixture)."""
    fake: Any = None
    """``FakeKubeAPI`` on the kmock tier (request counts), None on the real tier."""
    garbage_collection: bool = False
    server: str = ""
    plane: ControlPlane | None = None
    """The real tier's control plane."""

    async def forget_history(self) -> None:
        """Every resourceVersion so far is forgotten: a watch resuming from one gets 410
        Expired (etcd compacted on the real tier, which needs ``--watch-cache=false`` to show
        it at once; the fake's ``compact``)."""
        if self.plane is not None:
            await asyncio.to_thread(self.plane.compact)
        else:
            await self.fake.compact()


def chart_rbac(namespace: str) -> list[dict[str, Any]]:
    """The chart's ServiceAccount, Role and RoleBinding for an operator that serves
    ``namespace`` (its namespaced mode: what ``--namespace`` runs need)."""
    from support.charts import render_docs

    docs = render_docs(
        "--set", "watch.namespaced=true", "--set", f"watch.namespaces={{{namespace}}}"
    )
    return [d for d in docs if d["kind"] in RBAC_KINDS]


async def new_namespace(cluster: Cluster, name: str) -> str:
    """Creates a namespace; on the real tier also the chart's Role and RoleBinding in it, so
    that the operator (``Cluster.kubeconfig``) may serve it."""
    await cluster.client.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    if cluster.tier == "real":
        await create_all(
            cluster.client, [d for d in chart_rbac(name) if d["kind"] != "ServiceAccount"]
        )
    return name


@contextlib.asynccontextmanager
async def kmock_cluster(crds: list[dict[str, Any]], folder: Path) -> AsyncIterator[Cluster]:
    import kmock

    from support.kube_fake import new_fake

    async with new_fake(crds) as fake, kmock.Server(fake) as server:
        url = f"http://127.0.0.1:{server.port}"
        kubeconfig = write_kubeconfig(folder / "kubeconfig", url)
        try:
            async with KubeHTTP(url) as client:
                yield Cluster("kmock", client, kubeconfig, fake=fake, garbage_collection=True,
                              server=url)  # fmt: skip
        finally:
            await fake.end_watches()


@contextlib.asynccontextmanager
async def real_cluster(
    plane: ControlPlane, crds: list[dict[str, Any]], folder: Path
) -> AsyncIterator[Cluster]:
    """The real tier's ``Cluster``: the CRDs applied, and the operator's kubeconfig holding a
    token of the chart's ServiceAccount (the chart's RBAC only)."""
    async with KubeHTTP(plane.server, plane.token) as client:
        for crd in crds:
            await apply_crd(client, crd)
        kubeconfig = await operator_kubeconfig(
            client, plane.server, chart_rbac("default"), folder / "operator-kubeconfig"
        )
        yield Cluster("real", client, kubeconfig, garbage_collection=plane.has_garbage_collector,
                      server=plane.server, plane=plane)  # fmt: skip


@contextlib.contextmanager
def control_plane(
    assets: Path, workdir: Path, apiserver_args: tuple[str, ...] = ()
) -> Iterator[ControlPlane]:
    plane = ControlPlane(assets, workdir, apiserver_args)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()
