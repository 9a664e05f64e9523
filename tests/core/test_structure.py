"""``core.structure``: every file present, a regular file of its size, nothing unlisted; one
check and one set of messages for ``verify``, the plugin's node-copy check and the agent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from modelstage.core.errors import ArtifactError
from modelstage.core.manifest import MANIFEST, FileEntry
from modelstage.core.structure import (
    NOT_REGULAR,
    FileProblem,
    check_structure,
    regular_sizes,
)

FILES = {"a.safetensors": FileEntry(3, "0" * 64), "b.safetensors": FileEntry(5, "1" * 64)}


def check(sizes: dict[str, int | None]) -> None:
    check_structure(FILES, sizes, "/art", lambda n: f"/art/{n}")


def test_exactly_the_manifest_files_of_their_sizes_pass_the_manifest_itself_aside() -> None:
    check({"a.safetensors": 3, "b.safetensors": 5, MANIFEST: 100})


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"b.safetensors": 5}, "/art/a.safetensors: listed in the manifest but missing"),
        ({"a.safetensors": None, "b.safetensors": 5}, "/art/a.safetensors: listed in the manifest but missing"),
        ({"a.safetensors": NOT_REGULAR, "b.safetensors": 5}, "/art/a.safetensors: not a regular file"),
        ({"a.safetensors": 3, "b.safetensors": 4}, "/art/b.safetensors: 4 bytes, the manifest says 5"),
    ],
)  # fmt: skip
def test_the_first_file_that_is_missing_not_regular_or_of_another_size_is_named(
    sizes: dict[str, int | None], message: str
) -> None:
    with pytest.raises(FileProblem) as e:
        check(sizes)
    assert str(e.value) == message


def test_unlisted_files_are_named_sorted_the_first_five_and_how_many_more() -> None:
    extra: dict[str, int | None] = {f"x{i}": 1 for i in range(7)}
    with pytest.raises(ArtifactError) as e:
        check({"a.safetensors": 3, "b.safetensors": 5, **extra})
    assert str(e.value) == "/art: files not in the manifest: x0, x1, x2, x3, x4 and 2 more"


def test_a_link_a_fifo_and_a_directory_are_not_regular_files_and_no_link_is_followed(
    tmp_path: Path,
) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"12345")  # b's size: a followed link would pass
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "a.safetensors").write_bytes(b"abc")
    os.symlink(target, copy / "b.safetensors")
    os.mkfifo(copy / "fifo")
    (copy / "dir").mkdir()
    sizes = regular_sizes(copy)
    assert sizes == {
        "a.safetensors": 3,
        "b.safetensors": NOT_REGULAR,
        "fifo": NOT_REGULAR,
        "dir": NOT_REGULAR,
    }
    fd = os.open(copy, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert regular_sizes(fd) == sizes
    finally:
        os.close(fd)
    with pytest.raises(FileProblem, match=r"b\.safetensors: not a regular file"):
        check_structure(FILES, sizes, str(copy), lambda n: str(copy / n))
