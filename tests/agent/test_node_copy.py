"""``modelstage node-copy`` against the agent's copy server over HTTP, with tokens reviewed by
a TokenReview endpoint (``support.token_review``): a verified, atomic, content-addressed copy
from a local artifact or S3; a complete copy proven again without a byte rewritten; a corrupt
source refused with the file and chunk named and nothing published; room refused before any
byte; tokens for another node, another audience or no ServiceAccount refused; never a byte read
past a file's declared size; nothing written outside the root."""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from modelstage.agent import store
from modelstage.agent.auth import TokenReviewer
from modelstage.agent.receive import Receiver
from modelstage.agent.server import CopyServer
from modelstage.core import node_cache
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST, Manifest
from modelstage.plugin.node_copy import check_node_copy
from modelstage.stager.cli import main
from modelstage.stager.stage import StageRequest, stage
from support.node_agent import CHUNK, digest_of
from support.s3_server import ACCESS_KEY, SECRET_KEY, S3Server
from support.token_review import Token, TokenReviewAPI

HEX = "[0-9a-f]{64}"
NODE = "n1"


@dataclass
class Agent:
    root: Path
    server: CopyServer
    tokens: TokenReviewAPI
    token_dir: Path

    @property
    def url(self) -> str:
        return self.server.url

    def token(self, name: str, token: Token) -> Path:
        """A token file holding ``name``, which the API knows as ``token``."""
        self.tokens.tokens[name] = token
        path = self.token_dir / name
        path.write_text(name + "\n")
        return path


@pytest.fixture
def tokens() -> Iterator[TokenReviewAPI]:
    api = TokenReviewAPI().start()
    yield api
    api.stop()


def start_agent(tmp_path: Path, tokens: TokenReviewAPI, budget: int = 10**10, **kw: Any) -> Agent:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    receiver = Receiver(root, NODE, budget)
    server = CopyServer(("127.0.0.1", 0), receiver, TokenReviewer(tokens.client(), NODE, **kw))
    server.start()
    token_dir = tmp_path / "tokens"
    token_dir.mkdir(exist_ok=True)
    return Agent(root, server, tokens, token_dir)


@pytest.fixture
def agent(tmp_path: Path, tokens: TokenReviewAPI) -> Iterator[Agent]:
    running = start_agent(tmp_path, tokens)
    yield running
    running.server.shutdown()
    running.server.server_close()


def run_cli(
    capsys: pytest.CaptureFixture[str], agent: Agent, token: Path, *argv: str
) -> tuple[int, dict[str, Any] | str]:
    code = main(["node-copy", "--agent", agent.url, "--token-file", str(token), *argv])
    out, err = capsys.readouterr()
    if code == 0:
        return code, json.loads(out.strip().splitlines()[-1])
    return code, err.strip().splitlines()[-1]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not p.name.endswith(".lock"))  # fmt: skip


def test_copies_a_local_artifact_verified_content_addressed_and_granted(
    artifact: Path, agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    token = agent.token("a-token", Token("team-a"))
    digest = digest_of(artifact)
    code, summary = run_cli(capsys, agent, token, "--artifact", str(artifact), "--digest",
                            digest, "--tp", "2")  # fmt: skip
    assert code == 0, summary
    assert isinstance(summary, dict)
    raw = (artifact / MANIFEST).read_bytes()
    content = node_cache.content_address(raw)
    manifest = Manifest.from_json(raw, "source")
    assert summary["content"] == content and summary["digest"] == digest
    assert summary["node"] == NODE and summary["alreadyComplete"] is False
    assert summary["bytes"] == manifest.bytes + len(node_cache.canonical_manifest(raw))
    assert summary["files"] == len(manifest.files) and summary["bytesPerSecond"] > 0
    copy = node_cache.copy_dir(agent.root, content)
    assert {n: b for n, b in tree(copy).items() if n != MANIFEST} == {
        n: b for n, b in tree(artifact).items() if n != MANIFEST}  # fmt: skip
    assert check_node_copy(copy, digest, raw).hit
    copy.chmod(0o750)
    verify_directory(copy, digest=digest, tp=2)
    [held] = store.scan(agent.root).copies
    assert held.content == content and held.grants == [("team-a", digest)]
    assert not list((agent.root / node_cache.PARTIAL).glob("[0-9a-f]*[0-9a-f]"))


def test_a_complete_copy_is_proven_again_and_nothing_rewritten(
    artifact: Path, agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    digest = digest_of(artifact)
    args = ("--artifact", str(artifact), "--digest", digest)
    assert run_cli(capsys, agent, agent.token("a", Token("team-a")), *args)[0] == 0
    content = node_cache.content_address((artifact / MANIFEST).read_bytes())
    copy = node_cache.copy_dir(agent.root, content)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in copy.iterdir()}
    code, summary = run_cli(capsys, agent, agent.token("b", Token("team-b")), *args)
    assert code == 0 and isinstance(summary, dict) and summary["alreadyComplete"] is True
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in copy.iterdir()} == before
    [held] = store.scan(agent.root).copies
    assert held.grants == [("team-a", digest), ("team-b", digest)]
    code, again = run_cli(capsys, agent, agent.token("a", Token("team-a")), *args)
    assert code == 0 and isinstance(again, dict) and again["bytesPerSecond"] == 0.0


def flip_middle_chunk(directory: Path) -> tuple[str, int]:
    name = sorted(p.name for p in directory.glob("model-rank-1-part-*.safetensors"))[0]
    data = bytearray((directory / name).read_bytes())
    index = len(data) // CHUNK // 2
    data[index * CHUNK + 3] ^= 0xFF
    (directory / name).write_bytes(bytes(data))
    return name, index


def test_a_corrupt_source_is_refused_naming_file_and_chunk_and_nothing_is_published(
    artifact: Path, agent: Agent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "source"
    shutil.copytree(artifact, source)
    name, index = flip_middle_chunk(source)
    code, err = run_cli(capsys, agent, agent.token("a", Token("team-a")), "--artifact",
                        str(source), "--digest", digest_of(artifact))  # fmt: skip
    assert code == 1
    begin, end = index * CHUNK, (index + 1) * CHUNK - 1
    assert err == (f"error: {name}: chunk {index} (bytes {begin}-{end}) does not match the "
                   "manifest's hash; the artifact is corrupt or changed since it was staged: "
                   "verify it (`modelstage verify`) and restage")  # fmt: skip
    content = node_cache.content_address((artifact / MANIFEST).read_bytes())
    assert not node_cache.copy_dir(agent.root, content).exists()
    partial = node_cache.partial_dir(agent.root, content)
    assert not (partial / name).exists() and not (partial / MANIFEST).exists()
    for kept in partial.iterdir():  # only what verified stays, byte for byte the source's
        assert kept.read_bytes() == (artifact / kept.name).read_bytes()


def test_files_verified_before_a_stop_are_not_rewritten(
    artifact: Path, agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy Job that stopped after some files (its deadline, the node): the next one
    streams them again as proof, and the agent keeps the files it verified."""
    raw = (artifact / MANIFEST).read_bytes()
    digest = digest_of(artifact)
    receiver = agent.server.receiver
    offer = receiver.offer("team-a", digest, raw)
    first = str(offer["need"][0])  # type: ignore[index]
    data = (artifact / first).read_bytes()
    receiver.put_file("team-a", str(offer["content"]), first, len(data), io.BytesIO(data).read)
    partial = node_cache.partial_dir(agent.root, str(offer["content"]))
    inode = (partial / first).stat().st_ino
    code, summary = run_cli(capsys, agent, agent.token("a", Token("team-a")), "--artifact",
                            str(artifact), "--digest", digest)  # fmt: skip
    assert code == 0, summary
    copy = node_cache.copy_dir(agent.root, str(offer["content"]))
    assert (copy / first).stat().st_ino == inode


def sparse_artifact(artifact: Path, where: Path, size: int) -> str:
    """``artifact`` with one more file: ``size`` bytes of zeros, sparse on disk, declared in
    its manifest with valid chunk hashes."""
    from modelstage.core.integrity import MAX_CHUNK_BYTES, FileDigest, digest_bytes
    from modelstage.core.manifest import FileEntry

    shutil.copytree(artifact, where)
    name = "model-rank-0-part-9.safetensors"
    with open(where / name, "wb") as f:
        f.truncate(size)
    zero = digest_bytes(bytes(MAX_CHUNK_BYTES), MAX_CHUNK_BYTES).chunks[0]
    count = -(-size // MAX_CHUNK_BYTES)
    assert size % MAX_CHUNK_BYTES == 0
    entry = FileEntry.of(FileDigest(size, MAX_CHUNK_BYTES, (zero,) * count))
    doc = json.loads((where / MANIFEST).read_text())
    doc["files"][name] = entry.to_doc()
    doc["bytes"] += size
    (where / MANIFEST).write_text(json.dumps(doc))
    return name


def test_a_sparse_artifact_over_the_budget_is_refused_before_any_byte(
    artifact: Path, tmp_path: Path, tokens: TokenReviewAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    small = start_agent(tmp_path, tokens, budget=1 << 30)
    try:
        source = tmp_path / "sparse"
        sparse_artifact(artifact, source, 2 << 30)
        assert sum(p.stat().st_blocks * 512 for p in source.iterdir()) < 64 << 20
        code, err = run_cli(capsys, small, small.token("a", Token("team-a")), "--artifact",
                            str(source), "--digest", digest_of(artifact))  # fmt: skip
        assert code == 1
        assert re.fullmatch(r"error: node n1: the copy needs \d+ bytes, the node cache's budget "
                            rf"of {1 << 30} has {1 << 30} left \(0 held, 0 reserved by copies "
                            r"in progress\); raise the budget or let copies be evicted", err), err  # fmt: skip
        assert files_of(small.root) == []
    finally:
        small.server.shutdown()
        small.server.server_close()


@pytest.mark.parametrize(
    ("token", "status", "message"),
    [
        (Token("team-a", node="n2"), 403,
         "the token is bound to a pod on node ['n2'], not n1"),
        (Token("team-a", audiences=("https://kubernetes.default.svc",)), 401,
         'the token was refused by the API server: token audiences ["https://kubernetes.'
         'default.svc"] is invalid for the target audiences [\'modelstage-node-agent\']'),
        (Token("team-a", node=None), 403,
         "the token has no node claim (Kubernetes below 1.30?): the agent accepts such tokens "
         "only with --allow-tokens-without-node"),
        (Token("team-a", user="alice"), 403,
         "only a ServiceAccount token of a copy Job may stream copies"),
    ],
    ids=["another-node", "another-audience", "no-node-claim", "not-a-service-account"],
)  # fmt: skip
def test_a_token_the_agent_must_not_trust_is_refused(
    artifact: Path, agent: Agent, capsys: pytest.CaptureFixture[str],
    token: Token, status: int, message: str,
) -> None:  # fmt: skip
    code, err = run_cli(capsys, agent, agent.token("t", token), "--artifact", str(artifact),
                        "--digest", digest_of(artifact))  # fmt: skip
    assert (code, err) == (1, f"error: {message}")
    assert files_of(agent.root) == []
    conn = http.client.HTTPConnection("127.0.0.1", agent.server.server_address[1])
    conn.request("POST", f"/v1/offers?digest={digest_of(artifact)}", body=b"{}",
                 headers={"Authorization": "Bearer t"})  # fmt: skip
    assert conn.getresponse().status == status
    conn.request("POST", "/v1/offers?digest=x", body=b"{}")
    response = conn.getresponse()
    assert response.status == 401 and b"no bearer token" in response.read()


def test_a_token_without_the_node_claim_is_accepted_only_when_allowed(
    artifact: Path, tmp_path: Path, tokens: TokenReviewAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    old = start_agent(tmp_path, tokens, allow_without_node=True)
    try:
        for token in (Token("team-a", node=None), Token("team-b", node="n2")):
            code, out = run_cli(capsys, old, old.token(token.namespace, token), "--artifact",
                                str(artifact), "--digest", digest_of(artifact))  # fmt: skip
            assert code == (0 if token.node is None else 1), out
        assert [c.grants for c in store.scan(old.root).copies] == [[("team-a", digest_of(artifact))]]
    finally:
        old.server.shutdown()
        old.server.server_close()


def test_reviews_are_cached_for_a_minute(
    artifact: Path, agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_cli(capsys, agent, agent.token("a", Token("team-a")), "--artifact",
                      str(artifact), "--digest", digest_of(artifact))  # fmt: skip
    assert code == 0 and agent.tokens.reviews == 1


def test_a_body_longer_than_declared_is_refused_and_never_read(
    artifact: Path, agent: Agent
) -> None:
    agent.token("a", Token("team-a"))
    raw = (artifact / MANIFEST).read_bytes()
    conn = http.client.HTTPConnection("127.0.0.1", agent.server.server_address[1])
    auth = {"Authorization": "Bearer a"}
    conn.request("POST", f"/v1/offers?digest={digest_of(artifact)}", body=raw, headers=auth)
    offer = json.loads(conn.getresponse().read())
    name = offer["need"][0]
    data = (artifact / name).read_bytes()
    conn.request("PUT", f"/v1/copies/{offer['content']}/files/{name}", body=data + b"!" * 4096,
                 headers=auth)  # fmt: skip
    response = conn.getresponse()
    assert response.status == 400
    assert json.loads(response.read())["error"] == (
        f"{name}: Content-Length {len(data) + 4096}, the manifest says {len(data)} bytes; send "
        "exactly the file's bytes")  # fmt: skip
    assert response.getheader("Connection") == "close"
    assert files_of(agent.root) == []


def test_copies_from_s3(
    s3: S3Server, bucket: str, checkpoint: Path, agent: Agent, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    uri = f"s3://{bucket}/artifacts/x/"
    stage(StageRequest(source=str(checkpoint), out=uri, tp=2, format="runai_streamer_sharded",
                       s3=s3.options(), chunk_bytes=CHUNK))  # fmt: skip
    local = tmp_path / "local"
    local.mkdir()
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=bucket, Prefix="artifacts/x/")["Contents"]:
        body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        (local / obj["Key"].rsplit("/", 1)[1]).write_bytes(body)
    digest = digest_of(local)
    token = agent.token("a", Token("team-a"))
    env = {**os.environ, **s3.env(), "PYTHONSAFEPATH": "1",
           "MODELSTAGE_NODE_AGENT": agent.url, "MODELSTAGE_NODE_AGENT_TOKEN_FILE": str(token)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "modelstage.stager.cli", "node-copy", "--artifact", uri,
         "--digest", digest, "--tp", "2", "--s3-path-style"],
        env=env, capture_output=True, text=True, timeout=300, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["digest"] == digest and summary["files"] == len(list(local.iterdir())) - 1
    copy = node_cache.copy_dir(agent.root, summary["content"])
    assert {n: b for n, b in tree(copy).items() if n != MANIFEST} == {
        n: b for n, b in tree(local).items() if n != MANIFEST}  # fmt: skip
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert secret not in done.stdout + done.stderr
        for f in (agent.root / node_cache.STATE).iterdir():
            assert secret not in f.read_text() and "s3://" not in f.read_text()


def test_refuses_the_wrong_tensor_parallel_size(
    artifact: Path, agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(capsys, agent, agent.token("a", Token("team-a")), "--artifact",
                        str(artifact), "--digest", digest_of(artifact), "--tp", "4")  # fmt: skip
    assert code == 1 and "staged for tensor parallel size 2" in str(err)
    assert files_of(agent.root) == []


@pytest.mark.parametrize("digest", ["../x", "..", "A" * 64, "ab/cd", "0" * 63])
def test_a_bad_digest_sends_nothing(
    artifact: Path, agent: Agent, capsys: pytest.CaptureFixture[str], digest: str
) -> None:
    code, err = run_cli(capsys, agent, agent.token("a", Token("team-a")), "--artifact",
                        str(artifact), "--digest", digest)  # fmt: skip
    assert code == 1 and "is not an artifact digest" in str(err)
    assert agent.tokens.reviews == 0


def test_without_an_agent_it_says_what_to_set(
    artifact: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MODELSTAGE_NODE_AGENT", raising=False)
    code = main(["node-copy", "--artifact", str(artifact), "--digest", digest_of(artifact)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == (
        "error: no node agent: pass --agent http://HOST:PORT or set MODELSTAGE_NODE_AGENT")


def test_a_manifest_naming_a_path_outside_is_refused(
    artifact: Path, agent: Agent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "src" / "artifact"
    shutil.copytree(artifact, source)
    doc = json.loads((source / MANIFEST).read_text())
    name = sorted(doc["files"])[0]
    doc["files"]["../x"] = doc["files"].pop(name)
    (source / MANIFEST).write_text(json.dumps(doc))
    code, err = run_cli(capsys, agent, agent.token("a", Token("team-a")), "--artifact",
                        str(source), "--digest", doc["digest"])  # fmt: skip
    assert code == 1 and "invalid manifest" in str(err) and "'../x'" in str(err)
    assert files_of(agent.root) == []


@pytest.mark.parametrize("where", ["copy", "partial", "partial-root", "state"])
def test_a_link_in_the_root_is_replaced_not_followed(
    artifact: Path, agent: Agent, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """A link where the copy goes (``<content>``, ``.partial/<content>``, ``.partial``,
    ``.state``) pointing out of the root: the link itself is replaced, and what it pointed
    at is left as it was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"precious")
    (outside / MANIFEST).write_bytes(b"not ours")
    root = agent.root
    content = node_cache.content_address((artifact / MANIFEST).read_bytes())
    link = {
        "copy": node_cache.copy_dir(root, content),
        "partial": node_cache.partial_dir(root, content),
        "partial-root": root / node_cache.PARTIAL,
        "state": root / node_cache.STATE,
    }[where]
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, link)
    code, summary = run_cli(capsys, agent, agent.token("a", Token("team-a")), "--artifact",
                            str(artifact), "--digest", digest_of(artifact))  # fmt: skip
    assert code == 0, summary
    assert tree(outside) == {"keep": b"precious", MANIFEST: b"not ours"}
    assert not link.is_symlink()
    assert node_cache.copy_dir(root, content).is_dir()
