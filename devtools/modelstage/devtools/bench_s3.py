"""``modelstage bench --s3 URL``: staging to and loading from S3 vs plain parallel transfers.

Baselines move the same bytes to and from the same server in the simplest fast way: an
8-way multipart PUT of each source file (the stager's part size), and 8-way ranged GETs of
each staged rank file into a reused buffer. Staging writes ``runai_streamer_sharded`` (the
per-rank S3 format); loading reads rank 0 into preallocated parameters the two ways a
serving pod can: vLLM's Run:ai path (the streamer, ``clone``, ``copy_``) and the plugin's S3
reader (``MODELSTAGE_S3_READER``: the verify phase, then ranged GETs straight into the
parameters), both verifying every chunk as it lands (its default) and not
(``MODELSTAGE_VERIFY=0``). Everything written is deleted again.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from modelstage.core.formats import FORMATS, S3_READER_FORMAT
from modelstage.core.layouts import DEFAULT_VLLM_VERSION
from modelstage.core.s3_client import S3Client, S3Location, S3Options, load_credentials
from modelstage.core.safetensors_format import read_header
from modelstage.plugin.checks import content_checker, verify_s3
from modelstage.plugin.reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes
from modelstage.plugin.settings import PluginSettings
from modelstage.plugin.stores import store_for

from .measure import Measurement, run_child, stager_argv

WAYS = 8
GET_BYTES = 8 * 1024 * 1024
FORMAT = FORMATS[S3_READER_FORMAT]
"""What is staged to S3 and read back: the per-rank format the plugin's S3 reader serves."""


def bench_s3(
    source: Path, url: str, tp: int, repeats: int, options: S3Options, s3_flags: list[str]
) -> dict[str, list[Measurement]]:
    """``s3_flags``: the stager's ``--s3-*`` flags that reach the same server."""
    location = S3Location.parse(url)
    run = f"{location.prefix}/modelstage-bench-{uuid.uuid4().hex[:8]}".strip("/")
    s3 = S3Client(options, concurrency=WAYS)
    files = sorted(p for p in source.iterdir() if p.suffix == ".safetensors")
    size = sum(p.stat().st_size for p in files)
    put = Measurement(f"{WAYS}-way multipart PUT", nbytes=size)
    staged = Measurement(f"stage {FORMAT.name} tp={tp}", nbytes=size)
    flags = ["--format", FORMAT.name, *s3_flags]
    try:
        for i in range(repeats):
            prefix = f"{run}/put-{i}"
            start = time.perf_counter()
            for path in files:
                _multipart_put(s3, location.bucket, f"{prefix}/{path.name}", path, options)
            put.seconds.append(time.perf_counter() - start)
            _delete_prefix(s3, location.bucket, prefix)
            out = f"s3://{location.bucket}/{run}/stage-{i}"
            secs, peak = run_child(stager_argv(source, out, tp, *flags))
            staged.seconds.append(secs)
            staged.peak_rss = max(staged.peak_rss, peak)
            _delete_prefix(s3, location.bucket, f"{run}/stage-{i}")
        artifact = f"{run}/load"
        run_child(stager_argv(source, f"s3://{location.bucket}/{artifact}", tp, *flags))
        loading = _bench_loading(s3, location.bucket, artifact, options, repeats, tp)
    finally:
        _delete_prefix(s3, location.bucket, run)
    return {
        "staging to S3 vs multipart PUT": [put, staged],
        f"loading rank 0 of TP={tp} from S3": loading,
    }


def _multipart_put(s3: S3Client, bucket: str, key: str, path: Path, options: S3Options) -> None:
    client, part = s3.client, options.part_bytes
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    fd = os.open(path, os.O_RDONLY)
    try:

        def send(number: int) -> dict[str, Any]:
            body = os.pread(fd, part, (number - 1) * part)
            got = client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body
            )
            return {"PartNumber": number, "ETag": got["ETag"]}

        count = max(1, -(-path.stat().st_size // part))
        with ThreadPoolExecutor(WAYS) as pool:
            parts = list(pool.map(send, range(1, count + 1)))
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
    finally:
        os.close(fd)


def _bench_loading(
    s3: S3Client, bucket: str, prefix: str, options: S3Options, repeats: int, tp: int
) -> list[Measurement]:
    listed = s3.client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]
    rank0 = sorted(
        (o["Key"], int(o["Size"])) for o in listed if "-rank-0-" in o["Key"].rsplit("/", 1)[-1]
    )
    size = sum(n for _, n in rank0)
    params = _parameters(s3, bucket, rank0)
    get = Measurement(f"{WAYS}-way ranged GET", nbytes=size)
    streamer = Measurement("Run:ai streamer (vLLM's path)", nbytes=size)
    plugin = Measurement("modelstage S3 reader, unverified", nbytes=size)
    verified = Measurement("modelstage S3 reader, verified (plugin)", nbytes=size)
    env = _runai_env(s3, options)
    for _ in range(repeats):
        start = time.perf_counter()
        _ranged_get(s3, bucket, rank0)
        get.seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        _runai_read([f"s3://{bucket}/{key}" for key, _ in rank0], params, env)
        streamer.seconds.append(time.perf_counter() - start)
        for m, verify in ((plugin, False), (verified, True)):
            start = time.perf_counter()
            _plugin_read(f"s3://{bucket}/{prefix}/", tp, params, s3, verify)
            m.seconds.append(time.perf_counter() - start)
    return [get, streamer, plugin, verified]


def _ranged_get(s3: S3Client, bucket: str, objects: list[tuple[str, int]]) -> None:
    def fetch(job: tuple[str, int]) -> None:
        key, offset = job
        rng = f"bytes={offset}-{offset + GET_BYTES - 1}"
        s3.client.get_object(Bucket=bucket, Key=key, Range=rng)["Body"].read()

    jobs = [(key, off) for key, length in objects for off in range(0, length, GET_BYTES)]
    with ThreadPoolExecutor(WAYS) as pool:
        list(pool.map(fetch, jobs))


def _parameters(s3: S3Client, bucket: str, objects: list[tuple[str, int]]) -> dict[str, Any]:
    params = {}
    for key, length in objects:

        def read(offset: int, n: int, key: str = key) -> bytes:
            rng = f"bytes={offset}-{offset + n - 1}"
            body: bytes = s3.client.get_object(Bucket=bucket, Key=key, Range=rng)["Body"].read()
            return body

        for name, info in read_header(key, length, read).tensors.items():
            params[name] = torch.zeros(info.shape, dtype=TORCH_DTYPES[info.dtype])
    return params


def _runai_env(s3: S3Client, options: S3Options) -> dict[str, str]:
    """What the Run:ai streamer needs to reach the same server (the operator sets the same);
    credentials come from the environment, or from ``--s3-credentials-file``."""
    env = {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "RUNAI_STREAMER_S3_ENDPOINT": s3.endpoint,
        "AWS_REGION": str(s3.client.meta.region_name),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    if options.credentials_file:
        creds = load_credentials(options.credentials_file)
        env["AWS_ACCESS_KEY_ID"] = creds.access_key_id
        env["AWS_SECRET_ACCESS_KEY"] = creds.secret_access_key
        if creds.session_token:
            env["AWS_SESSION_TOKEN"] = creds.session_token
    if options.path_style:
        env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
    if options.ca_bundle:
        env["AWS_CA_BUNDLE"] = options.ca_bundle
    return env


def _runai_read(uris: list[str], params: dict[str, Any], env: dict[str, str]) -> None:
    from runai_model_streamer import SafetensorsStreamer

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(uris)
            for name, tensor in streamer.get_tensors():
                params[name].copy_(tensor.clone())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _plugin_read(uri: str, tp: int, params: dict[str, Any], s3: S3Client, verify: bool) -> None:
    """Rank 0 as the plugin loads it in a pod: verify (manifest, listing, headers), then the
    pipelined reader with its S3 defaults, straight into the parameters; ``verify``: every
    chunk checked as it lands (the plugin's default)."""
    settings = PluginSettings(verify=verify)
    verified = verify_s3(
        uri,
        s3,
        load_format=FORMAT.name,
        settings=settings,
        running_tp=tp,
        vllm_version=DEFAULT_VLLM_VERSION,
        rank_glob=FORMAT.rank_glob(0),
    )
    checker = content_checker(verified) if verify else None
    reader = PipelinedReader(
        chunk_bytes=settings.s3_chunk_bytes, depth=settings.s3_depth, device=torch.device("cpu")
    )
    reader.read(store_for(verified), lambda info: Target(flat_bytes(params[info.name])), checker)


def _delete_prefix(s3: S3Client, bucket: str, prefix: str) -> None:
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
