"""S3 faults injected by a loopback proxy (support/fault_proxy.py) in front of a real S3
server: throttling, slow responses, the server stopped in the middle of an upload or a
download, for a while or for good.

What each test proves: transient faults are retried with backoff and the run finishes with
the same bytes as an undisturbed run; a fault that outlasts the retry budget fails with one
clear line, within a bounded time, and publishes nothing (no manifest, ``verify`` fails); a
rerun once the server is back resumes and publishes the same bytes. Never a corrupt artifact.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import ModelstageError
from modelstage.core.location import open_artifact, verify, verify_directory
from modelstage.core.manifest import MANIFEST, TIMING_FIELDS
from modelstage.core.s3_client import S3Options
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.fault_proxy import DOWN_PIECE_BYTES, FaultProxy, fault_proxy
from support.s3_server import S3Server

MiB = 1024 * 1024
FAIL_FAST = {"max_attempts": 2}
"""botocore attempts per request for the give-up tests; the outer part retry loop remains."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~29 MB of weights: rank files of ~14 MB, three 5 MiB parts each."""
    spec = SyntheticModel(hidden_size=512, intermediate_size=1536, num_layers=2,
                          vocab_size=4000, num_shards=3, split_fused=True)  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("s3faults") / "ckpt")


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with fault_proxy(s3.endpoint) as p:
        yield p


def options(s3: S3Server, endpoint: str, **kw: Any) -> S3Options:
    return S3Options(endpoint_url=endpoint, region=s3.region, path_style=True,
                     credentials_file=str(s3.credentials_file), part_bytes=5 * MiB,
                     concurrency=4, **kw)  # fmt: skip


def upload(src: Path, out: str, opts: S3Options) -> dict[str, Any]:
    return stage(StageRequest(source=str(src), out=out, tp=2, format="runai_streamer_sharded",
                              s3=opts))  # fmt: skip


def objects(s3: S3Server, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
    return {k[len(prefix) :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def comparable(files: dict[str, bytes]) -> dict[str, Any]:
    """Objects by name, the manifest without its timing fields."""
    import json

    out: dict[str, Any] = dict(files)
    if MANIFEST in out:
        out[MANIFEST] = {k: v for k, v in json.loads(out[MANIFEST]).items() if k not in TIMING_FIELDS}
    return out


@pytest.fixture(scope="module")
def reference(s3: S3Server, ckpt: Path) -> dict[str, Any]:
    """The objects of an undisturbed upload, straight to the server."""
    s3.create_bucket("rel-s3faults-ref")
    upload(ckpt, "s3://rel-s3faults-ref/ref/", options(s3, s3.endpoint))
    return comparable(objects(s3, "rel-s3faults-ref", "ref/"))


def assert_nothing_published(s3: S3Server, bucket: str, prefix: str) -> None:
    assert MANIFEST not in objects(s3, bucket, prefix)
    with pytest.raises(ModelstageError, match="incomplete"):
        verify(open_artifact(f"s3://{bucket}/{prefix}", s3.options()))


def in_background(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["summary"] = call()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_for(condition: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_throttled_requests_are_retried_and_the_upload_is_byte_identical(
    s3: S3Server, bucket: str, ckpt: Path, proxy: FaultProxy, reference: dict[str, Any]
) -> None:
    proxy.throttle(8, every=2)  # every other request is refused until 8 were
    upload(ckpt, f"s3://{bucket}/t/", options(s3, proxy.endpoint))
    assert proxy.throttled == 8
    assert comparable(objects(s3, bucket, "t/")) == reference
    verify(open_artifact(f"s3://{bucket}/t/", s3.options()), hash_content=True)


def test_endless_throttling_fails_clearly_within_the_budget_and_publishes_nothing(
    s3: S3Server, bucket: str, ckpt: Path, proxy: FaultProxy
) -> None:
    proxy.throttle(10**9)
    started = time.monotonic()
    with pytest.raises(ModelstageError, match=r"SlowDown \(HTTP 503\)") as raised:
        upload(ckpt, f"s3://{bucket}/e/", options(s3, proxy.endpoint, **FAIL_FAST))
    assert time.monotonic() - started < 60
    assert "\n" not in str(raised.value) and f"s3://{bucket}/e/" in str(raised.value)
    assert proxy.throttled >= 2  # retried, then gave up
    assert_nothing_published(s3, bucket, "e/")


def test_slow_responses_do_not_break_the_upload(
    s3: S3Server, bucket: str, ckpt: Path, proxy: FaultProxy, reference: dict[str, Any]
) -> None:
    proxy.delay_s = 0.05  # every response chunk 50 ms late
    upload(ckpt, f"s3://{bucket}/slow/", options(s3, proxy.endpoint))
    assert comparable(objects(s3, bucket, "slow/")) == reference


def test_server_stopped_mid_upload_for_a_moment_is_ridden_out_by_retries(
    s3: S3Server, bucket: str, ckpt: Path, proxy: FaultProxy, reference: dict[str, Any]
) -> None:
    thread, result = in_background(
        lambda: upload(ckpt, f"s3://{bucket}/m/", options(s3, proxy.endpoint))
    )
    wait_for(lambda: proxy.bytes_up > 8 * MiB)
    proxy.down()  # connections reset, new ones refused
    time.sleep(1.5)
    proxy.up()
    thread.join(timeout=180)
    assert "error" not in result, result.get("error")
    assert comparable(objects(s3, bucket, "m/")) == reference


def test_server_gone_mid_upload_fails_clearly_and_a_rerun_resumes_byte_identical(
    s3: S3Server, bucket: str, ckpt: Path, proxy: FaultProxy, reference: dict[str, Any]
) -> None:
    out = f"s3://{bucket}/g/"
    # the server goes away when the first small file is written: every rank object is done
    proxy.down_on_request("/g/config.json")
    thread, result = in_background(lambda: upload(ckpt, out, options(s3, proxy.endpoint,
                                                                     **FAIL_FAST)))  # fmt: skip
    thread.join(timeout=120)
    assert not thread.is_alive(), "the stager kept trying past its retry budget"
    error = result.get("error")
    assert isinstance(error, ModelstageError), error
    assert str(error) == (
        f"{out}config.json: cannot reach {proxy.endpoint}; check --s3-endpoint / AWS_ENDPOINT_URL"
    )
    assert_nothing_published(s3, bucket, "g/")
    before = objects(s3, bucket, "g/")

    proxy.up()
    sent = proxy.bytes_up
    upload(ckpt, out, options(s3, proxy.endpoint))
    assert comparable(objects(s3, bucket, "g/")) == reference
    resent = proxy.bytes_up - sent
    reused = sum(len(v) for k, v in before.items() if k.startswith("model-rank-"))
    assert reused > 20 * MiB and resent < MiB, "the rerun uploaded finished objects again"
    assert not s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.fixture(scope="module")
def s3_source(s3: S3Server, ckpt: Path) -> str:
    """The checkpoint uploaded as an ``s3://`` source."""
    s3.create_bucket("rel-s3faults-src")
    client = s3.client()
    for path in sorted(ckpt.iterdir()):
        client.put_object(Bucket="rel-s3faults-src", Key=f"ckpt/{path.name}", Body=path.read_bytes())
    return "s3://rel-s3faults-src/ckpt/"


def download(src: str, out: Path, opts: S3Options) -> dict[str, Any]:
    return stage(StageRequest(source=src, out=str(out), tp=2, s3=opts))


def local_files(directory: Path) -> dict[str, Any]:
    return comparable({p.name: p.read_bytes() for p in directory.iterdir()})


def test_connections_cut_mid_download_are_retried_and_the_artifact_is_identical(
    s3: S3Server, s3_source: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    download(s3_source, tmp_path / "ref", options(s3, s3.endpoint))
    weights = sum(p.stat().st_size for p in (tmp_path / "ref").glob("*.safetensors"))
    for fired, cut in enumerate((3 * MiB, 9 * MiB, 17 * MiB), start=1):
        assert cut < weights, "the cut must fall inside the download"
        proxy.cut_after_bytes(cut)  # counted from now, in this download
        download(s3_source, tmp_path / f"cut{cut}", options(s3, proxy.endpoint))
        assert proxy.cuts == fired, f"the cut after {cut} bytes of download {fired} never fired"
        landed = proxy.cut_log[-1]
        assert landed.after == cut and cut <= landed.offset < cut + DOWN_PIECE_BYTES, (
            f"armed to cut {cut} bytes into download {fired}, it cut at {landed.offset}"
        )
        verify_directory(tmp_path / f"cut{cut}")
        assert local_files(tmp_path / f"cut{cut}") == local_files(tmp_path / "ref")


def test_server_gone_mid_download_fails_clearly_and_publishes_nothing(
    s3: S3Server, s3_source: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    out = tmp_path / "gone"
    thread, result = in_background(
        lambda: download(s3_source, out, options(s3, proxy.endpoint, **FAIL_FAST))
    )
    wait_for(lambda: proxy.bytes_down > 6 * MiB)
    proxy.down()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the stager kept trying past its retry budget"
    error = result.get("error")
    assert isinstance(error, ModelstageError), error
    # the weight file being read when the server went: which one depends on the scheduling
    assert re.fullmatch(
        rf"{re.escape(s3_source)}model-0000[1-3]-of-00003\.safetensors: cannot reach "
        rf"{re.escape(proxy.endpoint)}; check --s3-endpoint / AWS_ENDPOINT_URL",
        str(error),
    ), str(error)
    assert not out.exists()
    assert not list(tmp_path.glob("gone.tmp-*")), "the failed run left its work directory"
