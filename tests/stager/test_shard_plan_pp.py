"""The shard plan at pipeline parallel size > 1: each stage holds exactly its layers of vLLM's
partition, planned as at PP 1, and the tensors outside the layers where vLLM's model builds
them (Llama-like models: embeddings on the first stage, final norm and head on the last, tied
embeddings under the head's name on the last only; the others: every one on every stage)."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from modelstage.core.architectures import ARCHITECTURES, NON_LAYER_GROUP
from modelstage.core.errors import SpecError
from modelstage.core.formats import FORMATS
from modelstage.core.layouts import layout_for
from modelstage.core.model_config import ModelConfig
from modelstage.core.pipeline_parallel import layer_partition
from modelstage.devtools.synthetic import SyntheticModel
from modelstage.stager.shard_plan import (
    Pipeline,
    ShardPlan,
    SourceTensor,
    TargetTensor,
    plan_shards,
    plan_stages,
)

LAYOUT = layout_for("0.32")
EDGES_ONLY = sorted(a for a, arch in ARCHITECTURES.items() if not arch.edges_on_every_stage)
EVERY_STAGE = sorted(a for a, arch in ARCHITECTURES.items() if arch.edges_on_every_stage)
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _model(arch: str, layers: int, tied: bool) -> SyntheticModel:
    return SyntheticModel(
        architecture=arch, hidden_size=32, intermediate_size=64, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=8 if arch.startswith(("Qwen3", "Gemma")) else None,
        vocab_size=100, num_experts=4, experts_per_token=1,
        tie_word_embeddings=tied or arch == "Gemma2ForCausalLM",
    )  # fmt: skip


def _plan(model: SyntheticModel, tp: int, pipeline: Pipeline) -> tuple[ShardPlan, ...]:
    config = ModelConfig.from_dict(model.config())
    sources = {n: SourceTensor(model.dtype_code(n), s) for n, s in model.tensors()}
    return plan_stages(config, sources, tp, LAYOUT, pipeline=pipeline)


def _by_name(plan: ShardPlan) -> dict[str, TargetTensor]:
    return {t.name: t for t in plan.targets}


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[str, int, bool, Pipeline]:
    arch = draw(st.sampled_from(sorted(ARCHITECTURES)))
    layers = draw(st.integers(1, 7))
    pp = draw(st.integers(2, 5))
    partition = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, layers), min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, layers]
        partition = tuple(b - a for a, b in itertools.pairwise(bounds))
    return arch, layers, draw(st.booleans()), Pipeline(pp, partition)


@settings(max_examples=80, deadline=None)
@given(pipelines())
def test_each_stage_holds_its_layers_as_planned_at_pp_1_and_the_edges_where_vllm_builds_them(
    case: tuple[str, int, bool, Pipeline],
) -> None:
    arch, layers, tied, pipeline = case
    model = _model(arch, layers, tied)
    whole = _by_name(_plan(model, 2, Pipeline())[0])
    stages = _plan(model, 2, pipeline)
    counts = layer_partition(layers, pipeline.pp, pipeline.partition)
    assert [p.pp_rank for p in stages] == list(range(pipeline.pp))
    seen: list[str] = []
    for p, plan in enumerate(stages):
        first = sum(counts[:p])
        held = {int(m.group(1)) for t in plan.targets if (m := LAYER.match(t.name))}
        assert held == set(range(first, first + counts[p])), "the stage's layers, no other"
        for t in plan.targets:
            if t.group != NON_LAYER_GROUP:
                assert whole[t.name] == t, "a layer's tensors are planned as at PP 1"
                seen.append(t.name)
        edges = {t.name: t for t in plan.targets if t.group == NON_LAYER_GROUP}
        assert edges == _expected_edges(arch, whole, p, pipeline.pp, tied)
    assert sorted(seen) == sorted(n for n, t in whole.items() if t.group != NON_LAYER_GROUP)


def _expected_edges(
    arch: str, whole: dict[str, TargetTensor], p: int, pp: int, tied: bool
) -> dict[str, TargetTensor]:
    edges = {n: t for n, t in whole.items() if t.group == NON_LAYER_GROUP}
    if ARCHITECTURES[arch].edges_on_every_stage:
        return edges
    first, last = p == 0, p == pp - 1
    out = {n: t for n, t in edges.items() if last and n != "lm_head.weight"}
    out.pop("model.embed_tokens.weight", None)
    if last and "lm_head.weight" in edges:
        out["lm_head.weight"] = edges["lm_head.weight"]
    if first and not tied:
        out["model.embed_tokens.weight"] = edges["model.embed_tokens.weight"]
    if first and tied and not last:  # no head on this stage: the embeddings keep their name
        out["model.embed_tokens.weight"] = TargetTensor(
            "model.embed_tokens.weight", *_fields(edges["lm_head.weight"])
        )
    return out


def _fields(t: TargetTensor) -> tuple[object, ...]:
    return (t.dtype, t.shape, t.slots, t.group, t.constant)


def test_llama_tied_first_stage_keeps_embed_tokens_and_the_last_the_head() -> None:
    stages = _plan(_model("LlamaForCausalLM", 4, tied=True), 2, Pipeline(3))
    names = [sorted(n for n in _by_name(s) if not LAYER.match(n)) for s in stages]
    assert names == [["model.embed_tokens.weight"], [], ["lm_head.weight", "model.norm.weight"]]
    assert stages[0].targets[0].slots == _by_name(stages[2])["lm_head.weight"].slots


def test_mixtral_holds_embeddings_norm_and_head_on_every_stage() -> None:
    stages = _plan(_model("MixtralForCausalLM", 4, tied=False), 2, Pipeline(2))
    for s in stages:
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(
            _by_name(s)
        )


@pytest.mark.parametrize("arch", EDGES_ONLY)
def test_an_empty_middle_stage_of_a_llama_like_model_holds_nothing(arch: str) -> None:
    stages = _plan(_model(arch, 4, tied=False), 2, Pipeline(3, (2, 0, 2)))
    assert stages[1].targets == ()


def test_a_partition_that_does_not_fit_the_model_is_refused_before_any_stage() -> None:
    with pytest.raises(SpecError, match="holds 5 layers, but the model has 4"):
        _plan(_model("LlamaForCausalLM", 4, tied=False), 2, Pipeline(2, (2, 3)))


def test_pp_1_is_the_plan_it_always_was() -> None:
    model = _model("LlamaForCausalLM", 3, tied=True)
    config = ModelConfig.from_dict(model.config())
    sources = {n: SourceTensor(model.dtype_code(n), s) for n, s in model.tensors()}
    assert _plan(model, 2, Pipeline()) == (plan_shards(config, sources, 2, LAYOUT),)


def test_rank_files_at_pp_are_named_as_vllm_0_32_names_them() -> None:
    fmt = FORMATS["sharded_state"]
    assert fmt.rank_file_name(1, 0, 3, 4) == "model-pp-3-tp-1-part-0.safetensors"
    assert fmt.rank_file_name(1, 2) == "model-rank-1-part-2.safetensors"
    names = [fmt.rank_file_name(t, 5, p, 4) for p in range(4) for t in range(8)]
    for name in names:
        assert fmt.weight_files.match(name)
    for p in range(4):
        for t in range(8):
            owners = [n for n in names if fmt.is_rank_file(n, t, p, 4)]
            assert owners == [fmt.rank_file_name(t, 5, p, 4)]
    assert not fmt.is_rank_file("model-rank-0-part-0.safetensors", 0, 0, 2)


def test_formats_whose_vllm_loader_cannot_tell_stages_apart_are_refused_at_pp() -> None:
    with pytest.raises(SpecError, match="names a rank's file by its tensor-parallel rank alone"):
        FORMATS["tensorizer"].check_pipeline(2, LAYOUT)
    with pytest.raises(SpecError, match=r"vLLM 0\.31's sharded-state loader"):
        FORMATS["sharded_state"].check_pipeline(2, layout_for("0.31"))
    FORMATS["sharded_state"].check_pipeline(2, LAYOUT)
    FORMATS["runai_streamer_sharded"].check_pipeline(4, LAYOUT)
    FORMATS["safetensors"].check_pipeline(4, layout_for("0.31"))  # vLLM splits it at load
