"""The few facts of a Hugging Face ``config.json`` that decide how a checkpoint is split."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError, SpecError

FP8_CHANNEL = "compressed-tensors/w8a8-fp8-channel"
"""The quantization the stager reports for a compressed-tensors checkpoint of float8_e4m3fn
Linear weights with one scale per output channel and activations quantized per token at run
time (llm-compressor's ``FP8_DYNAMIC``); any other quantization goes by its ``quant_method``."""

FP8_BLOCK = "fp8/block-128x128"
"""The quantization the stager reports for ``quant_method: fp8`` with float8_e4m3fn weights
scaled per 128 x 128 tile (``weight_block_size: [128, 128]``, float32 ``weight_scale_inv``)
and activations quantized at run time, as DeepSeek-V3's hub checkpoint is written."""

MAX_DIM = 1 << 24
"""Far above any real model dimension; a config beyond it is corrupt, not big."""
MAX_NAME = 200
"""Architecture and quantization names are short identifiers (they reach the status)."""
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Where MoE configs give the routed experts per layer (Mixtral's, Qwen-MoE's, DeepSeek's);
absent, null or 0: a dense model."""


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention: the low ranks its projections go through and
    each head's parts (``config.json``'s fields of the same names)."""

    q_lora_rank: int
    """0: none (the queries projected directly)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @staticmethod
    def from_dict(config: Mapping[str, Any], where: str) -> Mla | None:
        """The MLA dimensions, or None where ``kv_lora_rank`` is absent (no MLA); a null
        ``q_lora_rank`` (queries projected directly, DeepSeek-V2-Lite) reads as 0."""
        if config.get("kv_lora_rank") is None:
            return None
        keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim")  # fmt: skip
        for key in keys:
            value = config.get(key)
            if key == "q_lora_rank" and value is None:
                continue
            if type(value) is not int or not 0 < value <= MAX_DIM:
                raise CheckpointError(
                    f"{where}: {key!r} must be a positive integer up to {MAX_DIM}, got {value!r}"
                )
        return Mla(*(int(config[key] or 0) for key in keys))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    quantization: str | None = None
    """``quantization_of``: ``FP8_CHANNEL``, another ``quant_method``, or None: unquantized."""
    quantization_mismatch: str = ""
    """Why a compressed-tensors ``quantization_config`` is not ``FP8_CHANNEL`` (for errors)."""
    num_experts: int = 0
    """Routed experts per MoE layer (``num_local_experts``, ``num_experts``); 0: dense."""
    moe_intermediate_size: int = 0
    """One expert's intermediate size (``moe_intermediate_size``, else ``intermediate_size``)."""
    shared_expert_intermediate_size: int = 0
    """The shared expert's intermediate size of an MoE layer that has one (Qwen2-MoE; DeepSeek's
    ``n_shared_experts`` experts fused into one); 0: none."""
    first_dense_layers: int = 0
    """``first_k_dense_replace``: the first layers of an MoE model are dense (DeepSeek)."""
    moe_layer_freq: int = 1
    """Of the later layers, those whose index is a multiple of it are MoE (DeepSeek)."""
    router_bias: bool = False
    """The router has a float32 ``e_score_correction_bias`` (DeepSeek-V3's ``topk_method``
    ``noaux_tc``)."""
    mla: Mla | None = None
    """Multi-head latent attention's dimensions (DeepSeek V2/V3); None: plain attention."""
    next_layers: int = 0
    """``num_nextn_predict_layers``: multi-token-prediction layers stored after the decoder
    layers (DeepSeek-V3), which the model skips."""
    unquantized_modules: tuple[str, ...] = ()
    """Block FP8's ``modules_to_not_convert``: modules vLLM builds unquantized by name."""

    @staticmethod
    def from_dict(config: Mapping[str, Any], *, where: str = "config.json") -> ModelConfig:
        """Parse and sanity-check what splitting per rank reads, with the reason."""
        architecture = architecture_of(config)
        if architecture is None:
            raise CheckpointError(f"{where}: 'architectures' must list exactly one architecture")

        def dim(key: str, default: int | None = None) -> int:
            value = config.get(key, default)
            if type(value) is not int or not 0 < value <= MAX_DIM:
                raise CheckpointError(
                    f"{where}: {key!r} must be a positive integer up to {MAX_DIM}, got {value!r}"
                )
            return value

        hidden, heads = dim("hidden_size"), dim("num_attention_heads")
        if config.get("head_dim") is not None:
            head_dim = dim("head_dim")
        elif hidden % heads == 0:
            head_dim = hidden // heads
        else:
            raise CheckpointError(
                f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{heads} and no head_dim is given"
            )
        dtype = config.get("torch_dtype", config.get("dtype"))
        experts_key = next((k for k in _EXPERT_KEYS if config.get(k) not in (None, 0)), None)
        experts = dim(experts_key) if experts_key else 0
        moe_inter = dim("moe_intermediate_size", config.get("intermediate_size")) if experts else 0
        shared = config.get("shared_expert_intermediate_size") not in (None, 0) and experts
        shared_inter = dim("shared_expert_intermediate_size") if shared else 0
        if experts and config.get("n_shared_experts") not in (None, 0):
            shared_inter = dim("n_shared_experts") * moe_inter
        return ModelConfig(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=dim("intermediate_size"),
            num_layers=dim("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=dim("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=dim("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            torch_dtype=dtype if isinstance(dtype, str) else None,
            quantization=quantization_of(config),
            quantization_mismatch=_mismatch(config.get("quantization_config")),
            num_experts=experts,
            moe_intermediate_size=moe_inter,
            shared_expert_intermediate_size=shared_inter,
            first_dense_layers=_count(config, "first_k_dense_replace", where),
            moe_layer_freq=dim("moe_layer_freq", 1),
            router_bias=config.get("topk_method") == "noaux_tc",
            mla=Mla.from_dict(config, where),
            next_layers=_count(config, "num_nextn_predict_layers", where),
            unquantized_modules=_unquantized_of(config),
        )

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is an MoE layer (vLLM's rule: past the first dense
        layers, every ``moe_layer_freq``-th)."""
        return bool(self.num_experts) and (
            layer >= self.first_dense_layers and layer % self.moe_layer_freq == 0
        )

    @property
    def symbols(self) -> dict[str, int]:
        """Values of the shape symbols that the architecture table uses."""
        return {
            "hidden": self.hidden_size,
            "inter": self.intermediate_size,
            "vocab": self.vocab_size,
            "q": self.num_heads * self.head_dim,
            "kv": self.num_kv_heads * self.head_dim,
            "head_dim": self.head_dim,
            "experts": self.num_experts,
            "moe_inter": self.moe_intermediate_size,
            "shared_inter": self.shared_expert_intermediate_size,
            "one": 1,
            "heads": self.num_heads,
            "moe_gate_up": 2 * self.moe_intermediate_size,
            **self._mla_symbols(),
        }

    def _mla_symbols(self) -> dict[str, int]:
        """MLA's shapes: the low ranks, the compressed KV with the shared rope part, and the
        head-major projections out of (and into) them."""
        m = self.mla
        if m is None:
            return {}
        return {
            "q_lora": m.q_lora_rank,
            "kv_lora": m.kv_lora_rank,
            "kv_a": m.kv_lora_rank + m.qk_rope_head_dim,
            "mla_q": self.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
            "mla_kv": self.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
            "mla_o": self.num_heads * m.v_head_dim,
        }

    def check_tensor_parallel(self, tp: int) -> None:
        """vLLM's own constraints on TP, checked before any byte is read."""
        if tp < 1:
            raise SpecError(f"tensor parallel size must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise SpecError(
                f"tensor parallel size {tp} does not divide the {self.num_heads} attention heads"
            )
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise SpecError(
                f"tensor parallel size {tp} and the {self.num_kv_heads} KV heads must divide "
                "one another"
            )
        if self.intermediate_size % tp:
            raise SpecError(
                f"tensor parallel size {tp} does not divide the intermediate size "
                f"{self.intermediate_size}"
            )
        if self.num_experts and self.moe_intermediate_size % tp:
            raise SpecError(
                f"tensor parallel size {tp} does not divide the expert intermediate size "
                f"{self.moe_intermediate_size}"
            )
        if self.shared_expert_intermediate_size % tp:
            raise SpecError(
                f"tensor parallel size {tp} does not divide the shared expert intermediate size "
                f"{self.shared_expert_intermediate_size}"
            )


def _unquantized_of(config: Mapping[str, Any]) -> tuple[str, ...]:
    quant = config.get("quantization_config")
    if quantization_of(config) != FP8_BLOCK or not isinstance(quant, Mapping):
        return ()
    return _unquantized(quant) or ()


def _count(config: Mapping[str, Any], key: str, where: str) -> int:
    """A non-negative count that may be absent or null (0)."""
    value = config.get(key) or 0
    if type(value) is not int or not 0 <= value <= MAX_DIM:
        raise CheckpointError(
            f"{where}: {key!r} must be a non-negative integer up to {MAX_DIM}, got {value!r}"
        )
    return value


def architecture_of(config: Mapping[str, Any]) -> str | None:
    """The one architecture ``config.json`` names, or None."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        return None
    return archs[0] if 0 < len(archs[0]) <= MAX_NAME and archs[0].isprintable() else None


def quantization_of(config: Mapping[str, Any]) -> str | None:
    """``FP8_CHANNEL`` for exactly that compressed-tensors scheme, else ``quantization_config``'s
    ``quant_method`` (None: unquantized)."""
    if config.get("quantization_config") is None:
        return None
    quant = config["quantization_config"]
    if fp8_channel_mismatch(quant) is None:
        return FP8_CHANNEL
    if fp8_block_mismatch(quant) is None:
        return FP8_BLOCK
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if isinstance(method, str) and 0 < len(method) <= MAX_NAME and method.isprintable():
        return method
    return "unknown method"


def _mismatch(quant: object) -> str:
    if quant is None:
        return ""
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    found = fp8_block_mismatch(quant) if method == "fp8" else fp8_channel_mismatch(quant)
    return found or ""


_FP8_BLOCK_FIELDS = {"quant_method", "weight_block_size", "activation_scheme", "fmt",
                     "modules_to_not_convert"}  # fmt: skip


def fp8_block_mismatch(quant: object) -> str | None:
    """None when ``quant`` is exactly block-wise FP8 as DeepSeek-V3's hub config writes it:
    ``quant_method: fp8``, ``weight_block_size: [128, 128]``, ``activation_scheme:
    dynamic``, ``fmt: e4m3`` (if given), and ``modules_to_not_convert`` a list of names if
    given (Qwen3-MoE's, which the family's rules check); nothing else. Otherwise the first
    difference, in words."""
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return "quant_method is not fp8"
    if quant.get("weight_block_size") != [128, 128]:
        return f"weight_block_size is {quant.get('weight_block_size')!r}, not [128, 128]"
    if quant.get("activation_scheme") != "dynamic":
        return f"activation_scheme is {quant.get('activation_scheme')!r}, not 'dynamic'"
    if quant.get("fmt", "e4m3") != "e4m3":
        return f"fmt is {quant.get('fmt')!r}, not 'e4m3'"
    extra = sorted(str(k) for k in quant if k not in _FP8_BLOCK_FIELDS)
    if extra:
        return f"{extra[0]} is set"
    if _unquantized(quant) is None:
        return f"modules_to_not_convert is not a list of up to {MAX_DIM} names"
    return None


def _unquantized(quant: Mapping[str, Any]) -> tuple[str, ...] | None:
    """``modules_to_not_convert``'s names (absent: none), or None if it is not a list of
    short names."""
    names = quant.get("modules_to_not_convert") or []
    ok = isinstance(names, list) and len(names) <= MAX_DIM and all(
        isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in names
    )
    return tuple(names) if ok else None


_FP8_ARGS = {"type": "float", "num_bits": 8, "symmetric": True}
_FP8_WEIGHTS = {**_FP8_ARGS, "strategy": "channel", "dynamic": False}
_FP8_INPUTS = {**_FP8_ARGS, "strategy": "token", "dynamic": True}
_UNSET_ARGS = ("group_size", "block_structure", "actorder")
"""Fields of the quantization args that must be null (absent) for the channel scheme."""
_UNSET_CONFIG = ("kv_cache_scheme", "sparsity_config", "transform_config")
"""``quantization_config`` fields that must be null or empty: each changes the tensors."""


def fp8_channel_mismatch(quant: object) -> str | None:
    """None when ``quant`` (a ``quantization_config``) is exactly the compressed-tensors
    W8A8-FP8 scheme whose per-rank layout is proven: one config group targeting ``Linear``
    with float8 weights, one scale per output channel, activations quantized per token at run
    time, ``lm_head`` left out, nothing else (no KV-cache scheme, sparsity or transform).
    Otherwise the first difference, in words."""
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "compressed-tensors":
        return "quant_method is not compressed-tensors"
    if quant.get("format") != "float-quantized":
        return f"format is {quant.get('format')!r}, not 'float-quantized'"
    if quant.get("quantization_status", "compressed") != "compressed":
        return f"quantization_status is {quant.get('quantization_status')!r}, not 'compressed'"
    for key in _UNSET_CONFIG:
        if quant.get(key):
            return f"{key} is set"
    if quant.get("ignore") != ["lm_head"]:
        return f"ignore is {quant.get('ignore')!r}, not ['lm_head']"
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        return "config_groups does not hold exactly one group"
    return _group_mismatch(next(iter(groups.values())))


def _group_mismatch(group: object) -> str | None:
    if not isinstance(group, Mapping) or group.get("targets") != ["Linear"]:
        return "the config group does not target exactly ['Linear']"
    if group.get("format", "float-quantized") != "float-quantized":
        return f"the config group's format is {group.get('format')!r}"
    if group.get("output_activations") is not None:
        return "output_activations are quantized"
    for key, want in (("weights", _FP8_WEIGHTS), ("input_activations", _FP8_INPUTS)):
        if (found := _args_mismatch(key, group.get(key), want)) is not None:
            return found
    return None


def _args_mismatch(key: str, args: object, want: Mapping[str, object]) -> str | None:
    if not isinstance(args, Mapping):
        return f"{key} are not given"
    for field, value in want.items():
        if args.get(field) != value or type(args.get(field)) is not type(value):
            return f"{key} {field} is {args.get(field)!r}, not {value!r}"
    for field in _UNSET_ARGS:
        if args.get(field) is not None:
            return f"{key} {field} is set"
    return None


def check_heads(config: Mapping[str, Any], tp: int) -> None:
    """vLLM's rule for every architecture: TP divides the attention heads (checked before a
    copy of a checkpoint no per-rank rules describe, when its config names them)."""
    if tp < 1:
        raise SpecError(f"tensor parallel size must be >= 1, got {tp}")
    heads = config.get("num_attention_heads")
    text = config.get("text_config")  # multimodal checkpoints: the language model's
    if heads is None and isinstance(text, Mapping):
        heads = text.get("num_attention_heads")
    if type(heads) is int and heads > 0 and heads % tp:
        raise SpecError(f"tensor parallel size {tp} does not divide the {heads} attention heads")
