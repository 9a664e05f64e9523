"""The layout oracle: every rank file the stager writes holds exactly, byte for byte, the
state vLLM's own weight loaders give that rank from the original checkpoint (names, dtypes,
shapes and values; ``layout_oracle.py`` takes it before ``process_weights_after_loading``,
filtered as ``ShardedStateLoader`` filters it).

Mixtral (4 experts: vLLM's Mixtral takes more ranks than experts), Qwen2-MoE (with query/key/value
biases and a gated shared expert) and Qwen3-MoE (8 experts: both models refuse more ranks than
experts) bfloat16, 8 query heads on 2 KV heads (replicated
from TP 4), at TP 2; TP 4 and 8 in the slow tier (a process per rank, each importing vLLM).

The dense families alike, bfloat16, 8 query heads on 2 KV heads: Llama (untied), Gemma 2
(feed-forward norms, tied embeddings kept as ``model.embed_tokens``: its model has no head)
and Gemma 3 (feed-forward and q/k norms, tied embeddings kept as ``lm_head``) at TP 2; Mistral
(tied), Qwen2 (query/key/value biases) and Qwen3 (q/k norms, head_dim 32 != hidden/heads,
tied) at TP 2 in the slow tier, and every dense family at TP 4 and 8 in the slow tier. Each
comparison has a control: the same rank files with two norms of one shape exchanged differ
from vLLM's state.
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
DENSE_FAMILIES = {
    name: SyntheticModel(
        architecture=arch, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2,
        vocab_size=512, dtype="bfloat16", num_shards=2, seed=seed, **extra,  # type: ignore[arg-type]
    )
    for name, arch, seed, extra in (
        ("llama", "LlamaForCausalLM", 20, {}),
        ("mistral", "MistralForCausalLM", 21, {"tie_word_embeddings": True}),
        ("qwen2", "Qwen2ForCausalLM", 22, {}),
        ("qwen3", "Qwen3ForCausalLM", 23, {"head_dim": 32, "tie_word_embeddings": True}),
        ("gemma2", "Gemma2ForCausalLM", 24, {"head_dim": 32, "tie_word_embeddings": True}),
        ("gemma3", "Gemma3ForCausalLM", 25, {"head_dim": 32, "tie_word_embeddings": True}),
    )
}  # fmt: skip
DENSE_DEFAULT_TIER = {"llama", "gemma2", "gemma3"}
"""At TP 2 in the default tier; the other dense families' TP 2 is slow."""
TIED_KEPT_AS = {"gemma2": "model.embed_tokens.weight"}
"""The name vLLM keeps for tied embeddings where it is not ``lm_head.weight``."""
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


def _differing(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """What keeps ``got`` from being vLLM's state ``want`` byte for byte: names, or tensors."""
    if sorted(got) != sorted(want):
        return [f"names differ: {sorted(set(got) ^ set(want))[:6]}"]
    return [k for k in want if not _same_bytes(want[k], got[k])]


def _check_dense_from_source(
    family: str, src: Path, rank: int, tp: int, want: dict[str, torch.Tensor]
) -> None:
    """The contract read off the source, for layer 1: qkv = cat(q, k, v) head rows of the
    rank (KV heads replicated when TP exceeds them), gate_up = cat(gate, up) rows, o and down
    the rank's columns, every norm whole and raw, the embeddings under vLLM's kept name."""
    source = _read(sorted(src.glob("*.safetensors")))
    spec = DENSE_FAMILIES[family]
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
    embeddings = TIED_KEPT_AS.get(family, "lm_head.weight") if spec.tie_word_embeddings else (
        "model.embed_tokens.weight")  # fmt: skip
    per = spec.vocab_size // tp
    assert want[embeddings].equal(
        source["model.embed_tokens.weight"][rank * per : (rank + 1) * per]
    )


def _exchanged(got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The control: layer 1's input and post-attention norms exchanged (same shape, other
    values), as a rule that confused two norms would write them."""
    a, b = (f"model.layers.1.{n}_layernorm.weight" for n in ("input", "post_attention"))
    return {**got, a: got[b], b: got[a]}


DENSE_MATRIX = [
    pytest.param(
        family, tp, id=f"{family}-tp{tp}",
        marks=() if tp == 2 and family in DENSE_DEFAULT_TIER else pytest.mark.slow,
    )
    for family in sorted(DENSE_FAMILIES)
    for tp in (2, 4, 8)
]  # fmt: skip


@pytest.mark.parametrize(("family", "tp"), DENSE_MATRIX)
def test_dense_rank_files_equal_vllms_own_per_rank_state_byte_for_byte(
    family: str,
    tp: int,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    tmp_path: Path,
) -> None:
    src = checkpoint(f"layout-{family}", DENSE_FAMILIES[family])
    artifact = staged(f"layout-{family}", src, tp, "--dtype", "auto")
    states = vllm_rank_states(src, tp, "bfloat16", tmp_path / "vllm")
    for rank, state in enumerate(states):
        want = _read([state])
        got = _read(sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")))
        differ = _differing(want, got)
        assert not differ, f"rank {rank}: {len(differ)} tensors differ, e.g. {differ[:4]}"
        assert _differing(want, _exchanged(got)), "the control: exchanged norms must differ"
        _check_dense_from_source(family, src, rank, tp, want)


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
