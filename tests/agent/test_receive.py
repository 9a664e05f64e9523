"""The agent's receiving side (``agent/receive.py``) with real files: room checked before any
byte, never a byte past a file's declared size, every chunk verified, one copy per content
whoever streams it, grants only for a namespace that proved every byte, and a different
content never replacing a verified copy."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from modelstage.agent import store
from modelstage.agent.auth import Refused
from modelstage.agent.receive import Receiver
from modelstage.core import node_cache
from modelstage.core.integrity import MAX_CHUNK_BYTES, digest_bytes
from modelstage.core.manifest import MANIFEST, FileEntry, Manifest
from support.node_agent import CHUNK, copy_manifest, fake_digest, make_copy

D1, D2 = fake_digest(1), fake_digest(2)
NAME = "model.safetensors"


def at(minutes: int) -> datetime:
    return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=minutes)


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


def held_bytes(root: Path) -> dict[str, int]:
    return {c.content: c.bytes for c in store.scan(root).copies}


def offer_size(digest: str, data: bytes) -> int:
    return len(data) + len(node_cache.canonical_manifest(copy_manifest(digest, data)))


def test_an_offer_evicts_the_least_recently_used_unpinned_copies_it_needs_then_reserves(
    tmp_path: Path,
) -> None:
    """Two copies fill the budget: the oldest is pinned by the spec, so the next oldest goes
    (and only it), the pinned one stays, and the offer is accepted with its bytes reserved."""
    pinned = make_copy(tmp_path, 11, 2 * CHUNK, last_used=at(0), grants=[("a", fake_digest(11))])
    older = make_copy(tmp_path, 12, 2 * CHUNK, last_used=at(1))
    newer = make_copy(tmp_path, 13, 2 * CHUNK, last_used=at(2))
    data = os.urandom(2 * CHUNK)
    sizes = held_bytes(tmp_path)
    budget = sizes[pinned] + sizes[newer] + offer_size(D1, data)
    evicted: list[str] = []
    r = Receiver(tmp_path, "n1", budget=budget, keep=lambda: frozenset({("a", fake_digest(11))}),
                 on_evict=evicted.append)  # fmt: skip
    offer = r.offer("b", D1, copy_manifest(D1, data))
    assert evicted == [older] and set(held_bytes(tmp_path)) == {pinned, newer}
    assert r.offers[str(offer["content"])].reserved == offer_size(D1, data)
    done = receive(r, "b", D1, data)
    assert set(held_bytes(tmp_path)) == {pinned, newer, done["content"]}
    assert store.scan(tmp_path).bytes <= budget


def test_an_offer_evicts_the_least_set_not_every_older_copy(tmp_path: Path) -> None:
    """The oldest copy is small: evicting it alone is not enough, the next one is, and with
    that one gone the small one fits again, so it stays."""
    small = make_copy(tmp_path, 21, CHUNK // 4, last_used=at(0))
    large = make_copy(tmp_path, 22, 4 * CHUNK, last_used=at(1))
    data = os.urandom(2 * CHUNK)
    budget = held_bytes(tmp_path)[small] + offer_size(D1, data)
    evicted: list[str] = []
    r = Receiver(tmp_path, "n1", budget=budget, keep=frozenset, on_evict=evicted.append)
    r.offer("b", D1, copy_manifest(D1, data))
    assert evicted == [large] and set(held_bytes(tmp_path)) == {small}


def test_an_offer_that_cannot_fit_even_after_eviction_evicts_nothing_and_says_the_numbers(
    tmp_path: Path,
) -> None:
    pinned = make_copy(tmp_path, 31, 4 * CHUNK, last_used=at(0), grants=[("a", fake_digest(31))])
    idle = make_copy(tmp_path, 32, CHUNK, last_used=at(1))
    sizes = held_bytes(tmp_path)
    data = os.urandom(4 * CHUNK)
    budget = sizes[pinned] + offer_size(D1, data) - 1  # one byte short with idle gone
    evicted: list[str] = []
    r = Receiver(tmp_path, "n1", budget=budget, keep=lambda: frozenset({("a", fake_digest(31))}),
                 on_evict=evicted.append)  # fmt: skip
    with pytest.raises(Refused) as refused:
        r.offer("b", D1, copy_manifest(D1, data))
    assert refused.value.status == 507 and evicted == [] and r.offers == {}
    held = sizes[pinned] + sizes[idle]
    assert refused.value.message.startswith(
        f"node n1: the copy needs {offer_size(D1, data)} bytes, the node cache's budget of "
        f"{budget} has {budget - held} left ({held} held, {sizes[idle]} of them evictable, 0 "
        "reserved by copies in progress); raise the budget or let copies be evicted"
    )
    assert set(held_bytes(tmp_path)) == {pinned, idle}


def test_an_offer_evicts_nothing_before_the_spec_is_known_nor_a_copy_being_offered(
    tmp_path: Path,
) -> None:
    idle = make_copy(tmp_path, 41, 2 * CHUNK, last_used=at(0))
    data = os.urandom(2 * CHUNK)
    budget = held_bytes(tmp_path)[idle] + offer_size(D1, data) - 1
    unknown = Receiver(tmp_path, "n1", budget=budget, keep=lambda: None)
    with pytest.raises(Refused, match="0 reserved") as refused:
        unknown.offer("b", D1, copy_manifest(D1, data))
    assert refused.value.status == 507 and set(held_bytes(tmp_path)) == {idle}
    r = Receiver(tmp_path, "n1", budget=budget, keep=frozenset)
    record = store.read_record(tmp_path, idle)
    raw = (node_cache.copy_dir(tmp_path, idle) / MANIFEST).read_bytes()
    ((_, digest),) = store.record_grants(record)
    assert r.offer("c", digest, raw)["content"] == idle  # a namespace proving the copy now
    with pytest.raises(Refused) as busy:
        r.offer("b", D1, copy_manifest(D1, data))
    assert busy.value.status == 507 and set(held_bytes(tmp_path)) == {idle}


def test_a_copy_this_agent_received_and_committed_before_is_evictable(tmp_path: Path) -> None:
    """Its offer is over once committed: what it received is a copy like any other."""
    old, new = os.urandom(2 * CHUNK), os.urandom(2 * CHUNK)
    evicted: list[str] = []
    r = Receiver(tmp_path, "n1", budget=10**9, keep=frozenset, on_evict=evicted.append)
    first = receive(r, "a", D1, old)
    r.budget = int(first["bytes"]) + offer_size(D2, new) - 1
    done = receive(r, "a", D2, new)
    assert evicted == [first["content"]] and set(held_bytes(tmp_path)) == {done["content"]}


def test_a_copy_removed_after_its_commit_is_streamed_again_by_the_same_namespace(
    tmp_path: Path,
) -> None:
    """Re-verification dropped it (or it was evicted): the namespace's earlier proofs name
    files no longer held, so the offer asks for every file again and the commit publishes."""
    data = os.urandom(2 * CHUNK)
    r = Receiver(tmp_path, "n1", budget=10**9)
    first = receive(r, "a", D1, data)
    assert store.remove_copy(tmp_path, str(first["content"]))
    offer = r.offer("a", D1, copy_manifest(D1, data))
    assert offer["need"] == [NAME] and offer["complete"] is False
    again = receive(r, "a", D1, data)
    assert again["alreadyComplete"] is False
    assert (node_cache.copy_dir(tmp_path, str(again["content"])) / NAME).read_bytes() == data


def test_an_offer_that_does_not_fit_reads_the_spec_again_before_refusing(tmp_path: Path) -> None:
    """The operator lets a copy go as it creates the Job that needs its room; the spec the
    agent last read still keeps it. The offer reads the spec again (once) and evicts it."""
    kept = make_copy(tmp_path, 51, 2 * CHUNK, last_used=at(0), grants=[("a", fake_digest(51))])
    data = os.urandom(2 * CHUNK)
    budget = held_bytes(tmp_path)[kept] + offer_size(D1, data) - 1
    spec = {"now": frozenset({("a", fake_digest(51))}), "next": frozenset({("a", fake_digest(51))})}
    reads: list[frozenset[store.GrantKey]] = []

    def read_again() -> None:
        spec["now"] = spec["next"]
        reads.append(spec["now"])

    evicted: list[str] = []
    r = Receiver(tmp_path, "n1", budget=budget, keep=lambda: spec["now"],
                 refresh_keep=read_again, on_evict=evicted.append)  # fmt: skip
    with pytest.raises(Refused) as still_kept:  # the spec read again still keeps it
        r.offer("a", D1, copy_manifest(D1, data))
    assert still_kept.value.status == 507 and len(reads) == 1 and evicted == []
    spec["next"] = frozenset()  # the operator wrote the spec; the agent has not read it yet
    done = receive(r, "a", D1, data)
    assert len(reads) == 2 and evicted == [kept]
    assert set(held_bytes(tmp_path)) == {done["content"]}
