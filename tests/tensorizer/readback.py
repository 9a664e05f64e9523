"""Reading artifacts back for the tensorizer tests: rank files through tensorizer's own
deserialiser, the ``sharded_state`` reference through safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from tensorizer import TensorDeserializer

MARKER = ".vllm_tensorized_marker"


def rank_file(artifact: Path, rank: int) -> Path:
    return artifact / f"model-rank-{rank:03d}.tensors"


def sharded_state(artifact: Path, rank: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")):
        out.update(load_file(part))
    return out


def read_entries(path: Path) -> dict[str, tuple[int, torch.Tensor]]:
    """{label: (tensor type, tensor)} in file order, as tensorizer's reader yields them."""
    with TensorDeserializer(str(path), device="cpu", lazy_load=True) as d:
        return {name: (int(kind), t.clone()) for _, kind, name, t in d.read_tensors()}
