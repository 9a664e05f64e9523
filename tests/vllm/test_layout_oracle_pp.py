"""The layout oracle with pipeline parallelism: every (stage, TP rank) file the stager writes
with ``--pp`` holds exactly, byte for byte, the state vLLM's own weight loaders give that
process (``layout_oracle.py --pp``: gloo groups of TP ranks per stage, each stage building
only its layers of vLLM's partition and the embeddings, norm and head where the family's
model puts them), for a dense family (Llama, untied and tied: the tied embeddings kept as
``model.embed_tokens.weight`` on the first stage, ``lm_head.weight`` on the last) and an MoE
family (Mixtral: embeddings, norm and head on every stage), and, slow, every other family of
the layout oracle's table at TP 2 x PP 2. Layer counts that do not divide
the stages exercise vLLM's uneven default partition; ``VLLM_PP_LAYER_PARTITION`` is honoured
when the stager is given the same partition. The control: staged with another partition,
the files differ from vLLM's state.

(TP 2, PP 2) runs four rank processes, (TP 2, PP 4) eight: each imports vLLM, minutes on a
2-core machine; the first is in the default vLLM tier, the rest slow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from modelstage.core.pipeline_parallel import PARTITION_ENV
from modelstage.devtools.synthetic import SyntheticModel
from safetensors import safe_open
from test_layout_oracle import FAMILIES as TP_FAMILIES
from vllm_oracle import stage, vllm_rank_states_batch

pytestmark = pytest.mark.vllm

PROVEN = {
    "llama": SyntheticModel(
        architecture="LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=512, dtype="bfloat16", num_shards=2, seed=30, num_layers=6,
    ),  # 6 layers: PP 2 -> 3, 3; PP 4 -> 1, 2, 2, 1
    "llama-tied": SyntheticModel(
        architecture="LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=512, dtype="bfloat16", num_shards=2, seed=31, num_layers=5,
        tie_word_embeddings=True,
    ),  # 5 layers: PP 2 -> 3, 2; PP 4 -> 1, 1, 2, 1
    "mixtral": SyntheticModel(
        architecture="MixtralForCausalLM", hidden_size=128, intermediate_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=512, num_experts=4, dtype="bfloat16", num_shards=2, seed=32,
        num_layers=5,
    ),
}  # fmt: skip
"""The dense and the MoE family of the default tier (PP 4: slow)."""
OTHERS = {
    name: dataclasses.replace(family.spec, num_layers=5)
    for name, family in TP_FAMILIES.items()
    if name not in ("llama", "mixtral")
}
"""Every other family of the layout oracle's table, 5 layers, at TP 2 x PP 2 (slow)."""
FAMILIES = {**PROVEN, **OTHERS}
PARTITIONED = ("llama", 2, 2, "4,2")
"""A family staged and built with an explicit ``VLLM_PP_LAYER_PARTITION`` (family, TP, PP)."""

Key = tuple[int, int, str]
"""(TP, PP, partition; "" for vLLM's default)."""


def _read(paths: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():  # noqa: SIM118
                assert k not in tensors, f"{k} in two files of one rank"
                tensors[k] = f.get_tensor(k)
    return tensors


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat_a, flat_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and flat_a.equal(flat_b)


def assert_stage_files_equal(artifact: Path, states: list[Path], tp: int, pp: int) -> None:
    """Each (stage, TP rank)'s staged files hold exactly vLLM's state of that process."""
    assert len(states) == tp * pp
    for state in states:
        p, t = (int(x) for x in state.stem.removeprefix("pp-").split("-tp-"))
        want = _read([state])
        got = _read(sorted(artifact.glob(f"model-pp-{p}-tp-{t}-part-*.safetensors")))
        assert sorted(got) == sorted(want), f"stage {p} rank {t}: names differ"
        differ = [k for k in want if not _same_bytes(want[k], got[k])]
        assert not differ, f"stage {p} rank {t}: {len(differ)} tensors differ, e.g. {differ[:4]}"
    assert len(list(artifact.glob("model-*.safetensors"))) == len(states), "files of no rank"


class States:
    """vLLM's per-process states, one oracle run per (TP, PP, partition) for every family this
    session selected at it (the control's family with the default partition at TP 2 x PP 2)."""

    def __init__(
        self,
        session: pytest.Session,
        checkpoint: Callable[[str, SyntheticModel], Path],
        root: Path,
    ) -> None:
        self.checkpoint, self.root = checkpoint, root
        self.found: dict[tuple[str, Key], list[Path] | str] = {}
        self.selected = {("llama", (2, 2, ""))}
        for item in session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if {"family", "tp", "pp"} <= set(params):
                self.selected.add((params["family"], (params["tp"], params["pp"], "")))

    def __call__(self, family: str, key: Key) -> list[Path]:
        if (family, key) not in self.found:
            tp, pp, partition = key
            names = [f for f in FAMILIES if (f, key) in self.selected or f == family]
            jobs = [(self.source(f), self.root / f"tp{tp}-pp{pp}-{partition}" / f) for f in names]
            with pytest.MonkeyPatch.context() as env:
                if partition:
                    env.setenv(PARTITION_ENV, partition)
                else:
                    env.delenv(PARTITION_ENV, raising=False)
                batch = vllm_rank_states_batch(jobs, tp, "bfloat16", pp=pp)
            self.found.update({(f, key): found for f, found in zip(names, batch, strict=True)})
        found = self.found[(family, key)]
        if isinstance(found, str):
            pytest.fail(f"vLLM's layout oracle failed on {family} at {key}: {found}", pytrace=False)
        return found

    def source(self, family: str) -> Path:
        return self.checkpoint(f"layout-pp-{family}", FAMILIES[family])


@pytest.fixture(scope="module")
def states(
    request: pytest.FixtureRequest,
    checkpoint: Callable[[str, SyntheticModel], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[States]:
    yield States(request.session, checkpoint, tmp_path_factory.mktemp("vllm-pp-states"))


def _staged(states: States, family: str, tp: int, pp: int, tmp: Path, *extra: str) -> Path:
    out = tmp / "artifact"
    stage(states.source(family), out, tp, "--pp", str(pp), "--dtype", "auto", *extra)
    return out


@pytest.mark.parametrize(
    ("family", "tp", "pp"),
    [
        *(
            pytest.param(f, 2, pp, id=f"{f}-tp2-pp{pp}", marks=() if pp == 2 else pytest.mark.slow)
            for pp in (2, 4)
            for f in PROVEN
        ),
        *(pytest.param(f, 2, 2, id=f"{f}-tp2-pp2", marks=pytest.mark.slow) for f in OTHERS),
    ],
)
def test_stage_files_equal_vllms_own_per_process_state_byte_for_byte(
    family: str, tp: int, pp: int, states: States, tmp_path: Path
) -> None:
    artifact = _staged(states, family, tp, pp, tmp_path)
    assert_stage_files_equal(artifact, states(family, (tp, pp, "")), tp, pp)


def test_the_control_a_wrong_partition_differs_from_vllms_state(
    states: States, tmp_path: Path
) -> None:
    """vLLM's default at 6 layers and PP 2 is 3, 3: files staged for 2, 4 must not pass."""
    artifact = _staged(states, "llama", 2, 2, tmp_path, "--pp-layer-partition", "2,4")
    with pytest.raises(AssertionError, match="names differ"):
        assert_stage_files_equal(artifact, states("llama", (2, 2, "")), 2, 2)


@pytest.mark.slow
def test_an_explicit_partition_equals_vllms_state_under_the_same_variable(
    states: States, tmp_path: Path
) -> None:
    family, tp, pp, partition = PARTITIONED
    artifact = _staged(states, family, tp, pp, tmp_path, "--pp-layer-partition", partition)
    assert_stage_files_equal(artifact, states(family, (tp, pp, partition)), tp, pp)
