"""Azure Blob settings, one client factory, error messages without credentials, retries.

Shared by every part that reads or writes ``az://CONTAINER/PREFIX`` (staging, ``verify``,
``az://`` sources), so that the endpoint and the credentials mean the same everywhere. The
SDK (``azure-storage-blob``) is imported when a client is built, never at import time: a
local run, the operator and the plugin never load it.

Credentials come from the environment, under the names Azure's own tools read (and, for the
``_NAME`` / ``_ACCOUNT_KEY`` spellings, the ones Run:ai's Azure backend reads, so one Secret
serves the stager and vLLM): ``AZURE_STORAGE_CONNECTION_STRING`` first, else
``AZURE_STORAGE_ACCOUNT`` (or ``AZURE_STORAGE_ACCOUNT_NAME``) with ``AZURE_STORAGE_KEY`` (or
``AZURE_STORAGE_ACCOUNT_KEY``) or ``AZURE_STORAGE_SAS_TOKEN``. ``AZURE_STORAGE_BLOB_ENDPOINT``
(or the connection string's ``BlobEndpoint``) points at another endpoint, e.g. the Azurite
emulator. No credential is ever part of a message: every line is redacted first.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import DestinationError, SpecError

T = TypeVar("T")

ENV_CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ENV_ACCOUNT = ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME")
ENV_KEY = ("AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY")
ENV_SAS = "AZURE_STORAGE_SAS_TOKEN"
ENV_ENDPOINT = "AZURE_STORAGE_BLOB_ENDPOINT"
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_SIG = re.compile(r"(?i)(sig|AccountKey|SharedAccessSignature)=[^&;\s'\"]+")

_HINTS = {
    "AuthenticationFailed": f"check the credentials ({ENV_CONNECTION_STRING}, or "
    f"{ENV_ACCOUNT[0]} with {ENV_KEY[0]} or {ENV_SAS})",
    "AuthorizationFailure": "the credentials may not do this; check the SAS permissions",
    "AuthorizationPermissionMismatch": "the credentials may not do this; check the SAS "
    "permissions or the role assignment",
    "ContainerNotFound": "create the container first or fix the container in the URI",
    "InvalidResourceName": "container names are 3-63 lower-case letters, digits and dashes",
}


@dataclass(frozen=True)
class AzureLocation:
    container: str
    prefix: str
    """Without leading or trailing slash; may be empty for a whole container."""

    @staticmethod
    def parse(uri: str) -> AzureLocation:
        if not uri.startswith("az://"):
            raise SpecError(f"{uri!r} is not an az:// URI")
        container, _, prefix = uri.removeprefix("az://").partition("/")
        if not container or "@" in container or ":" in container or "?" in uri:
            # a SAS in the query or user:key@ would put a credential into every log line
            raise SpecError(
                f"az://{container.rpartition('@')[2].partition('?')[0]}: expected "
                "az://CONTAINER/PREFIX; credentials never go into the URI (use the "
                f"{ENV_CONNECTION_STRING} or {ENV_ACCOUNT[0]} / {ENV_KEY[0]} variables)"
            )
        return AzureLocation(container, prefix.strip("/"))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def uri(self) -> str:
        base = f"az://{self.container}/"
        return f"{base}{self.prefix}/" if self.prefix else base


@dataclass(frozen=True)
class AzureOptions:
    """How to reach the account; the credentials are the environment's (``from_env``)."""

    connection_string: str | None = field(default=None, repr=False)
    account: str | None = None
    key: str | None = field(default=None, repr=False)
    sas_token: str | None = field(default=None, repr=False)
    endpoint: str | None = None
    """The blob endpoint, e.g. ``http://127.0.0.1:10000/devstoreaccount1`` for Azurite."""
    ca_bundle: str | None = None
    """A PEM file of CAs to trust for the endpoint (default: the system's and
    ``REQUESTS_CA_BUNDLE``)."""
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    """Seconds without a byte of an answer; then the SDK retries the request."""
    max_attempts: int = 6
    """The SDK's attempts per request (exponential backoff on 5xx, throttling, timeouts:
    about 35 s of waiting in all before a request is given up)."""
    block_bytes: int = 16 * 1024 * 1024
    """Block size of uploads; memory is about (open blobs + concurrency) x block_bytes."""
    concurrency: int = 8
    """Blocks (uploads) or ranges (reads) in flight at once."""

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None, **settings: Any) -> AzureOptions:
        env = os.environ if env is None else env

        def first(names: tuple[str, ...]) -> str | None:
            return next((env[n] for n in names if env.get(n)), None)

        return AzureOptions(
            connection_string=env.get(ENV_CONNECTION_STRING) or None,
            account=first(ENV_ACCOUNT),
            key=first(ENV_KEY),
            sas_token=(env.get(ENV_SAS) or "").lstrip("?") or None,
            endpoint=env.get(ENV_ENDPOINT) or None,
            **settings,
        )

    def secrets(self) -> tuple[str, ...]:
        found = [self.connection_string, self.key, self.sas_token]
        for part in (self.connection_string or "").split(";"):
            name, _, value = part.partition("=")
            if name.strip() in ("AccountKey", "SharedAccessSignature") and value:
                found.append(value)
        return tuple(s for s in found if s)


class AzureClient:
    """A container client plus what is needed to report its errors without leaking secrets."""

    def __init__(self, options: AzureOptions, container: str) -> None:
        from azure.storage.blob import ContainerClient, ExponentialRetry

        # The SDK's request log (INFO) names URLs; nothing of it is wanted in a stager's log.
        logging.getLogger("azure").setLevel(logging.WARNING)
        self.options = options
        self._secrets = options.secrets()
        kwargs: dict[str, Any] = {
            "retry_policy": ExponentialRetry(
                initial_backoff=1,
                increment_base=2,
                retry_total=options.max_attempts - 1,
                random_jitter_range=1,
            ),
            "connection_timeout": options.connect_timeout,
            "read_timeout": options.read_timeout,
            "max_single_get_size": options.block_bytes,
            "max_chunk_get_size": options.block_bytes,
            "connection_data_block_size": 1024 * 1024,
        }
        if options.ca_bundle:
            kwargs["connection_verify"] = options.ca_bundle
        if options.connection_string:
            conn = options.connection_string
            if options.endpoint and "BlobEndpoint=" not in conn:
                conn = f"{conn.rstrip(';')};BlobEndpoint={options.endpoint}"
            self.client: Any = ContainerClient.from_connection_string(conn, container, **kwargs)
        else:
            url, credential = self._account(options)
            self.client = ContainerClient(url, container, credential=credential, **kwargs)
        self.container = container

    @staticmethod
    def _account(options: AzureOptions) -> tuple[str, Any]:
        if not options.account:
            raise SpecError(
                f"az:// needs credentials: set {ENV_CONNECTION_STRING}, or {ENV_ACCOUNT[0]} "
                f"with {ENV_KEY[0]} or {ENV_SAS}"
            )
        url = options.endpoint or f"https://{options.account}.blob.core.windows.net"
        if "@" in url.partition("://")[2].partition("/")[0]:
            raise SpecError(
                f"{ENV_ENDPOINT}: credentials never go into the endpoint URL; use "
                f"{ENV_KEY[0]} or {ENV_SAS}"
            )
        if options.key:
            return url, {"account_name": options.account, "account_key": options.key}
        if options.sas_token:
            return url, options.sas_token
        try:
            from azure.identity import DefaultAzureCredential  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise SpecError(
                f"az://: {ENV_ACCOUNT[0]} is set without {ENV_KEY[0]} or {ENV_SAS}; set one "
                "(or install azure-identity for workload identity)"
            ) from None
        return url, DefaultAzureCredential()

    def blob(self, name: str) -> Any:
        return self.client.get_blob_client(name)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _SIG.sub(lambda m: f"{m.group(1)}=***", text)

    def error(self, e: BaseException, what: str) -> DestinationError:
        """One actionable line for a failed call on ``what`` (an az:// URI)."""
        from azure.core.exceptions import HttpResponseError, ServiceRequestError

        if isinstance(e, HttpResponseError):
            raw = getattr(e, "error_code", None)
            code = str(getattr(raw, "value", raw) or e.reason or "?")
            hint = _HINTS.get(code, "")
            line = f"{what}: request failed: {code} (HTTP {e.status_code})"
            line += f"; {hint}" if hint else ""
        elif isinstance(e, ServiceRequestError):
            line = f"{what}: cannot reach {self.endpoint}; check {ENV_ENDPOINT} or the account"
        else:
            line = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return DestinationError(self.redact(line))

    @property
    def endpoint(self) -> str:
        return self.redact(str(self.client.primary_endpoint).partition("?")[0])


def is_retryable(e: BaseException) -> bool:
    """Throttling, timeouts, 5xx and dropped connections are transient; nothing else is."""
    from azure.core.exceptions import (
        HttpResponseError,
        IncompleteReadError,
        ServiceRequestError,
        ServiceResponseError,
    )

    if isinstance(e, IncompleteReadError | ServiceRequestError | ServiceResponseError):
        return True
    if isinstance(e, HttpResponseError):
        return int(e.status_code or 0) in RETRYABLE_STATUS
    return isinstance(e, ConnectionError | TimeoutError)


def with_retries(
    call: Callable[[], T],
    *,
    attempts: int = 5,
    base_s: float = 0.5,
    cap_s: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``call``; on a transient error wait (exponential backoff, full jitter) and retry.
    The SDK retries each request; this outer loop keeps one block or range that outlasts
    those attempts from failing a whole upload or read."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if attempt == attempts - 1 or not is_retryable(e):
                raise
            sleep(random.uniform(0, min(cap_s, base_s * 2**attempt)))
    raise AssertionError("unreachable")


class _ViewWriter:
    """The writable stream the SDK's downloader fills: the caller's buffer, in order."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def write(self, data: bytes) -> int:
        n = len(data)
        if self.pos + n > len(self.view):
            raise ValueError("the blob answered more bytes than the range asked for")
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n

    def seekable(self) -> bool:
        return False


def get_range_into(az: AzureClient, name: str, etag: str, offset: int, view: memoryview) -> None:
    """One ranged read of exactly ``view``'s bytes of blob ``name``, conditional on ``etag``
    (a replaced blob answers 412: ``precondition_failed``). Transient failures, also in the
    middle of the body, retry the whole range; a short answer is an error."""
    if not len(view):
        return
    from azure.core import MatchConditions

    def fetch() -> None:
        conditions: dict[str, Any] = (
            {"etag": etag, "match_condition": MatchConditions.IfNotModified} if etag else {}
        )
        stream = az.blob(name).download_blob(
            offset=offset, length=len(view), max_concurrency=1, **conditions
        )
        writer = _ViewWriter(view)
        stream.readinto(writer)
        if writer.pos != len(view):
            from azure.core.exceptions import IncompleteReadError

            raise IncompleteReadError(message=f"{writer.pos} of {len(view)} bytes")

    with_retries(fetch)


def get_blob(az: AzureClient, name: str, limit: int | None = None) -> bytes | None:
    """A whole (small) blob, at most ``limit`` bytes of it; None when there is none."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        return bytes(az.blob(name).download_blob(offset=0, length=limit).readall())
    except ResourceNotFoundError:
        return None
    except Exception as e:
        if getattr(e, "status_code", None) == 416:  # an empty blob has no range 0-limit
            return b""
        raise


def precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` is Azure's answer to an ``If-Match`` that no longer holds."""
    return getattr(e, "status_code", None) == 412
