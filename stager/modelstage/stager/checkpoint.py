"""A Hugging Face checkpoint as the stager sees it: config, tensor index, files to carry over.

Only safetensors weights are read: pickle files (``*.bin``, ``*.pt``) can run arbitrary code
when loaded, so a source with nothing else is refused with a hint on how to convert it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from modelstage.core.architectures import HF_LAYOUT_HINT
from modelstage.core.errors import CheckpointError, SpecError
from modelstage.core.formats import FORMATS, PER_RANK_QUANTIZATIONS, Format
from modelstage.core.layouts import Layout
from modelstage.core.manifest import CARRIED_OVER as CARRIED_OVER
from modelstage.core.manifest import INDEX as INDEX
from modelstage.core.model_config import ModelConfig, check_heads
from modelstage.core.safetensors_format import TensorInfo, read_header

from .shard_plan import SINGLE_STAGE, Pipeline, ShardPlan, SourceTensor, plan_stages
from .sources import Source
from .sources.base import INDEX_VALUES as INDEX_VALUES
from .sources.base import MAX_JSON_BYTES as MAX_JSON_BYTES
from .sources.base import MAX_TENSORS as MAX_TENSORS
from .sources.base import parse_json, safe_name

CONFIG = "config.json"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
MiB = 1024 * 1024
MAX_CONFIG_BYTES = 1 * MiB
"""config.json files take a few KiB; anything near this is not a model config."""
MAX_CARRIED_BYTES = 256 * MiB
"""Each file carried beside the weights (tokenizer, vocabulary, config): the largest real
tokenizers take tens of MiB. They are streamed, never read whole."""


@dataclass(frozen=True)
class Checkpoint:
    source: Source
    config: Mapping[str, Any]
    weight_files: tuple[str, ...]
    tensors: Mapping[str, TensorInfo]
    carried_over: tuple[str, ...]

    @property
    def model(self) -> ModelConfig:
        """What splitting per rank reads of the config, parsed when a per-rank format asks
        (a copy of the Hugging Face layout takes any config vLLM takes)."""
        return ModelConfig.from_dict(self.config)

    @property
    def source_tensors(self) -> dict[str, SourceTensor]:
        return {n: SourceTensor(t.dtype, t.shape) for n, t in self.tensors.items()}

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def identity(self) -> dict[str, Any]:
        return self.source.identity([*self.weight_files, *self.carried_over])


def read_json(
    source: Source, name: str, *, max_bytes: int = MAX_JSON_BYTES, max_values: int | None = None
) -> Any:
    size = source.size(name)
    if size > max_bytes:
        raise CheckpointError(f"{name}: {size} bytes is too large for a JSON file here")
    return parse_json(source.read_bytes(name, max_bytes=max_bytes), name, max_values=max_values)


def open_checkpoint(source: Source) -> Checkpoint:
    """Read config, index and every safetensors header; no tensor data is read yet."""
    files = source.list_files()
    if CONFIG not in files:
        raise CheckpointError(f"{source.uri}: no config.json; not a Hugging Face checkpoint")
    config = read_json(source, CONFIG, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise CheckpointError(f"{CONFIG}: not a JSON object")
    weight_files = _weight_files(source, files)
    tensors: dict[str, TensorInfo] = {}
    for name in weight_files:
        header = read_header(name, source.size(name), _reader(source, name))
        if len(tensors) + len(header.tensors) > MAX_TENSORS:
            raise CheckpointError(
                f"{source.uri}: the weight files declare more than {MAX_TENSORS} tensors "
                f"(at {name}); refusing the checkpoint"
            )
        for tensor in header.tensors.values():
            if tensor.name in tensors:
                raise CheckpointError(
                    f"tensor {tensor.name!r} appears in both {tensors[tensor.name].file} and {name}"
                )
            tensors[tensor.name] = tensor
    if INDEX in files:
        _check_index(source, tensors)
    carried = tuple(f for f in CARRIED_OVER if f in files)
    for name in carried:  # before any work: a rank file written for nothing costs hours
        if (size := source.size(name)) > MAX_CARRIED_BYTES:
            raise CheckpointError(
                f"{source.uri}: {name} holds {size} bytes, more than the {MAX_CARRIED_BYTES} "
                "a file carried beside the weights may have; refusing it"
            )
    return Checkpoint(source, config, tuple(weight_files), tensors, carried)


def _reader(source: Source, name: str) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        buf = bytearray(length)
        source.read_range(name, offset, memoryview(buf))
        return bytes(buf)

    return read


def _weight_files(source: Source, files: list[str]) -> list[str]:
    if INDEX in files:
        index = read_json(source, INDEX, max_values=INDEX_VALUES)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(f"{INDEX}: 'weight_map' must map tensor names to file names")
        named = sorted({safe_name(v, INDEX) for v in weight_map.values()})
        absent = [f for f in named if f not in files]
        if absent:
            raise CheckpointError(
                f"{INDEX} names {len(absent)} file(s) that are not in the checkpoint: "
                + ", ".join(absent[:5])
            )
        return named
    safetensors = [f for f in files if f.endswith(".safetensors")]
    if safetensors:
        return safetensors
    pickles = [f for f in files if any(fnmatch.fnmatch(f, p) for p in PICKLE_PATTERNS)]
    if pickles:
        raise CheckpointError(
            f"{source.uri} holds only pickle weights ({', '.join(pickles[:3])}); modelstage reads "
            "safetensors only, since unpickling can run arbitrary code. Convert first, e.g. "
            "`safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')`,"
            " or pass --allow-pickle to have the stager do that"
        )
    raise CheckpointError(f"{source.uri}: no *.safetensors weights found")


def _check_index(source: Source, tensors: Mapping[str, TensorInfo]) -> None:
    index = read_json(source, INDEX, max_values=INDEX_VALUES)
    for name, file in index["weight_map"].items():
        found = tensors.get(name)
        if found is None:
            raise CheckpointError(f"{INDEX} maps tensor {name!r} to {file}, which lacks it")
        if found.file != file:
            raise CheckpointError(
                f"{INDEX} maps tensor {name!r} to {file}, but it is in {found.file}"
            )


def plan_for(
    checkpoint: Checkpoint,
    fmt: Format,
    tp: int,
    layout: Layout,
    dtype: str,
    pipeline: Pipeline = SINGLE_STAGE,
) -> tuple[ShardPlan, ...]:
    """What ``fmt``'s writer needs, one plan per pipeline stage: each rank's slices for a
    per-rank format (which refuses a checkpoint its rules do not describe); none for a copy
    of the Hugging Face layout, which vLLM splits at load whatever the architecture or
    quantization (its TP rule checked here, so a TP it cannot run fails before the copy)."""
    fmt.check_pipeline(pipeline.pp, layout)
    if fmt.per_rank:
        quantization = checkpoint.model.quantization
        if quantization in PER_RANK_QUANTIZATIONS and not fmt.splits_quantized:
            takes = [f.name for f in FORMATS.values() if f.splits_quantized]
            raise SpecError(
                f"format {fmt.name} does not take quantized checkpoints ({quantization}); "
                f"stage it per rank with --format {' or '.join(takes)}, or {HF_LAYOUT_HINT}"
            )
        return plan_stages(checkpoint.model, checkpoint.source_tensors, tp, layout, dtype, pipeline)
    check_heads(checkpoint.config, tp)
    return (ShardPlan(tp, (), (), pipeline.pp),)
