"""``modelstage plan``: offline, from the same planners the operator and the stager use, so
what it shows is what then happens (the live tier checks the operator's actual Job and
patch: tests/operator_live/test_operator_plan.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from modelstage.api.modeldeployment import DEFAULT_STAGER_IMAGE, ModelDeploymentSpec
from modelstage.api.objects import Owner
from modelstage.core.manifest import read_manifest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.operator.artifact import artifact_at, artifact_for, spec_digest
from modelstage.operator.claim_plan import plan_claim
from modelstage.operator.job_plan import staging_jobs
from modelstage.operator.offline_plan import OFFLINE_UID
from modelstage.operator.resolve_plan import resolve_job_name, source_status
from modelstage.operator.rollout_plan import plan_rollout
from modelstage.stager.plan import plan_files
from modelstage.stager.stage import StageRequest, stage

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("modeldeployment-*.yaml"))
EXPLICIT = [p for p in EXAMPLES if yaml.safe_load(p.read_text())["spec"].get("loadFormat")]
"""The examples that name their format (``auto``'s plan is its resolve Job: a test below)."""
WORKLOAD = ROOT / "examples" / "vllm-deployment.yaml"
OPT_IN = "modelstage.io/model-deployment"
"""The target's annotation that names the ModelDeployment allowed to patch it."""
MODELSTAGE = str(Path(sys.executable).with_name("modelstage"))
IDENTITY = "commit:" + "ab" * 20
"""The resolved source identity the plans are given (``--identity``)."""


def plan(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELSTAGE_")}
    return subprocess.run([MODELSTAGE, "plan", *args], env=env, cwd="/", input=stdin,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def plan_json(*args: str, code: int = 0) -> dict[str, Any]:
    done = plan(*args, "-o", "json")
    assert done.returncode == code, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def write_md(tmp_path: Path, spec: dict[str, Any], name: str = "llama") -> Path:
    path = tmp_path / "md.yaml"
    doc = {"apiVersion": "modelstage.io/v1alpha1", "kind": "ModelDeployment",
           "metadata": {"name": name, "namespace": "llm"}, "spec": spec}  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    return path


BASE: dict[str, Any] = {
    "model": {"uri": "hf://acme/llama", "revision": "main"},
    "parallelism": {"tensor": 2},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "models", "path": "/artifacts"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm-llama"},
                "containerName": "vllm"},
}  # fmt: skip


def opted_in(tmp_path: Path, md_name: str = "llama") -> Path:
    """The example Deployment, opted in for ``md_name`` (it names the example's own)."""
    workload = yaml.safe_load(WORKLOAD.read_text())
    workload["metadata"]["annotations"][OPT_IN] = md_name
    path = tmp_path / f"workload-{md_name}.yaml"
    path.write_text(yaml.safe_dump(workload))
    return path


# --- the ModelDeployment form equals the operator's planners ------------------------------------
def workload_for(
    spec: ModelDeploymentSpec, tmp_path: Path, md_name: str = "llama"
) -> tuple[dict[str, Any], Path]:
    """The example vLLM Deployment as the spec's target (kind and name; one container when
    the spec names none), opted in for ModelDeployment ``md_name``."""
    workload = yaml.safe_load(WORKLOAD.read_text())
    workload["metadata"]["annotations"][OPT_IN] = md_name
    workload["kind"], workload["metadata"]["name"] = spec.serving.target_ref.kind, spec.serving.target_ref.name
    pod = workload["spec"]["template"]["spec"]
    if spec.serving.container_name is None:
        pod["containers"] = pod["containers"][:1]
    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump(workload))
    return workload, path


@pytest.mark.parametrize("example", EXPLICIT, ids=lambda p: p.stem)
def test_the_plan_of_each_example_is_the_operators_digest_jobs_claim_and_patch(
    example: Path, tmp_path: Path
) -> None:
    doc = yaml.safe_load(example.read_text())
    spec = ModelDeploymentSpec.model_validate(doc["spec"])
    name, namespace = doc["metadata"]["name"], "team-a"
    workload, workload_file = workload_for(spec, tmp_path, name)
    report = plan_json(str(example), "--namespace", namespace, "--workload", str(workload_file),
                       "--identity", IDENTITY)  # fmt: skip

    digest = spec_digest(spec, IDENTITY)
    assert report["digest"] == digest
    owner = Owner(name=name, namespace=namespace, uid=OFFLINE_UID)
    source = source_status(spec, IDENTITY, now=datetime.now(UTC))
    jobs = staging_jobs(spec, owner=owner, artifact=artifact_at(spec, namespace=owner.namespace, deployment_name=owner.name, digest=digest), default_image=DEFAULT_STAGER_IMAGE,
                        source=source)  # fmt: skip
    assert [j["manifest"] for j in report["jobs"]] == jobs
    assert [j["command"] for j in report["jobs"]] == [
        j["spec"]["template"]["spec"]["containers"][0]["command"] for j in jobs
    ]
    assert report["claim"] == plan_claim(spec, owner=owner)
    artifact = artifact_for(spec, namespace=namespace, deployment_name=name, identity=IDENTITY)
    assert report["artifact"]["uri"] == artifact.location.uri
    assert report["vllm"]["mergePatch"] == plan_rollout(spec, artifact, workload).merge_patch
    assert report["checks"] == []


def test_the_digest_is_the_one_prepare_and_the_stager_are_given(tmp_path: Path) -> None:
    """Where ``prepare --digest`` comes from: the plan's digest, passed to the stager Job and
    to the serving pod's initContainer alike."""
    report = plan_json(str(write_md(tmp_path, BASE)), "--workload", str(opted_in(tmp_path)),
                       "--identity", IDENTITY)  # fmt: skip
    digest = report["digest"]
    stage_command = report["jobs"][0]["command"]
    assert stage_command[stage_command.index("--digest") + 1] == digest
    [prepare] = [c for c in report["vllm"]["initContainers"] if c["name"] == "modelstage-prepare"]
    assert prepare["command"][prepare["command"].index("--digest") + 1] == digest


def test_the_stager_image_comes_from_the_operators_setting(tmp_path: Path) -> None:
    md = str(write_md(tmp_path, BASE))
    report = plan_json(md, "--stager-image", "registry.local/stager:dev")
    assert report["jobs"][0]["manifest"]["spec"]["template"]["spec"]["containers"][0][
        "image"
    ] == "registry.local/stager:dev"


def test_human_output_names_the_digest_jobs_commands_and_files(
    tmp_path: Path, llama_ckpt: Path
) -> None:
    md = write_md(tmp_path, {**BASE, "stager": {"parallelism": 2}})
    done = plan(str(md), "--workload", str(opted_in(tmp_path)), "--checkpoint", str(llama_ckpt),
                "--identity", IDENTITY)  # fmt: skip
    assert done.returncode == 0, done.stderr
    digest = spec_digest(ModelDeploymentSpec.model_validate({**BASE, "stager": {"parallelism": 2}}),
                         IDENTITY)  # fmt: skip
    out = done.stdout
    assert out.startswith("ModelDeployment llm/llama (planned offline)\n")
    assert f"  digest:   {digest}\n" in out
    assert f"  artifact: pvc://models/artifacts/llm/{digest}\n" in out
    assert f"    modelstage-stage-{digest} (2 pods, Indexed)\n" in out
    assert f"    modelstage-finalize-{digest} (1 pod)\n" in out
    assert "      modelstage stage hf://acme/llama --tp 2 " in out
    assert "model-rank-1-part-0.safetensors" in out and "rank 1" in out
    assert "--load-format modelstage_sharded_state" in out
    assert out.rstrip().endswith("checks:   nothing would refuse it")


# --- files and sizes -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fmt", "part"), [("sharded_state", 2**20), ("runai_streamer_sharded", None),
                      ("tensorizer", None), ("runai_streamer", None), ("safetensors", None)],
)  # fmt: skip
def test_planned_files_and_sizes_are_what_stage_writes(
    llama_ckpt: Path, tmp_path: Path, fmt: str, part: int | None
) -> None:
    planned = plan_files(str(llama_ckpt), tp=2, load_format=fmt, max_part_bytes=part)
    stage(StageRequest(source=str(llama_ckpt), out=str(tmp_path / "a"), tp=2, format=fmt,
                       max_part_bytes=part))  # fmt: skip
    manifest = read_manifest(tmp_path / "a")
    assert manifest is not None
    assert {f.name: f.size for f in planned} == {n: e.size for n, e in manifest.files.items()}
    if fmt not in ("runai_streamer", "safetensors"):
        assert {f.rank for f in planned if f.name.startswith("model-rank")} == {0, 1}


def test_the_source_form_is_what_stage_then_does(llama_ckpt: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "a")
    report = plan_json(str(llama_ckpt), "--tp", "2", "--out", out, "--max-part-bytes", "1Mi")
    summary = stage(StageRequest(source=str(llama_ckpt), out=out, tp=2, max_part_bytes=2**20))
    assert report["digest"] == summary["digest"]
    assert report["files"]["bytes"] == summary["bytes"]
    assert len(report["files"]["list"]) == summary["files"]
    assert report["jobs"][0]["command"][:3] == ["modelstage", "stage", str(llama_ckpt)]


# --- the checks that would refuse it -------------------------------------------------------------
def test_a_tp_the_model_cannot_split_is_shown_and_exits_2(llama_ckpt: Path, tmp_path: Path) -> None:
    report = plan_json(str(write_md(tmp_path, {**BASE, "parallelism": {"tensor": 3}})),
                       "--checkpoint", str(llama_ckpt), "--identity", IDENTITY, code=2)  # fmt: skip
    [check] = report["checks"]
    assert check["reason"] == "StagingWouldFail" and check["blocks"] == "staging"
    assert "does not divide the 8 attention heads" in check["message"]
    assert report["files"] is None


def test_an_unknown_vllm_version_blocks_staging(tmp_path: Path) -> None:
    spec = {**BASE, "serving": {**BASE["serving"], "vllmVersion": "0.1"}}
    report = plan_json(str(write_md(tmp_path, spec)), code=2)
    assert [c["reason"] for c in report["checks"]] == ["UnsupportedVllmVersion"]
    assert report["digest"] is None and report["jobs"] == []


def test_a_workload_without_the_container_blocks_the_rollout_not_staging(tmp_path: Path) -> None:
    spec = {**BASE, "serving": {**BASE["serving"], "containerName": "nope"}}
    report = plan_json(str(write_md(tmp_path, spec)), "--workload", str(opted_in(tmp_path)),
                       "--identity", IDENTITY, code=2)  # fmt: skip
    assert [(c["reason"], c["blocks"]) for c in report["checks"]] == [
        ("ContainerNotFound", "rollout")
    ]
    assert report["jobs"] and report["vllm"] == {"workload": "Deployment vllm-llama",
                                                 "planned": False}  # fmt: skip


def test_a_workload_that_is_not_the_specs_target_is_pointed_out(tmp_path: Path) -> None:
    spec = {**BASE, "serving": {**BASE["serving"], "targetRef": {"kind": "Deployment",
                                                                  "name": "other"}}}  # fmt: skip
    report = plan_json(str(write_md(tmp_path, spec)), "--workload", str(opted_in(tmp_path)),
                       "--identity", IDENTITY)  # fmt: skip
    [check] = report["checks"]
    assert check == {
        "reason": "WorkloadNotTheTarget", "blocks": "nothing",
        "message": "--workload is Deployment vllm-llama, but spec.serving.targetRef is "
        "Deployment other: the plan patches the one given",
    }  # fmt: skip


def test_sharded_state_to_s3_is_refused_in_the_source_form(llama_ckpt: Path) -> None:
    report = plan_json(str(llama_ckpt), "--tp", "2", "--out", "s3://bucket/x", code=2)
    assert report["checks"][0]["reason"] == "StageRefused"
    assert "read from local directories only" in report["checks"][0]["message"]


def test_a_spec_the_api_server_would_refuse_is_one_error_line(tmp_path: Path) -> None:
    done = plan(str(write_md(tmp_path, {**BASE, "parallelism": {"tensor": 0}})))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: ModelDeployment llm/llama: the API server would refuse it: spec.parallelism.tensor"
    )


def test_a_source_without_tp_says_what_is_missing(tmp_path: Path) -> None:
    done = plan("hf://acme/llama")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: hf://acme/llama: not a file; to plan `modelstage stage SOURCE`, give --tp (and "
        "--format, --out as for stage)"
    )


def test_the_manifest_can_come_from_stdin(tmp_path: Path) -> None:
    done = plan("-", "-o", "json", stdin=write_md(tmp_path, BASE).read_text())
    assert done.returncode == 0 and json.loads(done.stdout)["name"] == "llama"


# --- what it imports -------------------------------------------------------------------------------
def test_planning_a_model_deployment_imports_neither_torch_nor_the_operators_kopf(
    tmp_path: Path,
) -> None:
    """The stager image runs it without the operator extras, the operator image without torch."""
    md = write_md(tmp_path, BASE)
    code = (
        "import sys\n"
        "from modelstage.stager import cli\n"
        f"assert cli.main(['plan', {str(md)!r}, '-o', 'json', '--workload', {str(opted_in(tmp_path))!r}]) == 0\n"
        "heavy = {'torch', 'numpy', 'kopf', 'kubernetes', 'boto3', 'huggingface_hub'}\n"
        "print(sorted(heavy & set(sys.modules)), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                          cwd="/", capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]"


# --- the source's identity ---------------------------------------------------------------------
def test_without_an_identity_the_plan_is_the_resolve_job_the_operator_runs_first(
    tmp_path: Path,
) -> None:
    report = plan_json(str(write_md(tmp_path, BASE)))
    assert report["digest"] is None and report["artifact"] is None
    spec = ModelDeploymentSpec.model_validate(BASE)
    [job] = report["jobs"]
    assert job["name"] == resolve_job_name(spec, None, "llama")
    assert job["command"] == ["modelstage", "resolve", "hf://acme/llama", "--revision=main"]
    [check] = report["checks"]
    assert (check["reason"], check["blocks"]) == ("Resolving", "nothing")
    assert "`modelstage resolve hf://acme/llama --revision main`" in check["message"]


def test_a_pinned_commit_is_its_own_identity(tmp_path: Path) -> None:
    pinned = {**BASE, "model": {"uri": "hf://acme/llama", "revision": "cd" * 20}}
    report = plan_json(str(write_md(tmp_path, pinned)))
    spec = ModelDeploymentSpec.model_validate(pinned)
    assert report["digest"] == spec_digest(spec, "commit:" + "cd" * 20)
    assert report["source"]["identity"] == "commit:" + "cd" * 20


def test_an_identity_that_resolve_never_prints_is_refused(tmp_path: Path) -> None:
    done = plan(str(write_md(tmp_path, BASE)), "--identity", "main")
    assert done.returncode == 2 and "expected commit:<40 hex> or sha256:<64 hex>" in done.stderr


def test_the_plan_of_auto_is_the_resolve_job_that_reads_the_architecture() -> None:
    (example,) = [p for p in EXAMPLES if p not in EXPLICIT]
    report = plan_json(str(example), "--identity", IDENTITY)
    assert report["digest"] is None and report["artifact"] is None
    (job,) = report["jobs"]
    assert job["command"][:2] == ["modelstage", "resolve"] and "--describe" in job["command"]
    (check,) = report["checks"]
    assert check["reason"] == "Resolving" and "with loadFormat auto the format" in check["message"]


def test_auto_with_a_local_checkpoint_is_planned_as_the_operator_will_decide_it(
    tmp_path: Path, llama_ckpt: Path
) -> None:
    olmo = tmp_path / "olmo"
    shutil.copytree(llama_ckpt, olmo)
    config = json.loads((olmo / "config.json").read_text())
    config["architectures"] = ["Olmo2ForCausalLM"]
    (olmo / "config.json").write_text(json.dumps(config))
    auto = {k: v for k, v in BASE.items() if k != "loadFormat"}
    for ckpt, fmt in ((llama_ckpt, "sharded_state"), (olmo, "safetensors")):
        report = plan_json(str(write_md(tmp_path, auto)), "--checkpoint", str(ckpt),
                           "--identity", IDENTITY)  # fmt: skip
        explicit = ModelDeploymentSpec.model_validate({**auto, "loadFormat": fmt})
        assert report["digest"] == spec_digest(explicit, IDENTITY)
        assert report["artifact"]["format"] == fmt
        assert report["checks"][0]["reason"] == "FormatChosen"
        command = report["jobs"][0]["command"]
        assert command[command.index("--format") + 1] == fmt
    assert "Olmo2ForCausalLM has no per-rank rules" in report["checks"][0]["message"]


def test_a_pipelined_deployments_files_are_the_ones_stage_writes_at_its_pipeline_size(
    tmp_path: Path, llama_ckpt: Path
) -> None:
    spec = {**BASE, "parallelism": {"tensor": 2, "pipeline": 2}}
    report = plan_json(str(write_md(tmp_path, spec)), "--checkpoint", str(llama_ckpt),
                       "--identity", IDENTITY)  # fmt: skip
    stage(StageRequest(source=str(llama_ckpt), out=str(tmp_path / "a"), tp=2, pp=2,
                       format="sharded_state"))  # fmt: skip
    manifest = read_manifest(tmp_path / "a")
    assert manifest is not None
    listed = {f["name"]: f["size"] for f in report["files"]["list"]}
    assert listed == {n: e.size for n, e in manifest.files.items()}
    assert any(name.startswith("model-pp-1-tp-1-part-") for name in listed)


def test_a_deployments_layer_partition_splits_the_planned_files_as_stage_does(
    tmp_path: Path,
) -> None:
    ckpt = write_checkpoint(SyntheticModel(num_layers=4), tmp_path / "ckpt")
    spec = {**BASE, "parallelism": {"tensor": 1, "pipeline": 2, "layerPartition": [1, 3]}}
    report = plan_json(str(write_md(tmp_path, spec)), "--checkpoint", str(ckpt),
                       "--identity", IDENTITY)  # fmt: skip
    assert report["checks"] == [], report["checks"]
    stage(StageRequest(source=str(ckpt), out=str(tmp_path / "a"), tp=1, pp=2,
                       pp_partition=(1, 3), format="sharded_state"))  # fmt: skip
    manifest = read_manifest(tmp_path / "a")
    assert manifest is not None and manifest.pipelineLayerPartition == "1,3"
    assert {f["name"]: f["size"] for f in report["files"]["list"]} == {
        n: e.size for n, e in manifest.files.items()
    }


def test_a_leaderworkerset_plans_its_leader_and_worker_templates_in_one_patch(
    tmp_path: Path,
) -> None:
    lws = yaml.safe_load((ROOT / "examples" / "vllm-leaderworkerset.yaml").read_text())
    lws["metadata"]["annotations"][OPT_IN] = "llama"
    workload = tmp_path / "lws.yaml"
    workload.write_text(yaml.safe_dump(lws))
    target = {"kind": "LeaderWorkerSet", "name": lws["metadata"]["name"]}
    spec = {**BASE, "parallelism": {"tensor": 2, "pipeline": 2},
            "serving": {**BASE["serving"], "targetRef": target}}  # fmt: skip
    report = plan_json(str(write_md(tmp_path, spec)), "--workload", str(workload),
                       "--identity", IDENTITY)  # fmt: skip
    assert report["checks"] == [] and report["vllm"]["workload"] == "LeaderWorkerSet vllm-llama-mn"
    patched = report["vllm"]["mergePatch"]["spec"]["leaderWorkerTemplate"]
    assert set(patched) == {"leaderTemplate", "workerTemplate"}
    assert "--pipeline-parallel-size=2" in report["vllm"]["args"]
