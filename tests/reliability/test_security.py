"""Security properties of the stager and of what the operator creates.

- Weights are read as safetensors only: a pickle is never unpickled, whether it is the only
  weight file (refused, with the conversion hint) or sits beside safetensors (ignored, and
  not published). A pickle whose loading would run code proves it by leaving no trace.
  ``--allow-pickle`` loads pickle-only weights with ``torch.load(weights_only=True)`` into
  the same safetensors path (identical rank files) and still refuses code-running pickles.
- Names that could escape a root are refused: file names from an index, symlinks out of a
  source folder (a mounted PVC is the same LocalSource), and no artifact file name is ever
  derived from a tensor name, so tensor names with ``/`` or ``..`` cannot place a file.
- Credentials never reach an output: logs of killed and failed runs, error messages of
  throttled and unreachable servers, manifests and summaries are grepped for the secrets.
- Every container the operator creates (stage and finalize Jobs, the serving
  initContainer) runs as non-root with a read-only root filesystem; the chart's own
  Deployment is checked in tests/chart/test_chart_operator.py and its RBAC against the verbs
  the operator calls in tests/chart/test_chart_rbac.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from modelstage.api.modeldeployment import ModelDeploymentSpec
from modelstage.api.objects import Owner
from modelstage.core.errors import CheckpointError, ModelstageError
from modelstage.core.s3_client import S3Options
from modelstage.operator.artifact import artifact_at, artifact_for, spec_digest
from modelstage.operator.job_plan import plan_finalize_job, plan_resolve_job, plan_stage_job
from modelstage.operator.rollout_plan import plan_rollout
from modelstage.stager import cli
from modelstage.stager.stage import StageRequest, stage
from support.fault_proxy import fault_proxy
from support.s3_server import S3Server

IDENTITY = "commit:" + "ab" * 20
"""A resolved source identity (a Hub commit) for planner tests."""

ROOT = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this creates the file named by ``marker``: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def malicious_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"model.embed_tokens.weight": _Payload(marker)}))


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def malicious_pickle_ckpt(small_ckpt: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``small_ckpt`` whose only weights are a pickle that would create ``marker``."""
    ckpt = copy_ckpt(small_ckpt, tmp_path / "ckpt")
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    marker = tmp_path / "pwned"
    malicious_pickle(ckpt / "pytorch_model.bin", marker)
    return ckpt, marker


def test_a_pickle_only_checkpoint_is_refused_with_the_hint_and_never_unpickled(
    small_ckpt: Path, tmp_path: Path
) -> None:
    ckpt, marker = malicious_pickle_ckpt(small_ckpt, tmp_path)
    with pytest.raises(CheckpointError, match=r"pickle weights .*safetensors only.*weights_only"):
        stage(StageRequest(source=str(ckpt), out=str(tmp_path / "out"), tp=2))
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_pickle_beside_safetensors_is_neither_loaded_nor_published(
    small_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(small_ckpt, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    malicious_pickle(ckpt / "pytorch_model.bin", marker)
    stage(StageRequest(source=str(ckpt), out=str(tmp_path / "out"), tp=2))
    assert not marker.exists()
    assert not list((tmp_path / "out").glob("*.bin"))


def to_pickle_only(src: Path, dst: Path) -> Path:
    """The same tensors as ``src``'s safetensors, as a pickle-only checkpoint."""
    import torch
    from safetensors.torch import load_file

    ckpt = copy_ckpt(src, dst)
    state: dict[str, Any] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(f))
        f.unlink()
    (ckpt / "model.safetensors.index.json").unlink(missing_ok=True)
    torch.save(state, ckpt / "pytorch_model.bin")
    return ckpt


def test_allow_pickle_stages_the_same_rank_files_as_the_safetensors_checkpoint(
    small_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spools = tmp_path / "tmpdir"  # the conversion spool goes to TMPDIR
    spools.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spools))
    ckpt = to_pickle_only(small_ckpt, tmp_path / "pickled")
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        stage(StageRequest(source=str(ckpt), out=str(tmp_path / "refused"), tp=2))
    assert cli.main(["stage", str(ckpt), "--tp", "2", "--out", str(tmp_path / "p"),
                     "--allow-pickle"]) == 0  # fmt: skip
    stage(StageRequest(source=str(small_ckpt), out=str(tmp_path / "s"), tp=2))
    ranks = sorted(p.name for p in (tmp_path / "s").glob("model-rank-*"))
    assert ranks and ranks == sorted(p.name for p in (tmp_path / "p").glob("model-rank-*"))
    for name in ranks:
        assert (tmp_path / "p" / name).read_bytes() == (tmp_path / "s" / name).read_bytes()
    manifest = json.loads((tmp_path / "p" / "modelstage.json").read_text())
    assert manifest["source"]["files"][0]["name"] == "pytorch_model.bin"
    assert not list(spools.iterdir()), "the conversion spool was left behind"


def test_allow_pickle_still_refuses_a_pickle_that_would_run_code(
    small_ckpt: Path, tmp_path: Path
) -> None:
    ckpt, marker = malicious_pickle_ckpt(small_ckpt, tmp_path)
    with pytest.raises(CheckpointError, match="weights_only"):
        stage(StageRequest(source=str(ckpt), out=str(tmp_path / "out"), tp=2, allow_pickle=True))
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("out.tmp-*"))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "a/../../b.safetensors",
                                  "sub/../../../x.safetensors", "..", "a\\..\\b.safetensors"])  # fmt: skip
def test_index_file_names_that_escape_the_checkpoint_are_refused(
    name: str, small_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(small_ckpt, tmp_path / "ckpt")
    weights = sorted(ckpt.glob("*.safetensors"))[0].name
    outside = tmp_path / "outside.safetensors"
    shutil.copy(ckpt / weights, outside)  # a valid file where the traversal would land
    index = {"metadata": {}, "weight_map": {"model.norm.weight": name, "lm_head.weight": weights}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unsafe file name"):
        stage(StageRequest(source=str(ckpt), out=str(tmp_path / "out"), tp=2))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("victim", ["config.json", "weights", "tokenizer.json"])
def test_symlinks_out_of_the_source_folder_are_refused(
    victim: str, small_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(small_ckpt, tmp_path / "pvc" / "ckpt")
    name = sorted(ckpt.glob("*.safetensors"))[0].name if victim == "weights" else victim
    secret = tmp_path / "host-secret"
    shutil.copy(ckpt / name if (ckpt / name).exists() else ckpt / "config.json", secret)
    (ckpt / name).unlink(missing_ok=True)
    (ckpt / name).symlink_to(secret)
    with pytest.raises(CheckpointError, match="symlink escapes"):
        stage(StageRequest(source=str(ckpt), out=str(tmp_path / "out"), tp=2))
    assert not (tmp_path / "out").exists()


def test_artifact_file_names_never_come_from_tensor_names(small_ckpt: Path, tmp_path: Path) -> None:
    """Tensor names are only keys inside the safetensors headers; a name with ``/`` or ``..``
    (refused anyway as an unknown tensor) could not place a file, since the stager names its
    files by rank and part only."""
    out = tmp_path / "out"
    stage(StageRequest(source=str(small_ckpt), out=str(out), tp=2))
    allowed = re.compile(r"model-rank-\d+-part-\d+\.safetensors|[a-z_]+\.json|modelstage\.json")
    assert all(allowed.fullmatch(p.name) for p in out.iterdir()), sorted(os.listdir(out))

    from safetensors.numpy import load_file, save_file

    ckpt = copy_ckpt(small_ckpt, tmp_path / "evil")
    weights = sorted(ckpt.glob("*.safetensors"))[0]
    tensors = load_file(weights)
    tensors["../../escaped/model-rank-0-part-0"] = tensors["model.norm.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelstageError, match="escaped"):
        stage(StageRequest(source=str(ckpt), out=str(tmp_path / "out2"), tp=2))
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "out2").exists()


def test_credentials_never_reach_logs_errors_manifests_or_summaries(
    s3: S3Server, bucket: str, small_ckpt: Path, tmp_path: Path
) -> None:
    secrets = (s3.access_key, s3.secret_key)
    texts: list[str] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=s3.access_key,
               AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
    cli = str(Path(sys.executable).with_name("modelstage"))
    common = ["--tp", "2", "--format", "runai_streamer_sharded", "--s3-path-style",
              "--s3-region", s3.region]  # fmt: skip
    ok = subprocess.run([cli, "stage", str(small_ckpt), "--out", f"s3://{bucket}/ok/",
                         "--s3-endpoint", s3.endpoint, *common],
                        env=env, capture_output=True, text=True, cwd="/", timeout=300)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    texts += [ok.stdout, ok.stderr]
    texts.append(s3.client().get_object(Bucket=bucket, Key="ok/modelstage.json")["Body"].read().decode())
    verify = subprocess.run([cli, "verify", f"s3://{bucket}/ok/", "--s3-endpoint", s3.endpoint,
                             "--s3-path-style"], env=env, capture_output=True, text=True, cwd="/",
                            timeout=120)  # fmt: skip
    texts += [verify.stdout, verify.stderr]

    with fault_proxy(s3.endpoint) as proxy:  # throttled for good, then unreachable
        opts = S3Options(endpoint_url=proxy.endpoint, region=s3.region, path_style=True,
                         credentials_file=str(s3.credentials_file), max_attempts=1)  # fmt: skip
        proxy.throttle(10**9)
        with pytest.raises(ModelstageError) as throttled:
            stage(StageRequest(source=str(small_ckpt), out=f"s3://{bucket}/t/", tp=2,
                               format="runai_streamer_sharded", s3=opts))  # fmt: skip
        proxy.down()
        with pytest.raises(ModelstageError) as unreachable:
            stage(StageRequest(source=f"s3://{bucket}/ok/", out=str(tmp_path / "o"), tp=2, s3=opts))
        texts += [str(throttled.value), repr(throttled.value), str(unreachable.value),
                  repr(unreachable.value)]  # fmt: skip
    for argv in (["--s3-endpoint", "http://127.0.0.1:9"], ["--s3-endpoint", s3.endpoint]):
        failed = subprocess.run([cli, "stage", str(small_ckpt), "--out", f"s3://{bucket}/f/",
                                 *argv, *common],
                                env={**env, "AWS_SECRET_ACCESS_KEY": s3.secret_key[::-1]},
                                capture_output=True, text=True, cwd="/", timeout=300)  # fmt: skip
        assert failed.returncode == 1 and failed.stderr.strip().splitlines()[-1].startswith("error:")
        texts += [failed.stdout, failed.stderr]
        secrets += (s3.secret_key[::-1],)
    for text in texts:
        for secret in secrets:
            assert secret not in text


# --- what the operator creates runs as non-root, read-only ------------------------------------
SPEC = {
    "model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "credentialsSecret": "hf-token"},
    "parallelism": {"tensor": 2},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "models", "path": "/artifacts"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm-llama"}, "containerName": "vllm"},
}


def assert_restricted(container: dict[str, Any], pod: dict[str, Any], what: str) -> None:
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    assert security.get("runAsNonRoot") is True, what
    assert security.get("runAsUser", 1) != 0, what
    assert container["securityContext"].get("readOnlyRootFilesystem") is True, what
    assert container["securityContext"].get("allowPrivilegeEscalation") is False, what
    assert container["securityContext"].get("capabilities", {}).get("drop") == ["ALL"], what


def test_every_container_the_operator_creates_is_non_root_with_a_read_only_root() -> None:
    spec = ModelDeploymentSpec.model_validate(SPEC)
    owner = Owner(name="llama", namespace="llm", uid="5f1c0000-0000-4000-8000-000000000001")
    artifact = artifact_at(spec, namespace=owner.namespace, deployment_name=owner.name,
                           digest=spec_digest(spec, IDENTITY))  # fmt: skip
    for job in (plan_stage_job(spec, owner=owner, artifact=artifact),
                plan_finalize_job(spec, owner=owner, artifact=artifact),
                plan_resolve_job(spec, owner=owner, name="modelstage-resolve-0")):  # fmt: skip
        pod = job["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert_restricted(c, pod, f"job {job['metadata']['name']} container {c['name']}")

    workload = yaml.safe_load((ROOT / "examples" / "vllm-deployment.yaml").read_text())
    artifact = artifact_for(spec, namespace="llm", deployment_name="llama", identity=IDENTITY)
    patch = plan_rollout(spec, artifact, workload).merge_patch
    pod = patch["spec"]["template"]["spec"]
    inits = pod.get("initContainers", [])
    assert inits, "the rollout adds the prepare initContainer"
    for c in inits:  # ours; the vLLM container and the pod context belong to the workload
        assert_restricted(c, {}, f"initContainer {c['name']}")


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["stage", "{ckpt}", "--tp", "1", "--out", "s3://bkt/x/", "--format",
          "runai_streamer_sharded", "--s3-endpoint", "http://admin:hunter2@127.0.0.1:9"], {}),
        (["verify", "s3://bkt/x/", "--s3-endpoint", "https://hunter2@127.0.0.1:9"], {}),
        (["delete", "--artifact", "s3://bkt/x/" + "0" * 20], {"AWS_ENDPOINT_URL": "http://a:hunter2@127.0.0.1:9"}),
        (["prepare", "--artifact", "s3://bkt/x/", "--digest", "d", "--tp", "1", "--plugin-dir",
          "{tmp}/p", "--s3-endpoint", "http://admin:hunter2@127.0.0.1:9"], {}),
        (["stage", "s3://bkt/ckpt", "--tp", "1", "--out", "{tmp}/out", "--s3-endpoint",
          "http://admin:hunter2@127.0.0.1:9"], {}),
    ],
    ids=["stage-to", "verify", "delete-env", "prepare", "stage-from"],
)  # fmt: skip
def test_an_s3_endpoint_with_credentials_is_refused_without_repeating_them(
    argv: list[str], env: dict[str, str], small_ckpt: Path, tmp_path: Path
) -> None:
    cli = str(Path(sys.executable).with_name("modelstage"))
    args = [a.format(ckpt=small_ckpt, tmp=tmp_path) for a in argv]
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = subprocess.run([cli, *args], env={**base, **env}, cwd="/",
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: S3 endpoint http") and "credentials never go into" in last
    assert "hunter2" not in done.stdout + done.stderr
