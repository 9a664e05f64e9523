"""The ``modelstage`` command: stage, verify, demo.

Contract with Kubernetes: on failure the last line printed is one human-readable reason (the
pod's termination message under ``FallbackToLogsOnError``); on success it is a one-line JSON
summary, also written to the termination-log file when one exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import ModelstageError, SpecError
from .layouts import DEFAULT_VLLM_VERSION

TERMINATION_LOG = "/dev/termination-log"


def _stage(args: argparse.Namespace) -> dict[str, Any]:
    from .scale_out import Group, finalize, stage_group
    from .stage import FORMATS, StageRequest, stage

    assert args.format in FORMATS
    group = Group.parse(args.group) if args.group else Group.from_env(os.environ)
    if args.command == "finalize" and args.group:
        raise SpecError("finalize checks and publishes every group's parts; drop --group")
    request = StageRequest(
        source=args.source,
        out=args.out,
        tp=args.tp,
        pp=args.pp,
        dtype=args.dtype,
        format=args.format,
        vllm_version=args.vllm_version,
        digest=args.digest,
        revision=args.revision,
        source_uri=args.source_uri,
        hf_token_file=args.hf_token_file,
        cache_dir=args.cache_dir,
        s3=_s3_options(args),
        max_part_bytes=args.max_part_bytes,
        allow_pickle=args.allow_pickle,
    )
    if args.command == "finalize":
        return finalize(request)
    if group is not None:
        return stage_group(request, group)
    return stage(request)


def _s3_options(args: argparse.Namespace) -> Any:
    from .s3_client import S3Options

    return S3Options(
        endpoint_url=args.s3_endpoint,
        region=args.s3_region,
        path_style=args.s3_path_style,
        ca_bundle=args.s3_ca_bundle,
        credentials_file=args.s3_credentials_file,
    )


def _add_s3_options(parser: argparse.ArgumentParser) -> None:
    """Flags for s3:// locations; credentials come from AWS_* variables or a mounted file."""
    group = parser.add_argument_group("S3 (for s3:// locations)")
    group.add_argument("--s3-endpoint", help="endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    group.add_argument("--s3-region", help="region (default: AWS_REGION, else us-east-1)")
    group.add_argument(
        "--s3-path-style", action="store_true",
        help="path-style addressing (most S3-compatible servers) instead of virtual-hosted",
    )  # fmt: skip
    group.add_argument("--s3-ca-bundle", help="PEM file of CAs to trust for the endpoint")
    group.add_argument(
        "--s3-credentials-file",
        help="a mounted Secret: a directory with aws_access_key_id and aws_secret_access_key "
        "files, or an INI file like ~/.aws/credentials ([default]); default: AWS_* variables",
    )


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    from .manifest import verify_directory

    if args.artifact.startswith("s3://"):
        from .destinations.s3 import S3Destination

        manifest = S3Destination(args.artifact, _s3_options(args)).verify(
            digest=args.digest, tp=args.tp, hash_content=not args.sizes_only
        )
    else:
        manifest = verify_directory(
            Path(args.artifact), digest=args.digest, tp=args.tp, hash_content=not args.sizes_only
        )
    return {
        "verified": str(args.artifact),
        "digest": manifest.digest,
        "format": manifest.format,
        "tensorParallelSize": manifest.tensorParallelSize,
        "files": len(manifest.files),
        "bytes": manifest.bytes,
    }


def _demo(args: argparse.Namespace) -> dict[str, Any]:
    """The README's embedded default: generate, stage at TP=2, verify, summarise."""
    from .manifest import verify_directory
    from .progress import human_bytes
    from .stage import StageRequest, stage
    from .synthetic import llama_demo, write_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="modelstage-demo-"))
    source = write_checkpoint(llama_demo(), work / "checkpoint")
    print(f"demo: generated a Llama-shaped checkpoint in {source}", file=sys.stderr)
    out = work / "artifact"
    summary = stage(StageRequest(source=str(source), out=str(out), tp=args.tp))
    verify_directory(out)
    rate = summary["bytes"] / max(summary["seconds"], 1e-9)
    print(
        f"demo: staged {human_bytes(summary['bytes'])} into {summary['files']} files at TP="
        f"{args.tp} in {summary['seconds']:.2f} s ({human_bytes(rate)}/s); verified {out}",
        file=sys.stderr,
    )
    return {**summary, "verified": True}


# --- prepare (issue 9: the serving pod's initContainer) --------------------------------------
def _prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Check the artifact, then copy the loader plugin where vLLM finds it (prepare.py)."""
    from .prepare import prepare

    return prepare(
        args.artifact,
        digest=args.digest,
        tp=args.tp,
        plugin_dir=Path(args.plugin_dir),
        hash_content=args.hash,
        s3=_s3_options(args) if args.artifact.startswith("s3://") else None,
    )


def _add_prepare_parser(sub: Any) -> None:
    pr = sub.add_parser(
        "prepare", help="initContainer: verify the artifact and install the vLLM loader plugin"
    )
    pr.add_argument("--artifact", required=True, help="artifact directory or s3://BUCKET/PREFIX/")
    pr.add_argument("--digest", required=True, help="the digest the workload expects")
    pr.add_argument("--tp", type=int, required=True, help="the workload's tensor parallel size")
    pr.add_argument("--plugin-dir", required=True, help="where to copy the plugin (PYTHONPATH)")
    pr.add_argument(
        "--hash", action="store_true",
        help="also hash every byte against the manifest (reads every file; the loader plugin "
        "verifies what each rank reads as it streams in anyway)",
    )  # fmt: skip
    _add_s3_options(pr)
    pr.set_defaults(run=_prepare)


# --- end prepare -----------------------------------------------------------------------------


# --- delete (issue 5: the operator's clean-up Job) -------------------------------------------
def _delete(args: argparse.Namespace) -> dict[str, Any]:
    """Remove one artifact, manifest first (delete.py)."""
    from .delete import delete_artifact

    s3 = _s3_options(args) if args.artifact.startswith("s3://") else None
    return delete_artifact(args.artifact, digest=args.digest, s3=s3)


def _add_delete_parser(sub: Any) -> None:
    de = sub.add_parser("delete", help="delete one artifact (manifest first); idempotent")
    de.add_argument("--artifact", required=True, help="artifact directory or s3://BUCKET/PREFIX/")
    de.add_argument("--digest", help="refuse unless the location is this artifact")
    _add_s3_options(de)
    de.set_defaults(run=_delete)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelstage", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    st = sub.add_parser(
        "stage", aliases=["finalize"],
        help="pre-shard a checkpoint per tensor-parallel rank; as `finalize` (same arguments): "
        "check the parts that `stage --group` workers wrote and publish the artifact",
    )  # fmt: skip
    st.add_argument(
        "source",
        help="checkpoint in Hugging Face layout: a local directory, s3://BUCKET/PREFIX or "
        "hf://ORG/NAME",
    )
    st.add_argument("--tp", type=int, required=True, help="tensor parallel size")
    st.add_argument("--pp", type=int, default=1, help="pipeline parallel size (1 only, for now)")
    st.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    st.add_argument(
        "--format", default="sharded_state",
        choices=["sharded_state", "runai_streamer_sharded", "runai_streamer", "tensorizer"],
        help="the vLLM load format; sharded_state needs a local --out",
    )  # fmt: skip
    st.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, help="layout to produce")
    st.add_argument("--out", required=True, help="the artifact directory or s3://BUCKET/PREFIX/")
    st.add_argument("--digest", help="expected artifact digest (the operator passes it)")
    st.add_argument("--revision", help="source revision (recorded; hub sources resolve it)")
    st.add_argument("--source-uri", help="logical source URI when SOURCE is a mount point")
    st.add_argument(
        "--hf-token-file",
        help="hf:// sources: a mounted Secret file holding the Hub token (default: HF_TOKEN)",
    )
    st.add_argument(
        "--cache-dir", help="hf:// sources: the hub cache to download into (default: HF_HUB_CACHE)"
    )
    st.add_argument(
        "--group", metavar="I/N",
        help="scale-out worker I of N: write every rank's files of this worker's parts, no "
        "manifest (then run `finalize`); default: JOB_COMPLETION_INDEX/MODELSTAGE_WORKERS "
        "when MODELSTAGE_WORKERS is set",
    )  # fmt: skip
    st.add_argument(
        "--max-part-bytes", type=int,
        help="largest part file per rank (default: the layout's, 5 GiB); workers and finalize "
        "of one artifact must agree",
    )  # fmt: skip
    st.add_argument(
        "--allow-pickle", action="store_true",
        help="accept pickle-only weights (*.bin, *.pt): loaded with torch.load(weights_only="
        "True), converted to safetensors, then staged as usual; unpickling untrusted files "
        "is a risk, so this is off by default",
    )  # fmt: skip
    _add_s3_options(st)
    st.set_defaults(run=_stage)

    ve = sub.add_parser("verify", help="re-check an artifact against its manifest")
    ve.add_argument("artifact", help="artifact directory or s3://BUCKET/PREFIX/")
    ve.add_argument("--digest", help="fail unless the artifact has this digest")
    ve.add_argument("--tp", type=int, help="fail unless the artifact has this TP size")
    ve.add_argument("--sizes-only", action="store_true", help="skip content hashing")
    _add_s3_options(ve)
    ve.set_defaults(run=_verify)

    de = sub.add_parser("demo", help="generate a small checkpoint, stage it at TP=2, verify it")
    de.add_argument("--tp", type=int, default=2)
    de.add_argument("--workdir", help="where to put the checkpoint and artifact (default: temp)")
    de.set_defaults(run=_demo)

    _add_prepare_parser(sub)  # issue 9
    _add_delete_parser(sub)  # issue 5
    _add_bench_parser(sub)
    return parser


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from .bench import run_bench

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="modelstage-bench-"))
    try:
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


def _write_termination_log(line: str) -> None:
    path = os.environ.get("MODELSTAGE_TERMINATION_LOG", TERMINATION_LOG)
    if os.path.exists(path) and os.access(path, os.W_OK):
        with open(path, "w") as f:
            f.write(line + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], dict[str, Any]] = args.run
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
    line = json.dumps(result, sort_keys=True, separators=(",", ":"))
    sys.stderr.flush()
    print(line)
    _write_termination_log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
