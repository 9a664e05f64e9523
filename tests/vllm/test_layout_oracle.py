"""The layout oracle: every rank file the stager writes holds exactly, byte for byte, the
state vLLM's own weight loaders give that rank from the original checkpoint (names, dtypes,
shapes and values; ``layout_oracle.py`` takes it before ``process_weights_after_loading``,
filtered as ``ShardedStateLoader`` filters it).

Mixtral (4 experts: vLLM's Mixtral takes more ranks than experts), Qwen2-MoE (with query/key/value
biases and a gated shared expert) and Qwen3-MoE (8 experts: both models refuse more ranks than
experts) bfloat16, 8 query heads on 2 KV heads (replicated
from TP 4), and gpt-oss (bf16 experts, 16 query heads on 8 KV heads), at TP 2; TP 4 and 8 in the
slow tier (a process per rank, each importing vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from modelstage.devtools.synthetic import SyntheticModel
from safetensors import safe_open
from vllm_oracle import vllm_rank_states

pytestmark = pytest.mark.vllm

MOE_FAMILIES = {
    "mixtral": SyntheticModel(
        architecture="MixtralForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=512, num_experts=4, dtype="bfloat16", num_shards=2, seed=4,
    ),
    "qwen2-moe": SyntheticModel(
        architecture="Qwen2MoeForCausalLM", hidden_size=128, intermediate_size=64, num_heads=8,
        num_kv_heads=2, vocab_size=512, num_experts=8, dtype="bfloat16", num_shards=2, seed=8,
    ),
    "qwen3-moe": SyntheticModel(
        architecture="Qwen3MoeForCausalLM", hidden_size=128, intermediate_size=64, num_heads=8,
        num_kv_heads=2, head_dim=32, vocab_size=512, num_experts=8, dtype="bfloat16",
        tie_word_embeddings=True, num_shards=2, seed=6,
    ),
}  # fmt: skip
"""Where each family's source names its experts and router, and vLLM's kept router name."""
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2"), "gate.weight"),
    "qwen2-moe": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "gate.weight"),
    "qwen3-moe": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "experts.gate.weight"),
}


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
    family: str, src: Path, rank: int, tp: int, want: dict[str, torch.Tensor]
) -> None:
    """The contract itself, read off the source: w13[e] = cat(gate_e, up_e) rows of the rank,
    w2[e] = the rank's columns of down_e, the router whole under vLLM's kept name."""
    source = _read(sorted(src.glob("*.safetensors")))
    block, (gate, up, down), router = EXPERT_NAMES[family]
    spec = MOE_FAMILIES[family]
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
    if family == "qwen2-moe":
        _check_shared_expert_from_source(source, spec, rank, tp, want)


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


def gpt_oss(tp: int) -> SyntheticModel:
    """gpt-oss with bfloat16 experts; 8 KV heads, since its model splits them and never copies;
    an expert intermediate size of 32 per rank (vLLM's CPU fused-MoE kernel refuses a rank's
    share that is not a multiple of 32)."""
    return SyntheticModel(
        architecture="GptOssForCausalLM", hidden_size=128, intermediate_size=32 * tp,
        num_heads=16, num_kv_heads=8, head_dim=16, vocab_size=512, num_experts=4,
        dtype="bfloat16", num_shards=2, seed=12,
    )  # fmt: skip


def _check_gpt_oss_from_source(
    src: Path, rank: int, tp: int, want: dict[str, torch.Tensor]
) -> None:
    """The contract itself, read off the source: per expert the rank's block of
    ``gate_up_proj``'s (interleaved) columns and of ``down_proj``'s rows, transposed;
    ``w13_bias`` cut alike; ``w2_bias`` whole on rank 0 and zero elsewhere; sinks by heads."""
    source = _read(sorted(src.glob("*.safetensors")))
    spec = gpt_oss(tp)
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


def _assert_rank_files_equal(artifact: Path, states: list[Path]) -> list[dict[str, torch.Tensor]]:
    wants = []
    for rank, state in enumerate(states):
        want = _read([state])
        got = _read(sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")))
        assert sorted(got) == sorted(want), f"rank {rank}: names differ"
        differ = [k for k in want if not _same_bytes(want[k], got[k])]
        assert not differ, f"rank {rank}: {len(differ)} tensors differ, e.g. {differ[:4]}"
        wants.append(want)
    return wants


@pytest.mark.parametrize(
    "tp",
    [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)],
    ids=lambda tp: f"tp{tp}",
)
def test_gpt_oss_rank_files_equal_vllms_own_per_rank_state_byte_for_byte(
    tp: int,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    tmp_path: Path,
) -> None:
    src = checkpoint(f"layout-gpt-oss-tp{tp}", gpt_oss(tp))
    artifact = staged(f"layout-gpt-oss-tp{tp}", src, tp, "--dtype", "auto")
    states = vllm_rank_states(src, tp, "bfloat16", tmp_path / "vllm")
    for rank, want in enumerate(_assert_rank_files_equal(artifact, states)):
        _check_gpt_oss_from_source(src, rank, tp, want)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize(
    "tp",
    [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)],
    ids=lambda tp: f"tp{tp}",
)
def test_moe_rank_files_equal_vllms_own_per_rank_state_byte_for_byte(
    family: str,
    tp: int,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    tmp_path: Path,
) -> None:
    src = checkpoint(f"layout-{family}", MOE_FAMILIES[family])
    artifact = staged(f"layout-{family}", src, tp, "--dtype", "auto")
    states = vllm_rank_states(src, tp, "bfloat16", tmp_path / "vllm")
    for rank, state in enumerate(states):
        want = _read([state])
        got = _read(sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")))
        assert sorted(got) == sorted(want), f"rank {rank}: names differ"
        differ = [k for k in want if not _same_bytes(want[k], got[k])]
        assert not differ, f"rank {rank}: {len(differ)} tensors differ, e.g. {differ[:4]}"
        _check_experts_from_source(family, src, rank, tp, want)
