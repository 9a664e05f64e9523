"""The architecture registry: per Hugging Face parameter name, vLLM's name and how it splits.

Read it like vLLM's ``stacked_params_mapping``: a table, not branches. ``{L}`` stands for the
decoder layer index, ``{E}`` for the expert index of an MoE layer. The shard math for each
split kind lives once, in the stager's ``shard_plan``. Torch-free: ``formats`` (and through it
the operator's ``loadFormat: auto``) reads the table's names, the dev tools build synthetic
checkpoints from its rows.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .errors import SpecError
from .model_config import FP8_BLOCK, FP8_CHANNEL, ModelConfig

HF_LAYOUT_HINT = (
    "stage it in the Hugging Face layout with --format safetensors (a directory) or "
    "runai_streamer (S3), which vLLM splits itself at load"
)
"""What a per-rank format's refusal of a checkpoint it cannot split points to."""


class Split(enum.Enum):
    REPLICATED = "replicated"  # whole on every rank (norms, row-parallel biases)
    COLUMN = "column"  # dim 0 in equal blocks (column-parallel outputs)
    ROW = "row"  # dim 1 in equal blocks (row-parallel inputs)
    VOCAB = "vocab"  # dim 0 padded with zero rows to the layout's multiple, then equal blocks
    QKV = "qkv"  # fused q/k/v along dim 0, head-aligned; KV heads replicated when tp > kv
    MERGED = "merged"  # fused column-parallel slots (gate, up) along dim 0
    EXPERTS_MERGED = "experts_merged"  # MERGED per expert ``{E}``, stacked on a new dim 0
    EXPERTS_ROW = "experts_row"  # ROW per expert ``{E}``, stacked on a new dim 0
    EXPERTS_COLUMN_T = "experts_column_t"  # [E, in, out]: per expert out in blocks, transposed
    EXPERTS_ROW_T = "experts_row_t"  # [E, in, out]: per expert in in blocks, transposed
    FIRST_RANK = "first_rank"  # whole on rank 0, zeros of its shape on the others


STACKED_SPLITS = frozenset({Split.EXPERTS_MERGED, Split.EXPERTS_ROW})
"""Splits whose source names hold ``{E}``: one tensor per expert, stacked in the target."""
TRANSPOSED_SPLITS = frozenset({Split.EXPERTS_COLUMN_T, Split.EXPERTS_ROW_T})
"""Splits of a source that already stacks its experts ([E, in, out], the input dim first):
each expert's matrix is cut for the rank and written transposed, [E, out, in] as vLLM holds
its fused experts."""


class When(enum.Enum):
    """Which config flag makes a (bias) parameter exist."""

    ALWAYS = "always"
    NEVER = "never"
    ATTENTION_BIAS = "attention_bias"
    MLP_BIAS = "mlp_bias"
    UNTIED = "untied"  # a separate lm_head exists only without tied embeddings
    ROUTER_BIAS = "router_bias"  # DeepSeek-V3's e_score_correction_bias (noaux_tc)

    def holds(self, config: ModelConfig) -> bool:
        return {
            When.ALWAYS: True,
            When.NEVER: False,
            When.ATTENTION_BIAS: config.attention_bias,
            When.MLP_BIAS: config.mlp_bias,
            When.UNTIED: not config.tie_word_embeddings,
            When.ROUTER_BIAS: config.router_bias,
        }[self]


class Layers(enum.Enum):
    """Which decoder layers a rule reads (``ModelConfig.sparse``): DeepSeek's first layers
    are dense, the others MoE."""

    ALL = "all"
    DENSE = "dense"
    SPARSE = "sparse"

    def holds(self, config: ModelConfig, layer: int) -> bool:
        if self is Layers.ALL:
            return True
        return config.sparse(layer) == (self is Layers.SPARSE)


@dataclass(frozen=True)
class Rule:
    source: str
    target: str
    split: Split
    shape: tuple[str, ...]
    """The source's expected shape in symbols of ``ModelConfig.symbols`` (checked before I/O)."""
    slot: str | int | None = None  # "q"/"k"/"v" for QKV, 0/1 for MERGED and EXPERTS_MERGED
    when: When = When.ALWAYS
    dtype: str | None = None
    """The target's dtype whatever the source's (vLLM's float32 weight scales); None: the
    source's (or ``--dtype``'s)."""
    source_dtype: str | None = None
    """The dtype the source tensor must have (quantized weights); None: any float."""
    part: int | None = None
    """For a source fused along dim 0, whose ``shape[0]`` names its parts (``"q+kv+kv"``):
    the part this rule reads; the split applies to that part's rows as to a tensor of its own."""
    layers: Layers = Layers.ALL
    block: int | None = None
    """The source holds one scale per ``block`` x ``block`` tile of a weight whose shape
    ``shape`` names (block FP8's ``weight_scale_inv``): it is cut where its weight is, in
    tiles, and a cut through a tile is refused."""

    def source_shape(self, symbols: Mapping[str, int]) -> tuple[int, ...]:
        """The source's shape in numbers, given ``ModelConfig.symbols``."""
        dims = tuple(dim_size(symbols, dim) for dim in self.shape)
        return dims if self.block is None else tuple(-(-d // self.block) for d in dims)


def dim_size(symbols: Mapping[str, int], dim: str) -> int:
    """A dimension in shape symbols; ``"q+kv+kv"`` is the sum of its parts."""
    return sum(symbols[part] for part in dim.split("+"))


NON_LAYER_GROUP = -1
"""The group of a tensor outside the decoder layers (embeddings, final norm, head)."""


ATTN = "model.layers.{L}.self_attn"
MLP = "model.layers.{L}.mlp"


def _attention(bias: When) -> tuple[Rule, ...]:
    """q, k and v (weights, then optional biases) fused into ``qkv_proj``, slot by slot."""
    rows = {"q": "q", "k": "kv", "v": "kv"}
    weights = [
        Rule(
            f"{ATTN}.{x}_proj.weight", f"{ATTN}.qkv_proj.weight", Split.QKV, (rows[x], "hidden"), x
        )
        for x in "qkv"
    ]
    biases = [
        Rule(f"{ATTN}.{x}_proj.bias", f"{ATTN}.qkv_proj.bias", Split.QKV, (rows[x],), x, bias)
        for x in "qkv"
    ]
    return (*weights, *biases)


def _llama_like(*, qkv_bias: When, o_bias: When) -> tuple[Rule, ...]:
    return (
        Rule("model.embed_tokens.weight", "model.embed_tokens.weight", Split.VOCAB,
             ("vocab", "hidden")),
        *_attention(qkv_bias),
        Rule(f"{ATTN}.o_proj.weight", f"{ATTN}.o_proj.weight", Split.ROW, ("hidden", "q")),
        Rule(f"{ATTN}.o_proj.bias", f"{ATTN}.o_proj.bias", Split.REPLICATED, ("hidden",),
             when=o_bias),
        Rule(f"{MLP}.gate_proj.weight", f"{MLP}.gate_up_proj.weight", Split.MERGED,
             ("inter", "hidden"), 0),
        Rule(f"{MLP}.up_proj.weight", f"{MLP}.gate_up_proj.weight", Split.MERGED,
             ("inter", "hidden"), 1),
        Rule(f"{MLP}.gate_proj.bias", f"{MLP}.gate_up_proj.bias", Split.MERGED, ("inter",), 0,
             When.MLP_BIAS),
        Rule(f"{MLP}.up_proj.bias", f"{MLP}.gate_up_proj.bias", Split.MERGED, ("inter",), 1,
             When.MLP_BIAS),
        Rule(f"{MLP}.down_proj.weight", f"{MLP}.down_proj.weight", Split.ROW, ("hidden", "inter")),
        Rule(f"{MLP}.down_proj.bias", f"{MLP}.down_proj.bias", Split.REPLICATED, ("hidden",),
             when=When.MLP_BIAS),
        Rule("model.layers.{L}.input_layernorm.weight", "model.layers.{L}.input_layernorm.weight",
             Split.REPLICATED, ("hidden",)),
        Rule("model.layers.{L}.post_attention_layernorm.weight",
             "model.layers.{L}.post_attention_layernorm.weight", Split.REPLICATED, ("hidden",)),
        Rule("model.norm.weight", "model.norm.weight", Split.REPLICATED, ("hidden",)),
        Rule("lm_head.weight", "lm_head.weight", Split.VOCAB, ("vocab", "hidden"),
             when=When.UNTIED),
    )  # fmt: skip


_LLAMA = _llama_like(qkv_bias=When.ATTENTION_BIAS, o_bias=When.ATTENTION_BIAS)


def _fused_in_source(rules: tuple[Rule, ...], target: str) -> tuple[Rule, ...]:
    """``rules`` with the parts fused into ``target`` read from one source tensor of the
    target's own name, whose rows hold the parts in rule order (Phi-3's ``qkv_proj``:
    q, k, v; its ``gate_up_proj``: gate, up), each split as its own source would be."""
    parts = [r for r in rules if r.target == target]
    rows = "+".join(r.shape[0] for r in parts)
    return tuple(
        replace(r, source=target, shape=(rows, *r.shape[1:]), part=parts.index(r))
        if r.target == target
        else r
        for r in rules
    )


def _phi3() -> tuple[Rule, ...]:
    """A Llama whose checkpoints hold q/k/v and gate/up already fused, under vLLM's names."""
    rules = _LLAMA
    for fused in (f"{ATTN}.qkv_proj", f"{MLP}.gate_up_proj"):
        for kind in ("weight", "bias"):
            rules = _fused_in_source(rules, f"{fused}.{kind}")
    return rules


def _moe(block: str, gate: str, up: str, down: str, router: str) -> tuple[Rule, ...]:
    """An MoE layer's router (whole) and experts: each expert's ``gate`` and ``up`` halves of
    the rank side by side in ``w13_weight`` [E, 2I/tp, H], its ``down`` columns of the rank in
    ``w2_weight`` [E, H, I/tp], as vLLM's fused MoE layer holds them per rank. ``block`` is
    the layer's MoE module, ``router`` the name vLLM keeps for the router's weight."""
    expert, routed = f"{block}.experts.{{E}}", f"{block}.experts.routed_experts"
    return (
        Rule(f"{expert}.{gate}.weight", f"{routed}.w13_weight", Split.EXPERTS_MERGED,
             ("moe_inter", "hidden"), 0),
        Rule(f"{expert}.{up}.weight", f"{routed}.w13_weight", Split.EXPERTS_MERGED,
             ("moe_inter", "hidden"), 1),
        Rule(f"{expert}.{down}.weight", f"{routed}.w2_weight", Split.EXPERTS_ROW,
             ("hidden", "moe_inter")),
        Rule(f"{block}.gate.weight", f"{block}.{router}.weight", Split.REPLICATED,
             ("experts", "hidden")),
    )  # fmt: skip


def _shared_expert(block: str) -> tuple[Rule, ...]:
    """Qwen2-MoE's shared expert, split like a dense MLP, and its sigmoid gate [1, H] whole,
    under the names vLLM's fused MoE layer keeps for them."""
    shared, kept = f"{block}.shared_expert", f"{block}.experts._shared_experts._layer"
    return (
        Rule(f"{shared}.gate_proj.weight", f"{kept}.gate_up_proj.weight", Split.MERGED,
             ("shared_inter", "hidden"), 0),
        Rule(f"{shared}.up_proj.weight", f"{kept}.gate_up_proj.weight", Split.MERGED,
             ("shared_inter", "hidden"), 1),
        Rule(f"{shared}.down_proj.weight", f"{kept}.down_proj.weight", Split.ROW,
             ("hidden", "shared_inter")),
        Rule(f"{block}.shared_expert_gate.weight", f"{kept}.expert_gate.weight",
             Split.REPLICATED, ("one", "hidden")),
    )  # fmt: skip


def _without_dense_mlp(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    return tuple(r for r in rules if not r.source.startswith(MLP))


_QK_NORM = tuple(
    Rule(f"{ATTN}.{x}_norm.weight", f"{ATTN}.{x}_norm.weight", Split.REPLICATED, ("head_dim",))
    for x in "qk"
)


def _gpt_oss() -> tuple[Rule, ...]:
    """gpt-oss with bf16 experts: Llama-like attention with biases everywhere and a sink
    logit per head, renamed as vLLM's model names it (``model.embedding``, ``attn``); a
    router with a bias; experts stacked in the source as [E, in, out] (``gate_up_proj``
    interleaves gate and up columns: the rank's block keeps the interleave) and written
    transposed; ``down_proj_bias`` added once, by rank 0 (the others hold zeros)."""
    attn, experts = "model.layers.{L}.attn", f"{MLP}.experts"
    routed = f"{experts}.routed_experts"
    renamed = tuple(
        Rule(r.source,
             r.target.replace(ATTN, attn).replace("embed_tokens", "embedding"),
             r.split, r.shape, r.slot, r.when)
        for r in _without_dense_mlp(_llama_like(qkv_bias=When.ALWAYS, o_bias=When.ALWAYS))
    )  # fmt: skip
    return (
        *renamed,
        Rule(f"{ATTN}.sinks", f"{attn}.sinks", Split.COLUMN, ("heads",)),
        Rule(f"{MLP}.router.weight", f"{MLP}.router.weight", Split.REPLICATED,
             ("experts", "hidden")),
        Rule(f"{MLP}.router.bias", f"{MLP}.router.bias", Split.REPLICATED, ("experts",)),
        Rule(f"{experts}.gate_up_proj", f"{routed}.w13_weight", Split.EXPERTS_COLUMN_T,
             ("experts", "hidden", "moe_gate_up")),
        Rule(f"{experts}.gate_up_proj_bias", f"{routed}.w13_bias", Split.ROW,
             ("experts", "moe_gate_up")),
        Rule(f"{experts}.down_proj", f"{routed}.w2_weight", Split.EXPERTS_ROW_T,
             ("experts", "moe_inter", "hidden")),
        Rule(f"{experts}.down_proj_bias", f"{routed}.w2_bias", Split.FIRST_RANK,
             ("experts", "hidden")),
    )  # fmt: skip


def _mla() -> tuple[Rule, ...]:
    """DeepSeek's multi-head latent attention as vLLM's MLA model holds it per rank: the
    query and KV down-projections fused into ``fused_qkv_a_proj`` whole on every rank (their
    outputs are low ranks, not heads), their norms whole, the up-projections ``q_b_proj`` and
    ``kv_b_proj`` head-major by head blocks, ``o_proj`` by its input columns. vLLM's MLA
    layer holds the query norm, ``q_b_proj`` and ``o_proj`` too: their kept names are
    ``mla_attn``'s (the alphabetically smaller alias)."""
    mla = f"{ATTN}.mla_attn"
    return (
        Rule(f"{ATTN}.q_a_proj.weight", f"{ATTN}.fused_qkv_a_proj.weight", Split.REPLICATED,
             ("q_lora", "hidden"), 0),
        Rule(f"{ATTN}.q_a_layernorm.weight", f"{mla}.q_a_layernorm.weight", Split.REPLICATED,
             ("q_lora",)),
        Rule(f"{ATTN}.q_b_proj.weight", f"{mla}.q_b_proj.weight", Split.COLUMN,
             ("mla_q", "q_lora")),
        Rule(f"{ATTN}.kv_a_proj_with_mqa.weight", f"{ATTN}.fused_qkv_a_proj.weight",
             Split.REPLICATED, ("kv_a", "hidden"), 1),
        Rule(f"{ATTN}.kv_a_layernorm.weight", f"{ATTN}.kv_a_layernorm.weight", Split.REPLICATED,
             ("kv_lora",)),
        Rule(f"{ATTN}.kv_b_proj.weight", f"{ATTN}.kv_b_proj.weight", Split.COLUMN,
             ("mla_kv", "kv_lora")),
        Rule(f"{ATTN}.o_proj.weight", f"{mla}.o_proj.weight", Split.ROW, ("hidden", "mla_o")),
    )  # fmt: skip


def _deepseek() -> tuple[Rule, ...]:
    """DeepSeek V2/V3: MLA; the first ``first_k_dense_replace`` layers a dense MLP, the others
    routed experts (router kept as ``experts.gate``, with V3's float32 correction bias) and
    the ``n_shared_experts`` shared experts fused into one MLP under the fused MoE layer."""
    dense = tuple(
        replace(r, layers=Layers.DENSE) for r in _LLAMA if r.source.startswith(MLP)
    )
    kept = f"{MLP}.experts._shared_experts._layer"
    sparse = (
        *_moe(MLP, "gate_proj", "up_proj", "down_proj", "experts.gate"),
        Rule(f"{MLP}.gate.e_score_correction_bias", f"{MLP}.experts.gate.e_score_correction_bias",
             Split.REPLICATED, ("experts",), when=When.ROUTER_BIAS, dtype="F32"),
        Rule(f"{MLP}.shared_experts.gate_proj.weight", f"{kept}.gate_up_proj.weight",
             Split.MERGED, ("shared_inter", "hidden"), 0),
        Rule(f"{MLP}.shared_experts.up_proj.weight", f"{kept}.gate_up_proj.weight",
             Split.MERGED, ("shared_inter", "hidden"), 1),
        Rule(f"{MLP}.shared_experts.down_proj.weight", f"{kept}.down_proj.weight", Split.ROW,
             ("hidden", "shared_inter")),
    )  # fmt: skip
    outside = tuple(r for r in _LLAMA if not r.source.startswith((ATTN, MLP)))
    layer_norms = tuple(r for r in outside if "{L}" in r.source)
    return (
        outside[0],  # the embeddings
        *_mla(),
        *dense,
        *(replace(r, layers=Layers.SPARSE) for r in sparse),
        *layer_norms,
        *(r for r in outside[1:] if "{L}" not in r.source),
    )


@dataclass(frozen=True)
class AttentionParam:
    """A parameter vLLM creates on every layer's attention and no checkpoint tensor fills:
    shape [1], ``value`` in every rank's file."""

    name: str
    value: float
    dtype: str | None
    """Its safetensors dtype; None: the model's (config.json's ``torch_dtype``)."""
    shape: tuple[int, ...] = (1,)


_LINEAR_SPLITS = frozenset({Split.QKV, Split.MERGED, Split.ROW})
_FP8_ATTENTION = tuple(AttentionParam(f"{x}_scale", 1.0, "F32") for x in "kvq") + tuple(
    AttentionParam(f"{x}_zero_point", 0.0, None) for x in "kvq"
)
"""What vLLM's compressed-tensors KV-cache method creates on each attention without a
``kv_cache_scheme``: unit scales (float32) and zero points (the model's dtype)."""


def _fp8_channel(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The rules of a compressed-tensors W8A8-FP8 checkpoint: each decoder Linear weight is
    float8_e4m3fn, followed by its ``weight_scale`` [N, 1], which vLLM holds in float32 and
    splits with its weight's rows (per q/k/v or gate/up slot); a row-parallel weight's
    scales (o_proj, down_proj) stay whole on every rank."""
    out: list[Rule] = []
    for rule in rules:
        linear = rule.split in _LINEAR_SPLITS and rule.source.endswith("_proj.weight")
        if not linear:
            out.append(rule)
            continue
        out.append(replace(rule, source_dtype="F8_E4M3"))
        out.append(
            replace(
                rule,
                source=rule.source + "_scale",
                target=rule.target + "_scale",
                split=Split.REPLICATED if rule.split is Split.ROW else rule.split,
                shape=(rule.shape[0], "one"),
                dtype="F32",
            )
        )
    return tuple(out)


FP8_BLOCK_SIZE = 128
_BLOCK_SPLITS = frozenset({Split.QKV, Split.MERGED, Split.ROW, Split.COLUMN, Split.REPLICATED,
                           Split.EXPERTS_MERGED, Split.EXPERTS_ROW})  # fmt: skip
_FP8_KV_CACHE = tuple(AttentionParam(f"{x}_scale", -1.0, None, ()) for x in ("k", "v", "q", "prob"))
"""What vLLM's FP8 KV-cache method creates on each (non-MLA) attention of a ``quant_method:
fp8`` model whose checkpoint has no KV scales: 0-d placeholders of -1 in the model's dtype."""


def _fp8_block(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The rules of a block-FP8 checkpoint: each decoder Linear weight (a ``*_proj`` or
    ``*_with_mqa`` matrix, experts included; not routers, norms, embeddings or the head) is
    float8_e4m3fn, followed by its float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)],
    cut with its weight's rows or columns in whole tiles (vLLM's ``weight_scale_inv``, and
    ``w13_weight_scale_inv``/``w2_weight_scale_inv`` for stacked experts)."""
    out: list[Rule] = []
    for rule in rules:
        out.append(rule)
        weight = rule.source.endswith(("_proj.weight", "_with_mqa.weight"))
        if not weight or rule.split not in _BLOCK_SPLITS:
            continue
        out[-1] = replace(rule, source_dtype="F8_E4M3")
        out.append(replace(rule, source=rule.source + "_scale_inv",
                           target=rule.target + "_scale_inv", dtype="F32",
                           block=FP8_BLOCK_SIZE))  # fmt: skip
    return tuple(out)


_FEEDFORWARD_NORMS = tuple(
    Rule(f"model.layers.{{L}}.{x}_feedforward_layernorm.weight",
         f"model.layers.{{L}}.{x}_feedforward_layernorm.weight", Split.REPLICATED, ("hidden",))
    for x in ("pre", "post")
)  # fmt: skip
"""Gemma's norms around the MLP; like every Gemma norm stored raw (vLLM adds 1 when it runs)."""


def _without_head(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    return tuple(r for r in rules if r.source != "lm_head.weight")


@dataclass(frozen=True)
class Architecture:
    name: str
    """``config.json``'s ``architectures[0]``."""
    model_type: str
    """``config.json``'s ``model_type`` for it (what transformers and vLLM read the config as)."""
    rules: tuple[Rule, ...]
    ignored: tuple[str, ...] = ("model.layers.{L}.self_attn.rotary_emb.inv_freq",)
    """Source tensors vLLM skips (recomputed buffers); anything else unknown is refused."""
    tp_within_experts: bool = False
    """vLLM's model refuses a TP size above the number of routed experts."""
    tp_within_kv_heads: bool = False
    """vLLM's model divides the KV heads among the ranks and never replicates them."""
    attention_params: tuple[AttentionParam, ...] = ()
    """Parameters of every layer's attention that no source tensor fills (quantized models)."""
    tied_embeddings_target: str = "lm_head.weight"
    """The name vLLM keeps for a tied embedding matrix: the head's, the alphabetically
    smaller alias, unless the model has no head module at all (Gemma 2)."""
    norms_hold_offsets: bool = False
    """The checkpoint's norm weights are offsets from a scale of 1 (vLLM's model adds 1 when it
    runs, as Gemma's do), not the scale itself."""
    attention_module: tuple[str, str] = ("qkv_proj.weight", "attn.")
    """Where vLLM's per-layer attention module holds its scale buffers and parameters: beside
    the target named by the first, under the module path the second names."""
    routers_listed_unquantized: bool = False
    """Block FP8: vLLM quantizes the MoE routers unless ``modules_to_not_convert`` names each
    (Qwen3-MoE's hub checkpoints do): the rules read them unquantized, so each must be named."""
    mla: bool = False
    """Its rules are MLA's: the config must give the MLA dimensions with a query low rank."""
    next_layers_ignored: bool = False
    """The layers after the decoder layers (``num_nextn_predict_layers``: DeepSeek-V3's
    multi-token prediction) are in the checkpoint and skipped by vLLM's model."""
    edges_on_every_stage: bool = False
    """vLLM's model builds its embeddings, final norm and head on every pipeline stage (else,
    as Llama's does, the embeddings on the first stage only, and on the last where tied, the
    final norm and head on the last)."""

    def expand(self, config: ModelConfig) -> list[tuple[Rule, str, int]]:
        """The rules ``config`` makes active, with ``{L}`` (and ``{E}``) expanded, each with its
        source name and group (decoder layer, or ``NON_LAYER_GROUP``), in output order:
        pre-layer, layers, post-layer. Within a layer expert rules run expert by expert, so
        the slots of a stacked target come in expert order, each expert's parts in rule order."""
        rules = [r for r in self.rules if r.when.holds(config)]
        first_layer = next(i for i, r in enumerate(self.rules) if "{L}" in r.source)
        outside = [r for r in rules if "{L}" not in r.source]
        before = [r for r in outside if self.rules.index(r) < first_layer]
        after = [r for r in outside if self.rules.index(r) > first_layer]
        layer_rules = [r for r in rules if "{L}" in r.source and "{E}" not in r.source]
        expert_rules = [r for r in rules if "{E}" in r.source]
        expanded = [(r, r.source, NON_LAYER_GROUP) for r in before]
        for layer in range(config.num_layers):
            expanded += [
                (r, r.source.replace("{L}", str(layer)), layer)
                for r in layer_rules
                if r.layers.holds(config, layer)
            ]
            experts = [r for r in expert_rules if r.layers.holds(config, layer)]
            for e in range(config.num_experts if experts else 0):
                expanded += [
                    (r, r.source.replace("{L}", str(layer)).replace("{E}", str(e)), layer)
                    for r in experts
                ]
        expanded += [(r, r.source, NON_LAYER_GROUP) for r in after]
        return expanded

    def check_tensor_parallel(self, config: ModelConfig, tp: int) -> None:
        if self.mla and (config.mla is None or not config.mla.q_lora_rank):
            raise SpecError(
                f"config.json: {self.name} is split per rank with multi-head latent attention "
                f"and a query low rank (kv_lora_rank and q_lora_rank set); {HF_LAYOUT_HINT}"
            )
        if self.tp_within_kv_heads and config.num_kv_heads % tp:
            raise SpecError(
                f"tensor parallel size {tp} does not divide the {config.num_kv_heads} KV heads, "
                f"which vLLM's {self.name} needs"
            )
        if self.tp_within_experts and tp > config.num_experts:
            raise SpecError(
                f"tensor parallel size {tp} is greater than the {config.num_experts} experts, "
                f"which vLLM's {self.name} refuses"
            )


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", _LLAMA),
        Architecture("MistralForCausalLM", "mistral", _LLAMA),
        Architecture(
            "MixtralForCausalLM",
            "mixtral",
            _without_dense_mlp(_LLAMA)
            + _moe("model.layers.{L}.block_sparse_moe", "w1", "w3", "w2", "gate"),
            edges_on_every_stage=True,
        ),
        Architecture("Phi3ForCausalLM", "phi3", _phi3()),
        Architecture(
            "Qwen2ForCausalLM", "qwen2", _llama_like(qkv_bias=When.ALWAYS, o_bias=When.NEVER)
        ),
        Architecture(
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            _without_dense_mlp(_llama_like(qkv_bias=When.ALWAYS, o_bias=When.NEVER))
            + _moe(MLP, "gate_proj", "up_proj", "down_proj", "gate")
            + _shared_expert(MLP),
            tp_within_experts=True,
            edges_on_every_stage=True,
        ),
        Architecture(
            "Qwen3ForCausalLM",
            "qwen3",
            _llama_like(qkv_bias=When.ATTENTION_BIAS, o_bias=When.ATTENTION_BIAS) + _QK_NORM,
        ),
        Architecture(
            "Gemma2ForCausalLM",
            "gemma2",
            _without_head(_LLAMA) + _FEEDFORWARD_NORMS,
            tied_embeddings_target="model.embed_tokens.weight",
            norms_hold_offsets=True,
            edges_on_every_stage=True,
        ),
        Architecture(
            "Gemma3ForCausalLM",
            "gemma3_text",
            _LLAMA + _FEEDFORWARD_NORMS + _QK_NORM,
            norms_hold_offsets=True,
            edges_on_every_stage=True,
        ),
        Architecture(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            _without_dense_mlp(_LLAMA)
            + _QK_NORM
            + _moe(MLP, "gate_proj", "up_proj", "down_proj", "experts.gate"),
            tp_within_experts=True,
            edges_on_every_stage=True,
        ),
        *(
            Architecture(
                name,
                model_type,
                _deepseek(),
                mla=True,
                next_layers_ignored=True,
                attention_module=("fused_qkv_a_proj.weight", "mla_attn.mla_attn."),
            )
            for name, model_type in (
                ("DeepseekV2ForCausalLM", "deepseek_v2"),
                ("DeepseekV3ForCausalLM", "deepseek_v3"),
            )
        ),
        Architecture(
            "GptOssForCausalLM",
            "gpt_oss",
            _gpt_oss(),
            tp_within_kv_heads=True,
            edges_on_every_stage=True,
        ),
    )
}


QUANTIZED: dict[str, dict[str, Architecture]] = {
    FP8_CHANNEL: {
        name: replace(
            ARCHITECTURES[name],
            rules=_fp8_channel(ARCHITECTURES[name].rules),
            attention_params=_FP8_ATTENTION,
        )
        for name in ("LlamaForCausalLM", "Qwen3ForCausalLM")
    },
    FP8_BLOCK: {
        # MLA's attention creates no KV-cache scales: the model's own buffers only
        "DeepseekV3ForCausalLM": replace(
            ARCHITECTURES["DeepseekV3ForCausalLM"],
            rules=_fp8_block(ARCHITECTURES["DeepseekV3ForCausalLM"].rules),
        ),
        "Qwen3MoeForCausalLM": replace(
            ARCHITECTURES["Qwen3MoeForCausalLM"],
            rules=_fp8_block(ARCHITECTURES["Qwen3MoeForCausalLM"].rules),
            attention_params=_FP8_KV_CACHE,
            routers_listed_unquantized=True,
        ),
    },
}
"""Quantization -> the architectures whose checkpoints in it are split per rank, with their
rules (``formats.PER_RANK_QUANTIZATIONS`` names them)."""


def architecture_for(config: ModelConfig) -> Architecture:
    """The rules that split ``config``'s checkpoint per rank; a checkpoint no rules describe
    (another architecture, or a quantization without rules) is refused, naming the formats
    that take it."""
    if config.quantization is not None:
        return _quantized(config)
    try:
        return ARCHITECTURES[config.architecture]
    except KeyError:
        raise SpecError(
            f"architecture {config.architecture!r} is not supported per rank; supported: "
            + ", ".join(sorted(ARCHITECTURES))
            + f"; {HF_LAYOUT_HINT}"
        ) from None


def _quantized(config: ModelConfig) -> Architecture:
    quantization = config.quantization
    if quantization not in QUANTIZED:
        mismatch = f" ({config.quantization_mismatch})" if config.quantization_mismatch else ""
        raise SpecError(
            f"config.json: quantized checkpoints (quantization_config: {quantization}) are "
            f"not split per rank, but for {', '.join(QUANTIZED)} (compressed-tensors float8 "
            f"weights with one scale per output channel and dynamic per-token activations; "
            f"quant_method fp8 with weight_block_size [128, 128] and dynamic activations)"
            f"{mismatch}; {HF_LAYOUT_HINT}"
        )
    try:
        return QUANTIZED[quantization][config.architecture]
    except KeyError:
        raise SpecError(
            f"architecture {config.architecture!r} is not split per rank when quantized as "
            f"{quantization}; supported: {', '.join(sorted(QUANTIZED[quantization]))}; "
            f"{HF_LAYOUT_HINT}"
        ) from None
