"""The pipelined reader on CPU: every byte lands in its tensor, through a few reused buffers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from modelstage.core.errors import ArtifactError
from modelstage.core.safetensors_format import SafetensorsHeader, TensorInfo, read_local_header
from modelstage.plugin.reader import (
    SPARE_BUFFERS,
    TORCH_DTYPES,
    PipelinedReader,
    Target,
    chunks,
    flat_bytes,
    staging_for,
)
from safetensors.torch import load_file
from support.serving import Artifact

CPU = torch.device("cpu")


def rank_files(artifact: Artifact, rank: int) -> list[tuple[Path, SafetensorsHeader]]:
    paths = sorted(artifact.path.glob(f"model-rank-{rank}-part-*.safetensors"))
    return [(p, read_local_header(p)) for p in paths]


def empty_like(info: TensorInfo, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.full(info.shape, float("nan"), dtype=dtype or TORCH_DTYPES[info.dtype])


MODES = [(4099, 3, False), (1 << 20, 1, False), (1 << 26, 4, False), (4099, 3, True),
         (1 << 20, 1, True)]  # fmt: skip
"""(chunk bytes, depth, direct): buffered is the CUDA path (run here without streams), direct
the host path; odd chunk sizes make tensors straddle chunks."""


@pytest.mark.parametrize(("chunk_bytes", "depth", "direct"), MODES)
def test_every_tensor_equals_safetensors_own_load(
    llama_tp2: Artifact, chunk_bytes: int, depth: int, direct: bool
) -> None:
    files = rank_files(llama_tp2, 1)
    dest = {n: empty_like(t) for _, h in files for n, t in h.tensors.items()}
    reader = PipelinedReader(chunk_bytes=chunk_bytes, depth=depth, device=CPU, direct=direct)
    stats = reader.read(files, lambda info: Target(flat_bytes(dest[info.name])))
    want = load_file(files[0][0])
    assert sorted(dest) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(dest[name], tensor), name
    assert stats.bytes == sum(t.nbytes for _, h in files for t in h.tensors.values())
    assert stats.read_seconds > 0 and stats.copy_seconds > 0
    # memory bounded by the pool (buffered) or no buffer at all (direct)
    assert len(reader.buffers) == (0 if direct else depth + SPARE_BUFFERS)
    assert all(b.numel() == chunk_bytes for b in reader.buffers)


@pytest.mark.parametrize("direct", [False, True])
def test_parameters_of_another_dtype_are_filled_through_staging_with_copy_semantics(
    llama_tp2: Artifact, direct: bool
) -> None:
    files = rank_files(llama_tp2, 0)
    dest = {n: empty_like(t, torch.float64) for _, h in files for n, t in h.tensors.items()}
    reader = PipelinedReader(chunk_bytes=8191, depth=2, device=CPU, direct=direct)
    reader.read(files, lambda info: staging_for(info, dest[info.name]))
    for name, tensor in load_file(files[0][0]).items():
        assert torch.equal(dest[name], tensor.to(torch.float64)), name


def test_chunks_cover_each_tensor_exactly_once_and_respect_the_size(llama_tp2: Artifact) -> None:
    files = rank_files(llama_tp2, 0)
    covered: dict[str, int] = {}
    for chunk in chunks([h for _, h in files], 1000):
        assert 0 < chunk.end - chunk.begin <= 1000
        for t in chunk.tensors:
            covered[t.name] = (
                covered.get(t.name, 0) + min(t.end, chunk.end) - max(t.begin, chunk.begin)
            )
    header = files[0][1]
    assert covered == {n: t.nbytes for n, t in header.tensors.items() if t.nbytes}


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_truncated_after_verification_fails_with_the_file_named(
    llama_tp2: Artifact, tmp_path: Path, direct: bool
) -> None:
    path = Path(shutil.copy(llama_tp2.path / "model-rank-0-part-0.safetensors", tmp_path))
    header = read_local_header(path)
    with open(path, "r+b") as f:
        f.truncate(header.file_size - 100)
    dest = {n: empty_like(t) for n, t in header.tensors.items()}
    reader = PipelinedReader(chunk_bytes=1 << 16, depth=2, device=CPU, direct=direct)
    with pytest.raises(ArtifactError, match="the file changed after it was verified"):
        reader.read([(path, header)], lambda info: Target(flat_bytes(dest[info.name])))


def test_bench_entry_point_reads_rank_files_and_refuses_missing_ones(llama_tp2: Artifact) -> None:
    from modelstage.core.errors import CheckpointError
    from modelstage.devtools.plugin_reads import read_files_for_bench

    read_files_for_bench([p for p, _ in rank_files(llama_tp2, 0)])
    with pytest.raises(CheckpointError, match="cannot read"):
        read_files_for_bench([llama_tp2.path / "model-rank-9-part-0.safetensors"])


@pytest.mark.parametrize(("chunk_bytes", "direct"), [(1 << 20, True), (4099, True), (4099, False)])
def test_holes_between_tensors_and_more_tensors_than_iovecs_in_one_read(
    tmp_path: Path, chunk_bytes: int, direct: bool
) -> None:
    """safetensors allows gaps between tensors' bytes; one vectored read takes at most 1024
    pieces (IOV_MAX): 1500 tiny tensors with gaps, read into their own tensors."""
    import json
    import struct

    entries, offset = {}, 0
    for i in range(1500):
        offset += 4 if i % 7 == 3 else 0  # a hole the reader must skip
        entries[f"t{i}"] = {"dtype": "F32", "shape": [3], "data_offsets": [offset, offset + 12]}
        offset += 12
    data = torch.randn(offset // 4 + 1).numpy().tobytes()[:offset]
    raw = json.dumps(entries).encode()
    path = tmp_path / "holes.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    header = read_local_header(path)
    dest = {n: empty_like(t) for n, t in header.tensors.items()}
    reader = PipelinedReader(chunk_bytes=chunk_bytes, depth=2, device=CPU, direct=direct)
    reader.read([(path, header)], lambda info: Target(flat_bytes(dest[info.name])))
    for name, entry in entries.items():
        begin, end = entry["data_offsets"]
        want = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.float32)
        assert torch.equal(dest[name], want), name
