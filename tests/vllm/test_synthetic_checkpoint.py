"""The generated checkpoints look exactly like hub checkpoints to transformers and safetensors.

Not marked ``vllm`` (no vLLM start, a few seconds): they guard the inputs of the oracle tier
and of the stager tests, so a generator bug cannot pass as a stager bug or hide one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from modelstage.devtools.synthetic import (
    ARCHITECTURES,
    SyntheticModel,
    _encode,
    llama_demo,
    write_checkpoint,
)
from safetensors import safe_open


def _load(ckpt: Path) -> dict[str, tuple[str, list[int], str]]:
    """name -> (file, shape, dtype) over every safetensors file of the checkpoint."""
    found: dict[str, tuple[str, list[int], str]] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensor = f.get_slice(key)
                assert key not in found, f"{key} in two files"
                found[key] = (path.name, list(tensor.get_shape()), tensor.get_dtype())
    return found


def _load_values(ckpt: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(str(ckpt / "model.safetensors")).items()}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_config_json_is_accepted_by_transformers(architecture: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    spec = SyntheticModel(
        architecture=architecture,  # type: ignore[arg-type]
        head_dim=64 if architecture == "Qwen3ForCausalLM" else None,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    config = AutoConfig.from_pretrained(write_checkpoint(spec, tmp_path))
    assert config.architectures == [architecture]
    assert config.num_key_value_heads == spec.num_kv_heads
    assert config.vocab_size == spec.vocab_size
    assert config.tie_word_embeddings is True
    if architecture == "Qwen3ForCausalLM":
        assert config.head_dim == 64


def test_weights_carry_exactly_the_hugging_face_names_and_shapes(tmp_path: Path) -> None:
    qwen2 = _load(write_checkpoint(SyntheticModel(architecture="Qwen2ForCausalLM"), tmp_path / "q2"))
    assert qwen2["model.layers.1.self_attn.k_proj.bias"][1] == [2 * 32]
    assert qwen2["lm_head.weight"][1] == [1000, 256]
    assert not any("norm" in k and "self_attn" in k for k in qwen2)

    qwen3 = _load(
        write_checkpoint(
            SyntheticModel(architecture="Qwen3ForCausalLM", head_dim=64, tie_word_embeddings=True),
            tmp_path / "q3",
        )
    )
    assert qwen3["model.layers.0.self_attn.q_proj.weight"][1] == [8 * 64, 256]
    assert qwen3["model.layers.0.self_attn.o_proj.weight"][1] == [256, 8 * 64]
    assert qwen3["model.layers.0.self_attn.k_norm.weight"][1] == [64]
    assert "lm_head.weight" not in qwen3
    assert not any(k.endswith(".bias") for k in qwen3)
    assert set(qwen3) == {name for name, _ in SyntheticModel(
        architecture="Qwen3ForCausalLM", head_dim=64, tie_word_embeddings=True).tensors()}  # fmt: skip


def test_mixtral_has_a_router_and_w1_w2_w3_per_expert_as_the_hub_writes_them(
    tmp_path: Path,
) -> None:
    spec = SyntheticModel(architecture="MixtralForCausalLM", num_experts=3, dtype="bfloat16")
    mixtral = _load(write_checkpoint(spec, tmp_path))
    moe = "model.layers.1.block_sparse_moe."
    assert mixtral[moe + "gate.weight"][1:] == ([3, 256], "BF16")
    assert mixtral[moe + "experts.2.w1.weight"][1] == [512, 256]  # gate: [I, H]
    assert mixtral[moe + "experts.2.w3.weight"][1] == [512, 256]  # up: [I, H]
    assert mixtral[moe + "experts.2.w2.weight"][1] == [256, 512]  # down: [H, I]
    assert not any(".mlp." in k or "experts.3." in k for k in mixtral)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (3, 2)


def test_gpt_oss_stacks_its_experts_input_dim_first_as_the_bf16_hub_checkpoints_do(
    tmp_path: Path,
) -> None:
    from transformers import AutoConfig

    spec = SyntheticModel(architecture="GptOssForCausalLM", num_layers=3, num_experts=3,
                          head_dim=32, dtype="bfloat16")  # fmt: skip
    gpt_oss = _load(write_checkpoint(spec, tmp_path))
    layer = "model.layers.1."
    assert gpt_oss[layer + "mlp.router.weight"][1:] == ([3, 256], "BF16")
    assert gpt_oss[layer + "mlp.router.bias"][1] == [3]
    assert gpt_oss[layer + "mlp.experts.gate_up_proj"][1] == [3, 256, 2 * 512]  # [E, H, 2I]
    assert gpt_oss[layer + "mlp.experts.gate_up_proj_bias"][1] == [3, 2 * 512]
    assert gpt_oss[layer + "mlp.experts.down_proj"][1] == [3, 512, 256]  # [E, I, H]
    assert gpt_oss[layer + "mlp.experts.down_proj_bias"][1] == [3, 256]
    assert gpt_oss[layer + "self_attn.sinks"][1] == [8]
    assert gpt_oss[layer + "self_attn.q_proj.bias"][1] == [8 * 32]
    assert gpt_oss[layer + "self_attn.o_proj.bias"][1] == [256]
    assert set(gpt_oss) == {name for name, _ in spec.tensors()}
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.rope_parameters["rope_type"] == "yarn" and config.head_dim == 32
    assert (config.num_local_experts, config.num_experts_per_tok) == (3, 2)
    assert config.sliding_window == 8 and config.swiglu_limit == 7.0
def test_phi3_holds_qkv_and_gate_up_fused_as_the_hub_writes_them(tmp_path: Path) -> None:
    spec = SyntheticModel(architecture="Phi3ForCausalLM", num_kv_heads=2, dtype="bfloat16")
    phi3 = _load(write_checkpoint(spec, tmp_path))
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert phi3[attn + "qkv_proj.weight"][1:] == ([256 + 2 * 64, 256], "BF16")  # q, k, v rows
    assert phi3[attn + "o_proj.weight"][1] == [256, 256]
    assert phi3[mlp + "gate_up_proj.weight"][1] == [2 * 512, 256]  # gate, up rows
    assert phi3[mlp + "down_proj.weight"][1] == [256, 512]
    assert not any(p in k for k in phi3 for p in (".q_proj", ".k_proj", ".v_proj", ".up_proj"))
    assert not any(k.endswith(".bias") for k in phi3)
    assert set(phi3) == {name for name, _ in spec.tensors()}
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["rope_scaling"]) == ("phi3", None)
    assert config["original_max_position_embeddings"] == config["max_position_embeddings"]


def test_split_fused_puts_q_k_v_and_gate_up_in_different_files(tmp_path: Path) -> None:
    ckpt = write_checkpoint(SyntheticModel(num_shards=3, split_fused=True), tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    tensors = _load(ckpt)
    assert index["weight_map"] == {name: where[0] for name, where in tensors.items()}
    total = sum(int(np.prod(shape)) * 4 for _, shape, _ in tensors.values())
    assert index["metadata"]["total_size"] == total
    for layer in range(2):
        files = {index["weight_map"][f"model.layers.{layer}.self_attn.{p}_proj.weight"]
                 for p in "qkv"}  # fmt: skip
        assert len(files) == 3
        gate, up = (index["weight_map"][f"model.layers.{layer}.mlp.{p}_proj.weight"]
                    for p in ("gate", "up"))  # fmt: skip
        assert gate != up


def test_one_shard_is_a_single_model_safetensors_without_index(tmp_path: Path) -> None:
    ckpt = write_checkpoint(SyntheticModel(num_shards=1), tmp_path)
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]
    assert not (ckpt / "model.safetensors.index.json").exists()


def test_same_spec_writes_identical_bytes_and_the_seed_changes_them(tmp_path: Path) -> None:
    def digest(ckpt: Path) -> str:
        h = hashlib.sha256()
        for path in sorted(ckpt.iterdir()):
            h.update(path.name.encode() + path.read_bytes())
        return h.hexdigest()

    spec = SyntheticModel(num_shards=2, dtype="bfloat16")
    first = digest(write_checkpoint(spec, tmp_path / "a"))
    assert digest(write_checkpoint(spec, tmp_path / "b")) == first
    assert digest(write_checkpoint(SyntheticModel(num_shards=2, dtype="bfloat16", seed=1),
                                   tmp_path / "c")) != first  # fmt: skip


def test_weights_are_scaled_for_informative_logits(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    weights = load_file(str(write_checkpoint(SyntheticModel(), tmp_path) / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 1 / 16) < 0.005  # 1/sqrt(hidden 256)
    norm = weights["model.norm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05 and float(norm.std()) > 0


def test_bfloat16_rounds_like_torch() -> None:
    import torch

    values = np.random.default_rng(0).standard_normal(100_000, dtype=np.float32)
    values[:4] = [0.0, -0.0, 1e-40, 3.0e38]  # zero, negative zero, subnormal, near max
    ours = np.frombuffer(_encode(values, "bfloat16"), dtype="<u2")
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
    assert np.array_equal(ours, theirs)


def test_tokenizer_has_exactly_the_model_vocab(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    ckpt = write_checkpoint(SyntheticModel(vocab_size=777), tmp_path)
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 777
    assert tokenizer.encode("w5 w776 nope").ids == [5, 776, 0]
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == 2


def test_demo_model_is_the_llama_shape_of_the_design() -> None:
    demo = llama_demo()
    assert (demo.architecture, demo.hidden_size, demo.intermediate_size, demo.num_layers) == (
        "LlamaForCausalLM", 256, 512, 2)  # fmt: skip
    assert (demo.num_heads, demo.num_kv_heads, demo.vocab_size, demo.dtype) == (
        8, 2, 1000, "float32")  # fmt: skip


def test_impossible_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        SyntheticModel(num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="split_fused"):
        SyntheticModel(split_fused=True)
    with pytest.raises(ValueError, match="experts_per_token"):
        SyntheticModel(architecture="MixtralForCausalLM", num_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="architecture"):
        SyntheticModel(architecture="GPT2LMHeadModel")  # type: ignore[arg-type]


def test_fp8_checkpoints_are_llm_compressors_channel_quantization_of_the_bf16_weights(
    tmp_path: Path,
) -> None:
    """Each FP8 weight times its per-row scale is the unquantized checkpoint's weight to
    float8's precision; the bytes are torch's float8_e4m3fn cast of the clamped quotient; the
    config carries the compressed-tensors quantization_config transformers reads."""
    import torch
    from modelstage.devtools.synthetic import _encode_fp8, fp8_quantization_config
    from transformers import AutoConfig

    base = SyntheticModel(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                          num_layers=1, vocab_size=100, dtype="bfloat16")  # fmt: skip
    plain = write_checkpoint(base, tmp_path / "bf16")
    fp8 = write_checkpoint(SyntheticModel(**{**base.__dict__, "fp8": True}), tmp_path / "fp8")
    config = AutoConfig.from_pretrained(fp8)
    assert config.quantization_config == fp8_quantization_config()
    with safe_open(str(plain / "model.safetensors"), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    quantized = {k for k, v in got.items() if v.dtype == torch.float8_e4m3fn}
    assert quantized == {k for k in want if k.endswith("_proj.weight")}
    assert set(got) == set(want) | {k + "_scale" for k in quantized}
    for name in quantized:
        scale = got[name + "_scale"]
        assert scale.dtype == torch.bfloat16 and scale.shape == (want[name].shape[0], 1)
        assert scale.equal((want[name].abs().amax(dim=1, keepdim=True) / 448).bfloat16())
        expected = (want[name] / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert got[name].view(torch.uint8).equal(expected.view(torch.uint8)), name
        error = (got[name].float() * scale.float() - want[name].float()).abs()
        assert bool((error <= scale.float() * 32).all()), name  # float8 steps by 32 at the top
    values = np.linspace(-500, 500, 100_001, dtype=np.float32)
    ours = np.frombuffer(_encode_fp8(values), np.uint8)
    cast = torch.from_numpy(values).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert np.array_equal(ours, cast.numpy())
    for k in set(want) - quantized:
        assert got[k].equal(want[k]), k
@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_gemma_tensors_are_the_ones_transformers_saves_for_its_config(
    architecture: str, tmp_path: Path
) -> None:
    """Names, shapes and config as the hub's: transformers builds the model from the generated
    ``config.json`` (sliding and full layers alternating, Gemma 3's local rope base, Gemma 2's
    soft-capping) and the checkpoint holds exactly its parameters, the tied head left out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = SyntheticModel(
        architecture=architecture,  # type: ignore[arg-type]
        hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=32,
        vocab_size=100, tie_word_embeddings=True, dtype="bfloat16",
    )  # fmt: skip
    ckpt = write_checkpoint(spec, tmp_path)
    config = AutoConfig.from_pretrained(ckpt)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert (config.head_dim, config.query_pre_attn_scalar) == (32, 32)
    assert config.hidden_activation == "gelu_pytorch_tanh"
    if architecture == "Gemma2ForCausalLM":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    else:
        assert config.model_type == "gemma3_text"
        rope = {kind: p["rope_theta"] for kind, p in config.rope_parameters.items()}
        assert rope == {"sliding_attention": 10000.0, "full_attention": 1000000.0}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = {n: list(p.shape) for n, p in model.state_dict().items() if n != "lm_head.weight"}
    ours = {name: where[1] for name, where in _load(ckpt).items()}
    assert ours == theirs
    norms = [v for k, v in _load_values(ckpt).items() if k.endswith("norm.weight")]
    assert abs(float(np.mean([n.mean() for n in norms]))) < 0.05, "Gemma norms are offsets from 1"


def test_deepseek_v3_is_written_as_the_hub_writes_it(tmp_path: Path) -> None:
    """MLA with a query low rank under the hub's names, layer 0 dense and layer 1 MoE with two
    shared experts and the router's float32 correction bias, the prediction layer after the
    decoder layers; transformers reads the config as DeepSeek-V3's."""
    from transformers import AutoConfig

    spec = SyntheticModel(architecture="DeepseekV3ForCausalLM", hidden_size=128,
                          intermediate_size=64, num_heads=8, num_kv_heads=8, num_experts=4,
                          dtype="bfloat16")  # fmt: skip
    ds = _load(write_checkpoint(spec, tmp_path))
    attn, moe = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert ds[attn + "q_a_proj.weight"][1] == [96, 128]
    assert ds[attn + "q_b_proj.weight"][1] == [8 * (16 + 64), 96]  # heads x (nope + rope)
    assert ds[attn + "kv_a_proj_with_mqa.weight"][1] == [512 + 64, 128]
    assert ds[attn + "kv_b_proj.weight"][1] == [8 * (16 + 8), 512]  # heads x (nope + v)
    assert ds[attn + "o_proj.weight"][1] == [128, 8 * 8]
    assert ds["model.layers.0.mlp.gate_proj.weight"][1] == [128, 128]
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in ds)
    assert ds[moe + "gate.e_score_correction_bias"][1:] == ([4], "F32")
    assert ds[moe + "shared_experts.up_proj.weight"][1] == [2 * 64, 128]
    assert ds[moe + "experts.3.down_proj.weight"][1] == [128, 64]
    assert ds["model.layers.2.eh_proj.weight"][1] == [128, 256]
    assert ds["model.layers.2.mlp.experts.3.down_proj.weight"][1] == [128, 64]
    assert set(ds) == {name for name, _ in spec.tensors()}
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "deepseek_v3" and config.topk_method == "noaux_tc"
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank) == (512, 64, 96)
    assert (config.first_k_dense_replace, config.n_shared_experts) == (1, 2)
    assert config.num_nextn_predict_layers == 1
