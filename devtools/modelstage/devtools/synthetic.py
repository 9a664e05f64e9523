"""Small random Hugging Face checkpoints, generated locally (no hub is reachable here).

The demo and the tests need real checkpoints of every supported architecture, in the exact
on-disk shape the hub serves: HF parameter names, ``config.json`` as transformers writes it,
sharded safetensors with an index, a tokenizer and a generation config. Weights are seeded so
that the same spec always yields the same bytes (the vLLM oracle caches reference outputs by
a hash of the files), and scaled (std ~ 1/sqrt(hidden)) so that log-probabilities are
informative: a wrongly split matrix changes them.

The tensors are the family table's (``core.architectures``): every source tensor its rules
read for the checkpoint's ``config.json``, in the rules' shapes, so a new row is a checkpoint
here with no other change. What ``config.json`` holds beyond the fields every family shares
is the hub's spelling per ``model_type`` (``_HUB_FIELDS``); a family without an entry gets the
fields its rules read (``_generic_fields``), and its oracle entry may add more
(``config_extra``).

Files are written tensor by tensor after a header from the product's own encoder
(``safetensors_format.encode_header``), so memory stays at one row block whatever the
checkpoint's size. numpy only: bfloat16 is produced by rounding float32 bits (round to nearest
even, as torch does), so torch is never imported.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from modelstage.core.architectures import ARCHITECTURES, QUANTIZED, Architecture, When
from modelstage.core.model_config import FP8_BLOCK, FP8_CHANNEL, ModelConfig
from modelstage.core.safetensors_format import DTYPE_CODES, DTYPE_SIZES, encode_header

DType = Literal["float32", "bfloat16", "float16"]
Weights = list[tuple[str, tuple[int, ...]]]
"""(HF name, shape) of tensors, in checkpoint order."""

_FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: a channel's largest magnitude maps to it."""
_FP8_CODE = "F8_E4M3"
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
_CHUNK_ELEMENTS = 8 * 1024 * 1024
"""Elements generated per step (32 MiB of float32): bounds memory for large tensors."""
_FLOAT32_SOURCES = (".e_score_correction_bias",)
"""Tensors the hub stores in float32 whatever the model's dtype (DeepSeek-V3's router bias)."""
_TRANSFORMERS_VERSION = "4.46.0"
"""What ``config.json`` claims to come from: the transformers-4 field names most hub
checkpoints carry (``torch_dtype``, top-level ``rope_theta``)."""


@dataclass(frozen=True)
class SyntheticModel:
    """What to generate. Defaults are a tiny Llama; ``llama_demo()`` is the demo's model."""

    architecture: str = "LlamaForCausalLM"
    """A name of the family table (``core.architectures.ARCHITECTURES``)."""
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None
    """Explicit head size (Qwen3 style, may differ from hidden/heads); None derives it."""
    vocab_size: int = 1000
    tie_word_embeddings: bool = False
    dtype: DType = "float32"
    seed: int = 0
    num_shards: int = 1
    split_fused: bool = False
    """Put q/k/v (and gate/up) of each layer in different shard files (needs num_shards > 1):
    the stager must assemble fused tensors from several files."""
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_experts: int = 4
    """Routed experts per layer (MoE architectures only; ``intermediate_size`` is then one
    expert's)."""
    experts_per_token: int = 2
    config_extra: tuple[tuple[str, object], ...] = field(default=())
    """Extra ``config.json`` entries (e.g. a ``quantization_config`` a test wants refused)."""
    fp8: bool = False
    """Quantize every Linear weight but ``lm_head`` to float8_e4m3fn with a per-channel
    ``weight_scale`` (dynamic per-token activations), as llm-compressor's ``FP8_DYNAMIC``
    scheme writes a compressed-tensors checkpoint; ``dtype`` is then the unquantized
    tensors' (and the scales')."""
    fp8_block: bool = False
    """Quantize every Linear weight of the decoder layers (not routers, norms, embeddings or
    the head) to float8_e4m3fn with one float32 ``weight_scale_inv`` per 128 x 128 tile, as
    DeepSeek-V3's hub checkpoint holds them (``quant_method: fp8``)."""
    q_lora_rank: int | None = None
    """MLA's query low rank (DeepSeek); None: 3/4 of ``hidden_size``."""
    v_head_dim: int | None = None
    """MLA's value head size (DeepSeek); None: half the head size."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} unsupported; one of {tuple(ARCHITECTURES)}"
            )
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype!r} unsupported; one of {tuple(DTYPE_CODES)}")
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "vocab_size",
            "num_shards",
            "max_position_embeddings",
            "num_experts",
            "experts_per_token",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < len(_SPECIAL_TOKENS) + 1:
            raise ValueError(f"vocab_size must be > {len(_SPECIAL_TOKENS)}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads (or set head_dim)")
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Options that only some families or shapes take (what their rows say)."""
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token must be <= num_experts")
        if self.split_fused and self.num_shards < 2:
            raise ValueError("split_fused needs num_shards >= 2")
        for flag, kind in ((self.fp8, FP8_CHANNEL), (self.fp8_block, FP8_BLOCK)):
            if flag and self.architecture not in QUANTIZED[kind]:
                raise ValueError(f"{kind} is written for {', '.join(QUANTIZED[kind])} only")
        if not self.tie_word_embeddings and not any(
            r.when is When.UNTIED for r in self.family.rules
        ):
            raise ValueError(f"{self.architecture} ties its embeddings (vLLM's model has no head)")
        derived = self.head_dim is not None and self.head_dim * self.num_heads != self.hidden_size
        if derived and "head_dim" not in self._family_fields():
            raise ValueError(
                f"{self.architecture} derives head_dim = hidden_size / num_heads (its config.json "
                "has no head_dim)"
            )

    @property
    def family(self) -> Architecture:
        """The family table's row whose rules name this checkpoint's tensors."""
        if self.fp8:
            return QUANTIZED[FP8_CHANNEL][self.architecture]
        if self.fp8_block:
            return QUANTIZED[FP8_BLOCK][self.architecture]
        return ARCHITECTURES[self.architecture]

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Qwen2-MoE's shared expert: twice a routed expert, so that a rule mixing the two
        sizes up fails."""
        return 2 * self.intermediate_size

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def tensors(self) -> Weights:
        """(HF name, shape) of every weight, in the rules' order: embeddings, then layer by
        layer, then the final norm and head; a quantized weight's scale right after it."""
        model = ModelConfig.from_dict(self._own_config())
        symbols, out, seen = model.symbols, [], set()
        for rule, source, _ in self.family.expand(model):
            if source not in seen:  # a source fused in the checkpoint feeds several rules
                seen.add(source)
                out.append((source, rule.source_shape(symbols)))
        return out + self._next_layers(model)

    def _next_layers(self, model: ModelConfig) -> Weights:
        """DeepSeek-V3's multi-token-prediction layers after the decoder layers, as the hub
        stores them (vLLM's model skips them): a decoder layer's tensors, the layer's own
        norms and projection, its embeddings and head."""
        if not (self.family.next_layers_ignored and model.next_layers):
            return []
        longer = replace(model, num_layers=model.num_layers + model.next_layers)
        symbols, out = model.symbols, []
        for layer in range(model.num_layers, longer.num_layers):
            at = f"model.layers.{layer}."
            out += [(source, rule.source_shape(symbols))
                    for rule, source, group in self.family.expand(longer) if group == layer]
            h, v = self.hidden_size, self.vocab_size
            out += [(at + "embed_tokens.weight", (v, h)), (at + "enorm.weight", (h,)),
                    (at + "hnorm.weight", (h,)), (at + "eh_proj.weight", (h, 2 * h)),
                    (at + "shared_head.norm.weight", (h,)),
                    (at + "shared_head.head.weight", (v, h))]  # fmt: skip
        return out

    def quantized(self, name: str) -> bool:
        """Whether tensor ``name`` is stored as float8_e4m3fn."""
        return name in self._quantized_names()

    def dtype_code(self, name: str) -> str:
        """The safetensors dtype of tensor ``name``."""
        if self.quantized(name):
            return _FP8_CODE
        f32 = name.endswith(_FLOAT32_SOURCES) or (self.fp8_block and name.endswith("_scale_inv"))
        return DTYPE_CODES["float32" if f32 else self.dtype]

    def _quantized_names(self) -> frozenset[str]:
        if not (self.fp8 or self.fp8_block):
            return frozenset()
        model = ModelConfig.from_dict(self._own_config())
        return frozenset(
            source for rule, source, _ in self.family.expand(model) if rule.source_dtype
        )

    def _family_fields(self) -> dict[str, object]:
        """The ``config.json`` fields of this family beyond the common ones."""
        hub = _HUB_FIELDS.get(self.family.model_type)
        return hub(self) if hub is not None else _generic_fields(self)

    def _own_config(self) -> dict[str, object]:
        """``config.json`` without ``config_extra``: what the tensors are made for."""
        cfg: dict[str, object] = {
            "architectures": [self.architecture],
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": self.family.model_type,
            "num_attention_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "transformers_version": _TRANSFORMERS_VERSION,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }
        cfg.update(self._family_fields())
        if self.fp8:
            cfg["quantization_config"] = fp8_quantization_config()
        if self.fp8_block:
            cfg["quantization_config"] = self._fp8_block_config()
        return cfg

    def _fp8_block_config(self) -> dict[str, object]:
        """``quantization_config`` as the hub's block-FP8 checkpoints write it: DeepSeek-V3's
        bare; Qwen3-MoE's naming what stays unquantized (the head, each layer's norms and
        router)."""
        quant: dict[str, object] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
        if self.family.routers_listed_unquantized:
            per_layer = ("input_layernorm", "mlp.gate", "post_attention_layernorm")
            quant["modules_to_not_convert"] = ["lm_head"] + [
                f"model.layers.{layer}.{m}" for layer in range(self.num_layers) for m in per_layer
            ]
        return dict(sorted(quant.items()))

    def config(self) -> dict[str, object]:
        """``config.json`` as transformers 4.x writes it for this architecture."""
        return dict(sorted({**self._own_config(), **dict(self.config_extra)}.items()))


def _generic_fields(m: SyntheticModel) -> dict[str, object]:
    """What a family without hub fields of its own writes: the head size, and the experts
    and the shared expert where its rules' shapes name them."""
    symbols = {part for r in m.family.rules for dim in r.shape for part in dim.split("+")}
    fields: dict[str, object] = {"head_dim": m.head_size}
    if "experts" in symbols or "moe_inter" in symbols:
        fields.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token)
    if "shared_inter" in symbols:
        fields["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
    return fields


def _llama(m: SyntheticModel) -> dict[str, object]:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
            "head_dim": m.head_size}  # fmt: skip


def _mistral(m: SyntheticModel) -> dict[str, object]:
    return {"sliding_window": None, "head_dim": m.head_size}


def _mixtral(m: SyntheticModel) -> dict[str, object]:
    return {
        "sliding_window": None,
        "head_dim": m.head_size,
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.experts_per_token,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
    }


def _phi3(m: SyntheticModel) -> dict[str, object]:
    return {
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "original_max_position_embeddings": m.max_position_embeddings,
        "sliding_window": m.max_position_embeddings // 2 - 1,  # Phi-3-mini-4k: 2047
        "pad_token_id": _SPECIAL_TOKENS.index("<pad>"),
    }


def _qwen2(m: SyntheticModel) -> dict[str, object]:
    return {"sliding_window": None, "use_sliding_window": False,
            "max_window_layers": m.num_layers}  # fmt: skip


def _qwen3(m: SyntheticModel) -> dict[str, object]:
    return {**_qwen2(m), "attention_bias": False, "head_dim": m.head_size}


def _qwen_moe(m: SyntheticModel) -> dict[str, object]:
    """The fields Qwen2-MoE and Qwen3-MoE share: every layer sparse."""
    return {
        **_qwen2(m),
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.experts_per_token,
        "moe_intermediate_size": m.intermediate_size,
        "intermediate_size": 2 * m.intermediate_size,  # a dense MLP's; no layer has one
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def _qwen2_moe(m: SyntheticModel) -> dict[str, object]:
    return {**_qwen_moe(m), "norm_topk_prob": False,
            "shared_expert_intermediate_size": m.shared_expert_intermediate_size}  # fmt: skip


def _qwen3_moe(m: SyntheticModel) -> dict[str, object]:
    return {**_qwen_moe(m), "attention_bias": False, "head_dim": m.head_size,
            "norm_topk_prob": True}  # fmt: skip


def _gemma(m: SyntheticModel) -> dict[str, object]:
    """Gemma's fields as the hub's ``config.json`` has them: GELU (tanh), an explicit
    head_dim with the query scaled by ``query_pre_attn_scalar``, sliding-window layers
    (Gemma 2: every other one; Gemma 3: all but every ``sliding_window_pattern``-th, with
    their own rope base), logit soft-capping (Gemma 2)."""
    gemma2 = m.family.model_type == "gemma2"
    cfg: dict[str, object] = {
        "attention_bias": False,
        "attn_logit_softcapping": 50.0 if gemma2 else None,
        "cache_implementation": "hybrid",
        "final_logit_softcapping": 30.0 if gemma2 else None,
        "head_dim": m.head_size,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "pad_token_id": 3,
        "query_pre_attn_scalar": m.head_size,
        "sliding_window": 64,
    }
    if not gemma2:
        cfg.update(rope_local_base_freq=m.rope_theta, sliding_window_pattern=2)
        cfg.update(rope_theta=100 * m.rope_theta)
    return cfg


def _gpt_oss(m: SyntheticModel) -> dict[str, object]:
    """gpt-oss's fields as its hub config.json has them: alternating sliding and full
    attention, yarn RoPE, the clamped SwiGLU's limit, biases everywhere."""
    return {
        "attention_bias": True,
        "head_dim": m.head_size,
        "hidden_act": "silu",
        "initial_context_length": m.max_position_embeddings // 4,
        "layer_types": [
            "sliding_attention" if layer % 2 == 0 else "full_attention"
            for layer in range(m.num_layers)
        ],
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.experts_per_token,
        "experts_per_token": m.experts_per_token,
        "output_router_logits": False,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 4.0,
            "original_max_position_embeddings": m.max_position_embeddings // 4,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000.0,
        "router_aux_loss_coef": 0.9,
        "sliding_window": min(8, m.max_position_embeddings),
        "swiglu_limit": 7.0,
    }


def _deepseek(m: SyntheticModel) -> dict[str, object]:
    """DeepSeek-V3's (and V2's) fields as its hub config.json has them: MLA with a query low
    rank (the KV low rank 512 and rope part 64 of the real model: vLLM's CPU MLA takes only
    that head size), the first layer dense and the others MoE with sigmoid-scored,
    group-limited routing (V3's ``noaux_tc``, its float32 correction bias), two shared
    experts, yarn RoPE, one multi-token-prediction layer stored after the decoder layers."""
    v3 = m.family.model_type == "deepseek_v3"
    return {
        "attention_bias": False,
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "intermediate_size": 2 * m.intermediate_size,  # the dense layers'
        "kv_lora_rank": 512,
        "moe_intermediate_size": m.intermediate_size,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": 2,
        "norm_topk_prob": True,
        "num_experts_per_tok": m.experts_per_token,
        "num_nextn_predict_layers": 1 if v3 else 0,
        "q_lora_rank": m.q_lora_rank or 3 * m.hidden_size // 4,
        "qk_nope_head_dim": m.head_size,
        "qk_rope_head_dim": 64,
        "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings":
            m.max_position_embeddings // 4, "type": "yarn",
        },
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid" if v3 else "softmax",
        "seq_aux": True,
        "topk_group": 1,
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy",
        "v_head_dim": m.v_head_dim or m.head_size // 2,
    }  # fmt: skip


_HUB_FIELDS: dict[str, Callable[[SyntheticModel], dict[str, object]]] = {
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "phi3": _phi3,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "gpt_oss": _gpt_oss,
}
"""``model_type`` -> the fields its hub ``config.json`` holds beyond the common ones (what
transformers and vLLM build the model from); a family without an entry: ``_generic_fields``."""


def fp8_quantization_config() -> dict[str, object]:
    """``quantization_config`` as llm-compressor writes it for ``FP8_DYNAMIC``: float8 weights
    with one scale per output channel, activations quantized per token at run time."""
    args: dict[str, object] = {"actorder": None, "block_structure": None, "group_size": None,
                               "num_bits": 8, "observer_kwargs": {}, "symmetric": True,
                               "type": "float"}  # fmt: skip
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": {**args, "dynamic": True, "observer": None,
                                      "strategy": "token"},
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**args, "dynamic": False, "observer": "minmax",
                            "strategy": "channel"},
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }  # fmt: skip


def llama_demo() -> SyntheticModel:
    """The model ``modelstage demo`` stages: a small Llama."""
    return SyntheticModel(
        architecture="LlamaForCausalLM",
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        vocab_size=1000,
        dtype="float32",
        num_shards=2,
    )


def write_checkpoint(spec: SyntheticModel, out_dir: Path | str) -> Path:
    """Write the checkpoint into ``out_dir`` (created; existing files are overwritten)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", spec.config())
    _write_json(
        out / "generation_config.json",
        {
            "_from_model_config": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "transformers_version": _TRANSFORMERS_VERSION,
        },
    )
    write_tokenizer(spec, out)

    tensors = spec.tensors()
    assignment = _assign_shards(spec, tensors)
    n = spec.num_shards
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    quantized, shapes = spec._quantized_names(), dict(tensors)
    codes = {name: spec.dtype_code(name) for name, _ in tensors}
    for k, file_name in enumerate(names):
        members = [(name, shape, codes[name]) for name, shape in tensors if assignment[name] == k]
        _write_safetensors(spec, out / file_name, members, {q: shapes[q] for q in quantized})
    if n > 1:
        total = sum(math.prod(shape) * DTYPE_SIZES[codes[name]] for name, shape in tensors)
        weight_map = {name: names[assignment[name]] for name, _ in tensors}
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    return out


def _assign_shards(spec: SyntheticModel, tensors: Weights) -> dict[str, int]:
    """Contiguous, byte-balanced shards (as transformers' max_shard_size does), then, with
    ``split_fused``, the k/v and up projections moved to the following shard files."""
    total = sum(math.prod(shape) for _, shape in tensors)
    n = spec.num_shards
    assignment: dict[str, int] = {}
    seen = 0
    for name, shape in tensors:
        assignment[name] = min(n - 1, seen * n // max(total, 1))
        seen += math.prod(shape)
    if spec.split_fused:
        # (moved part, the part it follows, how many files further on)
        moves = (
            ("self_attn.k_proj.", "self_attn.q_proj.", 1),
            ("self_attn.v_proj.", "self_attn.q_proj.", 2),
            ("mlp.up_proj.", "mlp.gate_proj.", 1),
        )
        for name in assignment:
            if not name.startswith("model.layers."):
                continue
            layer_prefix = ".".join(name.split(".")[:3]) + "."
            for part, anchor_part, step in moves:
                if part in name:
                    anchor = assignment[layer_prefix + anchor_part + "weight"]
                    assignment[name] = (anchor + step) % n
    return assignment


def _write_safetensors(
    spec: SyntheticModel,
    path: Path,
    members: list[tuple[str, tuple[int, ...], str]],
    quantized: dict[str, tuple[int, ...]],
) -> None:
    """Header first (shapes are known up front), then each tensor's bytes, chunk by chunk; a
    quantized weight's ``_scale`` tensor holds the scales its rows were quantized with."""
    header, _ = encode_header([(name, code, shape) for name, shape, code in members],
                              {"format": "pt"})  # fmt: skip
    with path.open("wb") as f:
        f.write(header)
        for name, shape, code in members:
            of = name.removesuffix("_scale")
            if spec.fp8_block:
                f.write(_block_quantized(spec, name, shape, quantized))
            elif code == _FP8_CODE:
                for weight, scale in _quantized_rows(spec, name, shape):
                    f.write(_encode_fp8(_rounded(weight / scale, spec.dtype)))
            elif of != name and of in quantized:
                for _, scale in _quantized_rows(spec, of, quantized[of]):
                    f.write(_encode(scale.reshape(-1), spec.dtype))
            else:
                dtype = "float32" if code == DTYPE_CODES["float32"] else spec.dtype
                for chunk in _generate(spec, name, shape):
                    f.write(_encode(chunk, dtype))


def _block_quantized(
    spec: SyntheticModel, name: str, shape: tuple[int, ...], quantized: dict[str, tuple[int, ...]]
) -> bytes:
    """The bytes of tensor ``name`` of a block-FP8 checkpoint: a quantized weight divided by
    its tiles' scales (a tile's largest magnitude over float8's largest value) in
    float8_e4m3fn, a ``weight_scale_inv`` those scales in float32, anything else as usual.
    A quantized weight is held whole (test checkpoints only)."""
    of = name.removesuffix("_scale_inv")
    if name not in quantized and of not in quantized:
        return b"".join(_encode(c, "float32" if spec.dtype_code(name) == "F32" else spec.dtype)
                        for c in _generate(spec, name, shape))  # fmt: skip
    rows, cols = quantized[of]
    weight = _rounded(np.concatenate(list(_generate(spec, of, (rows, cols)))), spec.dtype)
    weight = weight.reshape(rows, cols)
    b = 128
    tr, tc = -(-rows // b), -(-cols // b)
    padded = np.zeros((tr * b, tc * b), np.float32)
    padded[:rows, :cols] = np.abs(weight)
    scales = np.maximum(padded.reshape(tr, b, tc, b).max(axis=(1, 3)) / np.float32(_FP8_MAX), _TINY)
    if name != of:
        return _encode(scales.astype(np.float32).reshape(-1), "float32")
    full = np.repeat(np.repeat(scales, b, axis=0), b, axis=1)[:rows, :cols]
    return _encode_fp8(weight / full)


def _quantized_rows(
    spec: SyntheticModel, name: str, shape: tuple[int, ...]
) -> Iterator[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]:
    """Blocks of whole rows of weight ``name`` as the unquantized checkpoint holds them
    (rounded to ``dtype``), each with its rows' scales [rows, 1]: a row's largest magnitude
    over float8's largest value, rounded to ``dtype`` as llm-compressor computes it."""
    cols = shape[1]
    pending = np.empty(0, np.float32)
    for chunk in _generate(spec, name, shape):
        pending = np.concatenate([pending, chunk])
        whole = len(pending) // cols * cols
        block, pending = pending[:whole].reshape(-1, cols), pending[whole:]
        if len(block):
            weight = _rounded(block, spec.dtype)
            amax = np.abs(weight).max(axis=1, keepdims=True)
            scale = _rounded(np.maximum(amax / np.float32(_FP8_MAX), _TINY), spec.dtype)
            yield weight, scale


_TINY = np.float32(np.finfo(np.float32).tiny)


def _rounded(values: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.float32]:
    """``values`` rounded to ``dtype`` (as float32)."""
    if dtype == "float32":
        return values.astype(np.float32)
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    raw = np.frombuffer(_encode(values.reshape(-1), dtype), "<u2").astype(np.uint32) << 16
    return raw.view(np.float32).reshape(values.shape)


def _encode_fp8(values: npt.NDArray[np.float32]) -> bytes:
    """float8_e4m3fn bytes of ``values`` (1 sign, 4 exponent bits of bias 7, 3 mantissa bits,
    no infinities), rounded to nearest even and clamped to +-448 as a cast of the quantizer's
    clamped quotient gives them."""
    x = np.clip(values.astype(np.float64).reshape(-1), -_FP8_MAX, _FP8_MAX)
    sign = np.signbit(x).astype(np.uint8) << 7
    a = np.abs(x)
    exp = np.floor(np.log2(np.maximum(a, 2.0**-6)))  # below 2**-6: subnormals, steps of 2**-9
    steps = np.rint(a / 2.0 ** (exp - 3))  # 8..16 for normals (16 carries), 0..8 subnormal
    normal = a >= 2.0**-6
    code = np.where(normal, (exp + 7) * 8 + steps - 8, steps)
    return (sign | code.astype(np.uint8)).tobytes()


def _generate(
    spec: SyntheticModel, name: str, shape: tuple[int, ...]
) -> Iterator[npt.NDArray[np.float32]]:
    """The tensor's values as float32 chunks; seeded per (seed, name), so shard layout and
    write order never change a value."""
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    count = math.prod(shape)
    is_norm = name.endswith("norm.weight")
    std = np.float32(0.1 if is_norm else 1.0 / math.sqrt(spec.hidden_size))
    # Gemma's norms hold the offset from a scale of 1 (its models add 1 when they run).
    mean = np.float32(1.0 if is_norm and not spec.family.norms_hold_offsets else 0.0)
    for start in range(0, count, _CHUNK_ELEMENTS):
        chunk = rng.standard_normal(min(_CHUNK_ELEMENTS, count - start), dtype=np.float32)
        chunk *= std
        chunk += mean
        yield chunk


def _encode(values: npt.NDArray[np.float32], dtype: str) -> bytes:
    """Little-endian bytes of ``values`` in ``dtype``."""
    if dtype == "float32":
        return values.astype("<f4", copy=False).tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    bits = values.view(np.uint32)
    rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((bits + rounding) >> np.uint32(16)).astype("<u2").tobytes()


def write_tokenizer(spec: SyntheticModel, out: Path) -> None:
    """A word-level tokenizer whose vocabulary is exactly the model's: ids map 1:1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(_SPECIAL_TOKENS), spec.vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
    )


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
