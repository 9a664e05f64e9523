"""The agent's receiving side (``agent/receive.py``) with real files: room checked before any
byte, never a byte past a file's declared size, every chunk verified, one copy per content
whoever streams it, grants only for a namespace that proved every byte, and a different
content never replacing a verified copy."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from modelstage.agent import store
from modelstage.agent.auth import Refused
from modelstage.agent.receive import Receiver
from modelstage.core import node_cache
from modelstage.core.integrity import MAX_CHUNK_BYTES, digest_bytes
from modelstage.core.manifest import MANIFEST, FileEntry, Manifest
from support.node_agent import CHUNK, copy_manifest, fake_digest

D1, D2 = fake_digest(1), fake_digest(2)
NAME = "model.safetensors"


def reader(data: bytes) -> Callable[[int], bytes]:
    stream = io.BytesIO(data)
    return stream.read


def receive(r: Receiver, ns: str, digest: str, data: bytes) -> dict[str, object]:
    raw = copy_manifest(digest, data)
    offer = r.offer(ns, digest, raw)
    for name in offer["need"]:  # type: ignore[attr-defined]
        r.put_file(ns, str(offer["content"]), name, len(data), reader(data))
    return r.commit(ns, str(offer["content"]), digest)


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and f.suffix != ".lock")


def sparse_manifest(digest: str, size: int) -> bytes:
    """A manifest of one ``size``-byte file of zeros, chunk hashes valid (what a 3 MB sparse
    artifact can declare)."""
    zero = digest_bytes(bytes(MAX_CHUNK_BYTES), MAX_CHUNK_BYTES).chunks[0]
    count = -(-size // MAX_CHUNK_BYTES)
    last = digest_bytes(bytes(size - (count - 1) * MAX_CHUNK_BYTES), MAX_CHUNK_BYTES).chunks
    from modelstage.core.integrity import FileDigest

    entry = FileEntry.of(FileDigest(size, MAX_CHUNK_BYTES, (zero,) * (count - 1) + last))
    manifest = Manifest(format="safetensors", tensorParallelSize=1, dtype="float32",
                        digest=digest, source={}, vllmVersion="0.32", layoutVersion="1",
                        files={NAME: entry}, bytes=size, modelstageVersion="0.1.0",
                        createdAt="2026-01-01T00:00:00Z", stageSeconds=1.0)  # fmt: skip
    return manifest.to_json().encode()


def test_a_copy_lands_content_addressed_read_only_with_its_grant(tmp_path: Path) -> None:
    r = Receiver(tmp_path, "n1", budget=10**9)
    data = os.urandom(3 * CHUNK + 5)
    done = receive(r, "team-a", D1, data)
    content = node_cache.content_address(copy_manifest(D1, data))
    copy = node_cache.copy_dir(tmp_path, content)
    canonical = node_cache.canonical_manifest(copy_manifest(D1, data))
    assert done == {"content": content, "bytes": len(data) + len(canonical), "files": 1,
                    "alreadyComplete": False}  # fmt: skip
    assert (copy / NAME).read_bytes() == data and (copy / MANIFEST).read_bytes() == canonical
    assert b"createdAt" not in canonical and b"stageSeconds" not in canonical
    assert oct(copy.stat().st_mode & 0o777) == "0o550"
    assert {oct(f.stat().st_mode & 0o777) for f in copy.iterdir()} == {"0o440"}
    state = node_cache.state_file(tmp_path, content)
    assert oct(state.stat().st_mode & 0o777) == "0o600"
    assert oct(state.parent.stat().st_mode & 0o777) == "0o700"
    record = json.loads(state.read_text())
    assert record["grants"] == [{"namespace": "team-a", "digest": D1}]
    assert "uri" not in state.read_text().lower() and "source" not in record
    assert not list(node_cache.partial_dir(tmp_path, content).parent.glob(content))


def test_a_sparse_artifact_declaring_more_than_the_budget_is_refused_before_any_byte(
    tmp_path: Path,
) -> None:
    r = Receiver(tmp_path, "n1", budget=1 << 30)
    raw = sparse_manifest(D1, 2 << 30)
    with pytest.raises(Refused) as refused:
        r.offer("team-a", D1, raw)
    assert refused.value.status == 507
    assert refused.value.message.startswith(
        f"node n1: the copy needs {(2 << 30) + len(node_cache.canonical_manifest(raw))} bytes, "
        f"the node cache's budget of {1 << 30} has {1 << 30} left (0 held, 0 reserved"
    )
    assert r.offers == {} and tree_bytes(tmp_path) == 0
    content = node_cache.content_address(raw)
    with pytest.raises(Refused) as no_offer:  # no reservation: no file is taken either
        r.put_file("team-a", content, NAME, 2 << 30, reader(b"\0" * 100))
    assert no_offer.value.status == 404 and tree_bytes(tmp_path) == 0


def test_reservations_of_copies_in_progress_count_against_the_budget(tmp_path: Path) -> None:
    first, second = os.urandom(4 * CHUNK), os.urandom(4 * CHUNK)
    room = len(first) + 2 * len(node_cache.canonical_manifest(copy_manifest(D1, first)))
    r = Receiver(tmp_path, "n1", budget=room)
    r.offer("a", D1, copy_manifest(D1, first))  # reserved, nothing written yet
    with pytest.raises(Refused, match=r"reserved by copies in progress") as refused:
        r.offer("b", D2, copy_manifest(D2, second))
    assert refused.value.status == 507


def test_a_file_longer_or_shorter_than_declared_is_refused_and_nothing_kept(
    tmp_path: Path,
) -> None:
    r = Receiver(tmp_path, "n1", budget=10**9)
    data = os.urandom(2 * CHUNK)
    offer = r.offer("a", D1, copy_manifest(D1, data))
    content = str(offer["content"])
    with pytest.raises(Refused, match=r"Content-Length 524289, the manifest says 524288") as e:
        r.put_file("a", content, NAME, len(data) + 1, reader(data + b"x"))
    assert e.value.status == 400
    taken: list[int] = []
    stream = io.BytesIO(data + b"more than declared")

    def counting(n: int) -> bytes:
        block = stream.read(n)
        taken.append(len(block))
        return block

    r.put_file("a", content, NAME, len(data), counting)
    assert sum(taken) == len(data)  # never a byte past the declared size
    with pytest.raises(Refused, match=r"the stream ended after 1000 of its") as short:
        r.put_file("b", content, NAME, len(data), reader(data[:1000]))
    assert short.value.status == 400


def test_a_chunk_that_does_not_match_is_refused_and_its_file_removed(tmp_path: Path) -> None:
    r = Receiver(tmp_path, "n1", budget=10**9)
    data = os.urandom(3 * CHUNK)
    offer = r.offer("a", D1, copy_manifest(D1, data))
    bad = bytearray(data)
    bad[2 * CHUNK + 7] ^= 1
    with pytest.raises(Refused) as e:
        r.put_file("a", str(offer["content"]), NAME, len(data), reader(bytes(bad)))
    assert e.value.status == 422
    assert e.value.message.startswith(f"{NAME}: chunk 2 (bytes {2 * CHUNK}-{3 * CHUNK - 1}) "
                                      "does not match the manifest's hash")  # fmt: skip
    partial = node_cache.partial_dir(tmp_path, str(offer["content"]))
    assert list(partial.iterdir()) == []
    with pytest.raises(Refused, match="has not streamed 1 file") as commit:
        r.commit("a", str(offer["content"]), D1)
    assert commit.value.status == 409


def test_same_content_from_two_namespaces_is_one_copy_with_two_grants(tmp_path: Path) -> None:
    r = Receiver(tmp_path, "n1", budget=10**9)
    data = os.urandom(2 * CHUNK)
    first = receive(r, "team-a", D1, data)
    copy = node_cache.copy_dir(tmp_path, str(first["content"]))
    inode = (copy / NAME).stat().st_ino
    # the same bytes, staged at another time by another team: another createdAt
    doc = json.loads(copy_manifest(D1, data)) | {"createdAt": "2027-05-05T00:00:00Z",
                                                  "stageSeconds": 99.0}  # fmt: skip
    raw = json.dumps(doc).encode()
    offer = r.offer("team-b", D1, raw)
    assert offer["content"] == first["content"] and offer["complete"] is True
    assert offer["need"] == [NAME] and offer["granted"] is False  # must prove it all the same
    r.put_file("team-b", str(offer["content"]), NAME, len(data), reader(data))
    second = r.commit("team-b", str(offer["content"]), D1)
    assert second["alreadyComplete"] is True
    assert (copy / NAME).stat().st_ino == inode  # verified and discarded: nothing rewritten
    scan = store.scan(tmp_path)
    assert [c.content for c in scan.copies] == [first["content"]]
    assert scan.copies[0].grants == [("team-a", D1), ("team-b", D1)]


def test_a_namespace_without_proof_gets_no_grant(tmp_path: Path) -> None:
    r = Receiver(tmp_path, "n1", budget=10**9)
    data = os.urandom(2 * CHUNK + 1)
    done = receive(r, "team-a", D1, data)
    offer = r.offer("thief", D1, copy_manifest(D1, data))
    assert offer["need"] == [NAME] and offer["granted"] is False
    with pytest.raises(Refused, match=f"namespace thief has not streamed 1 file.*{NAME}") as e:
        r.commit("thief", str(done["content"]), D1)
    assert e.value.status == 409
    wrong = bytearray(data)
    wrong[0] ^= 1
    with pytest.raises(Refused) as mismatch:  # guessing the bytes does not work either
        r.put_file("thief", str(done["content"]), NAME, len(data), reader(bytes(wrong)))
    assert mismatch.value.status == 422
    with pytest.raises(Refused):
        r.commit("thief", str(done["content"]), D1)
    record = json.loads(node_cache.state_file(tmp_path, str(done["content"])).read_text())
    assert record["grants"] == [{"namespace": "team-a", "digest": D1}]
    restarted = Receiver(tmp_path, "n1", budget=10**9)  # proofs live in memory only
    again = restarted.offer("team-b", D1, copy_manifest(D1, data))
    assert again["need"] == [NAME] and again["granted"] is False


def test_different_content_under_the_same_digest_never_replaces_a_verified_copy(
    tmp_path: Path,
) -> None:
    r = Receiver(tmp_path, "n1", budget=10**9)
    good, other = os.urandom(2 * CHUNK), os.urandom(2 * CHUNK)
    first = receive(r, "team-a", D1, good)
    second = receive(r, "team-b", D1, other)  # a tenant's rewritten artifact, same spec digest
    assert second["content"] != first["content"] and second["alreadyComplete"] is False
    assert (node_cache.copy_dir(tmp_path, str(first["content"])) / NAME).read_bytes() == good
    assert (node_cache.copy_dir(tmp_path, str(second["content"])) / NAME).read_bytes() == other
    grants = {c.content: c.grants for c in store.scan(tmp_path).copies}
    assert grants == {first["content"]: [("team-a", D1)], second["content"]: [("team-b", D1)]}


def test_the_namespace_quota_counts_the_copies_granted_to_it(tmp_path: Path) -> None:
    data = os.urandom(2 * CHUNK)
    size = len(data) + len(node_cache.canonical_manifest(copy_manifest(D1, data)))
    r = Receiver(tmp_path, "n1", budget=10**9, namespace_quota=size + 10)
    receive(r, "team-a", D1, data)
    with pytest.raises(Refused, match=rf"namespace team-a holds {size} bytes") as e:
        r.offer("team-a", D2, copy_manifest(D2, os.urandom(2 * CHUNK)))
    assert e.value.status == 507 and "nodeCache.namespaceQuota" in e.value.message
    receive(r, "team-b", D2, os.urandom(2 * CHUNK))  # another namespace has its own quota


def test_schema_1_and_inconsistent_manifests_are_refused(tmp_path: Path) -> None:
    r = Receiver(tmp_path, "n1", budget=10**9)
    doc = json.loads(copy_manifest(D1, b"abc"))
    doc["schemaVersion"] = 1
    doc["files"][NAME] = {"size": 3, "sha256": "0" * 64}
    with pytest.raises(Refused, match="restage with this release") as e:
        r.offer("a", D1, json.dumps(doc).encode())
    assert e.value.status == 400
    doc = json.loads(copy_manifest(D1, b"abc"))
    doc["files"][NAME]["blake3"] = "0" * 64
    with pytest.raises(Refused, match="its blake3 is not the root of its chunk hashes"):
        r.offer("a", D1, json.dumps(doc).encode())
    with pytest.raises(Refused, match="artifact digest is"):
        r.offer("a", D2, copy_manifest(D1, b"abc"))


def test_an_offer_declaring_2_gib_chunks_is_refused_before_any_byte(tmp_path: Path) -> None:
    r = Receiver(tmp_path, "n1", budget=1 << 40)
    doc = json.loads(copy_manifest(D1, b"x" * 10))
    doc["files"][NAME] |= {"size": 1 << 31, "chunkBytes": 1 << 31, "chunks": ["0" * 64]}
    doc["bytes"] = 1 << 31
    with pytest.raises(Refused) as e:
        r.offer("a", D1, json.dumps(doc).encode())
    assert e.value.status == 400 and e.value.message == (
        "the offered manifest: invalid manifest: files.model.safetensors.chunkBytes: 2147483648 "
        "is more than 67108864 (64 MiB), the largest chunk a reader holds in memory; restage "
        "the artifact with this release")  # fmt: skip
    assert r.offers == {} and tree_bytes(tmp_path) == 0
