"""Is a place exactly an artifact's files? Every file the manifest lists present, a regular
file of the manifest's size, and nothing beside them but the manifest: the one check and the
one set of messages of ``verify`` (a directory or an S3 prefix), the loader plugin's node-copy
check and the node agent's store.

The check itself is pure: it compares the manifest with the sizes the caller found, so each
caller lists its place its own way (an S3 listing; a node root that is treated as hostile,
whose entries are stat'ed without following a link: ``regular_sizes``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from .errors import ArtifactError
from .manifest import MANIFEST, FileEntry

NOT_REGULAR = -1
"""The size ``regular_sizes`` gives an entry that is not a regular file (a link, a FIFO, a
directory): present, but never a file of the artifact."""
SHOWN = 5
"""How many unlisted files a message names."""


class FileProblem(ArtifactError):
    """A file of the manifest that is missing, not a regular file, or of another size."""

    def __init__(self, where: str, reason: str) -> None:
        self.where, self.reason = where, reason
        super().__init__(f"{where}: {reason}")


def check_files(
    files: Mapping[str, FileEntry],
    names: Iterable[str],
    sizes: Mapping[str, int | None],
    where: Callable[[str], str],
) -> None:
    """Each of ``names`` (keys of the manifest's ``files``) is in ``sizes``, a regular file of
    its entry's size (``FileProblem`` for the first that is not, ``where(name)`` naming it).
    A size of None (a dangling link) counts as missing."""
    for name in names:
        size, want = sizes.get(name), files[name].size
        if size is None:
            raise FileProblem(where(name), "listed in the manifest but missing")
        if size == NOT_REGULAR:
            raise FileProblem(where(name), "not a regular file")
        if size != want:
            raise FileProblem(where(name), f"{size} bytes, the manifest says {want}")


def check_nothing_unlisted(
    files: Mapping[str, FileEntry], present: Iterable[str], uri: str, noun: str = "file"
) -> None:
    """Nothing in ``present`` but the manifest's files and the manifest itself
    (``ArtifactError`` naming the first few others, sorted)."""
    extra = sorted(n for n in present if n not in files and n != MANIFEST)
    if extra:
        more = f" and {len(extra) - SHOWN} more" if len(extra) > SHOWN else ""
        raise ArtifactError(f"{uri}: {noun}s not in the manifest: {', '.join(extra[:SHOWN])}{more}")


def check_structure(
    files: Mapping[str, FileEntry],
    sizes: Mapping[str, int | None],
    uri: str,
    where: Callable[[str], str],
    noun: str = "file",
) -> None:
    """The place whose entries have ``sizes`` holds exactly the manifest's ``files``."""
    check_files(files, sorted(files), sizes, where)
    check_nothing_unlisted(files, sizes, uri, noun)


def regular_sizes(directory: int | Path) -> dict[str, int]:
    """Each entry of ``directory`` (a path, or an open directory's descriptor) with its size,
    ``NOT_REGULAR`` unless it is a regular file; a link is stat'ed as itself, never followed."""
    sizes: dict[str, int] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            sizes[entry.name] = st.st_size if stat.S_ISREG(st.st_mode) else NOT_REGULAR
    return sizes
