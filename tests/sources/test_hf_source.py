"""The Hugging Face Hub source, without the Hub: the download path against a loopback server
that speaks the Hub's endpoints (tests/support/hub_server.py), the offline path against a
hand-made cache in the Hub's layout with ``HF_HUB_OFFLINE=1``.

Proven here: revision -> commit resolution recorded as the identity, only the needed files
fetched, a dropped transfer resumed with a Range request, finished files not fetched again,
the token sent in the Authorization header and absent from every output, one clear line for
gated, missing and unknown-revision repositories, the offline cache read by branch name.
Only the real Hub proves: Xet-backed transfers (hf_xet), cross-host CDN redirects (the
client then drops the Authorization header), rate limiting, and the Hub's exact current
headers and status codes for gated and private repositories.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from modelstage.core.errors import CheckpointError
from modelstage.core.manifest import MANIFEST
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.network import Timeouts
from modelstage.stager.stage import StageRequest, stage
from support.hub_server import FakeHub, HubRepo, silent_server

from .conftest import HF_TOKEN

MiB = 1024 * 1024
COMMIT = hashlib.sha1(b"modelstage test commit").hexdigest()
NEEDED = {
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors", "special_tokens_map.json", "tokenizer.json",
    "tokenizer_config.json",
}  # fmt: skip
EXTRAS = {
    "README.md": b"# a model card\n",
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "pytorch_model.bin": b"pickle bytes the stager must never fetch",
    "original/consolidated.safetensors": b"a second copy of the weights, not needed",
}


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No token, no offline mode, no endpoint unless a test sets them."""
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)


def serve(hub: FakeHub, ckpt: Path, repo_id: str = "acme/llama", *, gated: bool = False) -> None:
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()} | EXTRAS
    hub.repos[repo_id] = HubRepo(files, COMMIT, {"main": COMMIT, "v1.0": COMMIT}, gated=gated)


def artifact_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != MANIFEST}


@pytest.fixture(scope="module")
def local_artifact(split_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint staged from local disk at TP=2: what every hub stage must equal."""
    out = tmp_path_factory.mktemp("hf-local") / "art"
    stage(StageRequest(source=str(split_ckpt), out=str(out), tp=2))
    return out


def hub_request(out: Path, cache: Path, **kw: object) -> StageRequest:
    kw.setdefault("revision", "main")
    return StageRequest(source="hf://acme/llama", out=str(out), tp=2, cache_dir=str(cache),
                        **kw)  # type: ignore[arg-type]  # fmt: skip


def test_a_branch_is_resolved_to_its_commit_and_only_the_needed_files_are_fetched(
    hub: FakeHub, split_ckpt: Path, local_artifact: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    serve(hub, split_ckpt)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    summary = stage(hub_request(tmp_path / "out", tmp_path / "cache"))

    assert artifact_files(tmp_path / "out") == artifact_files(local_artifact)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    source = manifest["source"]
    assert source["uri"] == "hf://acme/llama" and source["revision"] == "main"
    assert source["kind"] == "hf" and source["commit"] == COMMIT
    assert summary["sourceIdentity"] == f"commit:{COMMIT}"
    fetched = [name for name, _ in hub.content_gets()]
    assert sorted(fetched) == sorted(NEEDED), "each needed file exactly once, nothing else"
    resolved = [s.path for s in hub.seen if s.path.startswith("/api/")]
    # the branch once (the identity the digest is taken from), then the listing at that commit
    assert resolved == ["/api/models/acme/llama/revision/main", f"/api/models/acme/llama/revision/{COMMIT}"]
    assert all(f"/resolve/{COMMIT}/" in s.path for s in hub.seen if "/resolve/" in s.path)
    ref = tmp_path / "cache" / "models--acme--llama" / "refs" / "main"
    assert ref.read_text() == COMMIT  # an offline rerun by branch name finds this snapshot


def test_a_rerun_reads_finished_files_from_the_cache_without_fetching_them(
    hub: FakeHub, split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(hub, split_ckpt)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    stage(hub_request(tmp_path / "a", tmp_path / "cache"))
    hub.seen.clear()
    stage(hub_request(tmp_path / "b", tmp_path / "cache", revision="v1.0"))
    assert hub.content_gets() == []
    assert [s.path for s in hub.seen] == [
        "/api/models/acme/llama/revision/v1.0",
        f"/api/models/acme/llama/revision/{COMMIT}",
    ]
    assert artifact_files(tmp_path / "a") == artifact_files(tmp_path / "b")


def test_a_transfer_cut_off_midway_resumes_with_a_range_request(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub writes what it received in whole 10 MiB chunks and, after a dropped
    connection, asks for the rest from there; a 20 MB file cut at 12 MiB proves it."""
    spec = SyntheticModel(hidden_size=512, intermediate_size=1536, num_layers=2,
                          vocab_size=4000, num_shards=2)  # fmt: skip
    ckpt = write_checkpoint(spec, tmp_path / "ckpt")
    stage(StageRequest(source=str(ckpt), out=str(tmp_path / "local"), tp=2))
    serve(hub, ckpt)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    name = "model-00002-of-00002.safetensors"
    hub.drop_after[name] = 12 * MiB
    stage(hub_request(tmp_path / "out", tmp_path / "cache"))
    assert [r for n, r in hub.content_gets() if n == name] == [None, f"bytes={10 * MiB}-"]
    assert artifact_files(tmp_path / "out") == artifact_files(tmp_path / "local")


def test_a_token_from_the_environment_opens_a_gated_repository(
    hub: FakeHub, split_ckpt: Path, local_artifact: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    serve(hub, split_ckpt, gated=True)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    stage(hub_request(tmp_path / "out", tmp_path / "cache"))
    assert artifact_files(tmp_path / "out") == artifact_files(local_artifact)
    assert {s.authorization for s in hub.seen} == {f"Bearer {HF_TOKEN}"}


@pytest.mark.parametrize("token", [None, "hf_NotTheRightToken0Puffin"], ids=["none", "wrong"])
def test_a_gated_repository_without_access_is_one_line_that_names_the_fix(
    hub: FakeHub, split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    token: str | None,
) -> None:  # fmt: skip
    serve(hub, split_ckpt, gated=True)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(CheckpointError) as err:
        stage(hub_request(tmp_path / "out", tmp_path / "cache"))
    message = str(err.value)
    assert message.startswith("hf://acme/llama is gated") and "accept the model's terms" in message
    assert "\n" not in message and (token is None or token not in message)
    assert hub.content_gets() == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "revision", "expected"),
    [
        ("hf://acme/absent", "main", "hf://acme/absent: repository not found, or private"),
        ("hf://acme/llama", "no-such-branch", "revision 'no-such-branch' not found"),
    ],
    ids=["missing-repo", "missing-revision"],
)
def test_a_missing_repository_or_revision_is_one_clear_line(
    hub: FakeHub, split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    source: str, revision: str, expected: str,
) -> None:  # fmt: skip
    serve(hub, split_ckpt)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    request = StageRequest(source=source, out=str(tmp_path / "out"), tp=2, revision=revision,
                           cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(CheckpointError, match=expected) as err:
        stage(request)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("revision", ["../../../escape", "/abs", "main/../../x"])
def test_a_revision_that_would_leave_the_cache_folder_is_refused_before_any_request(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, revision: str
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    with pytest.raises(CheckpointError, match="not a branch, tag or commit sha"):
        stage(hub_request(tmp_path / "out", tmp_path / "cache", revision=revision))
    assert hub.seen == []


def test_cli_sends_the_token_file_only_in_the_authorization_header(
    hub: FakeHub, split_ckpt: Path, tmp_path: Path
) -> None:
    serve(hub, split_ckpt, gated=True)
    token_file = tmp_path / "token"
    token_file.write_text(HF_TOKEN + "\n")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("hf_WrongTokenForTheCli7Heron\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.endpoint)

    def run(out: str, token: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(Path(sys.executable).with_name("modelstage")), "stage", "hf://acme/llama",
             "--revision", "main", "--tp", "2", "--out", str(tmp_path / out),
             "--cache-dir", str(tmp_path / f"cache-{out}"), "--hf-token-file", str(token)],
            env=env, cwd="/", capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    ok = run("ok", token_file)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["sourceIdentity"] == f"commit:{COMMIT}"
    assert {s.authorization for s in hub.seen} == {f"Bearer {HF_TOKEN}"}

    denied = run("denied", wrong_file)
    assert denied.returncode == 1
    assert denied.stderr.strip().splitlines()[-1].startswith("error: hf://acme/llama is gated")
    for result in (ok, denied):
        for text in (result.stdout, result.stderr):
            assert HF_TOKEN not in text and "hf_WrongTokenForTheCli7Heron" not in text
    assert HF_TOKEN not in (tmp_path / "ok" / MANIFEST).read_text()


# --- timeouts, retries, progress ---------------------------------------------------------------
# Without the stager's timeouts these tests would hang: the timeout marks turn that into a
# failure.
@pytest.mark.timeout(120)
def test_an_endpoint_that_accepts_and_never_answers_fails_after_its_retries_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub's model-info call has no timeout of its own; the stager's read timeout
    (here from MODELSTAGE_READ_TIMEOUT) ends each attempt, MODELSTAGE_RETRIES more follow."""
    with silent_server() as silent:
        monkeypatch.setenv("HF_ENDPOINT", silent.endpoint)
        monkeypatch.setenv("MODELSTAGE_READ_TIMEOUT", "0.5")
        monkeypatch.setenv("MODELSTAGE_RETRIES", "2")
        with pytest.raises(CheckpointError) as err:
            stage(hub_request(tmp_path / "out", tmp_path / "cache"))
        accepted = silent.accepted
    message = str(err.value)
    assert message == (
        f"hf://acme/llama: the Hub at {silent.endpoint} did not answer in time (no answer "
        "within 0.5 s (ReadTimeout), 3 attempts); check HF_ENDPOINT and the network, raise "
        "--read-timeout / --retries, or stage from a pre-filled cache with HF_HUB_OFFLINE=1"
    )
    assert accepted == 3, "one connection per attempt"
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_cli_read_timeout_flag_ends_a_silent_hub_with_the_error_line(tmp_path: Path) -> None:
    with silent_server() as silent:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSTAGE_"))}
        env.update(HF_ENDPOINT=silent.endpoint)
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("modelstage")), "stage", "hf://acme/llama",
             "--tp", "2", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"),
             "--read-timeout", "0.5", "--connect-timeout", "2", "--retries", "1"],
            env=env, cwd="/", capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        accepted = silent.accepted
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: hf://acme/llama: the Hub at {silent.endpoint} did not "
                                "answer in time (no answer within 0.5 s (ReadTimeout), 2 attempts)")
    assert any(line.startswith("hf: the model info: no answer within 0.5 s (ReadTimeout); "
                               "retrying (1/1)") for line in lines), proc.stderr
    assert accepted == 2


def test_a_download_that_stalls_midway_is_abandoned_after_the_read_timeout_and_resumed(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection stays open and silent after 12 MiB: the read timeout (1 s) ends it and
    the download resumes from the last whole 10 MiB chunk with a Range request.
    huggingface_hub's own download timeout is set to an hour first, so only the stager's
    setting can end the stall: the stage runs in a thread, and a stage still running after a
    minute fails the test instead of hanging it (the thread ends when the hub stops)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 3600)
    spec = SyntheticModel(hidden_size=512, intermediate_size=1536, num_layers=2,
                          vocab_size=4000, num_shards=2)  # fmt: skip
    ckpt = write_checkpoint(spec, tmp_path / "ckpt")
    stage(StageRequest(source=str(ckpt), out=str(tmp_path / "local"), tp=2))
    serve(hub, ckpt)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    name = "model-00002-of-00002.safetensors"
    hub.stall_after[name] = 12 * MiB
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(stage(hub_request(tmp_path / "out", tmp_path / "cache",
                                             timeouts=Timeouts(connect=5, read=1, retries=1))))
        except BaseException as e:  # handed to the test thread
            outcome.append(e)  # fmt: skip

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the stalled download was not abandoned"
    assert isinstance(outcome[0], dict), outcome
    assert [r for n, r in hub.content_gets() if n == name] == [None, f"bytes={10 * MiB}-"]
    assert artifact_files(tmp_path / "out") == artifact_files(tmp_path / "local")


def test_downloads_report_bytes_of_the_total_rate_and_files(
    hub: FakeHub, split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    serve(hub, split_ckpt)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    stage(hub_request(tmp_path / "out", tmp_path / "cache"))
    err = capfd.readouterr().err
    needed = sum((split_ckpt / n).stat().st_size for n in NEEDED) - (
        split_ckpt / "model.safetensors.index.json"
    ).stat().st_size  # the index is fetched first, to learn the weight files
    from modelstage.core.progress import human_bytes

    assert f"hf: fetching 8 of 9 files ({human_bytes(needed)})" in err
    final = [line for line in err.splitlines() if line.startswith("hf: downloading acme/llama:")]
    assert final and final[-1].startswith(
        f"hf: downloading acme/llama: {human_bytes(needed)} / {human_bytes(needed)} (100%), "
        "8/8 files, "
    ), err


# --- offline: a pre-filled cache in the Hub's layout ------------------------------------------
def fill_cache(cache: Path, ckpt: Path, *, refs: dict[str, str]) -> Path:
    """The layout huggingface_hub writes: blobs by hash, snapshot links, refs by name."""
    storage = cache / "models--acme--llama"
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in ckpt.iterdir():
        data = path.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (storage / "blobs" / blob).write_bytes(data)
        (snapshot / path.name).symlink_to(f"../../blobs/{blob}")
    for name, commit in refs.items():
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / name).write_text(commit)
    return snapshot


def test_offline_mode_stages_a_prefilled_cache_by_branch_name_without_any_request(
    hub: FakeHub, split_ckpt: Path, local_artifact: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    fill_cache(tmp_path / "cache", split_ckpt, refs={"main": COMMIT})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # reachable, and must not be used
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    summary = stage(hub_request(tmp_path / "out", tmp_path / "cache"))
    assert hub.seen == []
    assert artifact_files(tmp_path / "out") == artifact_files(local_artifact)
    assert summary["sourceIdentity"] == f"commit:{COMMIT}"


def test_offline_mode_without_the_revision_in_the_cache_says_how_to_fill_it(
    split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill_cache(tmp_path / "cache", split_ckpt, refs={"main": COMMIT})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"HF_HUB_OFFLINE is set .* revision 'v2'"):
        stage(hub_request(tmp_path / "out", tmp_path / "cache", revision="v2"))


def test_a_snapshot_link_that_leaves_the_repository_cache_is_refused(
    split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = fill_cache(tmp_path / "cache", split_ckpt, refs={"main": COMMIT})
    outside = tmp_path / "elsewhere.json"
    outside.write_text((split_ckpt / "tokenizer.json").read_text())
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(outside)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: symlink escapes"):
        stage(hub_request(tmp_path / "out", tmp_path / "cache"))


def test_a_moved_branch_is_resolved_anew_and_never_answered_with_the_stale_artifact(
    hub: FakeHub, split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelstage.core.errors import ArtifactError

    serve(hub, split_ckpt)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    first = stage(hub_request(tmp_path / "out", tmp_path / "cache"))
    assert first["sourceIdentity"] == f"commit:{COMMIT}"

    retrained = write_checkpoint(SyntheticModel(num_shards=3, split_fused=True, seed=5),
                                 tmp_path / "retrained")  # fmt: skip
    moved = hashlib.sha1(b"main, one commit later").hexdigest()
    files = {p.name: p.read_bytes() for p in retrained.iterdir()}
    hub.repos["acme/llama"] = HubRepo(files, moved, {"main": moved})
    resolved = run_cli("resolve", "hf://acme/llama", "--revision", "main")
    assert resolved.returncode == 0, resolved.stderr
    answer = json.loads(resolved.stdout.strip().splitlines()[-1])
    assert (answer["identity"], answer["commit"]) == (f"commit:{moved}", moved)
    assert answer["digestInputs"] == {"uri": "hf://acme/llama", "source": f"commit:{moved}"}

    with pytest.raises(ArtifactError, match=f"would write artifact .* source identity commit:{moved}"):
        stage(hub_request(tmp_path / "out", tmp_path / "cache"))
    second = stage(hub_request(tmp_path / "new", tmp_path / "cache"))
    assert second["digest"] != first["digest"]
    assert second["sourceIdentity"] == f"commit:{moved}"
    manifest = json.loads((tmp_path / "new" / MANIFEST).read_text())
    assert manifest["source"]["commit"] == moved and manifest["source"]["revision"] == "main"


def test_a_pinned_commit_resolves_without_asking_the_hub(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    done = run_cli("resolve", "hf://acme/llama", "--revision", COMMIT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["identity"] == f"commit:{COMMIT}"
    assert hub.seen == []


def test_resolve_describe_reports_the_architecture_and_quantization_of_the_commit(
    hub: FakeHub, split_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``loadFormat: auto`` decides by what ``resolve --describe`` reports: config.json at the
    resolved commit, fetched alone (no weight file)."""
    quantized = tmp_path / "quantized"
    shutil.copytree(split_ckpt, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (quantized / "config.json").write_text(json.dumps(config))
    serve(hub, quantized)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    plain = run_cli("resolve", "hf://acme/llama", "--revision", "main")
    assert plain.returncode == 0, plain.stderr
    assert "architecture" not in json.loads(plain.stdout) and hub.content_gets() == []
    done = run_cli("resolve", "hf://acme/llama", "--revision", "main", "--describe")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert (answer["architecture"], answer["quantization"]) == ("LlamaForCausalLM", "fp8")
    assert answer["identity"] == f"commit:{COMMIT}"
    assert [name for name, _ in hub.content_gets()] == ["config.json"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with this process's environment (HF_ENDPOINT as the test set it)."""
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "modelstage.stager.cli", *args],
                          capture_output=True, text=True, env=env, cwd="/", check=False)  # fmt: skip
