"""Golden values of the schema-2 content hashes: what every stored artifact was written with.

``test_integrity.py`` checks the hashing machinery against itself; a change to the format (the
root's context string, what the root covers, how a chunk is hashed) would keep those green and
make every artifact already staged fail verification after an upgrade. These literals, and the
artifact kept under ``golden/``, fail instead. Never regenerate them: a format change is a new
schema version, read beside this one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from modelstage.core.integrity import digest_bytes
from modelstage.core.location import verify_directory
from modelstage.core.manifest import FileEntry, read_manifest

GOLDEN = Path(__file__).parent / "golden" / "schema2-sharded_state-tp2"
"""A tiny Llama staged at TP 2 (sharded_state, vLLM 0.32 layout), its rank files hashed in
2048-byte chunks (three each) and the rest in the stager's 32 MiB chunks (one each)."""
CLI = str(Path(sys.executable).with_name("modelstage"))

VECTOR = bytes(i % 251 for i in range(2500))
"""The BLAKE3 reference test vectors' input pattern."""


def test_a_chunk_hash_is_plain_blake3_as_in_the_reference_vectors() -> None:
    # BLAKE3's published test vector for 1024 input bytes (first 32 bytes of its output).
    assert digest_bytes(VECTOR[:1024], 1024).chunks == (
        "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
    )


def test_the_root_of_a_file_over_several_chunks() -> None:
    digest = digest_bytes(VECTOR, 1000)
    assert digest.chunks == (
        "b43670a52d1af24abdac5d2c3ed19ff4e62b60a618e823ad555888b1b0b91cff",
        "9d70947ab03daf9fe667a3e109e9f42c47bc121e39301c1902180944c2f51e50",
        "fd7ac76f6ac299cfe138192d92bff9d2a9d317e5b60a28564f474c1db16925bd",
    )
    assert digest.root == "fd06abb7cfcb40c052764068fc43c569ead2d9474ab2c14fd09b122fe20f4e70"
    assert digest_bytes(b"", 1000).root == (
        "d0059e464ac87639c51198b62bcf07aadb04315fc8aa9b6b41e1a6d1c172a799"
    )


def test_a_schema_2_manifest_entry() -> None:
    assert FileEntry.of(digest_bytes(VECTOR, 1000)).to_doc() == {
        "size": 2500,
        "blake3": "fd06abb7cfcb40c052764068fc43c569ead2d9474ab2c14fd09b122fe20f4e70",
        "chunkBytes": 1000,
        "chunks": [
            "b43670a52d1af24abdac5d2c3ed19ff4e62b60a618e823ad555888b1b0b91cff",
            "9d70947ab03daf9fe667a3e109e9f42c47bc121e39301c1902180944c2f51e50",
            "fd7ac76f6ac299cfe138192d92bff9d2a9d317e5b60a28564f474c1db16925bd",
        ],
    }


def test_the_kept_artifact_still_verifies(tmp_path: Path) -> None:
    artifact = shutil.copytree(GOLDEN, tmp_path / "artifact")
    manifest = read_manifest(artifact)
    assert manifest is not None and manifest.schemaVersion == 2
    rank0 = manifest.files["model-rank-0-part-0.safetensors"]
    assert rank0.blake3 == "6d5f6e721e84c99f72dcecfbc74001df5ddc81d5a9b85033955ab7178df43085"
    assert rank0.chunkBytes == 2048 and rank0.chunks is not None and len(rank0.chunks) == 3
    verified = verify_directory(artifact, digest="8ac08d644fb035e51858", tp=2)
    assert verified.files == manifest.files
    done = subprocess.run(
        [CLI, "verify", str(artifact), "--digest", "8ac08d644fb035e51858", "--tp", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["verified"] == str(artifact)


def test_a_changed_byte_in_the_kept_artifact_is_caught(tmp_path: Path) -> None:
    """The kept artifact is checked for real: one flipped byte in a rank file fails it."""
    artifact = shutil.copytree(GOLDEN, tmp_path / "artifact")
    rank1 = artifact / "model-rank-1-part-0.safetensors"
    raw = bytearray(rank1.read_bytes())
    raw[-1] ^= 1
    rank1.write_bytes(raw)
    done = subprocess.run(
        [CLI, "verify", str(artifact)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert f"{rank1}: chunk 2 (bytes 4096-5983) has BLAKE3" in done.stderr
