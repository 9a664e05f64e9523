"""S3 settings and retry policy, without a server: URI parsing, credentials files, retries."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from modelstage.core.errors import SpecError
from modelstage.core.s3_client import S3Location, is_retryable, load_credentials, with_retries


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "UploadPart",
    )


def test_throttling_5xx_and_dropped_connections_are_retried_until_success() -> None:
    failures = [client_error("SlowDown", 503), client_error("InternalError", 500),
                EndpointConnectionError(endpoint_url="http://127.0.0.1:1")]  # fmt: skip
    waits: list[float] = []

    def call() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    assert with_retries(call, attempts=4, base_s=1.0, sleep=waits.append) == "ok"
    assert len(waits) == 3
    assert all(0 <= w <= 2**i for i, w in enumerate(waits))  # full jitter under the cap


def test_client_errors_are_not_retried() -> None:
    calls: list[int] = []

    def call() -> None:
        calls.append(1)
        raise client_error("AccessDenied", 403)

    with pytest.raises(ClientError):
        with_retries(call, attempts=5, sleep=lambda _: None)
    assert calls == [1]


def test_retries_give_up_after_the_last_attempt() -> None:
    calls: list[int] = []

    def call() -> None:
        calls.append(1)
        raise client_error("SlowDown", 503)

    with pytest.raises(ClientError):
        with_retries(call, attempts=3, sleep=lambda _: None)
    assert len(calls) == 3


def test_unknown_5xx_codes_count_as_transient() -> None:
    assert is_retryable(client_error("WhateverTheGatewaySaid", 502))
    assert not is_retryable(client_error("NoSuchBucket", 404))


def test_s3_uris_never_carry_credentials() -> None:
    with pytest.raises(SpecError, match="credentials never go into the URI"):
        S3Location.parse("s3://AKID:secret@bucket/prefix")
    loc = S3Location.parse("s3://bucket/a/b/")
    assert (loc.bucket, loc.prefix, loc.uri, loc.key("x")) == ("bucket", "a/b", "s3://bucket/a/b/",
                                                               "a/b/x")  # fmt: skip


def test_a_secret_mounted_as_files_or_as_an_ini_file_gives_the_same_credentials(
    tmp_path: Path,
) -> None:
    files = tmp_path / "secret"
    files.mkdir()
    (files / "aws_access_key_id").write_text("AKID\n")
    (files / "aws_secret_access_key").write_text("s3cr3t\n")
    ini = tmp_path / "credentials"
    ini.write_text("[default]\naws_access_key_id = AKID\naws_secret_access_key = s3cr3t\n")
    assert load_credentials(str(files)) == load_credentials(str(ini))
    assert "s3cr3t" not in repr(load_credentials(str(ini)))
    (files / "aws_secret_access_key").unlink()
    with pytest.raises(SpecError, match="needs aws_access_key_id and aws_secret_access_key"):
        load_credentials(str(files))
