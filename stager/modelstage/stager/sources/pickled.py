"""``--allow-pickle``: a checkpoint with only pickle weights, converted to safetensors first.

Unpickling can run arbitrary code, so pickles are refused unless the user opts in, and even
then they are loaded with ``torch.load(weights_only=True)``, which unpickles tensors and
plain containers only (anything else is refused with a ``CheckpointError``). Each pickle
file becomes one safetensors file in a private spool directory; the stager then reads those
through the same header parser, shard plan and streaming writer as any safetensors
checkpoint, so the artifact's bytes equal those staged from the same tensors as safetensors.
The source identity stays the pickle files' (their content hashes).
"""

from __future__ import annotations

import fnmatch
import shutil
import tempfile
from pathlib import Path
from typing import Any

from modelstage.core.errors import CheckpointError
from modelstage.core.manifest import CARRIED_OVER
from modelstage.core.safetensors_format import encode_header

from .base import Source
from .local import LocalSource

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
PICKLE_INDEX = "pytorch_model.bin.index.json"


def pickle_weights(files: list[str]) -> list[str]:
    return [f for f in files if any(fnmatch.fnmatch(f, p) for p in PICKLE_PATTERNS)]


def spool_dir_for(out: str) -> Path:
    """A private directory in TMPDIR (an emptyDir in a pod: gone with the pod after a crash).

    Not beside a local ``--out``: the conversion runs before the destination's ``begin``,
    which removes every ``<out>.tmp-*`` as a leftover of a killed run. ``out`` is accepted
    for a later choice of place and unused."""
    del out
    return Path(tempfile.mkdtemp(prefix="modelstage-pickle-"))


def converted_names(pickles: list[str]) -> dict[str, str]:
    """``<stem>.safetensors`` -> the pickle file it is converted from."""
    return {f"{Path(p).stem}.safetensors": p for p in pickles}


def pickle_identity(source: Source) -> dict[str, Any] | None:
    """The identity ``ConvertedPickleSource(source).identity`` of the converted checkpoint
    would give, without converting anything (what the digest is taken from before the work);
    None when ``source`` is not a pickle-only checkpoint."""
    files = source.list_files()
    pickles = pickle_weights(files)
    if any(f.endswith(".safetensors") for f in files) or not pickles:
        return None
    converted = converted_names(pickles)
    originals = [converted[name] for name in sorted(converted)]
    carried = [f for f in CARRIED_OVER if f in files]
    return {**source.identity([*originals, *carried]), "convertedFromPickle": True}


class ConvertedPickleSource(Source):
    """``inner`` with each pickle weight file replaced by a converted ``<name>.safetensors``."""

    def __init__(self, inner: Source, spool: Path) -> None:
        self.inner, self.spool, self.uri = inner, spool, inner.uri
        files = inner.list_files()
        self.pickles = pickle_weights(files)
        self.converted = converted_names(self.pickles)
        try:
            for name, pickled in self.converted.items():
                _convert(inner, pickled, spool / name)
        except BaseException:
            shutil.rmtree(spool, ignore_errors=True)
            raise
        self.local = LocalSource(str(spool))
        hidden = {*self.pickles, PICKLE_INDEX}
        self.files = sorted({*(f for f in files if f not in hidden), *self.converted})

    def list_files(self) -> list[str]:
        return list(self.files)

    def size(self, name: str) -> int:
        return self.local.size(name) if name in self.converted else self.inner.size(name)

    def read_range(self, name: str, offset: int, out: memoryview) -> None:
        if name in self.converted:
            self.local.read_range(name, offset, out)
        else:
            self.inner.read_range(name, offset, out)

    def identity(self, files: list[str]) -> dict[str, Any]:
        originals = [self.converted.get(f, f) for f in files]
        return {**self.inner.identity(originals), "convertedFromPickle": True}

    def close(self) -> None:
        self.local.close()
        self.inner.close()
        shutil.rmtree(self.spool, ignore_errors=True)


SPOOL_CHUNK_BYTES = 8 * 1024 * 1024


def _local_copy(source: Source, name: str, spool: Path) -> tuple[str, Path | None]:
    """A path ``torch.load`` can memory-map: a local file as it is (through its descriptor,
    opened without following links), anything else copied to ``spool`` in chunks (then also
    returned, to be removed). The pickle is never read into memory whole."""
    if isinstance(source, LocalSource):
        return f"/proc/self/fd/{source.open_fd(name)}", None
    size = source.size(name)
    copy = spool / f".{Path(name).name}.pickle"
    buf = bytearray(min(size, SPOOL_CHUNK_BYTES))
    with open(copy, "wb") as f:
        for offset in range(0, size, SPOOL_CHUNK_BYTES):
            view = memoryview(buf)[: min(SPOOL_CHUNK_BYTES, size - offset)]
            source.read_range(name, offset, view)
            f.write(view)
    return str(copy), copy


def _convert(source: Source, name: str, target: Path) -> None:
    import torch

    path, spooled = _local_copy(source, name, target.parent)
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # weights_only refuses any non-tensor object: say which file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"{source.uri}: {name}: not a plain state dict of tensors in torch.save's zip "
                f"format ({first[:200]}); torch.load(weights_only=True, mmap=True) refused it"
            ) from None
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise CheckpointError(
                f"{source.uri}: {name}: expected a dict of tensor names to tensors"
            )
        _write_safetensors(source, name, state, target)
    finally:
        if spooled is not None:
            spooled.unlink(missing_ok=True)


def _write_safetensors(source: Source, name: str, state: dict[str, Any], target: Path) -> None:
    """Tensor by tensor, from the memory-mapped pickle: memory stays at the largest tensor
    (tensors sharing storage, tied weights, are written once each)."""
    import torch

    names = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
    }
    items = sorted(state.items())
    unknown = [k for k, v in items if v.dtype not in names]
    if unknown:
        raise CheckpointError(
            f"{source.uri}: {name}: tensor {unknown[0]!r} has dtype {state[unknown[0]].dtype}, "
            "which safetensors cannot hold"
        )
    header, _ = encode_header([(k, names[v.dtype], tuple(v.shape)) for k, v in items])
    with open(target, "wb") as f:
        f.write(header)
        for _, tensor in items:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            f.write(flat.numpy().data)
