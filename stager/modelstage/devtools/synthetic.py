"""Small random Hugging Face checkpoints, generated locally (no hub is reachable here).

The demo and the tests need real checkpoints of every supported architecture, in the exact
on-disk shape the hub serves: HF parameter names, ``config.json`` as transformers writes it,
sharded safetensors with an index, a tokenizer and a generation config. Weights are seeded so
that the same spec always yields the same bytes (the vLLM oracle caches reference outputs by
a hash of the files), and scaled (std ~ 1/sqrt(hidden)) so that log-probabilities are
informative: a wrongly split matrix changes them.

Files are written tensor by tensor after a header from the product's own encoder
(``safetensors_format.encode_header``), so memory stays at one row block whatever the
checkpoint's size. numpy only: bfloat16 is produced by rounding float32 bits (round to nearest
even, as torch does), so torch is never imported. The architectures are the stager's table's
(``architectures.ARCHITECTURES``); what each writes in ``config.json`` is here.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from modelstage.core.safetensors_format import DTYPE_CODES, DTYPE_SIZES, encode_header
from modelstage.stager.architectures import ARCHITECTURES

Architecture = Literal[
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
]
DType = Literal["float32", "bfloat16", "float16"]

_MODEL_TYPES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_GPT_OSS = "GptOssForCausalLM"
_FP8 = ("LlamaForCausalLM", "Qwen3ForCausalLM")
"""Architectures whose FP8 checkpoints the stager splits per rank."""
_LINEAR_WEIGHTS = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$")
"""The Linear weights llm-compressor quantizes (``targets: [Linear]``, ``ignore: [lm_head]``)."""
_FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: a channel's largest magnitude maps to it."""
_FUSED_IN_SOURCE = ("Phi3ForCausalLM",)
"""Architectures whose checkpoints hold q/k/v fused in ``qkv_proj`` and gate/up in
``gate_up_proj`` (rows: q, k, v; gate, up), as vLLM holds them."""
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QK_NORM = ("Gemma3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
_CHUNK_ELEMENTS = 8 * 1024 * 1024
"""Elements generated per step (32 MiB of float32): bounds memory for large tensors."""
_TRANSFORMERS_VERSION = "4.46.0"
"""What ``config.json`` claims to come from: the transformers-4 field names most hub
checkpoints carry (``torch_dtype``, top-level ``rope_theta``)."""


@dataclass(frozen=True)
class SyntheticModel:
    """What to generate. Defaults are a tiny Llama; ``llama_demo()`` is the demo's model."""

    architecture: Architecture = "LlamaForCausalLM"
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

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES or self.architecture not in _MODEL_TYPES:
            raise ValueError(
                f"architecture {self.architecture!r} unsupported; one of {tuple(_MODEL_TYPES)}"
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
        if (
            self.head_dim is not None
            and self.architecture == "Qwen2ForCausalLM"
            and (self.head_dim * self.num_heads != self.hidden_size)
        ):
            raise ValueError("Qwen2 derives head_dim = hidden_size / num_heads")
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Options that only some architectures or shapes take."""
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token must be <= num_experts")
        if self.split_fused and self.num_shards < 2:
            raise ValueError("split_fused needs num_shards >= 2")
        if self.fp8 and self.architecture not in _FP8:
            raise ValueError(f"fp8 is written for {', '.join(_FP8)} only")
        if self.architecture == "Gemma2ForCausalLM" and not self.tie_word_embeddings:
            raise ValueError("Gemma 2 ties its embeddings (vLLM's model has no lm_head)")

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Qwen2-MoE's shared expert: twice a routed expert, so that a rule mixing the two
        sizes up fails."""
        return 2 * self.intermediate_size

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every weight, in model order."""
        h, hd = self.hidden_size, self.head_size
        q_rows, kv_rows = self.num_heads * hd, self.num_kv_heads * hd
        out: list[tuple[str, tuple[int, ...]]] = [
            ("model.embed_tokens.weight", (self.vocab_size, h))
        ]
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            out.append((p + "input_layernorm.weight", (h,)))
            if self.architecture in _FUSED_IN_SOURCE:
                out.append((p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, h)))
            else:
                out += [
                    (p + "self_attn.q_proj.weight", (q_rows, h)),
                    (p + "self_attn.k_proj.weight", (kv_rows, h)),
                    (p + "self_attn.v_proj.weight", (kv_rows, h)),
                ]
            if self.architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", _GPT_OSS):
                out += [
                    (p + "self_attn.q_proj.bias", (q_rows,)),
                    (p + "self_attn.k_proj.bias", (kv_rows,)),
                    (p + "self_attn.v_proj.bias", (kv_rows,)),
                ]
            if self.architecture in _QK_NORM:
                out += [
                    (p + "self_attn.q_norm.weight", (hd,)),
                    (p + "self_attn.k_norm.weight", (hd,)),
                ]
            out += [
                (p + "self_attn.o_proj.weight", (h, q_rows)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
            if self.architecture == _GPT_OSS:
                out += [(p + "self_attn.o_proj.bias", (h,)),
                        (p + "self_attn.sinks", (self.num_heads,))]  # fmt: skip
            if self.architecture in _GEMMA:
                out += [
                    (p + "pre_feedforward_layernorm.weight", (h,)),
                    (p + "post_feedforward_layernorm.weight", (h,)),
                ]
            out += self._mlp(p)
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        if self.fp8:  # each quantized weight's scale follows it, as llm-compressor saves them
            out = [
                entry
                for name, shape in out
                for entry in [(name, shape)]
                + ([(_scale_of(name), (shape[0], 1))] if self.quantized(name) else [])
            ]
        return out

    def quantized(self, name: str) -> bool:
        """Whether tensor ``name`` is stored as float8_e4m3fn."""
        return self.fp8 and _LINEAR_WEIGHTS.match(name) is not None

    def dtype_code(self, name: str) -> str:
        """The safetensors dtype of tensor ``name``."""
        return "F8_E4M3" if self.quantized(name) else DTYPE_CODES[self.dtype]

    def _mlp(self, p: str) -> list[tuple[str, tuple[int, ...]]]:
        """One layer's MLP: dense gate/up/down, or a router and each expert's gate/up/down
        (Mixtral's ``block_sparse_moe`` names them w1/w3/w2)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.architecture == _GPT_OSS:
            return self._gpt_oss_mlp(p)
        if self.architecture in _FUSED_IN_SOURCE:
            return [
                (p + "mlp.gate_up_proj.weight", (2 * i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        if self.architecture not in _MOE:
            return [
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        mixtral = self.architecture == "MixtralForCausalLM"
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        out: list[tuple[str, tuple[int, ...]]] = [(moe + "gate.weight", (self.num_experts, h))]
        for e in range(self.num_experts):
            x = f"{moe}experts.{e}."
            out += [(f"{x}{gate}.weight", (i, h)), (f"{x}{down}.weight", (h, i)),
                    (f"{x}{up}.weight", (i, h))]  # fmt: skip
        if self.architecture == "Qwen2MoeForCausalLM":
            s, x = self.shared_expert_intermediate_size, moe + "shared_expert."
            out += [(x + "gate_proj.weight", (s, h)), (x + "up_proj.weight", (s, h)),
                    (x + "down_proj.weight", (h, s)),
                    (moe + "shared_expert_gate.weight", (1, h))]  # fmt: skip
        return out

    def _gpt_oss_mlp(self, p: str) -> list[tuple[str, tuple[int, ...]]]:
        """gpt-oss's MLP as its bf16 hub checkpoints hold it: a router with a bias, and every
        expert stacked in one tensor per kind, input dim first (``gate_up_proj`` [E, H, 2I]
        with gate and up columns interleaved, ``down_proj`` [E, I, H])."""
        e, h, i, x = self.num_experts, self.hidden_size, self.intermediate_size, p + "mlp."
        return [(x + "router.weight", (e, h)), (x + "router.bias", (e,)),
                (x + "experts.gate_up_proj", (e, h, 2 * i)),
                (x + "experts.gate_up_proj_bias", (e, 2 * i)),
                (x + "experts.down_proj", (e, i, h)),
                (x + "experts.down_proj_bias", (e, h))]  # fmt: skip

    def _gpt_oss_config(self) -> dict[str, object]:
        """gpt-oss's fields as its hub config.json has them: alternating sliding and full
        attention, yarn RoPE, the clamped SwiGLU's limit, biases everywhere."""
        window = min(8, self.max_position_embeddings)
        return {
            "attention_bias": True,
            "head_dim": self.head_size,
            "hidden_act": "silu",
            "initial_context_length": self.max_position_embeddings // 4,
            "layer_types": [
                "sliding_attention" if layer % 2 == 0 else "full_attention"
                for layer in range(self.num_layers)
            ],
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "experts_per_token": self.experts_per_token,
            "output_router_logits": False,
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 4.0,
                "original_max_position_embeddings": self.max_position_embeddings // 4,
                "rope_type": "yarn",
                "truncate": False,
            },
            "rope_theta": 150000.0,
            "router_aux_loss_coef": 0.9,
            "sliding_window": window,
            "swiglu_limit": 7.0,
        }

    def _architecture_config(self) -> dict[str, object]:
        """The ``config.json`` fields of this architecture beyond the common ones."""
        cfg: dict[str, object] = {}
        if self.architecture == "LlamaForCausalLM":
            cfg.update(
                attention_bias=False, mlp_bias=False, pretraining_tp=1, head_dim=self.head_size
            )
        elif self.architecture == "MistralForCausalLM":
            cfg.update(sliding_window=None, head_dim=self.head_size)
        elif self.architecture == "MixtralForCausalLM":
            cfg.update(
                sliding_window=None,
                head_dim=self.head_size,
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.experts_per_token,
                output_router_logits=False,
                router_aux_loss_coef=0.02,
                router_jitter_noise=0.0,
            )
        elif self.architecture == "Phi3ForCausalLM":
            cfg.update(
                embd_pdrop=0.0,
                resid_pdrop=0.0,
                original_max_position_embeddings=self.max_position_embeddings,
                sliding_window=self.max_position_embeddings // 2 - 1,  # Phi-3-mini-4k: 2047
                pad_token_id=_SPECIAL_TOKENS.index("<pad>"),
            )
        elif self.architecture == "Qwen2ForCausalLM":
            cfg.update(
                sliding_window=None, use_sliding_window=False, max_window_layers=self.num_layers
            )
        elif self.architecture == "Qwen2MoeForCausalLM":
            cfg.update(
                self._qwen_moe_config(),
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                norm_topk_prob=False,
            )
        elif self.architecture in _GEMMA:
            cfg.update(self._gemma_config())
        elif self.architecture == "Qwen3MoeForCausalLM":
            cfg.update(
                self._qwen_moe_config(),
                attention_bias=False,
                head_dim=self.head_size,
                norm_topk_prob=True,
            )
        elif self.architecture == _GPT_OSS:
            cfg.update(self._gpt_oss_config())
        else:  # Qwen3
            cfg.update(
                sliding_window=None,
                use_sliding_window=False,
                attention_bias=False,
                max_window_layers=self.num_layers,
                head_dim=self.head_size,
            )
        return cfg

    def _gemma_config(self) -> dict[str, object]:
        """Gemma's fields as the hub's ``config.json`` has them: GELU (tanh), an explicit
        head_dim with the query scaled by ``query_pre_attn_scalar``, sliding-window layers
        (Gemma 2: every other one; Gemma 3: all but every ``sliding_window_pattern``-th, with
        their own rope base), logit soft-capping (Gemma 2)."""
        gemma2 = self.architecture == "Gemma2ForCausalLM"
        cfg: dict[str, object] = {
            "attention_bias": False,
            "attn_logit_softcapping": 50.0 if gemma2 else None,
            "cache_implementation": "hybrid",
            "final_logit_softcapping": 30.0 if gemma2 else None,
            "head_dim": self.head_size,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "pad_token_id": 3,
            "query_pre_attn_scalar": self.head_size,
            "sliding_window": 64,
        }
        if not gemma2:
            cfg.update(rope_local_base_freq=self.rope_theta, sliding_window_pattern=2)
            cfg.update(rope_theta=100 * self.rope_theta)
        return cfg

    def _qwen_moe_config(self) -> dict[str, object]:
        """The fields Qwen2-MoE and Qwen3-MoE share: every layer sparse."""
        return {
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": self.num_layers,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "moe_intermediate_size": self.intermediate_size,
            "intermediate_size": 2 * self.intermediate_size,  # a dense MLP's; no layer has one
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }

    def config(self) -> dict[str, object]:
        """``config.json`` as transformers 4.x writes it for this architecture."""
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
            "model_type": _MODEL_TYPES[self.architecture],
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
        cfg.update(self._architecture_config())
        if self.fp8:
            cfg["quantization_config"] = fp8_quantization_config()
        cfg.update(dict(self.config_extra))
        return dict(sorted(cfg.items()))


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
    for k, file_name in enumerate(names):
        members = [(name, shape) for name, shape in tensors if assignment[name] == k]
        _write_safetensors(spec, out / file_name, members)
    if n > 1:
        total = sum(
            math.prod(shape) * DTYPE_SIZES[spec.dtype_code(name)] for name, shape in tensors
        )
        weight_map = {name: names[assignment[name]] for name, _ in tensors}
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    return out


def _assign_shards(
    spec: SyntheticModel, tensors: list[tuple[str, tuple[int, ...]]]
) -> dict[str, int]:
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
    spec: SyntheticModel, path: Path, members: list[tuple[str, tuple[int, ...]]]
) -> None:
    """Header first (shapes are known up front), then each tensor's bytes, chunk by chunk."""
    header, _ = encode_header(
        [(name, spec.dtype_code(name), shape) for name, shape in members], {"format": "pt"}
    )
    with path.open("wb") as f:
        f.write(header)
        for name, shape in members:
            if spec.quantized(name):
                for weight, scale in _quantized_rows(spec, name, shape):
                    f.write(_encode_fp8(_rounded(weight / scale, spec.dtype)))
            elif name.endswith(".weight_scale"):
                of = name.removesuffix("_scale")
                for _, scale in _quantized_rows(spec, of, dict(spec.tensors())[of]):
                    f.write(_encode(scale.reshape(-1), spec.dtype))
            else:
                for chunk in _generate(spec, name, shape):
                    f.write(_encode(chunk, spec.dtype))


def _scale_of(weight: str) -> str:
    return weight.removesuffix("weight") + "weight_scale"


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
    mean = np.float32(1.0 if is_norm and spec.architecture not in _GEMMA else 0.0)
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
