"""Property tests of the pure shard plan: the ranks' slices put back together are the source."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from modelstage.core.errors import CheckpointError, SpecError
from modelstage.core.layouts import layout_for
from modelstage.core.model_config import ModelConfig
from modelstage.devtools.synthetic import SyntheticModel
from modelstage.stager.shard_plan import ShardPlan, Slice, Slot, SourceTensor, plan_shards

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
                "GptOssForCausalLM",
                "Phi3ForCausalLM",
                "Gemma2ForCausalLM",
                "Gemma3ForCausalLM",
                "DeepseekV3ForCausalLM",
            ]
        )
    )
    if arch == "GptOssForCausalLM" and kv < tp:  # its model splits the KV heads, never copies
        heads, kv = heads * tp // kv, tp
    fp8 = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and draw(st.booleans())
    model = SyntheticModel(
        architecture=arch,
        fp8=fp8,
        hidden_size=heads * head_dim,
        intermediate_size=tp * draw(st.integers(1, 6)),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim if arch.startswith(("Qwen3", "Gemma")) else None,
        vocab_size=draw(st.integers(5, 300)),
        tie_word_embeddings=arch == "Gemma2ForCausalLM" or draw(st.booleans()),
        num_experts=draw(st.integers(tp if arch in REFUSE_MORE_RANKS_THAN_EXPERTS else 1, tp + 4)),
        experts_per_token=1,
    )
    return model, tp


def _execute(plan: ShardPlan, src: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """A naive in-memory executor of the plan (the streaming writer is tested end to end)."""
    out = {}
    for t in plan.targets:
        if t.constant is not None:
            out[t.name] = np.full(t.shape, t.constant, dtype=np.float32)
            continue
        pieces = []
        for slot in t.slots:
            sel = slot.per_rank[rank]
            if slot.source is None:
                pieces.append(np.zeros((sel.num_rows, *t.shape[1:]), np.float32))
                continue
            piece = _matrix(src[slot.source])[sel.rows[0] : sel.rows[1]]
            if sel.cols is not None:
                piece = piece[:, sel.cols[0] : sel.cols[1]]
            pieces.append(piece.T if slot.transposed else piece)
        out[t.name] = np.concatenate(pieces).reshape(t.shape)  # stacked experts: row-major
    return out


def _matrix(tensor: np.ndarray) -> np.ndarray:
    """A source as slices address it: every dim but the last is rows."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.ndim > 2 else tensor


def _out_rows(slot: Slot, sel: Slice, source_shape: tuple[int, ...]) -> int:
    """The rows a slot adds to a rank's tensor: a transposed cut adds its columns."""
    if not slot.transposed:
        return sel.num_rows
    return sel.cols[1] - sel.cols[0] if sel.cols else source_shape[-1]


def _by_rows(plan: ShardPlan, name: str, tensor: np.ndarray, rank: int) -> np.ndarray:
    """A rank's tensor as the concatenation of its slots along dim 0 (a stacked expert
    tensor [E, rows, ...] read row-major as [E * rows, ...])."""
    target = next(t for t in plan.targets if t.name == name)
    if target.slots[0].transposed:
        return tensor.reshape(-1, tensor.shape[-1])
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
    sources = {n: SourceTensor(model.dtype_code(n), s) for n, s in shapes.items()}
    plan = plan_shards(config, sources, tp, LAYOUT)
    ranks = [_execute(plan, src, r) for r in range(tp)]
    rebuilt = {n: np.full(s, np.nan, np.float32) for n, s in shapes.items()}
    for t in plan.targets:
        for r in range(tp):
            at = 0
            for slot in t.slots:
                sel = slot.per_rank[r]
                n = _out_rows(slot, sel, shapes[slot.source or ""] if slot.source else ())
                got = _by_rows(plan, t.name, ranks[r][t.name], r)[at : at + n]
                at += n
                if slot.source is None:
                    assert not got.any(), "padding rows must be zero"
                    continue
                dest = _matrix(rebuilt[slot.source])[sel.rows[0] : sel.rows[1]]
                if sel.cols is not None:
                    dest = dest[:, sel.cols[0] : sel.cols[1]]
                if slot.transposed:
                    dest = dest.T
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


def _gemma_plan(architecture: str, tied: bool = True) -> ShardPlan:
    model = SyntheticModel(
        architecture=architecture, hidden_size=32, intermediate_size=64, num_heads=4,
        num_kv_heads=2, head_dim=16, num_layers=1, vocab_size=100, tie_word_embeddings=tied,
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    return plan_shards(config, {n: SourceTensor("BF16", s) for n, s in model.tensors()}, 2, LAYOUT)


def test_gemma2_keeps_tied_embeddings_under_their_own_name_its_model_has_no_head() -> None:
    plan = _gemma_plan("Gemma2ForCausalLM")
    embed = next(
        t for t in plan.targets if t.slots and t.slots[0].source == "model.embed_tokens.weight"
    )
    assert embed.name == "model.embed_tokens.weight" and embed.shape == (64, 32)  # 100 -> 128 / 2
    assert "lm_head.weight" not in {t.name for t in plan.targets}


def test_gemma3_keeps_tied_embeddings_as_lm_head_and_every_norm_whole() -> None:
    plan = _gemma_plan("Gemma3ForCausalLM")
    names = {t.name: t for t in plan.targets}
    assert names["lm_head.weight"].slots[0].source == "model.embed_tokens.weight"
    assert "model.embed_tokens.weight" not in names
    norms = [t for n, t in names.items() if n.endswith("norm.weight")]
    assert {t.name.split(".")[-2] for t in norms} == {
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm", "q_norm", "k_norm", "norm"}  # fmt: skip
    for t in norms:  # raw and whole: one slot, every row of the source on every rank
        (slot,) = t.slots
        assert slot.source == t.name and all(s.rows == (0, t.shape[0]) and s.cols is None
                                             for s in slot.per_rank)  # fmt: skip


def test_an_untied_gemma3_has_its_own_head_and_a_gemma2_head_is_refused_as_vllm_does() -> None:
    names = {t.name for t in _gemma_plan("Gemma3ForCausalLM", tied=False).targets}
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= names
    model = SyntheticModel(architecture="Gemma2ForCausalLM", num_layers=1, head_dim=32,
                           tie_word_embeddings=True)  # fmt: skip
    config = ModelConfig.from_dict({**model.config(), "tie_word_embeddings": False})
    sources = {n: SourceTensor("F32", s) for n, s in model.tensors()}
    sources["lm_head.weight"] = SourceTensor("F32", (model.vocab_size, model.hidden_size))
    with pytest.raises(CheckpointError, match=r"does not use.*lm_head\.weight"):
        plan_shards(config, sources, 2, LAYOUT)


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


def _gpt_oss_plan(tp: int) -> ShardPlan:
    model = SyntheticModel(
        architecture="GptOssForCausalLM", hidden_size=16, intermediate_size=8, num_heads=4,
        num_kv_heads=4, num_layers=1, vocab_size=64, num_experts=3,
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    return plan_shards(config, {n: SourceTensor("BF16", s) for n, s in model.tensors()}, tp, LAYOUT)


def test_gpt_oss_experts_are_cut_per_expert_and_transposed() -> None:
    targets = {t.name: t for t in _gpt_oss_plan(2).targets}
    routed, src = "model.layers.0.mlp.experts.routed_experts.", "model.layers.0.mlp.experts."
    w13 = targets[routed + "w13_weight"]
    assert w13.shape == (3, 8, 16)  # [E, 2I/tp, H] from gate_up_proj [E, H, 2I]
    assert all(s.source == src + "gate_up_proj" and s.transposed for s in w13.slots)
    assert [[(sel.rows, sel.cols) for sel in s.per_rank] for s in w13.slots] == [
        [((16 * e, 16 * e + 16), (0, 8)), ((16 * e, 16 * e + 16), (8, 16))] for e in range(3)
    ]  # expert e's H rows; a block of the interleaved gate/up columns per rank
    w2 = targets[routed + "w2_weight"]
    assert w2.shape == (3, 16, 4)  # [E, H, I/tp] from down_proj [E, I, H]
    assert [[(sel.rows, sel.cols) for sel in s.per_rank] for s in w2.slots] == [
        [((8 * e, 8 * e + 4), None), ((8 * e + 4, 8 * e + 8), None)] for e in range(3)
    ]
    w13_bias = targets[routed + "w13_bias"]
    assert w13_bias.shape == (3, 8)
    assert [sel.cols for sel in w13_bias.slots[0].per_rank] == [(0, 8), (8, 16)]


def test_gpt_oss_down_bias_is_whole_on_rank_0_and_zeros_elsewhere() -> None:
    w2_bias = next(
        t for t in _gpt_oss_plan(4).targets if t.name.endswith("routed_experts.w2_bias")
    )
    assert w2_bias.shape == (3, 16)
    data, zeros = w2_bias.slots
    assert data.source == "model.layers.0.mlp.experts.down_proj_bias" and zeros.source is None
    assert [s.rows for s in data.per_rank] == [(0, 3), (0, 0), (0, 0), (0, 0)]
    assert [s.num_rows for s in zeros.per_rank] == [0, 3, 3, 3]
    assert [len(t.slots) for t in _gpt_oss_plan(1).targets if t.name == w2_bias.name] == [1]


def test_gpt_oss_names_attention_and_embedding_as_vllm_does_and_splits_sinks_by_heads() -> None:
    targets = {t.name: t for t in _gpt_oss_plan(2).targets}
    attn = "model.layers.0.attn."
    assert {"model.embedding.weight", attn + "qkv_proj.bias", attn + "attn._k_scale"} <= set(
        targets
    )
    assert not any("self_attn" in n or "embed_tokens" in n for n in targets)
    assert [sel.rows for sel in targets[attn + "sinks"].slots[0].per_rank] == [(0, 2), (2, 4)]
    assert [sel.rows for sel in targets[attn + "o_proj.bias"].slots[0].per_rank] == [(0, 16)] * 2


def test_gpt_oss_refuses_more_ranks_than_kv_heads_as_vllm_does() -> None:
    model = SyntheticModel(
        architecture="GptOssForCausalLM", hidden_size=16, intermediate_size=8, num_heads=4,
        num_kv_heads=2, num_layers=1, vocab_size=64, num_experts=3,
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    sources = {n: SourceTensor("BF16", s) for n, s in model.tensors()}
    with pytest.raises(SpecError, match="does not divide the 2 KV heads"):
        plan_shards(config, sources, 4, LAYOUT)


FP8 = SyntheticModel(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2,
                     num_layers=1, vocab_size=100, dtype="bfloat16", fp8=True)  # fmt: skip


def _fp8_plan(tp: int, model: SyntheticModel = FP8, dtype: str = "auto") -> ShardPlan:
    config = ModelConfig.from_dict(model.config())
    sources = {n: SourceTensor(model.dtype_code(n), s) for n, s in model.tensors()}
    return plan_shards(config, sources, tp, LAYOUT, dtype)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fp8_weight_scales_take_their_weights_rows_and_row_parallel_ones_stay_whole(
    tp: int,
) -> None:
    plan = _fp8_plan(tp)
    targets = {t.name: t for t in plan.targets}
    scales = [n for n in targets if n.endswith(".weight_scale")]
    assert sorted(n.rsplit(".", 2)[1] for n in scales) == [
        "down_proj", "gate_up_proj", "o_proj", "qkv_proj"]  # fmt: skip
    for name in scales:
        scale, weight = targets[name], targets[name.removesuffix("_scale")]
        assert (scale.dtype, weight.dtype) == ("F32", "F8_E4M3")
        assert [s.source for s in scale.slots] == [f"{s.source}_scale" for s in weight.slots]
        if name.endswith(("o_proj.weight_scale", "down_proj.weight_scale")):
            assert scale.shape == (FP8.hidden_size, 1)
            assert all(sel.rows == (0, FP8.hidden_size) for sel in scale.slots[0].per_rank)
            continue
        assert scale.shape == (weight.shape[0], 1)
        for s_slot, w_slot in zip(scale.slots, weight.slots, strict=True):
            assert [sel.rows for sel in s_slot.per_rank] == [sel.rows for sel in w_slot.per_rank]


def test_fp8_attention_gets_vllms_unit_scales_and_zero_points_in_the_models_dtype() -> None:
    plan = _fp8_plan(2)
    attn = "model.layers.0.self_attn.attn."
    params = {t.name: (t.dtype, t.shape, t.constant) for t in plan.targets if "attn.attn." in t.name}
    assert params == {
        **{f"{attn}_{x}_scale": ("F32", (), 1.0) for x in ("k", "v", "q", "prob")},
        **{f"{attn}{x}_scale": ("F32", (1,), 1.0) for x in "kvq"},
        **{f"{attn}{x}_zero_point": ("BF16", (1,), 0.0) for x in "kvq"},
    }


def test_fp8_is_staged_in_its_own_dtypes_and_refuses_a_cast_or_an_unquantized_weight() -> None:
    with pytest.raises(SpecError, match=r"a quantized checkpoint .* use --dtype auto"):
        _fp8_plan(2, dtype="float32")
    config = ModelConfig.from_dict(FP8.config())
    sources = {n: SourceTensor(FP8.dtype_code(n), s) for n, s in FP8.tensors()}
    sources["model.layers.0.mlp.up_proj.weight"] = SourceTensor("BF16", (128, 64))
    with pytest.raises(CheckpointError, match=r"up_proj.weight' has dtype BF16, but .* F8_E4M3"):
        plan_shards(config, sources, 2, LAYOUT)
    no_dtype = {**FP8.config(), "torch_dtype": None}
    with pytest.raises(CheckpointError, match="torch_dtype None is not one of"):
        plan_shards(ModelConfig.from_dict(no_dtype), dict(sources, **{
            "model.layers.0.mlp.up_proj.weight": SourceTensor("F8_E4M3", (128, 64))}), 2, LAYOUT)  # fmt: skip
def _phi3_and_llama(tp: int) -> tuple[ShardPlan, ShardPlan, dict[str, np.ndarray]]:
    """One Phi-3's plan and the plan of the same weights unfused into a Llama's q/k/v and
    gate/up (its fused rows: q, k, v; gate, up), with the Llama's source tensors."""
    shape = {"hidden_size": 32, "intermediate_size": 8, "num_heads": 4, "num_kv_heads": 2,
             "num_layers": 1, "vocab_size": 64}  # fmt: skip
    phi3 = SyntheticModel(architecture="Phi3ForCausalLM", **shape)  # type: ignore[arg-type]
    llama = SyntheticModel(architecture="LlamaForCausalLM", **shape)  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    src = {n: rng.standard_normal(s).astype(np.float32) for n, s in phi3.tensors()}
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    q, kv = 4 * 8, 2 * 8
    qkv, gate_up = src[attn + "qkv_proj.weight"], src[mlp + "gate_up_proj.weight"]
    unfused = {n: a for n, a in src.items() if n not in (attn + "qkv_proj.weight",
                                                         mlp + "gate_up_proj.weight")}  # fmt: skip
    unfused.update({attn + "q_proj.weight": qkv[:q], attn + "k_proj.weight": qkv[q : q + kv],
                    attn + "v_proj.weight": qkv[q + kv :], mlp + "gate_proj.weight": gate_up[:8],
                    mlp + "up_proj.weight": gate_up[8:]})  # fmt: skip
    assert set(unfused) == {n for n, _ in llama.tensors()}
    plans = [
        plan_shards(
            ModelConfig.from_dict(m.config()),
            {n: SourceTensor("F32", s) for n, s in m.tensors()},
            tp,
            LAYOUT,
        )
        for m in (phi3, llama)
    ]
    return plans[0], plans[1], {**src, **unfused}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_phi3_fused_sources_give_each_rank_what_the_unfused_llama_sources_give(tp: int) -> None:
    """Phi-3's ``qkv_proj`` and ``gate_up_proj`` are cut into their parts before the rank
    split: every rank's tensors equal those of a Llama holding the same weights unfused
    (TP 4: each of the 2 KV heads on two ranks)."""
    phi3, llama, src = _phi3_and_llama(tp)
    assert [(t.name, t.shape) for t in phi3.targets] == [(t.name, t.shape) for t in llama.targets]
    for rank in range(tp):
        want, got = _execute(llama, src, rank), _execute(phi3, src, rank)
        for name, tensor in want.items():
            np.testing.assert_array_equal(got[name], tensor, err_msg=f"rank {rank}: {name}")


def test_phi3_reads_each_part_of_a_fused_source_at_its_own_rows() -> None:
    phi3, _, _ = _phi3_and_llama(2)
    targets = {t.name: t for t in phi3.targets}
    qkv = targets["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (16 + 8 + 8, 32)
    assert {s.source for s in qkv.slots} == {"model.layers.0.self_attn.qkv_proj.weight"}
    # source rows: q 0-31, k 32-47, v 48-63; rank r takes half of each
    assert [[sel.rows for sel in s.per_rank] for s in qkv.slots] == [
        [(0, 16), (16, 32)], [(32, 40), (40, 48)], [(48, 56), (56, 64)]
    ]  # fmt: skip
    gate_up = targets["model.layers.0.mlp.gate_up_proj.weight"]
    assert [[sel.rows for sel in s.per_rank] for s in gate_up.slots] == [
        [(0, 4), (4, 8)], [(8, 12), (12, 16)]
    ]  # fmt: skip


def test_a_fused_source_of_the_wrong_size_is_refused_naming_its_parts() -> None:
    model = SyntheticModel(architecture="Phi3ForCausalLM", num_layers=1)
    sources = {n: SourceTensor("F32", s) for n, s in model.tensors()}
    name = "model.layers.0.self_attn.qkv_proj.weight"
    sources[name] = SourceTensor("F32", (256 + 32, 256))  # q and k only
    with pytest.raises(CheckpointError, match=r"\[384, 256\] \(q\+kv\+kv x hidden\)"):
        plan_shards(ModelConfig.from_dict(model.config()), sources, 2, LAYOUT)


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


def _deepseek(**extra: object) -> tuple[SyntheticModel, ModelConfig, dict[str, SourceTensor]]:
    """A DeepSeek-V3-shaped checkpoint: layer 0 dense, layer 1 MoE, a prediction layer 2."""
    model = SyntheticModel(
        architecture="DeepseekV3ForCausalLM", hidden_size=32, intermediate_size=8, num_heads=4,
        num_kv_heads=4, num_layers=2, vocab_size=64, num_experts=4, experts_per_token=1,
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    return model, config, {n: SourceTensor(model.dtype_code(n), s) for n, s in model.tensors()}


def test_deepseek_mla_fuses_the_down_projections_whole_and_splits_the_up_projections_by_heads() -> (
    None
):
    _, config, sources = _deepseek()
    targets = {t.name: t for t in plan_shards(config, sources, 2, LAYOUT).targets}
    attn = "model.layers.1.self_attn."
    fused = targets[attn + "fused_qkv_a_proj.weight"]
    assert [s.source for s in fused.slots] == [attn + "q_a_proj.weight",
                                               attn + "kv_a_proj_with_mqa.weight"]  # fmt: skip
    assert fused.shape == (24 + 512 + 64, 32)  # q_lora 24, kv_lora 512 + rope 64: whole
    # 4 heads of nope 8 + rope 64 (q_b) and nope 8 + v 4 (kv_b): 2 heads per rank
    assert [s.rows for s in targets[attn + "mla_attn.q_b_proj.weight"].slots[0].per_rank] == [
        (0, 144), (144, 288)]  # fmt: skip
    assert [s.rows for s in targets[attn + "kv_b_proj.weight"].slots[0].per_rank] == [
        (0, 24), (24, 48)]  # fmt: skip
    assert [s.cols for s in targets[attn + "mla_attn.o_proj.weight"].slots[0].per_rank] == [
        (0, 8), (8, 16)]  # fmt: skip
    scales = [n for n in targets if n.startswith(attn + "mla_attn.mla_attn._")]
    assert sorted(scales) == [attn + f"mla_attn.mla_attn._{x}_scale" for x in ("k", "prob", "q", "v")]


def test_deepseek_first_layer_is_dense_the_others_moe_with_a_float32_router_bias() -> None:
    _, config, sources = _deepseek()
    targets = {t.name: t for t in plan_shards(config, sources, 2, LAYOUT).targets}
    assert "model.layers.0.mlp.gate_up_proj.weight" in targets
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in targets)
    moe = "model.layers.1.mlp."
    assert moe + "gate_up_proj.weight" not in targets
    bias = targets[moe + "experts.gate.e_score_correction_bias"]
    assert (bias.dtype, bias.shape) == ("F32", (4,))
    shared = targets[moe + "experts._shared_experts._layer.gate_up_proj.weight"]
    assert shared.shape == (16, 32)  # two shared experts of 8 fused: 16 gate + 16 up rows / 2
    assert targets[moe + "experts.routed_experts.w13_weight"].shape == (4, 8, 32)


def test_deepseek_skips_its_prediction_layer_as_vllm_does_and_refuses_any_layer_beyond() -> None:
    _, config, sources = _deepseek()
    assert config.next_layers == 1
    plan = plan_shards(config, sources, 2, LAYOUT)
    assert "model.layers.2.eh_proj.weight" in plan.ignored_sources
    assert not any(t.name.startswith("model.layers.2.") for t in plan.targets)
    stray = {**sources, "model.layers.3.enorm.weight": SourceTensor("F32", (32,))}
    with pytest.raises(CheckpointError, match=r"does not use .*model\.layers\.3\.enorm"):
        plan_shards(config, stray, 2, LAYOUT)


def test_deepseek_without_a_query_low_rank_is_refused_per_rank_with_the_way_out() -> None:
    _, config, sources = _deepseek(config_extra=(("q_lora_rank", None),))
    assert config.mla is not None and config.mla.q_lora_rank == 0
    with pytest.raises(SpecError, match=r"q_lora_rank set.*--format safetensors"):
        plan_shards(config, sources, 2, LAYOUT)


def _block_fp8(tp: int, **extra: object) -> ShardPlan:
    """DeepSeek-V3 in block FP8: hidden 256, 4 heads of nope 64 + rope 64 (q_b: 128 rows a
    head) and nope 64 + v 64 (kv_b: 128 rows a head; o_proj: 64 columns a head), q_lora 128,
    experts of 256 rows; layer 1 MoE."""
    shape: dict[str, object] = {"q_lora_rank": 128, "v_head_dim": 64, **extra}
    model = SyntheticModel(
        architecture="DeepseekV3ForCausalLM", hidden_size=256, intermediate_size=256,
        num_heads=4, num_kv_heads=4, num_layers=2, vocab_size=64, num_experts=2,
        experts_per_token=1, fp8_block=True, **shape,  # type: ignore[arg-type]
    )  # fmt: skip
    config = ModelConfig.from_dict(model.config())
    assert config.quantization == "fp8/block-128x128"
    sources = {n: SourceTensor(model.dtype_code(n), s) for n, s in model.tensors()}
    return plan_shards(config, sources, tp, LAYOUT)


def test_block_fp8_scales_take_the_tiles_of_their_weights_cut_per_rank() -> None:
    targets = {t.name: t for t in _block_fp8(2).targets}
    attn, mla = "model.layers.1.self_attn.", "model.layers.1.self_attn.mla_attn."
    cuts = {  # rank 0, rank 1: 2 heads of 128 rows each = 2 tiles; o_proj 2 x 64 columns = 1
        mla + "q_b_proj": [((0, 2), None), ((2, 4), None)],
        attn + "kv_b_proj": [((0, 2), None), ((2, 4), None)],
        mla + "o_proj": [((0, 2), (0, 1)), ((0, 2), (1, 2))],  # 256 rows whole: 2 tiles
    }
    for name, want in cuts.items():
        scale = targets[name + ".weight_scale_inv"]
        assert scale.dtype == "F32"
        assert [(s.rows, s.cols) for s in scale.slots[0].per_rank] == want, name
    fused = targets[attn + "fused_qkv_a_proj.weight_scale_inv"]
    assert [s.per_rank[0].rows for s in fused.slots] == [(0, 1), (0, 5)]  # 128; 512 + 64 rows
    assert fused.shape == (6, 2)
    w13 = targets["model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv"]
    assert w13.shape == (2, 2, 2)  # per expert: gate's 128 rows of the rank, up's: 1 tile each
    assert [s.per_rank[1].rows for s in w13.slots] == [(1, 2)] * 4
    w2 = targets["model.layers.1.mlp.experts.routed_experts.w2_weight_scale_inv"]
    assert (w2.shape, w2.slots[0].per_rank[1].cols) == ((2, 2, 1), (1, 2))
    assert targets["model.layers.1.mlp.experts.gate.weight"].dtype != "F8_E4M3"
    assert targets[mla + "q_b_proj.weight"].dtype == "F8_E4M3"


def test_block_fp8_refuses_a_tp_that_cuts_a_block_and_a_fused_part_of_part_blocks() -> None:
    with pytest.raises(SpecError, match=r"size 4 cuts the 128 x 128 scale blocks of "
                       r"'model.layers.0.self_attn.o_proj.weight' \(columns 0..64 of 256"):  # fmt: skip
        _block_fp8(4)
    with pytest.raises(CheckpointError, match=r"q_a_proj.weight_scale_inv': 96 rows are not whole"):
        _block_fp8(2, q_lora_rank=96)


def test_block_fp8_is_recognized_only_as_deepseek_v3_writes_it() -> None:
    base = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]}  # fmt: skip
    config = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 8,
              "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
              "vocab_size": 8}  # fmt: skip
    assert ModelConfig.from_dict({**config, "quantization_config": base}).quantization == (
        "fp8/block-128x128")  # fmt: skip
    for change, why in (({"weight_block_size": [64, 64]}, "weight_block_size is [64, 64]"),
                        ({"activation_scheme": "static"}, "activation_scheme is 'static'"),
                        ({"ignored_layers": ["lm_head"]}, "ignored_layers is set"),
                        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert is not"),
                        ({"weight_block_size": None}, "weight_block_size is None")):  # fmt: skip
        parsed = ModelConfig.from_dict({**config, "quantization_config": {**base, **change}})
        assert parsed.quantization == "fp8" and parsed.quantization_mismatch.startswith(why)


def _qwen3_moe_block_fp8(**quant: object) -> tuple[ModelConfig, dict[str, SourceTensor]]:
    model = SyntheticModel(
        architecture="Qwen3MoeForCausalLM", hidden_size=256, intermediate_size=512, num_heads=4,
        num_kv_heads=2, head_dim=128, num_layers=2, vocab_size=64, num_experts=4,
        experts_per_token=1, fp8_block=True,
    )  # fmt: skip
    config = model.config()
    config["quantization_config"] = {**config["quantization_config"], **quant}  # type: ignore[dict-item]
    sources = {n: SourceTensor(model.dtype_code(n), s) for n, s in model.tensors()}
    return ModelConfig.from_dict(config), sources


def test_qwen3_moe_block_fp8_cuts_qkv_tiles_per_slot_and_keeps_its_listed_routers_unquantized() -> (
    None
):
    config, sources = _qwen3_moe_block_fp8()
    targets = {t.name: t for t in plan_shards(config, sources, 4, LAYOUT).targets}
    qkv = targets["model.layers.1.self_attn.qkv_proj.weight_scale_inv"]
    # 4 q heads of 128 rows: one tile a rank; 2 KV heads on 4 ranks: ranks 0, 1 head 0's tile
    assert [[s.rows for s in slot.per_rank] for slot in qkv.slots] == [
        [(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 1), (0, 1), (1, 2), (1, 2)],
        [(0, 1), (0, 1), (1, 2), (1, 2)]]  # fmt: skip
    assert targets["model.layers.1.mlp.experts.gate.weight"].dtype != "F8_E4M3"
    scale = targets["model.layers.1.self_attn.attn.k_scale"]
    assert (scale.shape, scale.constant, scale.dtype) == ((), -1.0, "F32")


def test_qwen3_moe_block_fp8_refuses_an_unlisted_router_or_a_listed_quantized_module() -> None:
    listed = ["lm_head", "model.layers.0.mlp.gate"]  # layer 1's router left out
    with pytest.raises(CheckpointError, match=r"does not name the router 'model.layers.1.mlp.gate'"):
        plan_shards(*_qwen3_moe_block_fp8(modules_to_not_convert=listed), 2, LAYOUT)
    wrong = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.0.self_attn.q_proj"]
    with pytest.raises(CheckpointError, match=r"names 'model.layers.0.self_attn.q_proj', which is"):
        plan_shards(*_qwen3_moe_block_fp8(modules_to_not_convert=wrong), 2, LAYOUT)
