"""The vLLM oracle: stock vLLM (``load_format="sharded_state"``) on a staged artifact gives
exactly the token ids, ``logprobs`` and ``prompt_logprobs`` that vLLM gives on the original
checkpoint at the same TP, and a single misplaced head block is caught.

Default matrix (6 vLLM starts with a warm reference cache; sized to stay well inside the
tier's ~6 minutes on 2 cores, where a TP=1 start takes ~16 s and a TP=2 start ~28 s):
- Llama, tied embeddings, vocab 1000 (padded to 1024), q/k/v and gate/up spread over three
  source files: TP 1, 2.
- Qwen2 (q/k/v biases), 1 KV head (replicated on both ranks at TP 2), vocab 1234, untied:
  TP 1, 2.
- Qwen3 (q_norm/k_norm, head_dim 64 != hidden/heads), 4 KV heads, bfloat16 source staged as
  float32, tied: TP 2.
- Mutation: the Llama TP 1 artifact with two KV-head blocks of one layer's ``qkv_proj``
  swapped loads in vLLM but fails the comparison.
``MODELSTAGE_ORACLE_EXTENDED=1`` adds Llama at TP 4 (each KV head on two ranks; ~50 s a
start) and Mistral from a float16 source at TP 1. They are not collected otherwise.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from modelstage.stager.synthetic import SyntheticModel
from vllm_oracle import VllmRun, differences, loader_warnings, reference, run_vllm

pytestmark = pytest.mark.vllm

Timings = list[tuple[str, VllmRun]]


@dataclass(frozen=True)
class Case:
    name: str
    spec: SyntheticModel
    tps: tuple[int, ...]
    stage_args: tuple[str, ...] = ()


LLAMA = Case(
    "llama-tied-vocab1000-split",
    SyntheticModel(tie_word_embeddings=True, vocab_size=1000, num_shards=3, split_fused=True),
    (1, 2),
)
CASES = [
    LLAMA,
    Case(
        "qwen2-bias-1kv-vocab1234",
        SyntheticModel(
            architecture="Qwen2ForCausalLM", num_kv_heads=1, vocab_size=1234, num_shards=2,
            split_fused=True, seed=1,
        ),
        (1, 2),
    ),
    Case(
        "qwen3-qknorm-headdim64-bf16-tied",
        SyntheticModel(
            architecture="Qwen3ForCausalLM", head_dim=64, num_kv_heads=4, vocab_size=1000,
            tie_word_embeddings=True, dtype="bfloat16", num_shards=2, seed=2,
        ),
        (2,),
        ("--dtype", "float32"),
    ),
]  # fmt: skip
EXTENDED_CASES = [
    Case(LLAMA.name, LLAMA.spec, (4,)),
    Case(
        "mistral-fp16-vocab1100",
        SyntheticModel(
            architecture="MistralForCausalLM", num_kv_heads=4, vocab_size=1100, dtype="float16",
            seed=3,
        ),
        (1,),
        ("--dtype", "float32"),
    ),
]  # fmt: skip
if os.environ.get("MODELSTAGE_ORACLE_EXTENDED") == "1":
    CASES += EXTENDED_CASES


def prompts_for(spec: SyntheticModel) -> list[list[int]]:
    """Token-id prompts that touch the first, middle, last and rank-boundary vocab rows."""
    last = spec.vocab_size - 1
    return [
        [1, 5, 100, 255, 256, 511, 512, 513, last, 42, 7, 300, 2, 64],
        [1, last, last - 1, 3, 900, 767, 768],
        [1, 250],
    ]


@pytest.mark.parametrize(
    ("case", "tp"),
    [(case, tp) for case in CASES for tp in case.tps],
    ids=[f"{case.name}-tp{tp}" for case in CASES for tp in case.tps],
)
def test_staged_sharded_state_gives_exactly_the_reference_logprobs(
    case: Case,
    tp: int,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    timings: Timings,
) -> None:
    src = checkpoint(case.name, case.spec)
    artifact = staged(case.name, src, tp, *case.stage_args)
    prompts = prompts_for(case.spec)

    ref = reference(src, tp, prompts)
    timings.append((f"reference {case.name} tp{tp}", ref))
    got = run_vllm(artifact, tp, "sharded_state", prompts)
    timings.append((f"staged    {case.name} tp{tp}", got))

    assert not loader_warnings(got.log), "vLLM narrowed or cast tensors of the artifact"
    diff = differences(ref.output, got.output)
    assert not diff, "staged artifact differs from the original checkpoint:\n" + "\n".join(diff)


def swap_kv_head_blocks(artifact: Path, spec: SyntheticModel, tp: int, layer: int) -> str:
    """Swap the first two k-head row blocks of one layer's fused qkv in rank 0's file.

    Rows of ``qkv_proj.weight`` on a rank are its q heads, then its k heads, then its v
    heads, ``head_dim`` rows each. Returns the file it rewrote.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    key = f"model.layers.{layer}.self_attn.qkv_proj.weight"
    kv_per_rank = spec.num_kv_heads // tp
    assert kv_per_rank >= 2, "the mutation needs two KV heads on the rank"
    for path in sorted(artifact.glob("model-rank-0-part-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if key not in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                continue
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        hd = spec.head_size
        k0 = spec.num_heads // tp * hd
        qkv = tensors[key].clone()
        qkv[k0 : k0 + hd] = tensors[key][k0 + hd : k0 + 2 * hd]
        qkv[k0 + hd : k0 + 2 * hd] = tensors[key][k0 : k0 + hd]
        assert not qkv.equal(tensors[key])
        tensors[key] = qkv
        save_file(tensors, str(path), metadata=metadata)
        return path.name
    raise AssertionError(f"{key} is in no rank-0 part file of {artifact}")


def test_swapped_kv_head_blocks_in_one_rank_file_fail_the_oracle(
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    timings: Timings,
    tmp_path: Path,
) -> None:
    tp = 1  # two KV heads on the rank; staged and referenced already by the matrix
    src = checkpoint(LLAMA.name, LLAMA.spec)
    mutated = tmp_path / "mutated"
    shutil.copytree(staged(LLAMA.name, src, tp, *LLAMA.stage_args), mutated)
    swap_kv_head_blocks(mutated, LLAMA.spec, tp, layer=1)
    prompts = prompts_for(LLAMA.spec)

    ref = reference(src, tp, prompts)
    timings.append((f"reference {LLAMA.name} tp{tp}", ref))
    got = run_vllm(mutated, tp, "sharded_state", prompts)
    timings.append((f"mutated   {LLAMA.name} tp{tp}", got))

    assert not loader_warnings(got.log), "the mutated artifact must still load cleanly"
    assert differences(ref.output, got.output), "the oracle missed two swapped KV-head blocks"
