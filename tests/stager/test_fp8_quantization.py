"""FP8 in the compressed-tensors W8A8 layout (float8 weights, one scale per output channel,
dynamic per-token activations) is split per rank, and only that: the gate reads
``quantization_config`` field by field, every other quantization is refused per rank with the
difference named and the Hugging Face layout pointed to, and ``auto`` decides alike."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from modelstage.core.errors import SpecError
from modelstage.core.formats import AUTO_FORMATS, FORMATS, choose_format
from modelstage.core.model_config import (
    FP8_BLOCK,
    FP8_CHANNEL,
    fp8_block_mismatch,
    fp8_channel_mismatch,
    quantization_of,
)
from modelstage.devtools.synthetic import SyntheticModel, fp8_quantization_config, write_checkpoint
from modelstage.stager.resolve import resolve
from modelstage.stager.stage import StageRequest, stage
from safetensors import safe_open

SPEC = SyntheticModel(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2,
                      vocab_size=200, dtype="bfloat16", num_shards=2, fp8=True, seed=3)  # fmt: skip
HF_HINT = "--format safetensors (a directory) or runai_streamer (S3)"


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(SPEC, tmp_path_factory.mktemp("fp8") / "c")


def _changed(path: str, value: object) -> dict[str, Any]:
    """The llm-compressor config with one field (``a/b/c``) set to ``value`` (None: removed)."""
    quant = copy.deepcopy(fp8_quantization_config())
    *parents, last = path.split("/")
    node: Any = quant
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return quant


W, A = "config_groups/group_0/weights", "config_groups/group_0/input_activations"
NOT_THE_SCHEME = [
    (_changed(W + "/strategy", "tensor"), "weights strategy is 'tensor', not 'channel'"),
    (_changed(W + "/block_structure", [128, 128]), "weights block_structure is set"),
    (_changed(W + "/num_bits", 4), "weights num_bits is 4, not 8"),
    (_changed(W + "/type", "int"), "weights type is 'int', not 'float'"),
    (_changed(W + "/symmetric", False), "weights symmetric is False, not True"),
    (_changed(A + "/dynamic", False), "input_activations dynamic is False, not True"),
    (_changed(A + "/strategy", "tensor"), "input_activations strategy is 'tensor', not 'token'"),
    (_changed(A, None), "input_activations are not given"),
    (_changed("config_groups/group_0/output_activations", {"num_bits": 8}),
     "output_activations are quantized"),
    (_changed("config_groups/group_0/targets", ["Linear", "Embedding"]),
     "the config group does not target exactly ['Linear']"),
    (_changed("config_groups/group_1", fp8_quantization_config()["config_groups"]["group_0"]),
     "config_groups does not hold exactly one group"),
    (_changed("ignore", []), "ignore is [], not ['lm_head']"),
    (_changed("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme is set"),
    (_changed("sparsity_config", {"format": "sparse-24-bitmask"}), "sparsity_config is set"),
    (_changed("format", "naive-quantized"), "format is 'naive-quantized', not 'float-quantized'"),
    (_changed("quantization_status", "frozen"), "quantization_status is 'frozen'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method is not compressed"),
]  # fmt: skip


def test_llm_compressors_fp8_dynamic_config_is_the_per_rank_scheme() -> None:
    assert fp8_channel_mismatch(fp8_quantization_config()) is None
    assert quantization_of({"quantization_config": fp8_quantization_config()}) == FP8_CHANNEL
    assert quantization_of({"quantization_config": None}) is None
    older = _changed("config_groups/group_0/format", None)  # compressed-tensors before 0.10
    for key in ("sparsity_config", "transform_config", "version", "global_compression_ratio"):
        del older[key]
    assert fp8_channel_mismatch(older) is None


@pytest.mark.parametrize(("quant", "why"), NOT_THE_SCHEME, ids=[w for _, w in NOT_THE_SCHEME])
def test_any_other_quantization_is_refused_per_rank_naming_the_difference(
    quant: dict[str, Any], why: str, fp8_ckpt: Path, tmp_path: Path
) -> None:
    found = fp8_channel_mismatch(quant)
    assert found is not None and found.startswith(why), found
    assert quantization_of({"quantization_config": quant}) == quant["quant_method"]
    src = tmp_path / "src"
    shutil.copytree(fp8_ckpt, src)
    config = {**SPEC.config(), "quantization_config": quant}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError) as refused:
        stage(StageRequest(source=str(src), out=str(tmp_path / "out"), tp=2))
    message = str(refused.value)
    assert f"quantization_config: {quant['quant_method']}) are not split per rank" in message
    # quant_method fp8 is told how it differs from block FP8, the per-rank scheme of its kind
    told = fp8_block_mismatch(quant) if quant["quant_method"] == "fp8" else why
    assert told and told in message and HF_HINT in message, message
    assert not (tmp_path / "out").exists()


def test_an_fp8_architecture_without_rules_is_refused_per_rank(tmp_path: Path) -> None:
    mixtral = SyntheticModel(architecture="MixtralForCausalLM", hidden_size=64, num_heads=8,
                             intermediate_size=64, vocab_size=100, num_layers=1,
                             config_extra=(("quantization_config", fp8_quantization_config()),))  # fmt: skip
    src = write_checkpoint(mixtral, tmp_path / "src")
    with pytest.raises(SpecError) as refused:
        stage(StageRequest(source=str(src), out=str(tmp_path / "out"), tp=2))
    assert str(refused.value).startswith(
        f"architecture 'MixtralForCausalLM' is not split per rank when quantized as {FP8_CHANNEL}"
    )
    assert HF_HINT in str(refused.value)


def test_fp8_is_staged_per_rank_scales_cast_to_float32_with_their_rows(
    fp8_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    summary = stage(StageRequest(source=str(fp8_ckpt), out=str(out), tp=2))
    assert summary["format"] == "sharded_state"
    with safe_open(str(fp8_ckpt / "model-00001-of-00002.safetensors"), "pt") as f:
        source = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    with safe_open(str(out / "model-rank-1-part-0.safetensors"), "pt") as f:
        rank1 = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    attn = "model.layers.0.self_attn."
    q, kv = SPEC.num_heads * SPEC.head_size // 2, SPEC.head_size  # 1 of 2 KV heads per rank
    want = torch.cat([source[attn + "q_proj.weight_scale"][q:].float(),
                      source[attn + "k_proj.weight_scale"][kv:].float(),
                      source[attn + "v_proj.weight_scale"][kv:].float()])  # fmt: skip
    assert rank1[attn + "qkv_proj.weight_scale"].equal(want)
    assert rank1[attn + "qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert rank1[attn + "qkv_proj.weight"][:q].view(torch.uint8).equal(
        source[attn + "q_proj.weight"][q:].view(torch.uint8)
    )
    assert rank1[attn + "o_proj.weight_scale"].equal(source[attn + "o_proj.weight_scale"].float())
    assert rank1[attn + "attn.k_zero_point"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("fmt", "dtype", "refusal"),
    [("tensorizer", "auto", "format tensorizer does not take quantized checkpoints "
      f"({FP8_CHANNEL}); stage it per rank with --format sharded_state or "
      "runai_streamer_sharded, or stage it in the Hugging Face layout"),
     ("sharded_state", "float32", "a quantized checkpoint"),
     ("runai_streamer_sharded", "bfloat16", "use --dtype auto")],
)  # fmt: skip
def test_fp8_refuses_tensorizer_and_any_cast(
    fmt: str, dtype: str, refusal: str, fp8_ckpt: Path, tmp_path: Path
) -> None:
    with pytest.raises(SpecError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        stage(StageRequest(source=str(fp8_ckpt), out=str(tmp_path / "o"), tp=2, format=fmt,
                           dtype=dtype))  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_resolve_reports_the_scheme_auto_decides_by(fp8_ckpt: Path) -> None:
    resolved = resolve(StageRequest(source=str(fp8_ckpt), out="", tp=1), config=True)
    resolved.close()
    assert resolved.summary()["quantization"] == FP8_CHANNEL


@pytest.mark.parametrize("storage", ["pvc", "s3"])
def test_auto_stages_fp8_per_rank_only_for_the_scheme_and_its_architectures(
    storage: str,
) -> None:
    per_rank, copy_ = AUTO_FORMATS[(storage, True)], AUTO_FORMATS[(storage, False)]
    assert FORMATS[per_rank].splits_quantized
    llama = choose_format(storage, "LlamaForCausalLM", FP8_CHANNEL)
    assert llama.format == per_rank
    assert llama.reason == (
        f"architecture LlamaForCausalLM ({FP8_CHANNEL}) is split per rank: staged as {per_rank}"
    )
    mixtral = choose_format(storage, "MixtralForCausalLM", FP8_CHANNEL)
    assert mixtral.format == copy_
    assert mixtral.reason.startswith(
        f"architecture MixtralForCausalLM has no per-rank rules for {FP8_CHANNEL}: cached"
    )
    other = choose_format(storage, "LlamaForCausalLM", "compressed-tensors")
    assert other.format == copy_
    assert other.reason == (
        "the checkpoint is quantized (compressed-tensors), which is not split per rank: cached "
        f"in the Hugging Face layout ({copy_})"
    )



@pytest.mark.parametrize("storage", ["pvc", "s3"])
def test_auto_splits_block_fp8_per_rank_for_deepseek_v3_and_qwen3_moe_only(storage: str) -> None:
    per_rank, copy_ = AUTO_FORMATS[(storage, True)], AUTO_FORMATS[(storage, False)]
    for architecture in ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert choose_format(storage, architecture, FP8_BLOCK).format == per_rank
    for architecture in ("Qwen3ForCausalLM", "DeepseekV2ForCausalLM"):
        other = choose_format(storage, architecture, FP8_BLOCK)
        assert other.format == copy_
        assert other.reason.startswith(f"architecture {architecture} has no per-rank rules")
    assert choose_format(storage, "DeepseekV3ForCausalLM", "fp8").format == copy_


def test_block_fp8_refuses_tensorizer_and_stages_each_ranks_tiles(tmp_path: Path) -> None:
    """Staged end to end: rank r's ``kv_b_proj.weight_scale_inv`` is the source's tile rows of
    its heads (golden values cut here from the source, 128 rows a tile)."""
    spec = SyntheticModel(architecture="DeepseekV3ForCausalLM", hidden_size=256,
                          intermediate_size=256, num_heads=4, num_kv_heads=4, vocab_size=64,
                          num_experts=2, experts_per_token=1, dtype="bfloat16", fp8_block=True,
                          q_lora_rank=128, v_head_dim=64)  # fmt: skip
    src = write_checkpoint(spec, tmp_path / "src")
    with pytest.raises(SpecError, match="format tensorizer does not take quantized checkpoints"):
        stage(StageRequest(source=str(src), out=str(tmp_path / "t"), tp=2, format="tensorizer"))
    stage(StageRequest(source=str(src), out=str(tmp_path / "out"), tp=2))
    name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        whole = f.get_tensor(name)
    assert whole.shape == (4, 4) and whole.dtype == torch.float32  # 4 heads x 128 rows; 512
    for rank in range(2):
        with safe_open(str(tmp_path / "out" / f"model-rank-{rank}-part-0.safetensors"), "pt") as f:
            assert f.get_tensor(name).equal(whole[2 * rank : 2 * rank + 2])
