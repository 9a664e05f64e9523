"""Local and ``pvc://`` sources: identity = path + size + header hash per file, symlinks kept
inside the folder, and the URI registry's answers for schemes it does not read itself."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from modelstage.core.errors import CheckpointError
from modelstage.stager.sources import open_source
from modelstage.stager.sources.local import LocalSource

WEIGHTS = "model-00001-of-00003.safetensors"


def identity(folder: Path, names: list[str]) -> dict[str, object]:
    source = open_source(str(folder))
    try:
        return source.identity(names)
    finally:
        source.close()


def entry(ident: dict[str, object], name: str) -> dict[str, object]:
    files = ident["files"]
    assert isinstance(files, list)
    return next(f for f in files if f["name"] == name)


def test_identity_records_the_path_and_each_files_size_and_header_hash(
    split_ckpt: Path, tmp_path: Path
) -> None:
    ident = identity(split_ckpt, [WEIGHTS, "config.json"])
    assert ident["kind"] == "local" and ident["path"] == str(split_ckpt)
    weights = entry(ident, WEIGHTS)
    assert weights["size"] == (split_ckpt / WEIGHTS).stat().st_size and "headerSha256" in weights
    assert "sha256" in entry(ident, "config.json")  # small files: hashed whole


def test_identity_changes_when_a_header_or_a_size_changes(split_ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(split_ckpt, copy)
    before = entry(identity(copy, [WEIGHTS]), WEIGHTS)

    data = bytearray((copy / WEIGHTS).read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    header["__metadata__"] = {"format": "pt", "edited": "1"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (copy / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + header_len :])
    after_header = entry(identity(copy, [WEIGHTS]), WEIGHTS)
    assert after_header["headerSha256"] != before["headerSha256"]

    with open(copy / WEIGHTS, "ab") as f:
        f.write(b"\0" * 8)
    after_size = entry(identity(copy, [WEIGHTS]), WEIGHTS)
    assert after_size["size"] == after_header["size"] + 8  # type: ignore[operator]


def test_a_plain_folder_refuses_links_into_a_sibling_folder_even_in_the_hub_layout(
    split_ckpt: Path, tmp_path: Path
) -> None:
    """The hub source widens the allowed root to the repo's cache folder; a plain local
    source must not: its links into ``../../blobs`` are refused."""
    (tmp_path / "blobs").mkdir()
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for path in split_ckpt.iterdir():
        shutil.copy(path, tmp_path / "blobs" / path.name)
        (snapshot / path.name).symlink_to(f"../../blobs/{path.name}")
    plain = LocalSource(str(snapshot))
    with pytest.raises(CheckpointError, match="symlink escapes the checkpoint folder"):
        plain.size("config.json")
    widened = LocalSource(str(snapshot), allowed_root=tmp_path)
    assert widened.read_bytes("config.json", max_bytes=1 << 20) == (split_ckpt / "config.json").read_bytes()


def test_a_pvc_uri_as_source_says_to_pass_the_mount_path() -> None:
    with pytest.raises(CheckpointError, match="pass the mount path as SOURCE"):
        open_source("pvc://models/llama")


def test_an_unknown_scheme_lists_the_supported_ones() -> None:
    with pytest.raises(CheckpointError, match=r"gs:// is not supported.*hf://, s3://"):
        open_source("gs://bucket/llama")


@pytest.mark.parametrize("uri", ["hf://", "hf://org/name/extra", "hf://user:hf_secret@org/name",
                                 "hf://org/../name"])  # fmt: skip
def test_a_malformed_hub_uri_is_refused_without_echoing_a_credential(uri: str) -> None:
    with pytest.raises(CheckpointError, match="expected hf://ORG/NAME") as err:
        open_source(uri)
    assert "hf_secret" not in str(err.value)


def test_identity_changes_when_weights_are_rewritten_in_place_with_the_same_header(
    split_ckpt: Path, tmp_path: Path
) -> None:
    """Retrained weights keep names, shapes and offsets: the header and the size stay, the
    modification time tells the rewrite."""
    import os

    copy = tmp_path / "copy"
    shutil.copytree(split_ckpt, copy)
    before = entry(identity(copy, [WEIGHTS]), WEIGHTS)
    data = bytearray((copy / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF  # one weight byte; the header is untouched
    with open(copy / WEIGHTS, "r+b") as f:
        f.write(data)
    stat = (copy / WEIGHTS).stat()
    os.utime(copy / WEIGHTS, ns=(stat.st_atime_ns, before["mtimeNs"] + 1))  # type: ignore[operator]
    after = entry(identity(copy, [WEIGHTS]), WEIGHTS)
    assert (after["size"], after["headerSha256"]) == (before["size"], before["headerSha256"])
    assert after != before
