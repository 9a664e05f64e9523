"""A checkpoint in a local directory (also a mounted PVC)."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path
from typing import Any

from modelstage.core.errors import CheckpointError

from .base import Source, safe_name

HASH_CHUNK_BYTES = 8 * 1024 * 1024


class LocalSource(Source):
    """Files in one folder; identity = path, and per file its size and header hash (safetensors,
    with the modification time: a checkpoint rewritten in place keeps its header) or its
    sha256 (small files).

    Symlinks may point anywhere inside ``allowed_root`` (default: the folder itself). Only the
    Hugging Face cache widens it, to the repository's cache folder: its snapshot files are
    symlinks into ``../../blobs``. A plain folder never follows a link out of itself, so a
    checkpoint cannot make the stager read (and publish) other files of the pod.
    """

    direct_reads = True

    def __init__(self, path: str, *, allowed_root: Path | None = None) -> None:
        self.root = Path(path).absolute()
        if not self.root.is_dir():
            raise CheckpointError(f"{path}: not a directory (a Hugging Face checkpoint folder)")
        self.uri = str(self.root)
        self._allowed = (allowed_root or self.root).resolve()
        if not self.root.resolve().is_relative_to(self._allowed):
            raise CheckpointError(f"{self.root}: outside {self._allowed}; refusing it")
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()  # rank writers read concurrently (direct_reads)

    def _resolved(self, name: str) -> Path:
        """Where ``name`` really is, refused when a link leads out of the allowed folder."""
        path = self.root / safe_name(name, str(self.root))
        resolved = path.resolve()
        if not resolved.is_relative_to(self._allowed):
            raise CheckpointError(f"{path}: symlink escapes the checkpoint folder; refusing it")
        return resolved

    def list_files(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_file())

    def size(self, name: str) -> int:
        """The size of the very file that is read (the descriptor's, not the path's)."""
        return os.fstat(self.open_fd(name)).st_size

    def open_fd(self, name: str) -> int:
        """A read-only descriptor of ``name``, opened once. The path is resolved and checked
        first, then opened with ``O_NOFOLLOW``: a link swapped in between is refused, not
        followed out of the folder."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        with self._fds_lock:
            fd = self._fds.get(name)
            if fd is None:
                resolved = self._resolved(name)
                try:
                    fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW)
                except FileNotFoundError:
                    raise CheckpointError(f"{self.root / name}: file not found") from None
                except OSError as e:
                    raise CheckpointError(
                        f"{self.root / name}: cannot open: {e.strerror}"
                    ) from None
                self._fds[name] = fd
            return fd

    def read_range(self, name: str, offset: int, out: memoryview) -> None:
        fd, done = self.open_fd(name), 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise CheckpointError(
                    f"{self.root / name}: file ended at byte {offset + done}; it is truncated"
                )
            done += n

    def identity(self, files: list[str]) -> dict[str, Any]:
        return {
            "kind": "local",
            "path": str(self.root),
            "files": [self._file_identity(name) for name in files],
        }

    def _file_identity(self, name: str) -> dict[str, Any]:
        size = self.size(name)
        entry: dict[str, Any] = {"name": name, "size": size}
        if name.endswith(".safetensors") and size >= 8:
            # Retrained weights have the same names, shapes and offsets, so the same header
            # and size: the modification time is what tells a rewrite in place, without
            # reading every byte (a copy that keeps times and header is taken as the same).
            entry["mtimeNs"] = os.fstat(self.open_fd(name)).st_mtime_ns
            prefix = bytearray(8)
            self.read_range(name, 0, memoryview(prefix))
            (header_len,) = struct.unpack("<Q", prefix)
            header = bytearray(min(header_len, size - 8))
            self.read_range(name, 8, memoryview(header))
            entry["headerSha256"] = hashlib.sha256(header).hexdigest()
        else:  # streamed: a carried file may be large, memory stays at one chunk
            digest, chunk = hashlib.sha256(), bytearray(min(size, HASH_CHUNK_BYTES))
            for offset in range(0, size, HASH_CHUNK_BYTES):
                view = memoryview(chunk)[: min(HASH_CHUNK_BYTES, size - offset)]
                self.read_range(name, offset, view)
                digest.update(view)
            entry["sha256"] = digest.hexdigest()
        return entry

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
