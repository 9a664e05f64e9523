"""What the serving pod tells the loader plugin, read from ``MODELSTAGE_*`` environment variables.

vLLM's stock loaders refuse unknown ``--model-loader-extra-config`` keys (``formats.py``),
so everything the plugin needs beyond vLLM's own arguments arrives by environment, set by the
operator's pod-template patch. Parsing is strict: a malformed value is a deployment bug, and a
loader that guessed would load an artifact nobody asked for. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from modelstage.core.errors import SpecError
from modelstage.core.node_cache import ENV_NODE_CACHE
from modelstage.core.s3_client import S3Options

ENV_DIGEST = "MODELSTAGE_DIGEST"
"""The artifact digest the operator rolled out; the manifest's must equal it."""
ENV_FORMAT = "MODELSTAGE_FORMAT"
"""The artifact format the operator staged (``sharded_state``, ``runai_streamer``, ...)."""
ENV_TP = "MODELSTAGE_TP"
"""The tensor parallel size the artifact was staged for; must equal vLLM's."""
ENV_ARTIFACT = "MODELSTAGE_ARTIFACT"
"""The artifact's URI, for logs and metrics only: vLLM's ``--model`` locates the files."""
ENV_METRICS_PORT = "MODELSTAGE_METRICS_PORT"
"""Base port of the per-rank metrics endpoints (rank r serves on base + r); unset: none."""
ENV_METRICS_ADDR = "MODELSTAGE_METRICS_ADDR"
"""Address the metrics endpoints bind (default ``0.0.0.0``)."""
ENV_VERIFY = "MODELSTAGE_VERIFY"
"""Content verification, on unless ``0``: every byte the rank loads is hashed against the
manifest's chunk hashes as it streams in (or in a pass before loading where the bytes move
through a reader the plugin does not own). ``0`` loads unverified, and says so in a warning
and in the ``modelstage_load_verification`` metric."""
ENV_READ_CHUNK_MIB = "MODELSTAGE_READ_CHUNK_MIB"
"""Size of one read of the pipelined reader, MiB (default 16; verifying, one hash chunk)."""
ENV_READ_DEPTH = "MODELSTAGE_READ_DEPTH"
"""Reads in flight in the pipelined reader (default 2, verifying 1: on a local disk, more
concurrent buffered reads of one file defeat the kernel's readahead; measured in
docs/performance.md)."""

ENV_S3_READER = "MODELSTAGE_S3_READER"
"""``1``: the plugin also registers its loader under vLLM's ``runai_streamer_sharded`` name and
reads S3 artifacts with its own ranged GETs (the only name vLLM accepts with ``--model s3://``
besides plain ``runai_streamer``). The operator sets it for S3 per-rank artifacts."""
ENV_S3_READ_CHUNK_MIB = "MODELSTAGE_S3_READ_CHUNK_MIB"
"""Size of one ranged GET of the S3 reader, MiB (default 32: botocore spends a few ms of CPU per
request, so on a loopback SeaweedFS 8 MiB GETs reach 0.7x of what 32 MiB ones do; CUDA ranks
pin (concurrency + 2) x this, 320 MiB by default)."""
ENV_S3_READ_CONCURRENCY = "MODELSTAGE_S3_READ_CONCURRENCY"
"""Ranged GETs in flight (default 8)."""

DEFAULT_CHUNK_MIB = 16
DEFAULT_DEPTH = 2
VERIFYING_DEPTH = 1
"""Local reads in flight while verifying: one sequential reader, which the kernel's readahead
follows, with the hashing on threads of its own; two readers whose timing the hashing shifts
read 0.6-0.7x as fast cold here (docs/performance.md)."""
DEFAULT_S3_CHUNK_MIB = 32
DEFAULT_S3_CONCURRENCY = 8
MiB = 1024 * 1024


@dataclass(frozen=True)
class PluginSettings:
    digest: str | None = None
    format: str | None = None
    tp: int | None = None
    artifact: str | None = None
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    verify: bool = True
    chunk_bytes: int | None = None
    """None: the default (``local_reads``)."""
    depth: int | None = None
    s3_reader: bool = False
    s3_chunk_bytes: int = DEFAULT_S3_CHUNK_MIB * MiB
    s3_depth: int = DEFAULT_S3_CONCURRENCY
    node_cache: str | None = None
    """This node's copy, mounted read-only (``MODELSTAGE_NODE_CACHE``): a rank reads its files
    from there when that copy is the artifact (``node_copy.py``)."""

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> PluginSettings:
        env = os.environ if env is None else env
        return PluginSettings(
            digest=env.get(ENV_DIGEST) or None,
            format=env.get(ENV_FORMAT) or None,
            tp=_int(env, ENV_TP, minimum=1),
            artifact=env.get(ENV_ARTIFACT) or None,
            metrics_port=_int(env, ENV_METRICS_PORT, minimum=1, maximum=65535),
            metrics_addr=env.get(ENV_METRICS_ADDR) or "0.0.0.0",
            verify=_flag(env, ENV_VERIFY, default=True),
            chunk_bytes=(_int(env, ENV_READ_CHUNK_MIB, minimum=1) or 0) * MiB or None,
            depth=_int(env, ENV_READ_DEPTH, minimum=1, maximum=64),
            s3_reader=_flag(env, ENV_S3_READER),
            s3_chunk_bytes=(_int(env, ENV_S3_READ_CHUNK_MIB, minimum=1) or DEFAULT_S3_CHUNK_MIB)
            * MiB,
            s3_depth=_int(env, ENV_S3_READ_CONCURRENCY, minimum=1, maximum=64)
            or DEFAULT_S3_CONCURRENCY,
            node_cache=env.get(ENV_NODE_CACHE) or None,
        )


def local_reads(settings: PluginSettings, hash_chunk: int | None) -> tuple[int, int]:
    """(read size, reads in flight) of the local reader: the settings where given; else, when
    verifying (``hash_chunk``: the largest hash chunk), one read of one chunk at a time
    (``VERIFYING_DEPTH``), else 16 MiB reads, two in flight."""
    if hash_chunk is None:
        return settings.chunk_bytes or DEFAULT_CHUNK_MIB * MiB, settings.depth or DEFAULT_DEPTH
    return settings.chunk_bytes or hash_chunk, settings.depth or VERIFYING_DEPTH


def serving_s3_options(env: Mapping[str, str] | None = None) -> S3Options:
    """The S3 connection a serving pod is given for vLLM's Run:ai streamer (the operator's
    ``AWS_*`` / ``RUNAI_STREAMER_S3_*`` variables), so the plugin reads where Run:ai would.
    Credentials stay with boto3's own chain (``AWS_*`` variables, web identity, profiles)."""
    env = os.environ if env is None else env
    endpoint = (
        env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
        or env.get("RUNAI_STREAMER_S3_ENDPOINT")
        or None
    )
    virtual = env.get("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "").strip().lower()
    return S3Options(
        endpoint_url=endpoint,
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        path_style=virtual in ("0", "false", "no"),
        ca_bundle=env.get("AWS_CA_BUNDLE") or None,
    )


def _int(
    env: Mapping[str, str], name: str, *, minimum: int, maximum: int | None = None
) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SpecError(f"{name}={raw!r} is not an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise SpecError(f"{name}={value} must be {bound}")
    return value


def _flag(env: Mapping[str, str], name: str, *, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise SpecError(f"{name}={raw!r} must be 1 or 0")
