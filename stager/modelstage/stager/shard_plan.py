"""The shard plan: which rows and columns of which source tensor become which rank's tensor.

A pure function of the model config, the source tensors' dtypes and shapes, the TP size and
the layout; no I/O. Every rank's tensor is a concatenation along dim 0 of *slots*; a slot is
one source tensor (or zero rows, for vocab padding) with a per-rank ``Slice``; a stacked
expert tensor ([E, rows, ...]) is the same concatenation, expert by expert, read row-major.
A slice addresses the source as a matrix (every dim but the last is rows); a *transposed*
slot writes its rank's cut transposed (one expert's matrix of a source that stacks experts
input dim first).
Because every rank has the same slots in the same order, the writer can stream each source
tensor once and append each rank's slice to that rank's file, keeping every rank file
sequential.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from modelstage.core.architectures import (
    HF_LAYOUT_HINT,
    NON_LAYER_GROUP,
    STACKED_SPLITS,
    TRANSPOSED_SPLITS,
    Architecture,
    Layers,
    Rule,
    Split,
    architecture_for,
    dim_size,
)
from modelstage.core.errors import CheckpointError, SpecError
from modelstage.core.layouts import DEFAULT_VLLM_VERSION, Layout
from modelstage.core.model_config import ModelConfig
from modelstage.core.pipeline_parallel import layer_partition, stage_layers
from modelstage.core.safetensors_format import DTYPE_CODES, DTYPE_SIZES

TIED_EMBEDDING_TARGET = "lm_head.weight"
"""With tied embeddings vLLM writes the shared matrix once, under the head's name, where its
model has a head (``Architecture.tied_embeddings_target`` says per architecture)."""


@dataclass(frozen=True)
class Slice:
    """Rows ``[rows[0], rows[1])`` of the source, and columns ``cols`` (None: every column);
    the source read as a matrix: its last dim the columns, all others the rows."""

    rows: tuple[int, int]
    cols: tuple[int, int] | None = None

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    def shifted(self, offset: int) -> Slice:
        """The same cut, ``offset`` rows further down (a part of a fused source)."""
        return Slice((self.rows[0] + offset, self.rows[1] + offset), self.cols)


@dataclass(frozen=True)
class Slot:
    source: str | None
    """Source tensor name; None means zero rows (``per_rank[r].num_rows`` of them)."""
    per_rank: tuple[Slice, ...]
    transposed: bool = False
    """The rank's cut is written transposed: its columns become the target's rows."""


@dataclass(frozen=True)
class TargetTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    """The per-rank shape (equal on every rank)."""
    slots: tuple[Slot, ...]
    group: int
    """Decoder layer index, or NON_LAYER_GROUP for embeddings, final norm and head."""
    constant: float | None = None
    """For one-element tensors no source fills (vLLM's 0-d attention buffers, its [1]
    attention parameters of a quantized model): every rank holds this value (``slots`` is
    empty)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class SourceTensor:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardPlan:
    """The tensor-parallel ranks' tensors of one pipeline stage (the whole model at PP 1)."""

    tp: int
    targets: tuple[TargetTensor, ...]
    ignored_sources: tuple[str, ...]
    pp: int = 1
    pp_rank: int = 0
    """The stage these targets are of, of ``pp``: what its rank files are named by."""


@dataclass(frozen=True)
class Pipeline:
    """The pipeline stages to plan: their number and the layers of each (vLLM's partition;
    None: its default)."""

    pp: int = 1
    partition: tuple[int, ...] | None = None


SINGLE_STAGE = Pipeline()
"""No pipeline parallelism: one stage holds every layer."""


def _check_proven(architecture: str, layout: Layout) -> None:
    """Refuse an architecture whose per-rank state is not proven for the layout's vLLM."""
    if not layout.splits(architecture):
        raise SpecError(
            f"architecture {architecture!r} is split per rank for vLLM "
            f"{DEFAULT_VLLM_VERSION} but not proven for vLLM {layout.vllm_version} (proven: "
            f"{', '.join(sorted(layout.architectures or ()))}); {HF_LAYOUT_HINT}"
        )


def plan_stages(
    config: ModelConfig,
    sources: Mapping[str, SourceTensor],
    tp: int,
    layout: Layout,
    dtype: str = "auto",
    pipeline: Pipeline = SINGLE_STAGE,
) -> tuple[ShardPlan, ...]:
    """Every pipeline stage's plan, in stage order."""
    layer_partition(config.num_layers, pipeline.pp, pipeline.partition)  # refused before any
    return tuple(
        plan_shards(config, sources, tp, layout, dtype, pipeline, pp_rank)
        for pp_rank in range(pipeline.pp)
    )


def plan_shards(
    config: ModelConfig,
    sources: Mapping[str, SourceTensor],
    tp: int,
    layout: Layout,
    dtype: str = "auto",
    pipeline: Pipeline = SINGLE_STAGE,
    pp_rank: int = 0,
) -> ShardPlan:
    """Map every source tensor to its per-rank slices on stage ``pp_rank`` of ``pipeline``;
    refuse missing or unknown tensors."""
    config.check_tensor_parallel(tp)
    arch = architecture_for(config)
    _check_proven(config.architecture, layout)
    arch.check_tensor_parallel(config, tp)
    _check_layer_count(arch, config, sources)
    active = arch.expand(config)
    _check_sources(arch, config, active, sources)
    _check_unquantized_modules(arch, config, active)
    out_dtype = _resolve_dtype(dtype)
    if config.quantization is not None and out_dtype is not None:
        raise SpecError(
            f"--dtype {dtype}: a quantized checkpoint ({config.quantization}) is staged in its "
            "own dtypes; use --dtype auto"
        )

    ignored = tuple(sorted(set(sources) - {s for _, s, _ in active}))
    layers = stage_layers(config.num_layers, pp_rank, pipeline.pp, pipeline.partition)
    last = pp_rank == pipeline.pp - 1
    by_target: dict[str, list[tuple[Rule, str, int]]] = {}
    for rule, source, group in _on_stage(arch, config, active, layers, (pp_rank == 0, last)):
        target = rule.target.replace("{L}", str(group)) if group >= 0 else rule.target
        head_here = last or arch.edges_on_every_stage  # tied: the head's name where it is
        if rule.split is Split.VOCAB and config.tie_word_embeddings and head_here:
            target = arch.tied_embeddings_target
        by_target.setdefault(target, []).append((rule, source, group))

    targets: list[TargetTensor] = []
    for name, members in by_target.items():
        targets.append(_target(name, members, sources, config, tp, layout, out_dtype))
        anchor, module = arch.attention_module
        if name.endswith("." + anchor):
            prefix = name.removesuffix(anchor) + module
            targets.extend(_attention_buffers(prefix, members[0][2], layout))
            targets.extend(_attention_params(prefix, members[0][2], arch, config))
    return ShardPlan(tp, tuple(targets), ignored, pipeline.pp, pp_rank)


def _on_stage(
    arch: Architecture,
    config: ModelConfig,
    active: list[tuple[Rule, str, int]],
    layers: tuple[int, int],
    edges: tuple[bool, bool],
) -> list[tuple[Rule, str, int]]:
    """The active rules of one pipeline stage: its ``layers`` [start, end); the tensors before
    the layers (embeddings) on the first stage, and on the last where tied; those after
    (final norm, head) on the last (``edges``: whether the stage is the first, the last); or
    both on every stage where vLLM's model builds them there."""
    first, last = edges
    kept: list[tuple[Rule, str, int]] = []
    seen_layer = False
    for rule, source, group in active:
        if group != NON_LAYER_GROUP:
            seen_layer = True
            if layers[0] <= group < layers[1]:
                kept.append((rule, source, group))
            continue
        before = not seen_layer
        edge = (first or (last and config.tie_word_embeddings)) if before else last
        if edge or arch.edges_on_every_stage:
            kept.append((rule, source, group))
    return kept


def _check_unquantized_modules(
    arch: Architecture, config: ModelConfig, active: list[tuple[Rule, str, int]]
) -> None:
    """Block FP8's ``modules_to_not_convert`` may name only modules the rules read
    unquantized (vLLM would build any other unquantized, against the float8 source), and,
    where vLLM quantizes routers by default, must name every layer's router."""
    listed = set(config.unquantized_modules)
    plain = {s for r, s, _ in active if r.source_dtype is None and r.block is None}
    quantized = {s for r, s, _ in active if r.source_dtype is not None}
    for name in sorted(listed):
        inside = [s for s in plain | quantized if s.startswith(name + ".")]
        if not inside or any(s in quantized for s in inside):
            raise CheckpointError(
                f"config.json: modules_to_not_convert names {name!r}, which is not an "
                f"unquantized module of {arch.name}'s block-FP8 rules; {HF_LAYOUT_HINT}"
            )
    routers = sorted({s.removesuffix(".weight") for r, s, _ in active
                      if r.target.endswith(".experts.gate.weight")})  # fmt: skip
    quantized_routers = [r for r in routers if r not in listed]
    if arch.routers_listed_unquantized and quantized_routers:
        raise CheckpointError(
            f"config.json: modules_to_not_convert does not name the router "
            f"{quantized_routers[0]!r}, which vLLM would then build in float8 against the "
            f"unquantized source; {HF_LAYOUT_HINT}"
        )


def _check_layer_count(
    arch: Architecture, config: ModelConfig, sources: Mapping[str, SourceTensor]
) -> None:
    """Refuse a config that claims more decoder layers than the checkpoint has tensors for
    before the rules are expanded per layer: that costs time and memory per claimed layer
    (``num_hidden_layers`` may be up to 2**24), whereas the checkpoint's headers bound the
    number of tensors."""
    per_layer = min(
        sum(
            config.num_experts if "{E}" in source else 1
            for source in {
                r.source
                for r in arch.rules
                if "{L}" in r.source and r.when.holds(config) and r.layers in (Layers.ALL, kind)
            }
        )
        for kind in (Layers.DENSE, Layers.SPARSE)
    )
    if config.num_layers * per_layer > len(sources):
        raise CheckpointError(
            f"config.json has {config.num_layers} layers, but the checkpoint holds only "
            f"{len(sources)} tensors ({arch.name} needs {per_layer} per layer)"
        )


def _check_sources(
    arch: Architecture,
    config: ModelConfig,
    active: list[tuple[Rule, str, int]],
    sources: Mapping[str, SourceTensor],
) -> None:
    missing = [s for _, s, _ in active if s not in sources]
    if missing:
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} tensor(s) that {arch.name} needs, e.g. "
            + ", ".join(missing[:5])
        )
    wanted = {s for _, s, _ in active}
    ignore = [re.compile(re.escape(p).replace(r"\{L\}", r"\d+") + "$") for p in arch.ignored]
    if config.tie_word_embeddings:
        ignore.append(re.compile(re.escape("lm_head.weight") + "$"))
    unknown = sorted(
        n
        for n in sources
        if n not in wanted
        and not any(p.match(n) for p in ignore)
        and not _in_next_layers(arch, config, n)
    )
    if unknown:
        raise CheckpointError(
            f"checkpoint has {len(unknown)} tensor(s) that {arch.name} with this config does not "
            "use (vLLM would refuse them), e.g. " + ", ".join(unknown[:5])
        )
    symbols = config.symbols
    for rule, source, _ in active:
        expected = rule.source_shape(symbols)
        actual = sources[source].shape
        if actual != expected:
            raise CheckpointError(
                f"tensor {source!r} has shape {list(actual)}, but config.json implies "
                f"{list(expected)} ({' x '.join(rule.shape)})"
            )
        if rule.source_dtype is not None and sources[source].dtype != rule.source_dtype:
            raise CheckpointError(
                f"tensor {source!r} has dtype {sources[source].dtype}, but config.json's "
                f"quantization ({config.quantization}) implies {rule.source_dtype}"
            )


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _in_next_layers(arch: Architecture, config: ModelConfig, name: str) -> bool:
    """Whether ``name`` is of a multi-token-prediction layer after the decoder layers, which
    the architecture's vLLM model skips."""
    found = _LAYER_INDEX.match(name) if arch.next_layers_ignored else None
    return found is not None and 0 <= int(found[1]) - config.num_layers < config.next_layers


def _resolve_dtype(dtype: str) -> str | None:
    if dtype == "auto":
        return None
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise SpecError(
            f"dtype {dtype!r} is not supported; use auto, " + ", ".join(DTYPE_CODES)
        ) from None


def _target(
    name: str,
    members: list[tuple[Rule, str, int]],
    sources: Mapping[str, SourceTensor],
    config: ModelConfig,
    tp: int,
    layout: Layout,
    out_dtype: str | None,
) -> TargetTensor:
    dtypes = {sources[s].dtype for _, s, _ in members}
    fixed = members[0][0].dtype
    if fixed is None and out_dtype is None and len(dtypes) > 1:
        raise CheckpointError(
            f"tensors fused into {name!r} have different dtypes {sorted(dtypes)}; "
            "pass --dtype to convert them"
        )
    dtype = fixed or out_dtype or dtypes.pop()
    slots: list[Slot] = []
    for rule, source, _ in members:
        slots.extend(_slots(rule, source, sources[source].shape, config, tp, layout))
    _check_fused_tiles(name, members, config)
    first_shape = sources[members[0][1]].shape
    if members[0][0].split in TRANSPOSED_SPLITS:  # one slot per expert: [E, out, in]
        cut = slots[0].per_rank[0]
        width = cut.cols[1] - cut.cols[0] if cut.cols else first_shape[-1]
        return TargetTensor(name, dtype, (len(slots), width, cut.num_rows), tuple(slots),
                            members[0][2])  # fmt: skip
    rows = sum(slot.per_rank[0].num_rows for slot in slots)
    cols = slots[0].per_rank[0].cols
    rest = first_shape[1:]
    if cols is not None:
        rest = (cols[1] - cols[0], *rest[1:])
    shape = (rows, *rest)
    if members[0][0].split in STACKED_SPLITS:  # expert by expert: [E, rows per expert, ...]
        shape = (config.num_experts, rows // config.num_experts, *rest)
    return TargetTensor(name, dtype, shape, tuple(slots), members[0][2])


def _check_fused_tiles(
    name: str, members: list[tuple[Rule, str, int]], config: ModelConfig
) -> None:
    """Block scales of weights fused into one target line up only if every fused weight but
    the last has whole tiles of rows (vLLM refuses to build the fused layer otherwise)."""
    for rule, source, _ in members[:-1]:
        rows = dim_size(config.symbols, rule.shape[0])
        if rule.block is not None and rule.split is not Split.EXPERTS_MERGED and rows % rule.block:
            raise CheckpointError(
                f"{source!r}: {rows} rows are not whole {rule.block}-row scale blocks, but it "
                f"is fused with others into {name!r}; {HF_LAYOUT_HINT}"
            )


def _slots(
    rule: Rule,
    source: str,
    shape: tuple[int, ...],
    config: ModelConfig,
    tp: int,
    layout: Layout,
) -> list[Slot]:
    """The per-rank slices of one source tensor (or of one part of a source fused along dim
    0, shifted to that part's rows); the shard math lives here, once per kind."""
    if rule.block is not None:
        return _tiles(rule, source, config, tp, layout)
    if rule.part is None:
        return _split(rule, source, shape, config, tp, layout)
    parts = rule.shape[0].split("+")
    first = sum(config.symbols[p] for p in parts[: rule.part])
    rows = config.symbols[parts[rule.part]]
    return [
        Slot(slot.source, tuple(sel.shifted(first) for sel in slot.per_rank))
        for slot in _split(rule, source, (rows, *shape[1:]), config, tp, layout)
    ]


def _tiles(rule: Rule, source: str, config: ModelConfig, tp: int, layout: Layout) -> list[Slot]:
    """A block-scale source's slices: its weight's cut (``rule.shape``) in whole tiles of
    ``rule.block``; a rank's rows or columns that begin or end inside a tile (but at the
    weight's own end) are refused, as vLLM refuses to build such a layer."""
    weight = tuple(dim_size(config.symbols, d) for d in rule.shape)
    block = rule.block or 1

    def tiles(cut: tuple[int, int], size: int, what: str) -> tuple[int, int]:
        if cut[0] % block or (cut[1] % block and cut[1] != size):
            raise SpecError(
                f"tensor parallel size {tp} cuts the {block} x {block} scale blocks of "
                f"{source.removesuffix('_scale_inv')!r} ({what} {cut[0]}..{cut[1]} of {size} "
                f"on one rank); use a tensor parallel size whose per-rank {what} are whole "
                f"blocks, or {HF_LAYOUT_HINT}"
            )
        return cut[0] // block, -(-cut[1] // block)

    return [
        Slot(slot.source, tuple(
            Slice(tiles(cut.rows, weight[0], "rows"),
                  None if cut.cols is None else tiles(cut.cols, weight[1], "columns"))
            for cut in slot.per_rank))
        for slot in _split(rule, source, weight, config, tp, layout)
    ]  # fmt: skip


def _split(
    rule: Rule,
    source: str,
    shape: tuple[int, ...],
    config: ModelConfig,
    tp: int,
    layout: Layout,
) -> list[Slot]:
    """The per-rank slices of a tensor of ``shape`` by ``rule``'s split kind."""
    n = shape[0]
    split = rule.split
    if split is Split.REPLICATED:
        return [Slot(source, tuple(Slice((0, n)) for _ in range(tp)))]
    if split in (Split.COLUMN, Split.MERGED, Split.EXPERTS_MERGED):
        return [Slot(source, tuple(Slice(_block(n, tp, r)) for r in range(tp)))]
    if split in (Split.ROW, Split.EXPERTS_ROW):
        cols = shape[1]
        if cols % tp:
            raise SpecError(f"tensor parallel size {tp} does not divide dim 1 of {source!r}")
        return [Slot(source, tuple(Slice((0, n), _block(cols, tp, r)) for r in range(tp)))]
    if split is Split.VOCAB:
        padded = -(-n // layout.vocab_padding) * layout.vocab_padding
        if padded % tp:
            raise SpecError(f"tensor parallel size {tp} does not divide the padded vocab {padded}")
        per = padded // tp
        real = [(min(r * per, n), min((r + 1) * per, n)) for r in range(tp)]
        data = Slot(source, tuple(Slice(rows) for rows in real))
        zeros = Slot(None, tuple(Slice((0, per - (b - a))) for a, b in real))
        return [data, zeros] if padded != n else [data]
    if split is Split.QKV:
        heads = config.num_heads if rule.slot == "q" else config.num_kv_heads
        return [
            Slot(source, tuple(Slice(_head_rows(heads, tp, r, config.head_dim)) for r in range(tp)))
        ]
    if split is Split.FIRST_RANK:  # rank 0 the source, every other rank as many zero rows
        data = Slot(source, tuple(Slice((0, n if r == 0 else 0)) for r in range(tp)))
        zeros = Slot(None, tuple(Slice((0, 0 if r == 0 else n)) for r in range(tp)))
        return [data, zeros] if tp > 1 else [data]
    if split in TRANSPOSED_SPLITS:
        return _expert_matrices(split, source, shape, tp)
    raise AssertionError(split)


def _expert_matrices(split: Split, source: str, shape: tuple[int, ...], tp: int) -> list[Slot]:
    """One transposed slot per expert of a source stacked [E, in, out]: expert ``e`` is rows
    ``[e * in, (e + 1) * in)`` of the matrix; the rank takes a block of its columns (out,
    ``EXPERTS_COLUMN_T``) or of its rows (in, ``EXPERTS_ROW_T``)."""
    experts, rows, cols = shape
    slots = []
    for e in range(experts):
        first = e * rows
        if split is Split.EXPERTS_COLUMN_T:
            cuts = tuple(Slice((first, first + rows), _block(cols, tp, r)) for r in range(tp))
        else:
            cuts = tuple(
                Slice((first + a, first + b)) for a, b in (_block(rows, tp, r) for r in range(tp))
            )
        slots.append(Slot(source, cuts, transposed=True))
    return slots


def _block(n: int, tp: int, rank: int) -> tuple[int, int]:
    if n % tp:
        raise SpecError(f"tensor parallel size {tp} does not divide a dimension of size {n}")
    size = n // tp
    return rank * size, (rank + 1) * size


def _head_rows(heads: int, tp: int, rank: int, head_dim: int) -> tuple[int, int]:
    """Rank's rows of a head-major projection; with fewer heads than ranks, heads replicate."""
    if heads >= tp:
        first, count = rank * (heads // tp), heads // tp
    else:
        first, count = rank // (tp // heads), 1
    return first * head_dim, (first + count) * head_dim


def _attention_params(
    prefix: str, layer: int, arch: Architecture, config: ModelConfig
) -> list[TargetTensor]:
    """The architecture's [1] attention parameters (a quantized model's unit scales and zero
    points) under ``prefix`` (the layer's attention module); ``None`` dtypes are the model's,
    as vLLM creates them at ``--dtype auto``."""
    if not arch.attention_params:
        return []
    model_dtype = DTYPE_CODES.get(config.torch_dtype or "")
    if model_dtype is None:
        raise CheckpointError(
            f"config.json's torch_dtype {config.torch_dtype!r} is not one of "
            f"{', '.join(DTYPE_CODES)}: the dtype of vLLM's attention parameters is unknown"
        )
    return [
        TargetTensor(prefix + p.name, p.dtype or model_dtype, p.shape, (), layer, constant=p.value)
        for p in arch.attention_params
    ]


def _attention_buffers(prefix: str, layer: int, layout: Layout) -> list[TargetTensor]:
    return [
        TargetTensor(prefix + buffer, "F32", (), (), layer, constant=1.0)
        for buffer in layout.attention_scale_buffers
    ]
