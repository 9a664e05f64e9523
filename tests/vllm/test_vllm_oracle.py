"""The vLLM oracle: stock vLLM (``load_format="sharded_state"``) on a staged artifact gives
exactly the token ids, ``logprobs`` and ``prompt_logprobs`` that vLLM gives on the original
checkpoint at the same TP and dtype, and misplaced weights are caught.

Every run is stock vLLM (``VLLM_PLUGINS=""``, checked in each result) at the dtype the case
names, on both sides; 16-bit sources are staged with ``--dtype auto`` and the artifact must
hold 16-bit weights (FP8: its own dtypes). Default matrix (each case two vLLM starts with a
cold reference cache, one with a warm one; a TP=1 start takes ~16 s and a TP=2 start ~28 s on
2 idle cores):
- Llama float32, tied embeddings, vocab 1000 (padded to 1024), q/k/v and gate/up spread over
  three source files: TP 1, 2.
- Qwen2 float32 (q/k/v biases), 1 KV head (replicated on both ranks at TP 2), vocab 1234,
  untied: TP 1, 2.
- Qwen3 bfloat16 (q_norm/k_norm, head_dim 64 != hidden/heads), 4 KV heads, tied, staged
  ``--dtype auto`` and run at bfloat16: TP 1, 2.
- Mistral float16, vocab 1100, staged ``--dtype auto`` and run at float16: TP 1.
- Mixtral bfloat16, 4 experts (2 routed per token), two source files, staged
  ``--dtype auto`` and run at bfloat16: TP 1, 2.
- Qwen2-MoE bfloat16 (query/key/value biases, router ``mlp.gate``, a gated shared expert kept
  under ``mlp.experts._shared_experts._layer``), 4 experts: TP 1, 2.
- Qwen3-MoE bfloat16 (q_norm/k_norm, head_dim 64, router kept as ``mlp.experts.gate``), 4
  experts, tied: TP 1, 2.
- gpt-oss bfloat16 (experts stacked [E, in, out] in the source, cut and transposed per rank;
  q/k/v, o and router biases, sinks, alternating sliding and full attention, yarn RoPE), 4
  experts, 8 query heads on 4 KV heads: TP 2 (TP 1 and 4 slow).
- Llama FP8 (compressed-tensors W8A8: float8 weights, per-channel scales, dynamic per-token
  activations) bfloat16, q/k/v and gate/up spread over two source files: TP 2 (TP 1, 4 slow);
  Qwen3 FP8 (q/k norms, head_dim 64, tied) bfloat16: TP 2 in the slow tier.
- Phi-3 bfloat16 (q/k/v fused in the source's ``qkv_proj``, gate/up in ``gate_up_proj``, cut
  into their parts before the rank split), 4 KV heads, two source files: TP 2 (TP 1 and 4
  slow).
- Gemma 2 bfloat16 (pre/post feed-forward norms stored raw, head_dim 64 != hidden/heads,
  soft-capping, sliding and full layers), vocab 1000, tied embeddings kept as
  ``model.embed_tokens``: TP 2 (TP 1 and 4 slow).
- Gemma 3 bfloat16 (those norms and q/k norms, a local rope base on sliding layers), vocab
  1000, tied embeddings kept as ``lm_head``: TP 2 (TP 1 and 4 slow).
- Mutations (``MUTATIONS``, one per kind of split): an artifact of the matrix with one thing
  misplaced (KV-head blocks, rank files, experts, gpt-oss's gate/up interleave, FP8 scales of
  the wrong slot, k and v of a fused source) loads in vLLM without a warning but fails the
  comparison.
Slow tier (``-m slow``): Llama, Mixtral, Qwen2-MoE and Qwen3-MoE at TP 4 (each KV head on two
ranks; ~50 s a start), gpt-oss, Phi-3, Gemma 2 and Gemma 3 at TP 1 and 4, Llama FP8 at TP 1 and 4, Mistral float16 at
TP 2, and the Qwen3 bfloat16 source staged ``--dtype float32`` (the stager's cast) at TP 2.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel
from vllm_oracle import (
    VllmRun,
    differences,
    loader_warnings,
    reference,
    run_vllm,
    split_gate_up_halves,
    swap_experts,
    swap_k_and_v,
    swap_kv_head_blocks,
    swap_rank_files,
    swap_rows,
    weight_dtypes,
)

pytestmark = pytest.mark.vllm

Timings = list[tuple[str, VllmRun]]
SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class Case:
    name: str
    spec: SyntheticModel
    tps: tuple[int, ...]
    stage_args: tuple[str, ...] = ()
    dtype: str = "float32"
    """What vLLM runs at, on the original checkpoint and on the artifact alike."""
    slow_tps: tuple[int, ...] = ()
    source: str = ""
    """The checkpoint's name when several cases stage one checkpoint (default: ``name``)."""
    artifact_dtypes: tuple[str, ...] = ()
    """The safetensors dtypes of the artifact's weights (default: ``dtype``'s alone)."""

    @property
    def checkpoint_name(self) -> str:
        return self.source or self.name


LLAMA = Case(
    "llama-tied-vocab1000-split",
    SyntheticModel(tie_word_embeddings=True, vocab_size=1000, num_shards=3, split_fused=True),
    (1, 2),
    slow_tps=(4,),
)
MIXTRAL = Case(
    "mixtral-bf16-4experts",
    SyntheticModel(
        architecture="MixtralForCausalLM", num_kv_heads=4, vocab_size=1000, num_experts=4,
        dtype="bfloat16", num_shards=2, seed=5,
    ),
    (1, 2),
    ("--dtype", "auto"),
    dtype="bfloat16",
    slow_tps=(4,),
)
QWEN2_MOE = Case(
    "qwen2-moe-bf16-4experts-shared",
    SyntheticModel(
        architecture="Qwen2MoeForCausalLM", num_kv_heads=4, vocab_size=1000,
        intermediate_size=128, num_experts=4, dtype="bfloat16", num_shards=2, seed=9,
    ),
    (1, 2),
    ("--dtype", "auto"),
    dtype="bfloat16",
    slow_tps=(4,),
)
QWEN3_MOE = Case(
    "qwen3-moe-bf16-4experts-tied",
    SyntheticModel(
        architecture="Qwen3MoeForCausalLM", head_dim=64, num_kv_heads=4, vocab_size=1000,
        intermediate_size=256, num_experts=4, tie_word_embeddings=True, dtype="bfloat16",
        num_shards=2, seed=7,
    ),
    (1, 2),
    ("--dtype", "auto"),
    dtype="bfloat16",
    slow_tps=(4,),
)
GPT_OSS = Case(
    "gpt-oss-bf16-4experts",
    SyntheticModel(
        architecture="GptOssForCausalLM", head_dim=64, num_kv_heads=4, vocab_size=1000,
        intermediate_size=128, hidden_size=128, num_experts=4, dtype="bfloat16", num_shards=2,
        seed=10,
    ),
    (2,),
    ("--dtype", "auto"),
    dtype="bfloat16",
    slow_tps=(1, 4),
)
PHI3 = Case(
    "phi3-bf16-fused-qkv-gate-up",
    SyntheticModel(
        architecture="Phi3ForCausalLM", num_kv_heads=4, vocab_size=1000, dtype="bfloat16",
        num_shards=2, seed=10,
    ),
    (2,),
    ("--dtype", "auto"),
    dtype="bfloat16",
    slow_tps=(1, 4),
)
FP8_LLAMA = Case(
    "llama-fp8-channel-bf16-split",
    SyntheticModel(dtype="bfloat16", fp8=True, num_shards=2, split_fused=True, seed=12),
    (2,),
    ("--dtype", "auto"),
    dtype="bfloat16",
    slow_tps=(1, 4),
    artifact_dtypes=("BF16", "F32", "F8_E4M3"),
)
GEMMA = {
    arch: Case(
        f"{name}-bf16-headdim64-tied",
        SyntheticModel(
            architecture=arch, head_dim=64, num_kv_heads=4, vocab_size=1000,  # type: ignore[arg-type]
            tie_word_embeddings=True, dtype="bfloat16", num_shards=2, seed=seed,
        ),
        (2,),
        ("--dtype", "auto"),
        dtype="bfloat16",
        slow_tps=(1, 4),
    )
    for arch, name, seed in (("Gemma2ForCausalLM", "gemma2", 10), ("Gemma3ForCausalLM", "gemma3", 11))
}  # fmt: skip
FP8_QWEN3 = Case(
    "qwen3-fp8-channel-bf16-tied",
    SyntheticModel(
        architecture="Qwen3ForCausalLM", head_dim=64, num_kv_heads=4, vocab_size=1000,
        tie_word_embeddings=True, dtype="bfloat16", fp8=True, num_shards=2, seed=14,
    ),
    (),
    ("--dtype", "auto"),
    dtype="bfloat16",
    slow_tps=(2,),
    artifact_dtypes=("BF16", "F32", "F8_E4M3"),
)  # fmt: skip
QWEN3_BF16 = SyntheticModel(
    architecture="Qwen3ForCausalLM", head_dim=64, num_kv_heads=4, vocab_size=1000,
    tie_word_embeddings=True, dtype="bfloat16", num_shards=2, seed=2,
)  # fmt: skip
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
        QWEN3_BF16,
        (1, 2),
        ("--dtype", "auto"),
        dtype="bfloat16",
    ),
    Case(
        "mistral-fp16-vocab1100",
        SyntheticModel(
            architecture="MistralForCausalLM", num_kv_heads=4, vocab_size=1100, dtype="float16",
            seed=3,
        ),
        (1,),
        ("--dtype", "auto"),
        dtype="float16",
        slow_tps=(2,),
    ),
    Case(
        "qwen3-bf16-staged-as-float32",
        QWEN3_BF16,
        (),
        ("--dtype", "float32"),
        slow_tps=(2,),
        source="qwen3-qknorm-headdim64-bf16-tied",
    ),
    MIXTRAL,
    QWEN2_MOE,
    QWEN3_MOE,
    GPT_OSS,
    FP8_LLAMA,
    PHI3,
    *GEMMA.values(),
    FP8_QWEN3,
]  # fmt: skip


def prompts_for(spec: SyntheticModel) -> list[list[int]]:
    """Token-id prompts that touch the first, middle, last and rank-boundary vocab rows."""
    last = spec.vocab_size - 1
    return [
        [1, 5, 100, 255, 256, 511, 512, 513, last, 42, 7, 300, 2, 64],
        [1, last, last - 1, 3, 900, 767, 768],
        [1, 250],
    ]


MATRIX = [
    *(pytest.param(case, tp, id=f"{case.name}-tp{tp}") for case in CASES for tp in case.tps),
    *(
        pytest.param(case, tp, id=f"{case.name}-tp{tp}", marks=pytest.mark.slow)
        for case in CASES
        for tp in case.slow_tps
    ),
]


def assert_stock_reference(ref: VllmRun, dtype: str) -> None:
    """A cached reference passes the checks its run made when it was taken, again."""
    assert ref.output["dtype"] == dtype, ref.output["dtype"]
    assert ref.output["plugin_load_formats"] == [], "the reference ran with the plugin"


@pytest.mark.parametrize(("case", "tp"), MATRIX)
def test_staged_sharded_state_gives_exactly_the_reference_logprobs(
    case: Case,
    tp: int,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    timings: Timings,
) -> None:
    src = checkpoint(case.checkpoint_name, case.spec)
    artifact = staged(case.name, src, tp, *case.stage_args)
    assert weight_dtypes(artifact) == set(case.artifact_dtypes or [SAFETENSORS_DTYPE[case.dtype]])
    prompts = prompts_for(case.spec)

    ref = reference(src, tp, prompts, case.dtype)
    timings.append((f"reference {case.name} tp{tp} {case.dtype}", ref))
    assert_stock_reference(ref, case.dtype)
    got = run_vllm(artifact, tp, "sharded_state", prompts, case.dtype)
    timings.append((f"staged    {case.name} tp{tp} {case.dtype}", got))

    assert not loader_warnings(got.log), "vLLM narrowed or cast tensors of the artifact"
    diff = differences(ref.output, got.output)
    assert not diff, "staged artifact differs from the original checkpoint:\n" + "\n".join(diff)


def _swap_k_and_v_scales(artifact: Path, spec: SyntheticModel, tp: int) -> None:
    q_rows = spec.num_heads * spec.head_size // tp
    kv_rows = spec.num_kv_heads * spec.head_size // tp
    key = "model.layers.0.self_attn.qkv_proj.weight_scale"
    swap_rows(artifact, 0, key, q_rows, q_rows + kv_rows, kv_rows)


@dataclass(frozen=True)
class Mutation:
    case: Case
    tp: int
    """A TP the matrix stages and references (the artifact and the reference are reused)."""
    what: str
    mutate: Callable[[Path, SyntheticModel, int], object]
    """Rewrites the copied artifact (``artifact, spec, tp``): same names, shapes and dtypes."""


MUTATIONS = {
    "kv-head-blocks": Mutation(LLAMA, 1, "two KV-head blocks of one layer's qkv_proj swapped",
        lambda a, s, tp: swap_kv_head_blocks(a, s.num_heads, s.num_kv_heads, s.head_size, tp,
                                             layer=1)),
    "rank-files": Mutation(LLAMA, 2, "the two ranks' files exchanged",
        lambda a, s, tp: swap_rank_files(a, 0, 1)),
    "experts": Mutation(MIXTRAL, 2, "two experts of one layer exchanged in rank 0's file",
        lambda a, s, tp: swap_experts(a, rank=0, layer=0, a=0, b=1)),
    "gpt-oss-gate-up": Mutation(GPT_OSS, 2,
        "one layer's gate/up rows of rank 0 in halves instead of interleaved",
        lambda a, s, tp: split_gate_up_halves(a, rank=0, layer=0)),
    "fp8-scales": Mutation(FP8_LLAMA, 2,
        "the k and v slots of one layer's qkv_proj.weight_scale exchanged in rank 0's file",
        lambda a, s, tp: _swap_k_and_v_scales(a, s, tp)),
    "fused-k-v": Mutation(PHI3, 2, "k and v of the fused qkv_proj exchanged in one layer",
        lambda a, s, tp: swap_k_and_v(a, s.num_heads, s.num_kv_heads, s.head_size, tp,
                                      layer=1)),
}  # fmt: skip


@pytest.mark.parametrize("mutation", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_a_misplaced_weight_fails_the_oracle(
    mutation: Mutation,
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    timings: Timings,
    tmp_path: Path,
) -> None:
    case, tp = mutation.case, mutation.tp
    src = checkpoint(case.checkpoint_name, case.spec)
    mutated = tmp_path / "mutated"
    shutil.copytree(staged(case.name, src, tp, *case.stage_args), mutated)
    mutation.mutate(mutated, case.spec, tp)
    prompts = prompts_for(case.spec)

    ref = reference(src, tp, prompts, case.dtype)
    timings.append((f"reference {case.name} tp{tp} {case.dtype}", ref))
    got = run_vllm(mutated, tp, "sharded_state", prompts, case.dtype)
    timings.append((f"mutated   {case.name} tp{tp} ({mutation.what})", got))

    assert not loader_warnings(got.log), "the mutated artifact must still load cleanly"
    assert differences(ref.output, got.output), f"the oracle missed {mutation.what}"
    assert differences(ref.output, got.output), "the oracle missed k and v scales swapped"


@pytest.mark.slow
def test_fp8_through_the_plugins_checking_loader_gives_exactly_the_reference_logprobs(
    checkpoint: Callable[[str, SyntheticModel], Path],
    staged: Callable[..., Path],
    timings: Timings,
) -> None:
    """What a serving pod runs: ``modelstage_sharded_state`` checks the manifest and each
    chunk of the float8 and float32 rank files as its reader moves them into vLLM's
    parameters."""
    tp, case = 2, FP8_LLAMA  # staged and referenced by the matrix
    src = checkpoint(case.name, case.spec)
    artifact = staged(case.name, src, tp, *case.stage_args)
    digest = json.loads((artifact / "modelstage.json").read_text())["digest"]
    env = {"MODELSTAGE_DIGEST": digest, "MODELSTAGE_FORMAT": "sharded_state",
           "MODELSTAGE_TP": str(tp)}  # fmt: skip
    prompts = prompts_for(case.spec)

    ref = reference(src, tp, prompts, case.dtype)
    timings.append((f"reference {case.name} tp{tp} {case.dtype}", ref))
    got = run_vllm(artifact, tp, "modelstage_sharded_state", prompts, case.dtype, env=env,
                   plugin=True)  # fmt: skip
    timings.append((f"plugin    {case.name} tp{tp} modelstage_sharded_state", got))

    assert got.output["load_format"] == "modelstage_sharded_state"
    assert f'"digest":"{digest}"' in got.log, "the checking loader did not load it"
    assert not loader_warnings(got.log), "the plugin narrowed or cast tensors of the artifact"
    diff = differences(ref.output, got.output)
    assert not diff, "the FP8 artifact differs through the plugin:\n" + "\n".join(diff)
