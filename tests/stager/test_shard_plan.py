"""Property tests of the pure shard plan: the ranks' slices put back together are the source."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from modelstage.core.errors import CheckpointError, SpecError
from modelstage.core.layouts import layout_for
from modelstage.devtools.synthetic import SyntheticModel
from modelstage.stager.model_config import ModelConfig
from modelstage.stager.shard_plan import ShardPlan, SourceTensor, plan_shards

LAYOUT = layout_for("0.32")
REFUSE_MORE_RANKS_THAN_EXPERTS = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@st.composite
def models(draw: st.DrawFn) -> tuple[SyntheticModel, int]:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8, 16) if k % tp == 0 or tp % k == 0]))
    heads = kv * draw(st.integers(1, 4))
    heads = heads if heads % tp == 0 else heads * tp
    head_dim = draw(st.sampled_from([2, 4, 8]))
    arch = draw(
        st.sampled_from(
            [
                "LlamaForCausalLM",
                "Qwen2ForCausalLM",
                "Qwen3ForCausalLM",
                "MixtralForCausalLM",
                "Qwen2MoeForCausalLM",
                "Qwen3MoeForCausalLM",
            ]
        )
    )
    model = SyntheticModel(
        architecture=arch,
        hidden_size=heads * head_dim,
        intermediate_size=tp * draw(st.integers(1, 6)),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim if arch.startswith("Qwen3") else None,
        vocab_size=draw(st.integers(5, 300)),
        tie_word_embeddings=draw(st.booleans()),
        num_experts=draw(st.integers(tp if arch in REFUSE_MORE_RANKS_THAN_EXPERTS else 1, tp + 4)),
        experts_per_token=1,
    )
    return model, tp


def _execute(plan: ShardPlan, src: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """A naive in-memory executor of the plan (the streaming writer is tested end to end)."""
    out = {}
    for t in plan.targets:
        if t.constant is not None:
            out[t.name] = np.array(t.constant, dtype=np.float32)
            continue
        pieces = []
        for slot in t.slots:
            sel = slot.per_rank[rank]
            if slot.source is None:
                pieces.append(np.zeros((sel.num_rows, *t.shape[1:]), np.float32))
                continue
            piece = src[slot.source][sel.rows[0] : sel.rows[1]]
            if sel.cols is not None:
                piece = piece[:, sel.cols[0] : sel.cols[1]]
            pieces.append(piece)
        out[t.name] = np.concatenate(pieces).reshape(t.shape)  # stacked experts: row-major
    return out


def _by_rows(plan: ShardPlan, name: str, tensor: np.ndarray, rank: int) -> np.ndarray:
    """A rank's tensor as the concatenation of its slots along dim 0 (a stacked expert
    tensor [E, rows, ...] read row-major as [E * rows, ...])."""
    target = next(t for t in plan.targets if t.name == name)
    rows = sum(slot.per_rank[rank].num_rows for slot in target.slots)
    return tensor if tensor.shape[:1] == (rows,) else tensor.reshape(rows, *tensor.shape[2:])


@settings(max_examples=60, deadline=None)
@given(models())
def test_reassembling_every_rank_reproduces_every_source_tensor(
    case: tuple[SyntheticModel, int],
) -> None:
    model, tp = case
    rng = np.random.default_rng(0)
    shapes = dict(model.tensors())
    src = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    config = ModelConfig.from_dict(model.config())
    plan = plan_shards(config, {n: SourceTensor("F32", s) for n, s in shapes.items()}, tp, LAYOUT)
    ranks = [_execute(plan, src, r) for r in range(tp)]
    rebuilt = {n: np.full(s, np.nan, np.float32) for n, s in shapes.items()}
    for t in plan.targets:
        for r in range(tp):
            at = 0
            for slot in t.slots:
                sel = slot.per_rank[r]
                got = _by_rows(plan, t.name, ranks[r][t.name], r)[at : at + sel.num_rows]
                at += sel.num_rows
                if slot.source is None:
                    assert not got.any(), "padding rows must be zero"
                    continue
                dest = rebuilt[slot.source][sel.rows[0] : sel.rows[1]]
                if sel.cols is not None:
                    dest = dest[:, sel.cols[0] : sel.cols[1]]
                # a replicated block must be identical on every rank that holds it
                assert np.all(np.isnan(dest) | (dest == got))
                dest[...] = got
    ignored = set(plan.ignored_sources)
    for name, tensor in src.items():
        if name not in ignored:
            np.testing.assert_array_equal(rebuilt[name], tensor, err_msg=name)
    every_rank_same_shape = {t.name: t.shape for t in plan.targets}
    for r in range(tp):
        assert {n: a.shape for n, a in ranks[r].items()} == every_rank_same_shape


def test_tp_larger_than_kv_heads_replicates_each_kv_head_on_tp_over_kv_ranks() -> None:
    model = SyntheticModel(num_heads=8, num_kv_heads=2, hidden_size=64, num_layers=1)
    config = ModelConfig.from_dict(model.config())
    plan = plan_shards(config, {n: SourceTensor("F32", s) for n, s in model.tensors()}, 8, LAYOUT)
    qkv = next(t for t in plan.targets if t.name.endswith("qkv_proj.weight"))
    k_slot = qkv.slots[1]
    hd = 8
    assert [s.rows for s in k_slot.per_rank] == [(0, hd)] * 4 + [(hd, 2 * hd)] * 4
    assert qkv.shape == (3 * hd, 64)


def test_vocab_is_padded_to_64_and_split_in_equal_blocks() -> None:
    model = SyntheticModel(vocab_size=1000, num_layers=1)
    config = ModelConfig.from_dict(model.config())
    plan = plan_shards(config, {n: SourceTensor("F32", s) for n, s in model.tensors()}, 2, LAYOUT)
    embed = plan.targets[0]
    assert embed.name == "model.embed_tokens.weight" and embed.shape == (512, 256)
    data, zeros = embed.slots
    assert [s.rows for s in data.per_rank] == [(0, 512), (512, 1000)]
    assert [s.num_rows for s in zeros.per_rank] == [0, 24]


def test_tied_embeddings_are_written_once_as_lm_head() -> None:
    model = SyntheticModel(tie_word_embeddings=True, num_layers=1)
    config = ModelConfig.from_dict(model.config())
    plan = plan_shards(config, {n: SourceTensor("F32", s) for n, s in model.tensors()}, 2, LAYOUT)
    names = [t.name for t in plan.targets]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    head = next(t for t in plan.targets if t.name == "lm_head.weight")
    assert head.slots[0].source == "model.embed_tokens.weight"


def _mixtral_plan(tp: int) -> tuple[SyntheticModel, ShardPlan]:
    model = SyntheticModel(
        architecture="MixtralForCausalLM", hidden_size=16, intermediate_size=8, num_heads=2,
        num_kv_heads=2, num_layers=1, vocab_size=64, num_experts=3,
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    sources = {n: SourceTensor("BF16", s) for n, s in model.tensors()}
    return model, plan_shards(config, sources, tp, LAYOUT)


def test_mixtral_experts_stack_per_rank_gate_and_up_halves_expert_by_expert() -> None:
    _, plan = _mixtral_plan(2)
    targets = {t.name: t for t in plan.targets}
    moe = "model.layers.0.block_sparse_moe."
    w13 = targets[moe + "experts.routed_experts.w13_weight"]
    assert w13.shape == (3, 8, 16)  # [E, 2 * I / tp, H]
    assert [s.source for s in w13.slots] == [
        f"{moe}experts.{e}.{w}.weight" for e in range(3) for w in ("w1", "w3")
    ]
    assert all([sel.rows for sel in s.per_rank] == [(0, 4), (4, 8)] for s in w13.slots)
    w2 = targets[moe + "experts.routed_experts.w2_weight"]
    assert w2.shape == (3, 16, 4)  # [E, H, I / tp]
    assert [s.source for s in w2.slots] == [f"{moe}experts.{e}.w2.weight" for e in range(3)]
    assert all([sel.cols for sel in s.per_rank] == [(0, 4), (4, 8)] for s in w2.slots)
    router = targets[moe + "gate.weight"]
    assert router.shape == (3, 16)
    assert [sel.rows for sel in router.slots[0].per_rank] == [(0, 3), (0, 3)]


def test_a_config_claiming_more_experts_than_the_checkpoint_holds_is_refused_early() -> None:
    model = SyntheticModel(
        architecture="MixtralForCausalLM", hidden_size=16, intermediate_size=8, num_heads=2,
        num_kv_heads=2, num_layers=1, vocab_size=64, num_experts=2,
    )  # fmt: skip
    config = ModelConfig.from_dict({**model.config(), "num_local_experts": 1 << 24})
    sources = {n: SourceTensor("BF16", s) for n, s in model.tensors()}
    with pytest.raises(CheckpointError, match=r"needs \d+ per layer"):
        plan_shards(config, sources, 1, LAYOUT)


def test_tp_must_divide_the_expert_intermediate_size() -> None:
    config = ModelConfig.from_dict(
        {**_mixtral_plan(1)[0].config(), "moe_intermediate_size": 6, "num_attention_heads": 4}
    )
    with pytest.raises(SpecError, match="expert intermediate size 6"):
        config.check_tensor_parallel(4)


def test_qwen3_moe_keeps_the_router_under_vllms_alias_and_stacks_gate_up_per_expert() -> None:
    model = SyntheticModel(
        architecture="Qwen3MoeForCausalLM", hidden_size=16, intermediate_size=8, num_heads=2,
        num_kv_heads=2, head_dim=8, num_layers=1, vocab_size=64, num_experts=2,
        experts_per_token=1,
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    assert (config.num_experts, config.moe_intermediate_size) == (2, 8)
    sources = {n: SourceTensor("BF16", s) for n, s in model.tensors()}
    targets = {t.name: t for t in plan_shards(config, sources, 2, LAYOUT).targets}
    mlp = "model.layers.0.mlp."
    assert targets[mlp + "experts.gate.weight"].slots[0].source == mlp + "gate.weight"
    assert mlp + "gate.weight" not in targets
    w13 = targets[mlp + "experts.routed_experts.w13_weight"]
    assert w13.shape == (2, 8, 16)
    assert [s.source for s in w13.slots] == [
        f"{mlp}experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up")
    ]


def test_qwen3_moe_refuses_more_ranks_than_experts_as_vllm_does() -> None:
    model = SyntheticModel(
        architecture="Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=8, num_heads=8,
        num_kv_heads=8, num_layers=1, vocab_size=64, num_experts=4, experts_per_token=1,
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    sources = {n: SourceTensor("BF16", s) for n, s in model.tensors()}
    assert plan_shards(config, sources, 4, LAYOUT).tp == 4
    with pytest.raises(SpecError, match="tensor parallel size 8 is greater than the 4 experts"):
        plan_shards(config, sources, 8, LAYOUT)


def test_qwen2_moe_keeps_the_router_and_splits_the_shared_expert_as_a_dense_mlp() -> None:
    model = SyntheticModel(
        architecture="Qwen2MoeForCausalLM", hidden_size=16, intermediate_size=8, num_heads=4,
        num_kv_heads=4, num_layers=1, vocab_size=64, num_experts=2, experts_per_token=1,
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    assert config.shared_expert_intermediate_size == 16
    sources = {n: SourceTensor("BF16", s) for n, s in model.tensors()}
    targets = {t.name: t for t in plan_shards(config, sources, 2, LAYOUT).targets}
    mlp, kept = "model.layers.0.mlp.", "model.layers.0.mlp.experts._shared_experts._layer."
    assert targets[mlp + "gate.weight"].slots[0].source == mlp + "gate.weight"
    assert targets[mlp + "experts.routed_experts.w13_weight"].shape == (2, 8, 16)
    gate_up = targets[kept + "gate_up_proj.weight"]
    assert gate_up.shape == (16, 16)
    assert [s.source for s in gate_up.slots] == [
        f"{mlp}shared_expert.{p}_proj.weight" for p in ("gate", "up")
    ]
    assert targets[kept + "down_proj.weight"].shape == (16, 8)
    expert_gate = targets[kept + "expert_gate.weight"]
    assert expert_gate.shape == (1, 16)
    assert expert_gate.slots[0].source == mlp + "shared_expert_gate.weight"
    assert "model.layers.0.self_attn.qkv_proj.bias" in targets
    with pytest.raises(SpecError, match="greater than the 2 experts"):
        plan_shards(config, sources, 4, LAYOUT)


def test_tp_must_divide_the_shared_expert_intermediate_size() -> None:
    config = ModelConfig.from_dict(
        {
            **SyntheticModel(architecture="Qwen2MoeForCausalLM", num_layers=1).config(),
            "shared_expert_intermediate_size": 6,
        }
    )
    assert config.shared_expert_intermediate_size == 6
    with pytest.raises(SpecError, match="shared expert intermediate size 6"):
        config.check_tensor_parallel(4)


def test_expert_counts_are_read_from_either_key_and_zero_or_null_means_dense() -> None:
    dense = SyntheticModel(num_layers=1).config()
    for extra in ({}, {"num_experts": 0}, {"num_local_experts": None}):
        assert ModelConfig.from_dict({**dense, **extra}).num_experts == 0
    assert ModelConfig.from_dict({**dense, "num_local_experts": 8}).num_experts == 8
    with pytest.raises(CheckpointError, match="'num_experts' must be a positive integer"):
        ModelConfig.from_dict({**dense, "num_experts": -1})


def test_an_architecture_not_proven_for_the_layouts_vllm_is_refused_with_the_way_out() -> None:
    """A release's layout names the architectures proven on it; any other is refused, pointing
    to the Hugging Face layout (which that vLLM splits itself)."""
    import dataclasses

    model = SyntheticModel(architecture="MixtralForCausalLM", hidden_size=64, num_layers=1)
    config = ModelConfig.from_dict(model.config())
    sources = {n: SourceTensor("F32", s) for n, s in model.tensors()}
    assert plan_shards(config, sources, 2, layout_for("0.28")).targets
    older = dataclasses.replace(layout_for("0.28"), architectures=frozenset({"LlamaForCausalLM"}))
    with pytest.raises(SpecError) as refused:
        plan_shards(config, sources, 2, older)
    assert str(refused.value) == (
        "architecture 'MixtralForCausalLM' is split per rank for vLLM 0.32 but not proven for "
        "vLLM 0.28 (proven: LlamaForCausalLM); stage it in the Hugging Face layout with "
        "--format safetensors (a directory) or runai_streamer (S3), which vLLM splits itself "
        "at load"
    )
