"""An OCI registry over its distribution HTTP API: references, credentials, blobs, manifests.

Used by the ``oci://`` destination (push), the ``oci://`` source (pull) and ``verify``. It
speaks the API directly (``/v2/<name>/blobs/...``, ``/v2/<name>/manifests/...``) with the
standard library's ``http.client``: one connection per thread and host, bodies streamed in
caller-sized pieces, nothing buffered beyond them.

**Credentials** come from a docker config JSON file (``auths`` by registry host, each with
``auth`` = base64 ``user:password``, or ``username``/``password``, or ``identitytoken``):
``--registry-auth FILE``, else ``REGISTRY_AUTH_FILE``, else ``$DOCKER_CONFIG/config.json``,
else ``~/.docker/config.json``, as skopeo and docker look. A registry's 401 challenge says
which scheme it wants: ``Basic`` gets the credentials, ``Bearer`` a token fetched from its
realm with them. Neither a credential nor a token ever reaches a message or a log.

**Transport**: HTTPS, with ``ca_file`` trusted besides the system's CAs; plain HTTP only for
``127.0.0.1``/``localhost`` or with ``insecure`` set explicitly.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import re
import ssl
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelstageError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_ACCEPT = ", ".join([OCI_MANIFEST, "application/vnd.docker.distribution.manifest.v2+json"])
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
"""The largest image manifest read: distribution itself refuses manifests above 4 MiB."""
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_REPO = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
READ_BLOCK = 1024 * 1024


class RegistryError(ModelstageError):
    """The registry refused or failed a request; callers re-raise it as their domain's error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class OciReference:
    """``oci://REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]``."""

    registry: str
    """``host`` or ``host:port``."""
    repository: str
    tag: str | None = None
    digest: str | None = None

    @staticmethod
    def parse(uri: str) -> OciReference:
        text = uri.removeprefix("oci://")
        registry, _, rest = text.partition("/")
        hostlike = "." in registry or ":" in registry or registry == "localhost"
        if not registry or not rest or not hostlike:
            raise RegistryError(
                f"{uri!r}: expected oci://REGISTRY/REPOSITORY:TAG (the registry host first, "
                "e.g. oci://registry.example.com/models/llama:v1)"
            )
        digest = None
        if "@" in rest:
            rest, _, digest = rest.partition("@")
            if not _DIGEST.match(digest):
                raise RegistryError(f"{uri!r}: the digest must be sha256:<64 hex characters>")
        tag = None
        name, colon, maybe_tag = rest.rpartition(":")
        if colon and "/" not in maybe_tag:
            rest, tag = name, maybe_tag
            if not _TAG.match(tag):
                raise RegistryError(f"{uri!r}: {tag!r} is not a valid tag")
        if not _REPO.match(rest):
            raise RegistryError(
                f"{uri!r}: {rest!r} is not a valid repository name (lower-case letters, digits, "
                "separators . _ - and /)"
            )
        return OciReference(registry, rest, tag, digest)

    @property
    def name(self) -> str:
        """``REGISTRY/REPOSITORY``: what a pinned address starts with."""
        return f"{self.registry}/{self.repository}"

    @property
    def reference(self) -> str:
        """What ``/manifests/<reference>`` takes: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def uri(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        at = f"@{self.digest}" if self.digest else ""
        return f"oci://{self.name}{tag}{at}"

    def pinned(self, digest: str) -> str:
        """The address that names exactly one image: ``REGISTRY/REPOSITORY@sha256:...``."""
        return f"{self.name}@{digest}"


@dataclass(frozen=True)
class RegistryOptions:
    auth_file: str | None = None
    """A docker config JSON file (a mounted ``kubernetes.io/dockerconfigjson`` Secret)."""
    ca_file: str | None = None
    """PEM CAs to trust for the registry, besides the system's."""
    insecure: bool = False
    """Plain HTTP to a registry that is not on the loopback interface."""
    timeout: float = 120.0
    concurrency: int = 4
    """Blob uploads or downloads in flight."""


def auth_file_path(explicit: str | None, env: Mapping[str, str] | None = None) -> Path | None:
    """The docker config file to read, as skopeo and docker look for one (module docstring)."""
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit)
    if env.get("REGISTRY_AUTH_FILE"):
        return Path(env["REGISTRY_AUTH_FILE"])
    if env.get("DOCKER_CONFIG"):
        return Path(env["DOCKER_CONFIG"]) / "config.json"
    home = Path(env.get("HOME", "~")).expanduser() / ".docker" / "config.json"
    return home if home.is_file() else None


def credentials_for(path: Path | None, registry: str) -> tuple[str, str] | None:
    """(user, secret) for ``registry`` from a docker config file; the secret is never shown."""
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else "not valid JSON"
        raise RegistryError(f"{path}: cannot read the registry credentials file ({why})") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        raise RegistryError(f"{path}: no `auths` object; expected a docker config JSON file")
    for key in (registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v1/"):
        entry = auths.get(key)
        if isinstance(entry, dict):
            return _entry_credentials(entry, path, registry)
    return None


def _entry_credentials(entry: dict[str, Any], path: Path, registry: str) -> tuple[str, str]:
    if entry.get("identitytoken"):
        return "<token>", str(entry["identitytoken"])
    if entry.get("username") and entry.get("password"):
        return str(entry["username"]), str(entry["password"])
    try:
        user, colon, secret = base64.b64decode(str(entry.get("auth", ""))).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        colon = ""
    if not colon:
        raise RegistryError(
            f"{path}: the entry for {registry} has no usable `auth` (base64 of user:password)"
        )
    return user, secret


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="...",service="..."`` -> ("bearer", {realm, service, ...})."""
    scheme, _, params = header.strip().partition(" ")
    found = dict(re.findall(r'(\w+)="([^"]*)"', params))
    return scheme.lower(), found


class Response:
    """A response whose body the caller reads (streamed) or drops."""

    def __init__(self, raw: http.client.HTTPResponse) -> None:
        self.raw, self.status = raw, raw.status

    def header(self, name: str) -> str:
        return self.raw.getheader(name) or ""

    def read(self, limit: int | None = None) -> bytes:
        return self.raw.read() if limit is None else self.raw.read(limit)


class RegistryClient:
    """One repository of one registry; safe to share between threads."""

    def __init__(self, ref: OciReference, options: RegistryOptions | None = None) -> None:
        self.ref, self.options = ref, options or RegistryOptions()
        host = ref.registry.split(":")[0].strip("[]")
        loopback = ref.registry.split(":")[0] in LOOPBACK or host == "::1"
        self.scheme = (
            "http" if self.options.insecure or (loopback and not self.options.ca_file) else "https"
        )
        self.base = f"{self.scheme}://{ref.registry}"
        self._local = threading.local()
        self._auth_lock = threading.Lock()
        self._authorization: str | None = None
        self._credentials = credentials_for(auth_file_path(self.options.auth_file), ref.registry)
        self._context: ssl.SSLContext | None = None
        if self.scheme == "https":
            self._context = ssl.create_default_context()
            if self.options.ca_file:
                try:
                    self._context.load_verify_locations(self.options.ca_file)
                except (OSError, ssl.SSLError):
                    raise RegistryError(
                        f"{self.options.ca_file}: cannot load it as PEM CA certificates"
                    ) from None

    # -- HTTP plumbing ----------------------------------------------------------------------

    def _connection(self, netloc: str, scheme: str) -> http.client.HTTPConnection:
        conns: dict[tuple[str, str], http.client.HTTPConnection] = getattr(self._local, "conns", {})
        self._local.conns = conns
        conn = conns.get((scheme, netloc))
        if conn is None:
            timeout = self.options.timeout
            if scheme == "https":
                conn = http.client.HTTPSConnection(netloc, timeout=timeout, context=self._context)
            else:
                conn = http.client.HTTPConnection(netloc, timeout=timeout)
            conns[(scheme, netloc)] = conn
        return conn

    def _drop_connection(self, netloc: str, scheme: str) -> None:
        conn = getattr(self._local, "conns", {}).pop((scheme, netloc), None)
        if conn is not None:
            conn.close()

    def url(self, path: str) -> str:
        """An absolute URL for an API path or a (possibly relative) ``Location``."""
        return urllib.parse.urljoin(self.base + "/", path)

    def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | memoryview | None = None,
        headers: Mapping[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
        what: str = "",
    ) -> Response:
        """One request, authorized (answering one 401 challenge), its status checked.

        Connection failures are retried once on a fresh connection for requests without a
        body being streamed twice (the body, when any, is in memory)."""
        for attempt in (0, 1, 2):
            response = self._send(method, url, body, headers or {})
            if response.status == 401 and attempt == 0 and self._authorize(response):
                response.read()
                continue
            redirect = response.header("Location")
            if response.status in (302, 307) and method in ("GET", "HEAD") and redirect:
                response.read()  # blob storage behind the registry (a signed URL)
                url = self.url(redirect)
                continue
            break
        if response.status not in ok:
            detail = self._error_detail(response)
            response.read()
            raise RegistryError(
                f"{what or url}: the registry answered {method} with HTTP {response.status}"
                f"{detail}",
                response.status,
            )
        return response

    def _send(
        self, method: str, url: str, body: bytes | memoryview | None, headers: Mapping[str, str]
    ) -> Response:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RegistryError(f"{self.ref.name}: the registry sent an unusable URL")
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        send = dict(headers)
        if self._authorization and parts.netloc == self.ref.registry:
            send["Authorization"] = self._authorization
        if body is not None:
            send["Content-Length"] = str(len(body))
        last: Exception | None = None
        for _ in (0, 1):
            conn = self._connection(parts.netloc, parts.scheme)
            try:
                conn.request(method, path, body=body, headers=send)
                return Response(conn.getresponse())
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection(parts.netloc, parts.scheme)
                last = e
        raise RegistryError(
            f"{self.ref.name}: cannot reach the registry at {self.base} ({type(last).__name__}: "
            f"{_reason(last)})"
        )

    def _error_detail(self, response: Response) -> str:
        """The registry's error code (``BLOB_UNKNOWN``, ``DENIED``), never a header value."""
        try:
            doc = json.loads(response.read(64 * 1024) or b"{}")
            codes = [str(e.get("code")) for e in doc.get("errors", []) if isinstance(e, dict)]
        except (ValueError, AttributeError):
            codes = []
        hint = ""
        if response.status == 401:
            hint = "; check the credentials (--registry-auth, REGISTRY_AUTH_FILE, DOCKER_CONFIG)"
        return (f" ({', '.join(codes)})" if codes else "") + hint

    def _authorize(self, response: Response) -> bool:
        """Answer a 401 challenge; False when there is nothing to answer it with."""
        scheme, params = _challenge(response.header("WWW-Authenticate"))
        with self._auth_lock:
            if scheme == "basic":
                if self._credentials is None:
                    return False
                user, secret = self._credentials
                token = base64.b64encode(f"{user}:{secret}".encode()).decode()
                self._authorization = f"Basic {token}"
                return True
            if scheme == "bearer" and params.get("realm"):
                self._authorization = f"Bearer {self._bearer(params)}"
                return True
        return False

    def _bearer(self, params: dict[str, str]) -> str:
        query = {k: v for k, v in params.items() if k in ("service", "scope")}
        query.setdefault("scope", f"repository:{self.ref.repository}:pull,push")
        url = params["realm"] + "?" + urllib.parse.urlencode(query)
        headers = {}
        if self._credentials is not None:
            user, secret = self._credentials
            headers["Authorization"] = (
                "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()
            )
        response = self._send("GET", url, None, headers)
        if response.status != 200:
            response.read()
            raise RegistryError(
                f"{self.ref.name}: the registry's token service refused a token (HTTP "
                f"{response.status}); check the credentials",
                response.status,
            )
        try:
            doc = json.loads(response.read(1024 * 1024))
            return str(doc.get("token") or doc["access_token"])
        except (ValueError, KeyError, TypeError):
            raise RegistryError(f"{self.ref.name}: the token service sent no token") from None

    def _api(self, kind: str, ref: str) -> str:
        return self.url(f"/v2/{self.ref.repository}/{kind}/{ref}")

    # -- the distribution API -----------------------------------------------------------------

    def ping(self) -> None:
        """``GET /v2/``: reachable, speaks the API, and our credentials are accepted."""
        self.request("GET", self.url("/v2/"), what=self.ref.name).read()

    def blob_size(self, digest: str) -> int | None:
        """The size of a blob the repository holds, or None (``HEAD``)."""
        response = self.request(
            "HEAD", self._api("blobs", digest), ok=(200, 404), what=self.where(digest)
        )
        response.read()
        return int(response.header("Content-Length") or 0) if response.status == 200 else None

    def start_upload(self) -> str:
        response = self.request(
            "POST", self._api("blobs", "uploads/"), body=b"", ok=(202,), what=self.ref.name
        )
        response.read()
        return self._location(response)

    def append(self, location: str, start: int, data: memoryview) -> str:
        """``PATCH`` the bytes of an upload from ``start`` on (``Content-Range``, which the
        OCI distribution spec asks of chunked uploads); returns the upload's next location."""
        end = start + len(data) - 1
        response = self.request(
            "PATCH",
            self.url(location),
            body=data,
            headers={"Content-Type": "application/octet-stream", "Content-Range": f"{start}-{end}"},
            ok=(202,),
            what=self.ref.name,
        )
        response.read()
        return self._location(response)

    def finish_upload(self, location: str, digest: str, data: memoryview | bytes = b"") -> None:
        """``PUT ...?digest=``: the registry checks the digest and only then stores the blob."""
        url = self.url(location)
        url += ("&" if "?" in url else "?") + urllib.parse.urlencode({"digest": digest})
        headers = {"Content-Type": "application/octet-stream"}
        self.request(
            "PUT", url, body=data, headers=headers, ok=(201,), what=self.where(digest)
        ).read()

    def cancel_upload(self, location: str) -> None:
        # An upload left behind (this failing too) expires in the registry (its purge policy).
        with contextlib.suppress(RegistryError):
            self.request("DELETE", self.url(location), ok=(204, 404), what=self.ref.name).read()

    def put_blob(self, data: bytes) -> tuple[str, bool]:
        """A small blob in one request unless the registry has it: (digest, uploaded)."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.blob_size(digest) == len(data):
            return digest, False
        self.finish_upload(self.start_upload(), digest, data)
        return digest, True

    def get_manifest(self, reference: str) -> tuple[bytes, str] | None:
        """(manifest bytes, their digest) of a tag or digest, or None when absent; a manifest
        asked for by digest must hash to it."""
        response = self.request(
            "GET",
            self._api("manifests", reference),
            headers={"Accept": MANIFEST_ACCEPT},
            ok=(200, 404),
            what=f"{self.ref.name}:{reference}",
        )
        if response.status == 404:
            response.read()
            return None
        body = response.read(MAX_MANIFEST_BYTES + 1)
        if len(body) > MAX_MANIFEST_BYTES:
            raise RegistryError(f"{self.ref.name}:{reference}: the manifest exceeds 4 MiB")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise RegistryError(
                f"{self.ref.name}@{reference}: the registry sent a manifest that hashes to "
                f"{digest}; refusing it"
            )
        return body, digest

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> str:
        """Store a manifest under a tag; returns its digest (what the registry confirms)."""
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        response = self.request(
            "PUT",
            self._api("manifests", reference),
            body=body,
            headers={"Content-Type": media_type},
            ok=(201,),
            what=f"{self.ref.name}:{reference}",
        )
        response.read()
        confirmed = response.header("Docker-Content-Digest")
        if confirmed and confirmed != digest:
            raise RegistryError(
                f"{self.ref.name}:{reference}: the registry stored digest {confirmed}, not {digest}"
            )
        return digest

    def read_range(self, digest: str, offset: int, view: memoryview) -> None:
        """Bytes ``offset..offset+len(view)`` of a blob (ranged ``GET``), exactly."""
        if not len(view):
            return
        end = offset + len(view) - 1
        response = self.request(
            "GET",
            self._api("blobs", digest),
            headers={"Range": f"bytes={offset}-{end}"},
            ok=(206, 200),
            what=self.where(digest),
        )
        skip = offset if response.status == 200 else 0  # a registry that ignores Range
        while skip and (block := response.read(min(skip, READ_BLOCK))):
            skip -= len(block)
        got = 0
        while got < len(view) and (n := response.raw.readinto(view[got:])):
            got += n
        if response.status == 200:  # the rest of the whole blob is not wanted
            self._drop_connection(urllib.parse.urlsplit(self.base).netloc, self.scheme)
        else:
            response.read()
        if got != len(view):
            raise RegistryError(
                f"{self.where(digest)}: the blob ended after {offset + got} bytes, {end + 1} "
                "were expected; it is truncated"
            )

    def stream_blob(self, digest: str) -> Iterator[bytes]:
        """A whole blob, block by block (the caller hashes it against ``digest``)."""
        response = self.request("GET", self._api("blobs", digest), what=self.where(digest))
        while block := response.read(READ_BLOCK):
            yield block

    def where(self, digest: str) -> str:
        return f"{self.ref.name}@{digest}"

    def _location(self, response: Response) -> str:
        location = response.header("Location")
        if not location:
            raise RegistryError(f"{self.ref.name}: the registry sent no upload Location")
        return location


def _reason(error: Exception | None) -> str:
    text = str(error) if error is not None else "unknown"
    return text.splitlines()[0][:200] if text else "no detail"
