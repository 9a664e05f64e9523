"""An independent, deliberately naive statement of vLLM 0.32's per-rank layout.

Written from the documented facts, not from the planner, so the stager's output can be
checked against it byte for byte without vLLM. The vLLM oracle tier checks both against vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file

Arr = npt.NDArray[np.generic]
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def _heads(t: Arr, heads: int, hd: int, tp: int, r: int) -> Arr:
    if heads >= tp:
        per = heads // tp
        return t[r * per * hd : (r + 1) * per * hd]
    h = r // (tp // heads)
    return t[h * hd : (h + 1) * hd]


def _vocab(t: Arr, tp: int, r: int) -> Arr:
    padded = -(-t.shape[0] // 64) * 64
    full = np.zeros((padded, *t.shape[1:]), dtype=t.dtype)
    full[: t.shape[0]] = t
    per = padded // tp
    return full[r * per : (r + 1) * per]


def _split(t: Arr, tp: int, r: int, dim: int) -> Arr:
    return np.array_split(t, tp, axis=dim)[r]


def expected_rank(hf: dict[str, Arr], config: dict[str, object], tp: int, r: int) -> dict[str, Arr]:
    if config["architectures"] == ["GptOssForCausalLM"]:
        return _gpt_oss_rank(hf, config, tp, r)
    heads = int(config["num_attention_heads"])  # type: ignore[call-overload]
    kv = int(config["num_key_value_heads"])  # type: ignore[call-overload]
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // heads)  # type: ignore[call-overload]
    layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    hf = _unfused(hf, heads * hd, kv * hd)
    out: dict[str, Arr] = {}
    embed = _vocab(hf["model.embed_tokens.weight"], tp, r)
    if config.get("tie_word_embeddings"):
        out["lm_head.weight"] = embed
    else:
        out["model.embed_tokens.weight"] = embed
        out["lm_head.weight"] = _vocab(hf["lm_head.weight"], tp, r)
    out["model.norm.weight"] = hf["model.norm.weight"]
    for i in range(layers):
        a, m, p = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"model.layers.{i}"
        for kind in ("weight", "bias"):
            if f"{a}.q_proj.{kind}" in hf:
                out[f"{a}.qkv_proj.{kind}"] = np.concatenate([
                    _heads(hf[f"{a}.q_proj.{kind}"], heads, hd, tp, r),
                    _heads(hf[f"{a}.k_proj.{kind}"], kv, hd, tp, r),
                    _heads(hf[f"{a}.v_proj.{kind}"], kv, hd, tp, r),
                ])  # fmt: skip
        out[f"{a}.o_proj.weight"] = _split(hf[f"{a}.o_proj.weight"], tp, r, 1)
        if f"{m}.gate_proj.weight" not in hf:  # an MoE layer
            out.update(_experts(hf, p, tp, r, str(config["architectures"][0])))  # type: ignore[index]
        else:
            out[f"{m}.gate_up_proj.weight"] = np.concatenate([
                _split(hf[f"{m}.gate_proj.weight"], tp, r, 0),
                _split(hf[f"{m}.up_proj.weight"], tp, r, 0),
            ])  # fmt: skip
            out[f"{m}.down_proj.weight"] = _split(hf[f"{m}.down_proj.weight"], tp, r, 1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = hf[f"{p}.{norm}.weight"]
        for norm in ("q_norm", "k_norm"):
            if f"{a}.{norm}.weight" in hf:
                out[f"{a}.{norm}.weight"] = hf[f"{a}.{norm}.weight"]
        for scale in SCALES:
            out[f"{a}.attn.{scale}"] = np.array(1.0, dtype=np.float32)
    return out


def _experts(hf: dict[str, Arr], layer: str, tp: int, r: int, arch: str) -> dict[str, Arr]:
    """vLLM's fused MoE per rank: w13 [E, 2I/tp, H] = per expert cat(gate_r, up_r), w2
    [E, H, I/tp], the router whole (Qwen3-MoE's under its kept alias ``experts.gate``),
    Qwen2-MoE's shared expert as a dense MLP with its gate whole."""
    mixtral = f"{layer}.block_sparse_moe.gate.weight" in hf
    block = f"{layer}.block_sparse_moe" if mixtral else f"{layer}.mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    count = hf[f"{block}.gate.weight"].shape[0]
    x = [f"{block}.experts.{e}." for e in range(count)]
    routed = f"{block}.experts.routed_experts"
    router = "experts.gate" if arch == "Qwen3MoeForCausalLM" else "gate"
    out = {
        f"{routed}.w13_weight": np.stack([np.concatenate([
            _split(hf[f"{e}{gate}.weight"], tp, r, 0), _split(hf[f"{e}{up}.weight"], tp, r, 0),
        ]) for e in x]),
        f"{routed}.w2_weight": np.stack([_split(hf[f"{e}{down}.weight"], tp, r, 1) for e in x]),
        f"{block}.{router}.weight": hf[f"{block}.gate.weight"],
    }  # fmt: skip
    if arch == "Qwen2MoeForCausalLM":
        s, kept = f"{block}.shared_expert.", f"{block}.experts._shared_experts._layer."
        out[kept + "gate_up_proj.weight"] = np.concatenate([
            _split(hf[s + "gate_proj.weight"], tp, r, 0), _split(hf[s + "up_proj.weight"], tp, r, 0),
        ])  # fmt: skip
        out[kept + "down_proj.weight"] = _split(hf[s + "down_proj.weight"], tp, r, 1)
        out[kept + "expert_gate.weight"] = hf[f"{block}.shared_expert_gate.weight"]
    return out


def _gpt_oss_rank(hf: dict[str, Arr], config: dict[str, object], tp: int, r: int) -> dict[str, Arr]:
    """gpt-oss: q/k/v, o and their biases as Llama's under vLLM's names (``model.embedding``,
    ``attn``), o's bias and the router whole, sinks split by heads, each expert's slices
    transposed (w13 keeps gate/up interleaved: a block of 2I/tp columns), w2's bias whole on
    rank 0 and zeros on the others."""
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])  # type: ignore[call-overload]
    hd = int(config["head_dim"])  # type: ignore[call-overload]
    out: dict[str, Arr] = {
        "model.embedding.weight": _vocab(hf["model.embed_tokens.weight"], tp, r),
        "lm_head.weight": _vocab(hf["lm_head.weight"], tp, r),
        "model.norm.weight": hf["model.norm.weight"],
    }
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{i}"
        a, m, attn, routed = f"{p}.self_attn", f"{p}.mlp", f"{p}.attn", f"{p}.mlp.experts.routed_experts"
        for kind in ("weight", "bias"):
            out[f"{attn}.qkv_proj.{kind}"] = np.concatenate([
                _heads(hf[f"{a}.q_proj.{kind}"], heads, hd, tp, r),
                _heads(hf[f"{a}.k_proj.{kind}"], kv, hd, tp, r),
                _heads(hf[f"{a}.v_proj.{kind}"], kv, hd, tp, r),
            ])  # fmt: skip
        out[f"{attn}.o_proj.weight"] = _split(hf[f"{a}.o_proj.weight"], tp, r, 1)
        out[f"{attn}.o_proj.bias"] = hf[f"{a}.o_proj.bias"]
        out[f"{attn}.sinks"] = _split(hf[f"{a}.sinks"], tp, r, 0)
        for scale in SCALES:
            out[f"{attn}.attn.{scale}"] = np.array(1.0, dtype=np.float32)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = hf[f"{p}.{norm}.weight"]
        for kind in ("weight", "bias"):
            out[f"{m}.router.{kind}"] = hf[f"{m}.router.{kind}"]
        gate_up, down = hf[f"{m}.experts.gate_up_proj"], hf[f"{m}.experts.down_proj"]
        out[f"{routed}.w13_weight"] = _split(gate_up, tp, r, 2).transpose(0, 2, 1).copy()
        out[f"{routed}.w13_bias"] = _split(hf[f"{m}.experts.gate_up_proj_bias"], tp, r, 1)
        out[f"{routed}.w2_weight"] = _split(down, tp, r, 1).transpose(0, 2, 1).copy()
        bias = hf[f"{m}.experts.down_proj_bias"]
        out[f"{routed}.w2_bias"] = bias if r == 0 else np.zeros_like(bias)
    return out


def _unfused(hf: dict[str, Arr], q: int, kv: int) -> dict[str, Arr]:
    """Phi-3's fused sources cut into the parts a Llama checkpoint holds: ``qkv_proj`` rows
    into q [q], k [kv], v [kv]; ``gate_up_proj`` rows into gate and up halves."""
    out = dict(hf)
    for name in [n for n in hf if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        t = out.pop(name)
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            parts = {"q_proj": t[:q], "k_proj": t[q : q + kv], "v_proj": t[q + kv :]}
        else:
            base, half = name.removesuffix("gate_up_proj.weight"), t.shape[0] // 2
            parts = {"gate_proj": t[:half], "up_proj": t[half:]}
        out.update({f"{base}{part}.weight": rows for part, rows in parts.items()})
    return out


def load_checkpoint_tensors(path: Path) -> dict[str, Arr]:
    tensors: dict[str, Arr] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def load_config(path: Path) -> dict[str, object]:
    return json.loads((path / "config.json").read_text())  # type: ignore[no-any-return]
