"""``statuses -> artifacts to delete``: keep the newest N per ModelDeployment, never delete
what another ModelDeployment of the namespace keeps or wants; and the clean-up Job."""

from __future__ import annotations

import kubernetes_validate
from modelstage.api.modeldeployment import ArtifactStatus, ModelDeploymentStatus, S3Connection
from modelstage.operator.job_plan import cleanup_job_name, plan_cleanup_job
from modelstage.operator.retention import Holder, kept, plan_release, plan_retention, remember


def art(digest: str, claim: str = "models") -> ArtifactStatus:
    return ArtifactStatus(
        digest=digest * 20, uri=f"pvc://{claim}/a/ns/{digest * 20}", format="sharded_state",
        tensor_parallel_size=1,
    )  # fmt: skip


def holder(*history: ArtifactStatus, keep: int = 2, phase: str = "Ready",
           wants: str | None = None) -> Holder:  # fmt: skip
    status = ModelDeploymentStatus(
        phase=phase, artifact=history[0] if history else None, artifacts=list(history)
    )  # type: ignore[arg-type]
    return Holder(status, keep, wants or (history[0].uri if history else None))


def digests(artifacts: tuple[ArtifactStatus, ...]) -> list[str]:
    return [a.digest[0] for a in artifacts]


def test_the_newest_n_are_kept_and_the_rest_deleted() -> None:
    plan = plan_retention(holder(art("d"), art("c"), art("b"), art("a")), [])
    assert digests(plan.history) == ["d", "c"]
    assert digests(plan.delete) == ["b", "a"]


def test_an_artifact_another_model_deployment_keeps_is_released_not_deleted() -> None:
    other = holder(art("x"), art("b"))  # keeps x and b
    plan = plan_retention(holder(art("d"), art("c"), art("b"), art("a")), [other])
    assert digests(plan.delete) == ["a"]
    assert digests(plan.released) == ["b"]
    assert digests(plan.history) == ["d", "c"]


def test_an_artifact_another_model_deployment_wants_is_never_deleted() -> None:
    """The other spec asks for ``a`` (maybe being staged right now into that location)."""
    other = holder(art("x"), wants=art("a").uri)
    plan = plan_retention(holder(art("d"), art("c"), art("a"), keep=1), [other])
    assert digests(plan.delete) == ["c"] and digests(plan.released) == ["a"]


def test_the_same_digest_on_another_claim_is_another_artifact() -> None:
    other = holder(art("a", claim="elsewhere"))
    plan = plan_retention(holder(art("d"), art("c"), art("a")), [other])
    assert digests(plan.delete) == ["a"]


def test_the_rollback_target_is_kept_until_the_rollout_is_ready() -> None:
    own = holder(art("d"), art("c"), art("b"), keep=1, phase="RollingOut")
    own = Holder(own.status.model_copy(update={"previous_artifact": art("c")}), 1, own.wants)
    assert kept(own) == {art("d").uri, art("c").uri}
    ready = Holder(own.status.model_copy(update={"phase": "Ready"}), 1, own.wants)
    assert kept(ready) == {art("d").uri}


def test_history_puts_the_current_artifact_first_once() -> None:
    status = ModelDeploymentStatus(artifact=art("c"), previous_artifact=art("b"),
                                   artifacts=[art("b"), art("a"), art("c")])  # fmt: skip
    assert digests(tuple(remember(status).artifacts)) == ["c", "b", "a"]
    same = remember(remember(status))
    assert same.artifacts == remember(status).artifacts


def test_deleting_the_model_deployment_releases_everything_only_it_keeps() -> None:
    own = holder(art("c"), art("b"), art("a"))
    plan = plan_release(own, [holder(art("b"))])
    assert digests(plan.delete) == ["c", "a"] and digests(plan.released) == ["b"]


def test_cleanup_job_mounts_the_claim_of_the_artifact_and_runs_delete() -> None:
    artifact = art("a", claim="old-claim")
    job = plan_cleanup_job(artifact, namespace="ns", owner_name="llama", connection=None,
                           image="stager:1")  # fmt: skip
    assert job is not None
    assert job["metadata"]["name"] == cleanup_job_name(artifact.digest, artifact.uri)
    assert len(job["metadata"]["name"]) <= 63 and "ownerReferences" not in job["metadata"]
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["modelstage", "delete", "--artifact",
                                    f"/mnt/modelstage/artifacts/a/ns/{'a' * 20}",
                                    "--digest", "a" * 20]  # fmt: skip
    assert pod["volumes"][1]["persistentVolumeClaim"] == {"claimName": "old-claim"}
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)


def test_cleanup_job_for_s3_needs_the_connection_and_takes_its_credentials_by_reference() -> None:
    artifact = ArtifactStatus(digest="e" * 20, uri=f"s3://b/p/ns/{'e' * 20}",
                              format="runai_streamer_sharded", tensor_parallel_size=1)  # fmt: skip
    assert plan_cleanup_job(artifact, namespace="ns", owner_name="x", connection=None,
                            image="i") is None  # fmt: skip
    connection = S3Connection(endpoint="http://s3:9000", credentials_secret="creds")
    job = plan_cleanup_job(artifact, namespace="ns", owner_name="x", connection=connection,
                           image="i")  # fmt: skip
    assert job is not None
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:4] == ["modelstage", "delete", "--artifact", artifact.uri]
    assert any(a.startswith("--s3-endpoint=") for a in container["command"])
    env = {e["name"]: e for e in container["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "creds"
