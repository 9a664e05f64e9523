"""The layout oracle: every rank file the stager writes holds exactly, byte for byte, the
state vLLM's own weight loaders give that rank from the original checkpoint (names, dtypes,
shapes and values; ``layout_oracle.py`` takes it before ``process_weights_after_loading``,
filtered as ``ShardedStateLoader`` filters it), for every family of the stager's table.

Each family also has its contract checked against the source itself (``FAMILIES``'s check):
which source rows and columns make each rank's tensor. The checkpoints are bfloat16 with 8
query heads on 2 KV heads (each KV head replicated from TP 4) unless a family needs otherwise.
TP 2 for the families in ``DEFAULT_TIER``; every other family, and TP 4 and 8, in the slow tier
(a process per rank, each importing vLLM). vLLM's states come from one oracle run per TP for
every family the session selected at that TP (``vllm_states``): each rank's process imports
vLLM once and builds the families in turn.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from modelstage.devtools.synthetic import SyntheticModel
from safetensors import safe_open
from safetensors.torch import save_file
from vllm_oracle import vllm_rank_states, vllm_rank_states_batch

pytestmark = pytest.mark.vllm

Want = dict[str, torch.Tensor]
Check = Callable[[SyntheticModel, Path, int, int, Want], None]


def _read(paths: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat_a, flat_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and flat_a.equal(flat_b)


def _check_experts_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: Want
) -> None:
    """The contract itself, read off the source: w13[e] = cat(gate_e, up_e) rows of the rank,
    w2[e] = the rank's columns of down_e, the router whole under vLLM's kept name."""
    source = _read(sorted(src.glob("*.safetensors")))
    block, (gate, up, down), router = EXPERT_NAMES[spec.architecture]
    inter = spec.intermediate_size // tp
    rows = slice(rank * inter, (rank + 1) * inter)
    moe = "model.layers.1." + block
    for e in range(spec.num_experts):
        x = f"{moe}experts.{e}."
        w13 = torch.cat([source[f"{x}{gate}.weight"][rows], source[f"{x}{up}.weight"][rows]])
        assert want[moe + "experts.routed_experts.w13_weight"][e].equal(w13)
        assert want[moe + "experts.routed_experts.w2_weight"][e].equal(
            source[f"{x}{down}.weight"][:, rows]
        )
    assert want[moe + router].equal(source[moe + "gate.weight"])
    if spec.architecture == "Qwen2MoeForCausalLM":
        _check_shared_expert_from_source(source, spec, rank, tp, want)


EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe.", ("w1", "w3", "w2"), "gate.weight"),
    "Qwen2MoeForCausalLM": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "gate.weight"),
    "Qwen3MoeForCausalLM": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "experts.gate.weight"),
    **{
        f"DeepseekV{v}ForCausalLM": ("mlp.", ("gate_proj", "up_proj", "down_proj"),
                                     "experts.gate.weight")
        for v in (2, 3)
    },
}
"""Where each MoE family's source names its experts and router, and vLLM's kept router name."""


def _check_shared_expert_from_source(
    source: dict[str, torch.Tensor],
    spec: SyntheticModel,
    rank: int,
    tp: int,
    want: dict[str, torch.Tensor],
) -> None:
    """Qwen2-MoE's shared expert as a dense MLP of its own size: gate_up = cat(gate, up) rows
    of the rank, down = the rank's columns; its gate [1, H] whole."""
    inter = spec.shared_expert_intermediate_size // tp
    rows = slice(rank * inter, (rank + 1) * inter)
    mlp = "model.layers.1.mlp."
    shared, kept = mlp + "shared_expert.", mlp + "experts._shared_experts._layer."
    gate_up = torch.cat([source[shared + "gate_proj.weight"][rows],
                         source[shared + "up_proj.weight"][rows]])  # fmt: skip
    assert want[kept + "gate_up_proj.weight"].equal(gate_up)
    assert want[kept + "down_proj.weight"].equal(source[shared + "down_proj.weight"][:, rows])
    assert want[kept + "expert_gate.weight"].equal(source[mlp + "shared_expert_gate.weight"])


def _check_gpt_oss_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: dict[str, torch.Tensor]
) -> None:
    """The contract itself, read off the source: per expert the rank's block of
    ``gate_up_proj``'s (interleaved) columns and of ``down_proj``'s rows, transposed;
    ``w13_bias`` cut alike; ``w2_bias`` whole on rank 0 and zero elsewhere; sinks by heads."""
    source = _read(sorted(src.glob("*.safetensors")))
    inter, heads = spec.intermediate_size // tp, spec.num_heads // tp
    cols = slice(2 * rank * inter, 2 * (rank + 1) * inter)
    rows = slice(rank * inter, (rank + 1) * inter)
    hf, routed = "model.layers.1.mlp.experts.", "model.layers.1.mlp.experts.routed_experts."
    gate_up, down, bias = (source[hf + k] for k in ("gate_up_proj", "down_proj", "down_proj_bias"))
    assert want[routed + "w13_weight"].equal(gate_up[:, :, cols].permute(0, 2, 1))
    assert want[routed + "w13_bias"].equal(source[hf + "gate_up_proj_bias"][:, cols])
    assert want[routed + "w2_weight"].equal(down[:, rows, :].permute(0, 2, 1))
    assert want[routed + "w2_bias"].equal(bias if rank == 0 else torch.zeros_like(bias))
    sinks = source["model.layers.1.self_attn.sinks"][rank * heads : (rank + 1) * heads]
    assert want["model.layers.1.attn.sinks"].equal(sinks)
    o_bias = source["model.layers.1.self_attn.o_proj.bias"]
    assert want["model.layers.1.attn.o_proj.bias"].equal(o_bias)


def _check_fp8_scales_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: dict[str, torch.Tensor]
) -> None:
    """The contract read off the source: float32 scales, split with their weight's rows
    (q, k, v slots of the rank; gate, up), o_proj's and down_proj's whole."""
    source = _read(sorted(src.glob("*.safetensors")))
    hd = spec.head_size
    kv_rows = hd * max(spec.num_kv_heads // tp, 1)
    kv_first = (rank * spec.num_kv_heads // tp if spec.num_kv_heads >= tp
                else rank // (tp // spec.num_kv_heads)) * hd  # fmt: skip
    q_rows, inter = spec.num_heads * hd // tp, spec.intermediate_size // tp
    layer = "model.layers.1."
    attn, mlp = layer + "self_attn.", layer + "mlp."

    def scale(name: str, first: int, count: int) -> torch.Tensor:
        return source[name + ".weight_scale"][first : first + count].float()

    qkv = torch.cat([scale(attn + "q_proj", rank * q_rows, q_rows),
                     scale(attn + "k_proj", kv_first, kv_rows),
                     scale(attn + "v_proj", kv_first, kv_rows)])  # fmt: skip
    assert want[attn + "qkv_proj.weight_scale"].equal(qkv)
    gate_up = torch.cat([scale(mlp + "gate_proj", rank * inter, inter),
                         scale(mlp + "up_proj", rank * inter, inter)])  # fmt: skip
    assert want[mlp + "gate_up_proj.weight_scale"].equal(gate_up)
    for whole in (attn + "o_proj", mlp + "down_proj"):
        assert want[whole + ".weight_scale"].equal(source[whole + ".weight_scale"].float())
    assert want[mlp + "down_proj.weight"].dtype == torch.float8_e4m3fn
    for x in "kvq":
        assert want[f"{attn}attn.{x}_scale"].equal(torch.ones(1))
        assert want[f"{attn}attn.{x}_zero_point"].equal(torch.zeros(1, dtype=torch.bfloat16))


def _check_fused_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: dict[str, torch.Tensor]
) -> None:
    """The contract itself, read off the source: the source's fused ``qkv_proj`` cut into q,
    k and v, then each part's rows of the rank (a KV head on several ranks from TP 4), side
    by side; ``gate_up_proj`` cut into gate and up, likewise."""
    source = _read(sorted(src.glob("*.safetensors")))
    hd = spec.head_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    fused = source[attn + "qkv_proj.weight"]
    q_rows = q // tp
    kv_first = rank * spec.num_kv_heads // tp * hd  # ranks past the KV heads share them
    kv_rows = max(spec.num_kv_heads // tp, 1) * hd
    qkv = torch.cat([
        fused[rank * q_rows : (rank + 1) * q_rows],
        fused[q + kv_first : q + kv_first + kv_rows],
        fused[q + kv + kv_first : q + kv + kv_first + kv_rows],
    ])  # fmt: skip
    assert want[attn + "qkv_proj.weight"].equal(qkv)
    inter = spec.intermediate_size // tp
    gate_up = source[mlp + "gate_up_proj.weight"]
    rows = slice(rank * inter, (rank + 1) * inter)
    up = slice(spec.intermediate_size + rank * inter, spec.intermediate_size + (rank + 1) * inter)
    assert want[mlp + "gate_up_proj.weight"].equal(torch.cat([gate_up[rows], gate_up[up]]))


def _check_dense_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: Want
) -> None:
    """The contract read off the source, for layer 1: qkv = cat(q, k, v) head rows of the
    rank (KV heads replicated when TP exceeds them), gate_up = cat(gate, up) rows, o and down
    the rank's columns, every norm whole and raw, the embeddings under vLLM's kept name; and
    the comparison's control: two norms of one shape exchanged no longer equal vLLM's state."""
    source = _read(sorted(src.glob("*.safetensors")))
    hd, kv = spec.head_size, spec.num_kv_heads
    q_rows = slice(rank * spec.num_heads // tp * hd, (rank + 1) * spec.num_heads // tp * hd)
    kv_head = rank * kv // tp if kv >= tp else rank // (tp // kv)
    kv_count = max(kv // tp, 1)
    kv_rows = slice(kv_head * hd, (kv_head + kv_count) * hd)
    inter = slice(rank * spec.intermediate_size // tp, (rank + 1) * spec.intermediate_size // tp)
    layer = "model.layers.1."
    attn, mlp = layer + "self_attn.", layer + "mlp."
    qkv = torch.cat([source[attn + "q_proj.weight"][q_rows], source[attn + "k_proj.weight"][kv_rows],
                     source[attn + "v_proj.weight"][kv_rows]])  # fmt: skip
    assert want[attn + "qkv_proj.weight"].equal(qkv)
    assert want[attn + "o_proj.weight"].equal(source[attn + "o_proj.weight"][:, q_rows])
    gate_up = torch.cat([source[mlp + "gate_proj.weight"][inter],
                         source[mlp + "up_proj.weight"][inter]])  # fmt: skip
    assert want[mlp + "gate_up_proj.weight"].equal(gate_up)
    assert want[mlp + "down_proj.weight"].equal(source[mlp + "down_proj.weight"][:, inter])
    norms = [n for n in source if n.endswith("norm.weight")]
    assert norms and all(want[n].equal(source[n]) for n in norms), "a norm is not raw and whole"
    embeddings = TIED_KEPT_AS.get(spec.architecture, "lm_head.weight") if (
        spec.tie_word_embeddings) else "model.embed_tokens.weight"  # fmt: skip
    per = spec.vocab_size // tp
    assert want[embeddings].equal(
        source["model.embed_tokens.weight"][rank * per : (rank + 1) * per]
    )
    a, b = (f"{layer}{n}_layernorm.weight" for n in ("input", "post_attention"))
    assert not want[a].equal(want[b]), "the control: exchanged norms must differ"


def _check_deepseek_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: Want
) -> None:
    """The contract read off the source. MLA (layer 1): ``fused_qkv_a_proj`` = cat(q_a_proj,
    kv_a_proj_with_mqa) whole, its norms whole, ``q_b_proj`` and ``kv_b_proj`` the rank's
    heads' rows, ``o_proj`` their columns, under ``mla_attn``'s names where it holds them.
    Layer 0 dense; layer 1's router and float32 correction bias whole, the two shared experts
    as one MLP, the routed experts stacked; the multi-token-prediction layer nowhere."""
    source = _read(sorted(src.glob("*.safetensors")))
    config = json.loads((src / "config.json").read_text())
    heads = spec.num_heads // tp
    nope, rope, v = (config[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    attn, mla = "model.layers.1.self_attn.", "model.layers.1.self_attn.mla_attn."

    def head_rows(name: str, per_head: int) -> torch.Tensor:
        return source[attn + name][rank * heads * per_head : (rank + 1) * heads * per_head]

    fused = torch.cat([source[attn + "q_a_proj.weight"], source[attn + "kv_a_proj_with_mqa.weight"]])
    assert want[attn + "fused_qkv_a_proj.weight"].equal(fused)
    assert want[mla + "q_a_layernorm.weight"].equal(source[attn + "q_a_layernorm.weight"])
    assert want[attn + "kv_a_layernorm.weight"].equal(source[attn + "kv_a_layernorm.weight"])
    assert want[mla + "q_b_proj.weight"].equal(head_rows("q_b_proj.weight", nope + rope))
    assert want[attn + "kv_b_proj.weight"].equal(head_rows("kv_b_proj.weight", nope + v))
    cols = slice(rank * heads * v, (rank + 1) * heads * v)
    assert want[mla + "o_proj.weight"].equal(source[attn + "o_proj.weight"][:, cols])
    dense, moe = "model.layers.0.mlp.", "model.layers.1.mlp."
    inter = 2 * spec.intermediate_size // tp
    rows = slice(rank * inter, (rank + 1) * inter)
    for mlp, kept in ((dense, dense), (moe + "shared_experts.", moe + "experts._shared_experts._layer.")):
        gate_up = torch.cat([source[mlp + "gate_proj.weight"][rows],
                             source[mlp + "up_proj.weight"][rows]])  # fmt: skip
        assert want[kept + "gate_up_proj.weight"].equal(gate_up)
        assert want[kept + "down_proj.weight"].equal(source[mlp + "down_proj.weight"][:, rows])
    bias = want.get(moe + "experts.gate.e_score_correction_bias")
    if spec.architecture == "DeepseekV3ForCausalLM":  # noaux_tc routing; V2 has no bias
        assert bias is not None and bias.dtype == torch.float32
        assert bias.equal(source[moe + "gate.e_score_correction_bias"])
    else:
        assert bias is None
    assert not any(k.startswith(f"model.layers.{spec.num_layers}.") for k in want)
    _check_experts_from_source(spec, src, rank, tp, want)


def _tiles(scale: torch.Tensor, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
    """The scales of the weight's ``rows`` and ``cols`` (element ranges), 128 x 128 per scale."""

    def blocks(cut: slice | None) -> slice:
        return slice(None) if cut is None else slice(cut.start // 128, -(-cut.stop // 128))

    return scale[blocks(rows), blocks(cols)]


def _check_block_scales_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: Want
) -> None:
    """The block scales' contract read off the source, beside DeepSeek's own: each
    ``weight_scale_inv`` holds the float32 scales of exactly the weight's rows and columns the
    rank holds, 128 x 128 elements a scale (fused: the parts' scales one after the other;
    stacked experts: per expert, gate's then up's); the weights stay float8."""
    _check_deepseek_from_source(spec, src, rank, tp, want)
    source = _read(sorted(src.glob("*.safetensors")))
    attn, mla = "model.layers.1.self_attn.", "model.layers.1.self_attn.mla_attn."
    s = {k.removesuffix(".weight_scale_inv"): v for k, v in source.items() if k.endswith("_inv")}
    per = 8 // tp * 128  # q_b: 128 rows a head (nope 64 + rope 64), kv_b: 128 (nope + v 64)
    heads = slice(rank * per, (rank + 1) * per)
    fused = torch.cat([s[attn + "q_a_proj"], s[attn + "kv_a_proj_with_mqa"]])
    assert want[attn + "fused_qkv_a_proj.weight_scale_inv"].equal(fused)
    assert fused.shape == (1 + 5, 4)  # q_lora 128: 1 row of blocks; 512 + 64 = 576: 5
    assert want[mla + "q_b_proj.weight_scale_inv"].equal(_tiles(s[attn + "q_b_proj"], heads))
    assert want[attn + "kv_b_proj.weight_scale_inv"].equal(_tiles(s[attn + "kv_b_proj"], heads))
    v_cols = slice(rank * 8 // tp * 64, (rank + 1) * 8 // tp * 64)
    assert want[mla + "o_proj.weight_scale_inv"].equal(_tiles(s[attn + "o_proj"], cols=v_cols))
    moe, inter = "model.layers.1.mlp.", spec.intermediate_size // tp
    rows = slice(rank * inter, (rank + 1) * inter)
    for e in range(spec.num_experts):
        x = f"{moe}experts.{e}."
        w13 = torch.cat([_tiles(s[x + "gate_proj"], rows), _tiles(s[x + "up_proj"], rows)])
        assert want[moe + "experts.routed_experts.w13_weight_scale_inv"][e].equal(w13)
        w2 = _tiles(s[x + "down_proj"], cols=rows)
        assert want[moe + "experts.routed_experts.w2_weight_scale_inv"][e].equal(w2)
    assert want[moe + "experts.routed_experts.w13_weight"].dtype == torch.float8_e4m3fn
    assert want[moe + "experts.gate.weight"].dtype == torch.bfloat16  # the router unquantized


def _check_qwen3_moe_block_scales_from_source(
    spec: SyntheticModel, src: Path, rank: int, tp: int, want: Want
) -> None:
    """Qwen3-MoE in block FP8, read off the source: ``qkv_proj``'s scales the tiles of the
    rank's q heads, then of its KV head's k and v (a KV head on two ranks from TP 4),
    ``o_proj``'s the tiles of its columns, the experts' as DeepSeek's, the routers unquantized
    (named in ``modules_to_not_convert``), the attention's FP8 KV-cache placeholders -1."""
    _check_experts_from_source(spec, src, rank, tp, want)
    source = _read(sorted(src.glob("*.safetensors")))
    s = {k.removesuffix(".weight_scale_inv"): v for k, v in source.items() if k.endswith("_inv")}
    attn = "model.layers.1.self_attn."
    q = slice(rank * 4 // tp * 128, (rank + 1) * 4 // tp * 128)
    kv_head = rank * 2 // tp
    kv = slice(kv_head * 128, (kv_head + 1) * 128)
    qkv = torch.cat([_tiles(s[attn + "q_proj"], q), _tiles(s[attn + "k_proj"], kv),
                     _tiles(s[attn + "v_proj"], kv)])  # fmt: skip
    assert want[attn + "qkv_proj.weight_scale_inv"].equal(qkv)
    assert want[attn + "o_proj.weight_scale_inv"].equal(_tiles(s[attn + "o_proj"], cols=q))
    moe, inter = "model.layers.1.mlp.", spec.intermediate_size // tp
    rows = slice(rank * inter, (rank + 1) * inter)
    for e in range(spec.num_experts):
        x = f"{moe}experts.{e}."
        w13 = torch.cat([_tiles(s[x + "gate_proj"], rows), _tiles(s[x + "up_proj"], rows)])
        assert want[moe + "experts.routed_experts.w13_weight_scale_inv"][e].equal(w13)
    assert want[moe + "experts.gate.weight"].dtype == torch.bfloat16
    assert moe + "experts.gate.weight_scale_inv" not in want
    for x in ("k", "v", "q", "prob"):
        assert want[f"{attn}attn.{x}_scale"].equal(torch.tensor(-1.0, dtype=torch.bfloat16))


TIED_KEPT_AS = {"Gemma2ForCausalLM": "model.embed_tokens.weight"}
"""The name vLLM keeps for tied embeddings where it is not ``lm_head.weight`` (Gemma 2's model
has no head module)."""


def _dense(architecture: str, seed: int, **extra: object) -> Family:
    """A dense family's checkpoint: bfloat16, 8 query heads on 2 KV heads."""
    spec = SyntheticModel(
        architecture=architecture, hidden_size=128, intermediate_size=256, num_heads=8,  # type: ignore[arg-type]
        num_kv_heads=2, vocab_size=512, dtype="bfloat16", num_shards=2, seed=seed,
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    return Family(spec, _check_dense_from_source)


@dataclass(frozen=True)
class Family:
    spec: SyntheticModel
    check: Check | None = None
    """The family's contract read off the source, beyond the byte-for-byte comparison."""
    tps: tuple[int, ...] = (2, 4, 8)
    """The TP sizes vLLM builds it at (block FP8: those whose ranks hold whole blocks)."""


FAMILIES = {
    "mixtral": Family(SyntheticModel(
        architecture="MixtralForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=512, num_experts=4, dtype="bfloat16", num_shards=2, seed=4,
    ), _check_experts_from_source),  # vLLM's Mixtral takes more ranks than experts
    "qwen2-moe": Family(SyntheticModel(
        architecture="Qwen2MoeForCausalLM", hidden_size=128, intermediate_size=64, num_heads=8,
        num_kv_heads=2, vocab_size=512, num_experts=8, dtype="bfloat16", num_shards=2, seed=8,
    ), _check_experts_from_source),  # q/k/v biases, a gated shared expert; <= 8 ranks
    "qwen3-moe": Family(SyntheticModel(
        architecture="Qwen3MoeForCausalLM", hidden_size=128, intermediate_size=64, num_heads=8,
        num_kv_heads=2, head_dim=32, vocab_size=512, num_experts=8, dtype="bfloat16",
        tie_word_embeddings=True, num_shards=2, seed=6,
    ), _check_experts_from_source),
    "gpt-oss": Family(SyntheticModel(
        architecture="GptOssForCausalLM", hidden_size=128, intermediate_size=256, num_heads=16,
        num_kv_heads=8, head_dim=16, vocab_size=512, num_experts=4, dtype="bfloat16",
        num_shards=2, seed=12,
    ), _check_gpt_oss_from_source),  # 8 KV heads (its model splits them, never copies); 256 / 8
    # ranks = 32: vLLM's CPU MoE kernel takes an intermediate size per rank of a multiple of 32
    "fp8-llama": Family(SyntheticModel(
        hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2, vocab_size=512,
        dtype="bfloat16", num_shards=2, split_fused=True, fp8=True, seed=11,
    ), _check_fp8_scales_from_source),  # q/k/v and gate/up in different source files
    "fp8-qwen3": Family(SyntheticModel(
        architecture="Qwen3ForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True,
        dtype="bfloat16", num_shards=2, fp8=True, seed=13,
    ), _check_fp8_scales_from_source),  # q/k norms, head_dim 32 != hidden/heads, tied
    "deepseek-v3": Family(SyntheticModel(
        architecture="DeepseekV3ForCausalLM", hidden_size=128, intermediate_size=64,
        num_heads=8, num_kv_heads=8, vocab_size=512, num_experts=8, dtype="bfloat16",
        num_shards=2, seed=14,
    ), _check_deepseek_from_source),  # MLA: KV low rank 512, rope 64 (vLLM CPU's only MLA)
    "deepseek-v2": Family(SyntheticModel(
        architecture="DeepseekV2ForCausalLM", hidden_size=128, intermediate_size=64,
        num_heads=8, num_kv_heads=8, vocab_size=512, num_experts=8, dtype="bfloat16",
        num_shards=2, seed=15,
    ), _check_deepseek_from_source),  # V2: softmax group routing, no bias, no prediction layer
    "fp8-block-deepseek-v3": Family(SyntheticModel(
        architecture="DeepseekV3ForCausalLM", hidden_size=512, intermediate_size=512,
        num_heads=8, num_kv_heads=8, vocab_size=512, num_experts=4, dtype="bfloat16",
        num_shards=2, seed=16, fp8_block=True, q_lora_rank=128, v_head_dim=64,
    ), _check_block_scales_from_source, (2, 4)),  # per rank: 1 head of o_proj at TP 8 = 64
    # columns, half a block: refused (as vLLM refuses it)
    "fp8-block-qwen3-moe": Family(SyntheticModel(
        architecture="Qwen3MoeForCausalLM", hidden_size=256, intermediate_size=512, num_heads=4,
        num_kv_heads=2, head_dim=128, vocab_size=512, num_experts=4, dtype="bfloat16",
        num_shards=2, seed=18, fp8_block=True,
    ), _check_qwen3_moe_block_scales_from_source, (2, 4)),  # routers named unquantized, as
    # the hub's config lists them; a head of 128 rows is one block; TP 8 exceeds the experts
    "phi3": Family(SyntheticModel(
        architecture="Phi3ForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=512, dtype="bfloat16", num_shards=2, seed=10,
    ), _check_fused_from_source),  # q/k/v and gate/up fused in the source
    "llama": _dense("LlamaForCausalLM", 20),  # untied
    "mistral": _dense("MistralForCausalLM", 21, tie_word_embeddings=True),
    "qwen2": _dense("Qwen2ForCausalLM", 22),  # q/k/v biases
    "qwen3": _dense("Qwen3ForCausalLM", 23, head_dim=32, tie_word_embeddings=True),
    # Gemma: feed-forward norms, raw norms; Gemma 2 keeps tied embeddings as embed_tokens
    "gemma2": _dense("Gemma2ForCausalLM", 24, head_dim=32, tie_word_embeddings=True),
    "gemma3": _dense("Gemma3ForCausalLM", 25, head_dim=32, tie_word_embeddings=True),  # q/k norms
}  # fmt: skip
DEFAULT_TIER = frozenset({"llama", "gemma2", "gemma3", "mixtral", "gpt-oss", "fp8-llama", "phi3"})
"""At TP 2 in the default tier: one family per kind of split (dense, stacked experts,
transposed experts with a rank-0 bias, float8 weights with their scales, fused sources) and
Gemma's norms and tied-embedding names."""


def _cases() -> list[object]:
    return [
        pytest.param(
            family, tp, id=f"{family}-tp{tp}",
            marks=() if tp == 2 and family in DEFAULT_TIER else pytest.mark.slow,
        )
        for family in FAMILIES
        for tp in FAMILIES[family].tps
    ]  # fmt: skip


def _assert_rank_files_equal(artifact: Path, states: list[Path]) -> list[Want]:
    wants = []
    for rank, state in enumerate(states):
        want = _read([state])
        got = _read(sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")))
        assert sorted(got) == sorted(want), f"rank {rank}: names differ"
        differ = [k for k in want if not _same_bytes(want[k], got[k])]
        assert not differ, f"rank {rank}: {len(differ)} tensors differ, e.g. {differ[:4]}"
        wants.append(want)
    return wants


class VllmStates:
    """vLLM's per-rank states, one oracle run per TP for every family this session selected
    at that TP: the first family asked for at a TP builds them all, in ``FAMILIES`` order."""

    def __init__(self, session: pytest.Session, checkpoint: Callable[[str, SyntheticModel], Path],
                 root: Path) -> None:  # fmt: skip
        self.checkpoint, self.root = checkpoint, root
        self.selected: set[tuple[str, int]] = set()
        for item in session.items:
            params = getattr(item, "callspec", None)
            if params is None or getattr(item, "obj", None) not in _USES_STATES:
                continue
            for key in ("family", "built_after"):
                if key in params.params:
                    self.selected.add((params.params[key], params.params.get("tp", 2)))
        self.batches: dict[int, list[str]] = {}
        self.found: dict[tuple[str, int], list[Path] | str] = {}

    def __call__(self, family: str, tp: int) -> list[Path]:
        """The family's rank states at ``tp``; fails with vLLM's error if its build failed."""
        if (family, tp) not in self.found:
            batch = [f for f in FAMILIES if (f, tp) in self.selected or f == family]
            self.batches[tp] = batch
            jobs = [(self.checkpoint(f"layout-{f}", FAMILIES[f].spec), self.root / f"tp{tp}" / f)
                    for f in batch]  # fmt: skip
            for f, found in zip(batch, vllm_rank_states_batch(jobs, tp, "bfloat16"), strict=True):
                self.found[(f, tp)] = found
        found = self.found[(family, tp)]
        if isinstance(found, str):
            pytest.fail(f"vLLM's layout oracle failed on {family} at TP {tp}: {found}", pytrace=False)
        return found


@pytest.fixture(scope="session")
def vllm_states(
    request: pytest.FixtureRequest,
    checkpoint: Callable[[str, SyntheticModel], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmStates]:
    yield VllmStates(request.session, checkpoint, tmp_path_factory.mktemp("vllm-states"))


@pytest.mark.parametrize(("family", "tp"), _cases())
def test_rank_files_equal_vllms_own_per_rank_state_byte_for_byte(
    family: str,
    tp: int,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    vllm_states: VllmStates,
) -> None:
    spec, check = FAMILIES[family].spec, FAMILIES[family].check
    src = checkpoint(f"layout-{family}", spec)
    artifact = staged(f"layout-{family}", src, tp, "--dtype", "auto")
    states = vllm_states(family, tp)
    for rank, want in enumerate(_assert_rank_files_equal(artifact, states)):
        if check is not None:
            check(spec, src, rank, tp, want)


@pytest.mark.parametrize(
    ("family", "built_after", "tp"),
    [("phi3", "mixtral", 2), pytest.param("gpt-oss", "mixtral", 2, marks=pytest.mark.slow)],
)
def test_batched_oracle_equals_one_model_at_a_time(
    family: str,
    built_after: str,
    tp: int,
    checkpoint: Callable[[str, SyntheticModel], Path],
    vllm_states: VllmStates,
    tmp_path: Path,
) -> None:
    """A model built after others in the same processes gets the very state it gets alone:
    nothing of an earlier build leaks into a later one."""
    batched = vllm_states(family, tp)
    assert built_after in vllm_states.batches[tp][: vllm_states.batches[tp].index(family)]
    alone = vllm_rank_states(checkpoint(f"layout-{family}", FAMILIES[family].spec), tp,
                             "bfloat16", tmp_path / "alone")  # fmt: skip
    for rank, (a, b) in enumerate(zip(batched, alone, strict=True)):
        want, got = _read([a]), _read([b])
        assert sorted(got) == sorted(want), f"rank {rank}: names differ"
        differ = [k for k in want if not _same_bytes(want[k], got[k])]
        assert not differ, f"rank {rank}: {len(differ)} tensors differ, e.g. {differ[:4]}"


def _exchange_two_heads(kv_b: torch.Tensor) -> torch.Tensor:
    """``kv_b_proj`` (rank 0's 4 heads) with its first two heads' rows exchanged."""
    per_head = kv_b.shape[0] // 4
    order = [*range(per_head, 2 * per_head), *range(per_head), *range(2 * per_head, len(kv_b))]
    return kv_b[order].contiguous()


def _exchange_two_experts(w13: torch.Tensor) -> torch.Tensor:
    """Stacked experts [E, ...] with experts 0 and 1 exchanged."""
    return w13[[1, 0, *range(2, len(w13))]].contiguous()


def _exchange_two_blocks(scales: torch.Tensor) -> torch.Tensor:
    """Block scales with the first two blocks' scales of the first row exchanged."""
    out = scales.clone()
    out[0, 0], out[0, 1] = scales[0, 1], scales[0, 0]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "name", "mutate"),
    [
        ("deepseek-v3", "model.layers.1.self_attn.kv_b_proj.weight", _exchange_two_heads),
        ("deepseek-v3", "model.layers.1.mlp.experts.routed_experts.w13_weight",
         _exchange_two_experts),
        ("fp8-block-deepseek-v3", "model.layers.1.self_attn.kv_b_proj.weight_scale_inv",
         _exchange_two_blocks),
        ("fp8-block-qwen3-moe", "model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv",
         _exchange_two_experts),
    ],
)  # fmt: skip
def test_the_controls_deepseek_files_with_heads_experts_or_blocks_exchanged_differ(
    family: str,
    name: str,
    mutate: Callable[[torch.Tensor], torch.Tensor],
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    vllm_states: VllmStates,
    tmp_path: Path,
) -> None:
    """The comparison sees a split right in names, shapes and dtypes that puts two MLA heads,
    two experts, two blocks' scales or two experts' scales in each other's place (on rank 0
    of TP 2)."""
    spec = FAMILIES[family].spec
    artifact = staged(f"layout-{family}", checkpoint(f"layout-{family}", spec), 2,
                      "--dtype", "auto")  # fmt: skip
    states = vllm_states(family, 2)
    _assert_rank_files_equal(artifact, states)
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    part = next(p for p in sorted(copy.glob("model-rank-0-part-*.safetensors"))
                if name in _read([p]))  # fmt: skip
    tensors = _read([part])
    tensors[name] = mutate(tensors[name])
    save_file(tensors, str(part))
    with pytest.raises(AssertionError, match=rf"rank 0: 1 tensors differ, e.g. \['{name}'\]"):
        _assert_rank_files_equal(copy, states)


_USES_STATES = (
    test_rank_files_equal_vllms_own_per_rank_state_byte_for_byte,
    test_batched_oracle_equals_one_model_at_a_time,
    test_the_controls_deepseek_files_with_heads_experts_or_blocks_exchanged_differ,
)
