"""``modelstage plan``: what staging (and the operator) would do, before anything is done.

Two forms, one report. For a ModelDeployment manifest, the operator's own planners
(``operator/offline_report.py``, found through its ``modelstage.planners`` entry point, so
that nothing here imports the operator): the digest and artifact location, the staging Jobs
with their command lines, the claim to create, the patched vLLM container (given the workload's
manifest) and the checks that would refuse it. For ``SOURCE --tp N --format F``, what
``modelstage stage`` would do with the same arguments. In both, given a local copy of the
checkpoint (its ``config.json`` and safetensors headers are read, never the weights), each
file of the artifact with its size, from the same shard plan the stager writes. Nothing is
contacted: no cluster, no Hub, no S3.

Where ``prepare --digest`` comes from: it is this digest. The operator computes it from the
spec and the source's resolved identity (``operator/artifact.py``; ``modelstage resolve``
prints the identity, ``--identity`` gives it to the plan, a pinned commit is its own), names
the artifact's folder or prefix and the stager Job after it, passes it to the stager as
``--digest`` and to the serving pod's ``modelstage prepare`` initContainer, which refuses an
artifact whose manifest records another. A local SOURCE is resolved here (its headers are
read); any other source without ``--identity`` plans no digest.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from modelstage.core.errors import ModelstageError, SpecError
from modelstage.core.progress import human_bytes

if TYPE_CHECKING:
    from .writers import PlannedFile


def plan_files(
    checkpoint_dir: str,
    *,
    tp: int,
    load_format: str,
    dtype: str = "auto",
    vllm_version: str | None = None,
    max_part_bytes: int | None = None,
    pp: int = 1,
    pp_partition: tuple[int, ...] | None = None,
) -> list[PlannedFile]:
    """The artifact's files and sizes, exactly as ``stage`` would write them (manifest aside).
    Raises the stager's own error where staging would fail (a TP that cannot split the model,
    an unsupported architecture)."""
    from modelstage.core.formats import format_for
    from modelstage.core.layouts import layout_for

    from .checkpoint import open_checkpoint, plan_for
    from .shard_plan import Pipeline
    from .sources.local import LocalSource
    from .writers import PlannedFile, WriteJob, writer_for

    layout = layout_for(vllm_version)
    if max_part_bytes is not None:
        layout = dataclasses.replace(layout, max_part_bytes=max_part_bytes)
    fmt = format_for(load_format)
    source = LocalSource(checkpoint_dir)
    try:
        ckpt = open_checkpoint(source)
        plans = plan_for(ckpt, fmt, tp, layout, dtype, Pipeline(pp, pp_partition))
        writer = writer_for(fmt)
        files = [f for plan in plans for f in writer.planned(WriteJob(ckpt, plan, layout, fmt))]
        files += [PlannedFile(n, source.size(n), None) for n in writer.carried(ckpt)]
    finally:
        source.close()
    return files


# --- the ModelDeployment form --------------------------------------------------------------------
def load_manifests(path: str, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """The documents of ``kinds`` in a YAML file (``-`` is stdin)."""
    import sys

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        docs = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not YAML: {' '.join(str(e).split())}") from None
    found = [d for d in docs if d.get("kind") in kinds]
    if not found:
        raise SpecError(f"{path}: holds no {' or '.join(kinds)}")
    return found


PLANNERS = "modelstage.planners"
"""The entry-point group where the operator publishes its offline planner (pyproject.toml)."""


def _deployment_planner() -> Callable[..., tuple[dict[str, Any], dict[str, Any]]]:
    """The operator's ``deployment_report`` (``operator/offline_report.py``), found through
    its entry point: the stager runs it without importing the operator."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=PLANNERS, name="deployment"))
    if not found:
        raise SpecError(
            "planning a ModelDeployment runs the operator's planners, and this installation "
            f"has none (no {PLANNERS!r} entry point named 'deployment'): install modelstage "
            "with its operator package (the stager image has it)"
        )
    planner: Callable[..., tuple[dict[str, Any], dict[str, Any]]] = found[0].load()
    return planner


def plan_deployment_report(
    manifest: dict[str, Any],
    *,
    namespace: str | None,
    workload: dict[str, Any] | None,
    checkpoint: str | None,
    stager_image: str,
    identity: str | None = None,
) -> dict[str, Any]:
    """The report for one ModelDeployment manifest (the operator's planners, plus files);
    ``identity``: the source's resolved identity, when known."""
    report, stage = _deployment_planner()(
        manifest,
        namespace=namespace,
        workload=workload,
        stager_image=stager_image,
        identity=identity,
        read_config=None if checkpoint is None else lambda: _read_config(checkpoint),
    )
    if checkpoint is not None:
        report["files"] = _files_or_finding(checkpoint, report["checks"], **stage)
    return report


def _read_config(checkpoint: str) -> tuple[str, Any]:
    """The local checkpoint's ``config.json``, as the resolve Job reads the source's."""
    from .checkpoint import CONFIG, MAX_CONFIG_BYTES, read_json
    from .sources.local import LocalSource

    source = LocalSource(checkpoint)
    try:
        return f"{checkpoint}/{CONFIG}", read_json(source, CONFIG, max_bytes=MAX_CONFIG_BYTES)
    finally:
        source.close()


def _files_or_finding(checkpoint: str, checks: list[dict[str, Any]], **kw: Any) -> Any:
    try:
        files = plan_files(checkpoint, **kw)
    except ModelstageError as error:
        checks.append(
            {
                "reason": "StagingWouldFail",
                "message": " ".join(str(error).split()),
                "blocks": "staging",
            }
        )
        return None
    return {
        "from": str(Path(checkpoint).absolute()),
        "list": [dataclasses.asdict(f) for f in files],
        "bytes": sum(f.size for f in files),
    }


# --- the SOURCE form ---------------------------------------------------------------------------
def plan_stage_report(
    req: Any, *, checkpoint: str | None, identity: str | None = None
) -> dict[str, Any]:
    """What ``modelstage stage`` would do with ``req`` (a StageRequest); ``identity``: the
    source's resolved identity, else resolved here for a local source (headers only)."""
    from .stage import check_request, request_destination, request_digest

    checks: list[dict[str, Any]] = []
    try:
        check_request(req)
        request_destination(req)
    except ModelstageError as error:
        checks.append(_finding("StageRefused", error))
    local = checkpoint or (req.source if "://" not in req.source else None)
    files = None
    if local is not None and not checks:
        files = _files_or_finding(
            local,
            checks,
            tp=req.tp,
            load_format=req.format,
            dtype=req.dtype,
            vllm_version=req.vllm_version,
            max_part_bytes=req.max_part_bytes,
            pp=req.pp,
            pp_partition=req.pp_partition,
        )
    command = _stage_command(req)
    identity = identity or _local_identity(req, checks)
    if identity is None and req.digest is None:
        checks.append(
            {
                "reason": "Resolving",
                "blocks": "nothing",
                "message": f"the digest is taken from the identity of {req.source} when "
                "staging resolves it: plan with --identity (`modelstage resolve "
                f"{req.source}` prints it)",
            }
        )
    return {
        "kind": "stage",
        "digest": req.digest or (request_digest(req, identity) if identity else None),
        "artifact": {
            "uri": req.out,
            **_pinned_address(req.out),
            "format": req.format,
            "tensorParallelSize": req.tp,
            "pipelineParallelSize": req.pp,
            "dtype": req.dtype,
        },
        "source": {
            "uri": req.source_uri or req.source,
            "revision": req.revision,
            "identity": identity,
        },
        "jobs": [{"name": "(this machine)", "pods": 1, "command": command}],
        "files": files,
        "checks": checks,
    }


def _finding(reason: str, error: ModelstageError) -> dict[str, Any]:
    return {"reason": reason, "message": " ".join(str(error).split()), "blocks": "staging"}


def _pinned_address(out: str) -> dict[str, str]:
    """An ``oci://`` artifact is served by the digest its push returns, never by its tag."""
    if not out.startswith("oci://"):
        return {}
    return {
        "address": "REGISTRY/REPOSITORY@sha256:<the image manifest digest the push returns; "
        "the summary line and `modelstage verify` print it>"
    }


def _stage_command(req: Any) -> list[str]:
    """The ``modelstage stage`` command line of ``req``."""
    command = ["modelstage", "stage", req.source, "--tp", str(req.tp), "--format", req.format,
               "--dtype", req.dtype, "--out", req.out]  # fmt: skip
    if req.pp != 1:
        command += ["--pp", str(req.pp)]
    if req.pp_partition is not None:
        command += ["--pp-layer-partition", ",".join(map(str, req.pp_partition))]
    for flag, value in (
        ("--revision", req.revision),
        ("--source-uri", req.source_uri),
        ("--vllm-version", req.vllm_version),
        ("--digest", req.digest),
        ("--max-part-bytes", req.max_part_bytes),
        ("--oci-form", req.oci_form),
    ):
        if value is not None:
            command += [flag, str(value)]
    return command


def _local_identity(req: Any, checks: list[dict[str, Any]]) -> str | None:
    """A local source's identity (``stage`` resolves the same); a pinned Hub commit's; None
    for any other source, which only staging (or ``modelstage resolve``) may contact."""
    import re

    from .resolve import resolve

    if req.source.startswith("hf://") and re.fullmatch(r"[0-9a-f]{40}", req.revision or ""):
        return f"commit:{req.revision}"
    if "://" in req.source and not req.source.startswith("file://"):
        return None
    try:
        resolved = resolve(req)
    except ModelstageError as error:
        checks.append(
            {
                "reason": "StagingWouldFail",
                "message": " ".join(str(error).split()),
                "blocks": "staging",
            }
        )
        return None
    resolved.close()
    return resolved.identity


# --- the human-readable report ----------------------------------------------------------------
def render(report: dict[str, Any]) -> str:
    lines: list[str] = []
    _render_artifact(report, lines.append)
    _render_jobs(report, lines.append)
    _render_files(report, lines.append)
    _render_vllm(report, lines.append)
    _render_checks(report, lines.append)
    return "\n".join(lines)


Add = Callable[[str], None]


def _render_artifact(report: dict[str, Any], add: Add) -> None:
    if report["kind"] == "ModelDeployment":
        add(f"ModelDeployment {report['namespace']}/{report['name']} (planned offline)")
    else:
        add("modelstage stage (planned)")
    source = report["source"]
    add(f"  source:   {source['uri']}" + (f" @ {source['revision']}" if source["revision"] else ""))
    if source.get("identity"):
        add(f"  identity: {source['identity']}")
    art = report.get("artifact")
    add(f"  digest:   {report.get('digest') or '(none: see checks)'}")
    if art:
        add(f"  artifact: {art['uri']}")
        if art.get("address"):
            add(f"            (pinned: {art['address']})")
        if art.get("path") and art["path"] != art["uri"]:
            add(f"            (in pods: {art['path']}, claim {art['claimName']})")
        layout = f", vLLM {art['vllmVersion']} layout" if art.get("vllmVersion") else ""
        add(
            f"  format:   {art['format']}, TP {art['tensorParallelSize']}, dtype {art['dtype']}"
            f"{layout}"
        )
    if report.get("claim"):
        claim = report["claim"]
        size = claim["spec"]["resources"]["requests"]["storage"]
        add(f"  claim:    creates PersistentVolumeClaim {claim['metadata']['name']} ({size})")


def _render_jobs(report: dict[str, Any], add: Add) -> None:
    if report["kind"] == "stage":
        add(f"  command:  {shlex.join(report['jobs'][0]['command'])}")
        return
    add("  staging:" if report["jobs"] else "  staging:  nothing (see checks)")
    for job in report["jobs"]:
        pods = f"{job['pods']} pods, Indexed" if job["pods"] > 1 else "1 pod"
        add(f"    {job['name']} ({pods})")
        add(f"      {shlex.join(job['command'])}")


def _render_files(report: dict[str, Any], add: Add) -> None:
    files = report.get("files")
    if files:
        add(
            f"  files:    {len(files['list'])} files, {human_bytes(files['bytes'])} "
            f"(+ modelstage.json), from {files['from']}"
        )
        width = max(len(f["name"]) for f in files["list"])
        for f in files["list"]:
            who = f"rank {f['rank']}" if f["rank"] is not None else "all ranks"
            add(f"    {f['name']:<{width}}  {human_bytes(f['size']):>10}  {who}")
    elif any(c["blocks"] == "staging" for c in report["checks"]):
        add("  files:    none (staging would be refused: see checks)")
    else:
        add("  files:    (give a local copy of the checkpoint with --checkpoint DIR to list them)")


def _render_vllm(report: dict[str, Any], add: Add) -> None:
    vllm = report.get("vllm")
    if vllm is None and report["kind"] == "ModelDeployment":
        add("  vLLM:     (give the workload's manifest with --workload FILE to plan its patch)")
    elif vllm is not None and not vllm["planned"]:
        add(f"  vLLM:     {vllm['workload']}: not planned (see checks)")
    elif vllm is not None:
        add(f"  vLLM:     {vllm['workload']}, container {vllm['container']}:")
        add(f"      {shlex.join([*(vllm['command'] or []), *(vllm['args'] or [])])}")
        for init in vllm["initContainers"]:
            add(f"    initContainer {init['name']}: {shlex.join(init['command'] or [])}")
        add(f"    env: {', '.join(vllm['env'])}")


def _render_checks(report: dict[str, Any], add: Add) -> None:
    if not report["checks"]:
        add("  checks:   nothing would refuse it")
        return
    add("  checks:")
    for c in report["checks"]:
        what = {"staging": "blocks staging", "rollout": "blocks the rollout"}.get(
            c["blocks"], "warning"
        )
        add(f"    {c['reason']} ({what}): {c['message']}")
