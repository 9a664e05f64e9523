"""The safetensors container format: parse and validate headers, encode them.

We parse headers ourselves (instead of ``safe_open``) so that the stager knows every tensor's
byte range before it reads a byte of data, and so that malformed files are refused with a
message naming the file and the tensor. Format: 8-byte little-endian header length N, N bytes
of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then the
data, offsets relative to the end of the header.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, json_fault

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
DTYPE_CODES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
"""A float dtype's name (``--dtype``, ``torch_dtype``) -> its safetensors code."""
MAX_HEADER_BYTES = 32 * 1024 * 1024
"""A header takes about 100 bytes per tensor, so MAX_TENSORS_PER_HEADER with long names fits
(the reference implementation allows 100 MiB; parsing that much JSON takes several times
its size in memory, and no real file comes near)."""
MAX_TENSORS_PER_HEADER = 131_072
"""Tensors in one file: real files hold hundreds to a few thousand."""
MAX_VALUES_PER_TENSOR = 16
"""JSON values one tensor's entry needs (dtype, a shape of a few dimensions, two offsets)."""
HEADER_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str = ""
    """The file holding it, relative to the checkpoint root."""

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    file: str
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    data_start: int
    file_size: int


def read_header(file: str, file_size: int, read: Callable[[int, int], bytes]) -> SafetensorsHeader:
    """Read and fully validate one file's header through ``read(offset, length)``.

    Raises CheckpointError naming the file and the problem; reads at most the header.
    """
    if file_size < 8:
        raise CheckpointError(f"{file}: truncated safetensors file ({file_size} bytes)")
    (header_len,) = struct.unpack("<Q", read(0, 8))
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{file}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )
    if 8 + header_len > file_size:
        raise CheckpointError(
            f"{file}: header length {header_len} runs beyond the end of the file "
            f"({file_size} bytes); the file is truncated or not safetensors"
        )
    return parse_header(file, read(8, header_len), file_size)


def read_local_header(path: Path) -> SafetensorsHeader:
    """``read_header`` for a file on a local filesystem."""
    try:
        with open(path, "rb") as f:

            def read(offset: int, length: int) -> bytes:
                f.seek(offset)
                return f.read(length)

            return read_header(str(path), os.fstat(f.fileno()).st_size, read)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None


def parse_header(file: str, raw: bytes, file_size: int) -> SafetensorsHeader:
    """Validate a header's JSON against the file size (pure; the fuzzers call it directly).

    The entries are counted on the raw bytes before the JSON is parsed: a header of a million
    empty tensors is refused at the cost of its bytes, not of a million parsed objects."""
    entries = raw.count(b"{")
    values = entries + raw.count(b",") + raw.count(b"[")
    if entries > MAX_TENSORS_PER_HEADER + 2 or values > MAX_TENSORS_PER_HEADER * (
        MAX_VALUES_PER_TENSOR
    ):
        raise CheckpointError(
            f"{file}: the header holds more entries than the {MAX_TENSORS_PER_HEADER} tensors "
            "a file may have; refusing it"
        )
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise CheckpointError(f"{file}: invalid header JSON: nested too deeply") from None
    except CheckpointError as e:
        raise CheckpointError(f"{file}: {e}") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, Python's digit limit
        raise CheckpointError(f"{file}: invalid header JSON: {json_fault(e)}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{file}: header is not a JSON object")
    data_start = 8 + len(raw)
    data_len = file_size - data_start
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{file}: __metadata__ must map strings to strings")
    if len(doc) > MAX_TENSORS_PER_HEADER:  # the exact count; the scan above is a bound
        raise CheckpointError(
            f"{file}: the header holds more entries than the {MAX_TENSORS_PER_HEADER} tensors "
            "a file may have; refusing it"
        )
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _tensor_info(file, name, entry, data_start, data_len)
    _check_no_overlap(file, tensors.values())
    return SafetensorsHeader(file, tensors, metadata, data_start, file_size)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    found: dict[str, object] = {}
    for name, value in pairs:  # linear, whatever the number of names
        if name in found:
            raise CheckpointError(f"duplicate name {name!r} in header")
        found[name] = value
    return found


def _tensor_info(file: str, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list is not even hashable
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**62 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
    ):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] integers")
    begin, end = offsets
    if begin < 0 or end < begin or end > data_len:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] out of bounds of the "
            f"{data_len}-byte data section"
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if expected != end - begin:
        raise CheckpointError(
            f"{where}: dtype {dtype} and shape {shape} need {expected} bytes, "
            f"but data_offsets span {end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end, file)


def _check_no_overlap(file: str, tensors: Iterable[TensorInfo]) -> None:
    spans = sorted((t.begin, t.end, t.name) for t in tensors if t.end > t.begin)
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise CheckpointError(f"{file}: tensors {n0!r} and {n1!r} overlap")


def encode_header(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included) for tensors laid out back to back, in order.

    Returns the header and each tensor's (begin, end) relative to the data section. The JSON is
    padded with spaces to an 8-byte boundary, as the reference implementation does, so that
    the data stays aligned for zero-copy readers.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    spans: list[tuple[int, int]] = []
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * DTYPE_SIZES[dtype]
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        spans.append((offset, offset + size))
        offset += size
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw, spans
