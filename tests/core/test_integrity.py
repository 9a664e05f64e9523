"""Chunked content hashes (``integrity.py``): what the manifest records and every reader checks."""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
from pathlib import Path

import blake3
import pytest
from modelstage.core.errors import ArtifactError
from modelstage.core.integrity import (
    ChunkChecker,
    ChunkedHasher,
    ChunkMismatch,
    FileDigest,
    FileToHash,
    digest_bytes,
    hash_files,
    hash_local_files,
    root_hash,
)
from modelstage.core.manifest import FileEntry, Manifest

CHUNK = 1000
DATA = os.urandom(3 * CHUNK + 217)  # three whole chunks and a partial last one


NAME = "model-rank-0-part-0.safetensors"
"""A file name a sharded_state artifact has (manifests name only those)."""


def reference(data: bytes, chunk: int) -> list[str]:
    return [blake3.blake3(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]


def test_each_chunk_is_the_plain_blake3_of_its_bytes_and_the_last_one_is_partial() -> None:
    digest = digest_bytes(DATA, CHUNK)
    assert list(digest.chunks) == reference(DATA, CHUNK)
    assert len(digest.chunks) == 4 and digest.range(3) == (3 * CHUNK, len(DATA))
    exact = digest_bytes(DATA[: 3 * CHUNK], CHUNK)
    assert len(exact.chunks) == 3, "a size that is a multiple of the chunk has no empty chunk"


def test_an_empty_file_has_no_chunk_and_still_a_root() -> None:
    digest = digest_bytes(b"", CHUNK)
    assert digest.chunks == () and digest.size == 0
    assert len(digest.root) == 64
    assert digest.root != digest_bytes(b"", CHUNK + 1).root, "the chunk size is part of the root"
    assert hash_files([FileToHash("empty", 0, lambda o, v: None, CHUNK)])[0] == [digest]


def test_any_split_of_the_writes_gives_the_same_digest() -> None:
    rng = random.Random(7)
    for _ in range(20):
        hasher, at = ChunkedHasher(CHUNK), 0
        while at < len(DATA):
            n = rng.randint(0, 2 * CHUNK + 3)
            hasher.update(memoryview(DATA)[at : at + n])
            at += n
        assert hasher.finish() == digest_bytes(DATA, CHUNK)


def test_the_root_pins_size_chunking_and_every_chunk() -> None:
    digest = digest_bytes(DATA, CHUNK)
    assert digest.root == root_hash(len(DATA), CHUNK, digest.chunks)
    assert digest.root != blake3.blake3(DATA).hexdigest()
    assert digest.root not in digest.chunks
    swapped = (digest.chunks[1], digest.chunks[0], *digest.chunks[2:])
    assert root_hash(len(DATA), CHUNK, swapped) != digest.root
    with pytest.raises(ValueError, match="3 chunk hashes for 3217 bytes"):
        FileDigest(len(DATA), CHUNK, digest.chunks[:3])


def test_chunks_checked_out_of_order_from_many_threads() -> None:
    """A reader that fetches chunks in any order, in parallel, checks each as it lands."""
    digest = digest_bytes(DATA, CHUNK)
    checker = ChunkChecker([("f", digest)])
    order = list(range(4))
    random.Random(3).shuffle(order)
    errors: list[BaseException] = []

    def land(i: int) -> None:
        lo, hi = digest.range(i)
        try:
            checker.check(0, lo, [memoryview(DATA)[lo:hi]])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=land, args=(i,)) for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert checker.stats.bytes == len(DATA)


def test_a_read_of_several_chunks_in_odd_views_is_checked_chunk_by_chunk() -> None:
    digest = digest_bytes(DATA, CHUNK)
    checker = ChunkChecker([("f", digest)])
    cuts = [0, 7, 999, 1000, 1001, 2500, len(DATA)]
    views = [memoryview(DATA)[a:b] for a, b in itertools.pairwise(cuts)]
    checker.check(0, 0, views)  # all four chunks, views straddling chunk boundaries
    assert checker.read_bytes(10) == CHUNK and checker.read_bytes(5000) == 5000
    with pytest.raises(ValueError, match="chunk boundary"):
        checker.check(0, 10, [memoryview(DATA)[10:1000]])
    with pytest.raises(ValueError, match="given 999 of 1000 bytes"):
        checker.check(0, 0, [memoryview(DATA)[:999]])


@pytest.mark.parametrize(("offset", "index"), [(0, 0), (len(DATA) - 1, 3), (1500, 1)])
def test_a_flipped_byte_names_the_file_the_chunk_its_range_and_both_hashes(
    offset: int, index: int
) -> None:
    digest = digest_bytes(DATA, CHUNK)
    bad = bytearray(DATA)
    bad[offset] ^= 0x01
    lo, hi = digest.range(index)
    checker = ChunkChecker([("ok", digest), ("model-rank-0.safetensors", digest)])
    checker.check(0, 0, [memoryview(DATA)])
    with pytest.raises(ChunkMismatch) as e:
        checker.check(1, 0, [memoryview(bad)])
    actual = blake3.blake3(bytes(bad[lo:hi])).hexdigest()
    assert str(e.value) == (
        f"model-rank-0.safetensors: chunk {index} (bytes {lo}-{hi - 1}) has BLAKE3 {actual}, "
        f"the manifest says {digest.chunks[index]}; the file is corrupt: re-stage it"
    )
    assert (e.value.index, e.value.begin, e.value.end) == (index, lo, hi)


@pytest.mark.parametrize("offset", [0, 1500, len(DATA) - 1])
def test_hash_files_reads_every_chunk_in_parallel_and_stops_at_a_mismatch(
    tmp_path: Path, offset: int
) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_bytes(DATA)
    corrupt = bytearray(DATA)
    corrupt[offset] ^= 0x80
    bad.write_bytes(corrupt)
    digest = digest_bytes(DATA, CHUNK)
    assert hash_local_files([good], [digest]) == [digest]
    assert hash_local_files([good, good], chunk_bytes=CHUNK, workers=3) == [digest, digest]
    with pytest.raises(ChunkMismatch, match=rf"^{bad}: chunk {offset // CHUNK} "):
        hash_local_files([good, bad], [digest, digest], workers=4)
    bad.write_bytes(DATA[:-1])
    with pytest.raises(ArtifactError, match=r"3216 bytes, the manifest says 3217"):
        hash_local_files([bad], [digest])


def test_hash_files_checks_a_recorded_root() -> None:
    digest = digest_bytes(DATA, CHUNK)

    def read_into(offset: int, view: memoryview) -> None:
        view[:] = DATA[offset : offset + len(view)]

    job = FileToHash("obj", len(DATA), read_into, CHUNK, expected_root=digest.root)
    assert hash_files([job])[0] == [digest]
    wrong = FileToHash("obj", len(DATA), read_into, CHUNK, expected_root="0" * 64)
    with pytest.raises(ArtifactError, match=r"^obj: content hash [0-9a-f]{64} differs"):
        hash_files([wrong])


def manifest_doc(**changes: object) -> dict[str, object]:
    digest = digest_bytes(DATA, CHUNK)
    doc: dict[str, object] = {
        "format": "sharded_state", "tensorParallelSize": 1, "dtype": "auto", "digest": "d",
        "source": {}, "vllmVersion": "0.32.0", "layoutVersion": "vllm-0.32/1",
        "files": {NAME: FileEntry.of(digest).to_doc()}, "bytes": len(DATA),
        "modelstageVersion": "0", "createdAt": "now", "stageSeconds": 1.0, "schemaVersion": 2,
    }  # fmt: skip
    doc.update(changes)
    return doc


def test_schema_2_round_trips_and_schema_1_still_reads() -> None:
    manifest = Manifest.from_json(json.dumps(manifest_doc()), "m")
    assert manifest.files[NAME].digest == digest_bytes(DATA, CHUNK)
    assert Manifest.from_json(manifest.to_json(), "m") == manifest
    old = manifest_doc(schemaVersion=1, files={NAME: {"size": 3, "sha256": "0" * 64}})
    legacy = Manifest.from_json(json.dumps(old), "m")
    assert legacy.files[NAME] == FileEntry(3, sha256="0" * 64) and legacy.files[NAME].digest is None
    assert json.loads(legacy.to_json())["files"] == {NAME: {"size": 3, "sha256": "0" * 64}}
    del old["schemaVersion"]
    assert Manifest.from_json(json.dumps(old), "m").schemaVersion == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schemaVersion": 3}, "schemaVersion: 3 is not one this modelstage reads"),
        ({"schemaVersion": 1}, 'files.model-rank-0-part-0.safetensors: must be {"size": bytes, "sha256": hex}'),
        ({"files": {NAME: {"size": 3, "sha256": "0" * 64}}}, 'files.model-rank-0-part-0.safetensors: must be {"size"'),
        ({"root": "0" * 6}, "files.model-rank-0-part-0.safetensors.blake3: must be 64 lower-case hex digits"),
        ({"chunks": ["0" * 64]}, "files.model-rank-0-part-0.safetensors.chunks: 1 chunk hashes for 3217 bytes"),
        ({"chunks": ["X" * 64] * 4}, r"files.model-rank-0-part-0\.safetensors.chunks\[0\]: must be 64 lower-case hex"),
        ({"chunkBytes": 0}, "files.model-rank-0-part-0.safetensors.chunkBytes: must be at least 1"),
    ],
)
def test_malformed_schema_2_entries_are_refused(change: dict[str, object], message: str) -> None:
    doc = manifest_doc()
    entry = dict(doc["files"][NAME])  # type: ignore[index]
    if "root" in change:
        entry["blake3"] = change.pop("root")
    for key in ("chunks", "chunkBytes"):
        if key in change:
            entry[key] = change.pop(key)
    doc["files"] = {NAME: entry}
    doc.update(change)
    with pytest.raises(ArtifactError, match=rf"^m: invalid manifest: {message}"):
        Manifest.from_json(json.dumps(doc), "m")


def test_verify_checks_the_recorded_root_against_the_chunks(tmp_path: Path) -> None:
    """Parsing takes the root as written (no blake3 needed to read a manifest); verifying
    the content also checks that it is the root of the chunks."""
    from modelstage.core.location import Listed, LocalArtifact, verify_content

    path = tmp_path / "f"
    path.write_bytes(DATA)
    entry = FileEntry.of(digest_bytes(DATA, CHUNK))
    verify_content(LocalArtifact(tmp_path), [("f", entry, Listed(entry.size))])
    wrong = FileEntry(entry.size, blake3="0" * 64, chunkBytes=CHUNK, chunks=entry.chunks)
    with pytest.raises(ArtifactError, match=rf"^{path}: the manifest's blake3 is not the root"):
        verify_content(LocalArtifact(tmp_path), [("f", wrong, Listed(wrong.size))])
