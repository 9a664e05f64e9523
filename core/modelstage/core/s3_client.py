"""S3 settings users trip on, one client factory, error messages without credentials, retries.

Shared by every part that reads or writes S3 (staging, ``verify``, ``prepare``, the plugin's
reader, the node copy), so that endpoint, region, addressing style, CA bundle and credentials
mean the same everywhere.
S3-compatible servers (MinIO, SeaweedFS, Ceph) often reject the CRC checksums that recent
boto3 sends by default, so checksums are computed only where the API requires them.
"""

from __future__ import annotations

import configparser
import os
import random
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .errors import DestinationError, SpecError

T = TypeVar("T")

RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
    }
)
"""S3 error codes worth another try; any HTTP status >= 500 is retried too."""

_HINTS = {
    "AccessDenied": "check the credentials (--s3-credentials-file or AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY) and the bucket policy",
    "InvalidAccessKeyId": "the access key is unknown to this endpoint; check the credentials "
    "and --s3-endpoint",
    "SignatureDoesNotMatch": "the secret key does not match the access key, or the region or "
    "addressing style is wrong (--s3-region, --s3-path-style)",
    "NoSuchBucket": "create the bucket first or fix the bucket in the URI",
    "PermanentRedirect": "the bucket lives in another region; pass --s3-region",
    "AuthorizationHeaderMalformed": "the region is wrong; pass --s3-region",
}


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str
    """Without leading or trailing slash; may be empty for a whole bucket."""

    @staticmethod
    def parse(uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise SpecError(f"{uri!r} is not an s3:// URI")
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket or "@" in bucket or ":" in bucket:
            # user:secret@bucket would put a credential into every log line and status
            shown = "s3://***@" + bucket.rpartition("@")[2] if "@" in bucket else "s3://" + bucket
            raise SpecError(
                f"{shown}: expected s3://BUCKET/PREFIX; credentials never go into the URI "
                "(use AWS_* variables or --s3-credentials-file)"
            )
        return S3Location(bucket, prefix.strip("/"))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/" if self.prefix else f"s3://{self.bucket}/"


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class S3Options:
    """How to reach the store. ``None`` falls back to boto3's own sources (AWS_* variables)."""

    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = False
    ca_bundle: str | None = None
    credentials_file: str | None = None
    max_attempts: int = 8
    """botocore's attempts per request (standard mode: backoff with jitter on 5xx/throttling)."""
    connect_timeout: float = 10.0
    """Seconds to connect; then the attempt fails and botocore retries it."""
    read_timeout: float = 120.0
    """Seconds without a byte of an answer; then the attempt fails and botocore retries it.
    Longer than the Hub's default: completing a large multipart upload can take a minute.
    (``--connect-timeout`` / ``--read-timeout`` or ``MODELSTAGE_*``, network.py)."""
    part_bytes: int = 16 * 1024 * 1024
    """Multipart part size; memory is about (open objects + concurrency) x part_bytes."""
    concurrency: int = 8
    """Parts uploaded at once, over all objects being written."""


def load_credentials(path: str) -> Credentials:
    """Read credentials from a mounted Secret.

    Two shapes are accepted, both common for Kubernetes Secrets: a directory holding one file
    per key (``aws_access_key_id``, ``aws_secret_access_key``, optional ``aws_session_token``;
    the upper-case environment names work too), or a file in ``~/.aws/credentials`` INI form
    with a ``[default]`` section. Parse errors never quote the file, which holds the secret.
    """
    p = Path(path)
    if p.is_dir():

        def read(key: str) -> str | None:
            for name in (key, key.upper()):
                if (p / name).is_file():
                    return (p / name).read_text().strip() or None
            return None

        key_id, secret = read("aws_access_key_id"), read("aws_secret_access_key")
        token = read("aws_session_token")
    else:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            with open(p) as f:
                parser.read_file(f)
        except OSError as e:
            raise SpecError(f"{path}: cannot read the credentials file: {e.strerror}") from None
        except configparser.Error:
            raise SpecError(
                f"{path}: not an AWS credentials file (INI with a [default] section holding "
                "aws_access_key_id and aws_secret_access_key)"
            ) from None
        section = (
            "default" if parser.has_section("default") else next(iter(parser.sections()), None)
        )
        values = parser[section] if section else {}
        key_id, secret = values.get("aws_access_key_id"), values.get("aws_secret_access_key")
        token = values.get("aws_session_token")
    if not key_id or not secret:
        raise SpecError(
            f"{path}: needs aws_access_key_id and aws_secret_access_key (a directory with one "
            "file per key, or an INI file with a [default] section)"
        )
    return Credentials(key_id, secret, token)


def check_endpoint(url: str | None) -> None:
    """Refuse an endpoint URL with userinfo (``http://user:secret@host``): the credential
    would land in every error message and log line that names the endpoint. The refusal
    does not repeat it."""
    if not url:
        return
    netloc = urllib.parse.urlsplit(url).netloc
    if "@" in netloc:
        shown = urllib.parse.urlsplit(url)._replace(netloc="***@" + netloc.rpartition("@")[2])
        raise SpecError(
            f"S3 endpoint {shown.geturl()}: credentials never go into the endpoint URL; "
            "use AWS_* variables or --s3-credentials-file"
        )


class S3Client:
    """A boto3 S3 client plus what is needed to report its errors without leaking secrets."""

    def __init__(self, options: S3Options, *, concurrency: int = 8) -> None:
        import boto3
        from botocore.config import Config

        check_endpoint(options.endpoint_url)
        creds = load_credentials(options.credentials_file) if options.credentials_file else None
        session = boto3.session.Session(
            aws_access_key_id=creds.access_key_id if creds else None,
            aws_secret_access_key=creds.secret_access_key if creds else None,
            aws_session_token=creds.session_token if creds else None,
        )
        region = (
            options.region or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
        )
        config = Config(
            region_name=region,
            s3={"addressing_style": "path" if options.path_style else "auto"},
            retries={"mode": "standard", "max_attempts": options.max_attempts},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=concurrency + 4,
            connect_timeout=options.connect_timeout,
            read_timeout=options.read_timeout,
        )
        self.options = options
        self.client: Any = session.client(
            "s3",
            endpoint_url=options.endpoint_url,
            config=config,
            verify=options.ca_bundle if options.ca_bundle else None,
        )
        check_endpoint(self.client.meta.endpoint_url)  # also from AWS_ENDPOINT_URL*
        resolved = session.get_credentials()
        frozen = resolved.get_frozen_credentials() if resolved is not None else None
        self._secrets = tuple(
            s
            for s in (
                frozen.access_key if frozen else None,
                frozen.secret_key if frozen else None,
                frozen.token if frozen else None,
            )
            if s
        )

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def error(self, e: BaseException, what: str) -> DestinationError:
        """One actionable line for a failed call on ``what`` (an s3:// URI)."""
        from botocore.exceptions import ClientError, EndpointConnectionError, SSLError

        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", "?"))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
            op = getattr(e, "operation_name", "request")
            message = str(err.get("Message") or "").strip()
            hint = _HINTS.get(code, "")
            line = f"{what}: {op} failed: {code} (HTTP {status})"
            line += f": {message}" if message else ""
            line += f"; {hint}" if hint else ""
        elif isinstance(e, SSLError):
            line = (
                f"{what}: TLS verification failed for {self.endpoint}; pass the server's CA "
                "with --s3-ca-bundle"
            )
        elif isinstance(e, EndpointConnectionError):
            line = f"{what}: cannot reach {self.endpoint}; check --s3-endpoint / AWS_ENDPOINT_URL"
        else:
            line = f"{what}: {type(e).__name__}: {e}"
        return DestinationError(self.redact(line))

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)


def is_retryable(e: BaseException) -> bool:
    """Throttling, 5xx and dropped connections are transient; everything else is not.

    A connection that drops in the middle of a response body surfaces as botocore's
    ``IncompleteReadError`` (a ``BotoCoreError``, not an ``HTTPClientError``): it is a
    dropped connection too (tests/reliability/test_s3_faults.py cuts downloads mid-body).
    """
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
    )

    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return code in RETRYABLE_CODES or int(status) >= 500
    return isinstance(e, ConnectionError | HTTPClientError | IncompleteReadError)


def with_retries(
    call: Callable[[], T],
    *,
    attempts: int = 5,
    base_s: float = 0.5,
    cap_s: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``call``; on a transient error wait (exponential backoff, full jitter) and retry.

    botocore already retries each request; this outer loop covers part uploads, where a
    whole part failing after botocore's attempts (a long throttling episode, a restarted
    gateway) would otherwise throw away every part uploaded so far.
    """
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if attempt == attempts - 1 or not is_retryable(e):
                raise
            sleep(random.uniform(0, min(cap_s, base_s * 2**attempt)))
    raise AssertionError("unreachable")


def get_range_into(
    s3: S3Client, bucket: str, key: str, etag: str, offset: int, views: list[memoryview]
) -> None:
    """One ranged GET of exactly the views' bytes, streamed into them in order, conditional on
    ``etag`` (``If-Match``: a replaced object answers 412, see ``precondition_failed``).
    Transient failures, also in the middle of the body, retry the whole GET."""
    length = sum(len(v) for v in views)
    if not length:
        return

    def fetch() -> None:
        response = s3.client.get_object(
            Bucket=bucket, Key=key, IfMatch=etag, Range=f"bytes={offset}-{offset + length - 1}"
        )
        body = response["Body"]
        try:
            _body_into(body, views)
        finally:
            body.close()

    with_retries(fetch)


def precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` is S3's answer to an ``If-Match`` that no longer holds."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "412") or status == 412


def _body_into(body: Any, views: list[memoryview]) -> None:
    """Stream a response body into ``views``. The socket reads straight into them through
    ``http.client``'s ``readinto`` where botocore's stream exposes it (urllib3's ``readinto``
    reads into a fresh ``bytes`` and copies); otherwise ``read`` + copy. A short or broken
    body raises botocore's ``IncompleteReadError``, which ``with_retries`` retries."""
    import http.client  # here, not at the top: a local staging run never needs it (nor ssl)

    from botocore.exceptions import IncompleteReadError

    raw = getattr(getattr(body, "_raw_stream", None), "_fp", None)
    direct = isinstance(raw, http.client.HTTPResponse) and raw.getheader(
        "Content-Encoding", "identity"
    ) in ("", "identity")
    expected, done = sum(len(v) for v in views), 0
    try:
        for view in views:
            filled = 0
            while filled < len(view):
                if direct:
                    assert isinstance(raw, http.client.HTTPResponse)
                    n = raw.readinto(view[filled:])
                else:
                    data = body.read(min(len(view) - filled, 1 << 20))
                    n = len(data)
                    view[filled : filled + n] = data
                if not n:
                    raise IncompleteReadError(actual_bytes=done, expected_bytes=expected)
                filled += n
                done += n
    except (OSError, http.client.HTTPException) as e:
        raise IncompleteReadError(actual_bytes=done, expected_bytes=expected) from e
