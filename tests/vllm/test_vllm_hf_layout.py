"""The Hugging Face layout cache, which takes any architecture without per-rank rules: a GPT-2
checkpoint (an architecture the per-rank table does not know: Conv1D weights stored transposed,
q/k/v fused in ``c_attn``, learned positions, a tied head) staged as ``safetensors`` and loaded
through the plugin's checking loader (``modelstage_safetensors``) gives exactly the token ids
and log-probabilities of stock vLLM on the original checkpoint (bf16, TP 2); the same artifact
with one flipped bit is refused before vLLM serves.

Three vLLM starts (the reference is cached on disk): the reference, the staged artifact, the
corrupt control.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from modelstage.core.architectures import ARCHITECTURES
from modelstage.devtools.synthetic import SyntheticModel, write_tokenizer
from vllm_oracle import STAGE_TIMEOUT_S, VllmRun, differences, reference, run_vllm

pytestmark = pytest.mark.vllm

Timings = list[tuple[str, VllmRun]]
TP = 2
DTYPE = "bfloat16"
VOCAB = 512
PROMPTS = [[1, 5, 100, 255, 256, 300, 511, 42, 7, 64], [1, 511, 510, 3, 400], [1, 250]]
ARCHITECTURE = "GPT2LMHeadModel"
SEED = 7


def write_gpt2(out: Path) -> Path:
    """A tiny GPT-2 in bf16 (2 layers, hidden 128, 4 heads, vocab 512) in two safetensors files
    with their index, and a tokenizer of the same vocabulary. Seeded weights of std
    1/sqrt(fan-in), norms near 1 and small biases: logits far from uniform, every tensor
    distinct, so a misplaced shard shows in the log-probabilities."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=128, n_layer=2, n_head=4, n_inner=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:  # Conv1D is [in, out]: the embeddings' fan-in is the hidden size
                fan_in = param.shape[0] if ".h." in name else param.shape[1]
                param.normal_(0.0, 1.0 / math.sqrt(fan_in))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.02)
            else:  # layer norm scales
                param.normal_(1.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size="400KB")
    write_tokenizer(SyntheticModel(vocab_size=VOCAB), out)
    return out


def stage_safetensors(src: Path, out: Path) -> dict[str, object]:
    cli = Path(sys.executable).with_name("modelstage")
    proc = subprocess.run(
        [str(cli), "stage", str(src), "--tp", str(TP), "--format", "safetensors", "--out",
         str(out)],
        capture_output=True, text=True, timeout=STAGE_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(checkpoint, its safetensors artifact, the artifact's digest)."""
    root = tmp_path_factory.mktemp("gpt2")
    src = write_gpt2(root / "ckpt")
    assert len(list(src.glob("*.safetensors"))) == 2, "the test wants a sharded checkpoint"
    assert (src / "model.safetensors.index.json").is_file()
    summary = stage_safetensors(src, root / "artifact")
    return src, root / "artifact", str(summary["digest"])


def plugin_env(digest: str) -> dict[str, str]:
    """What the operator sets on a serving pod (content verification is on by default)."""
    return {"MODELSTAGE_DIGEST": digest, "MODELSTAGE_FORMAT": "safetensors", "MODELSTAGE_TP": str(TP)}


def test_the_architecture_is_outside_the_per_rank_table() -> None:
    """What this file proves holds for an architecture without per-rank rules only."""
    assert ARCHITECTURE not in ARCHITECTURES, (
        f"{ARCHITECTURE} has per-rank rules now: pick an architecture outside the table"
    )


def test_gpt2_cached_as_safetensors_gives_exactly_the_reference_logprobs(
    gpt2: tuple[Path, Path, str], timings: Timings
) -> None:
    src, artifact, digest = gpt2
    config = json.loads((artifact / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    ref = reference(src, TP, PROMPTS, DTYPE)
    timings.append((f"reference gpt2 tp{TP} {DTYPE}", ref))
    assert ref.output["plugin_load_formats"] == [] and ref.output["dtype"] == DTYPE
    got = run_vllm(artifact, TP, "modelstage_safetensors", PROMPTS, DTYPE,
                   env=plugin_env(digest), plugin=True)  # fmt: skip
    timings.append((f"staged    gpt2 tp{TP} modelstage_safetensors", got))
    assert "modelstage_safetensors" in got.output["plugin_load_formats"]
    assert got.output["load_format"] == "modelstage_safetensors"
    assert f'"digest":"{digest}"' in got.log, "the checking loader did not load it"
    found = differences(ref.output, got.output)
    assert not found, "the cached artifact differs from the checkpoint:\n" + "\n".join(found)


def test_a_flipped_bit_in_the_cached_checkpoint_is_refused_before_serving(
    gpt2: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Staged with small hash chunks, so the flipped bit sits in a chunk past the header's:
    the verify phase passes and the pass before loading (vLLM's default loader moves the
    bytes) refuses it, naming the file and the chunk."""
    from modelstage.core.integrity import digest_bytes
    from modelstage.stager.stage import StageRequest, stage

    src, _, _ = gpt2
    chunk = 16 * 1024
    out = tmp_path / "artifact"
    request = StageRequest(
        source=str(src), out=str(out), tp=TP, format="safetensors", chunk_bytes=chunk
    )
    digest = str(stage(request)["digest"])
    victim = sorted(out.glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    at = len(data) - 2  # tensor data: the header and the size stay valid
    data[at] ^= 0x01
    victim.write_bytes(bytes(data))
    index = at // chunk
    lo, hi = index * chunk, min((index + 1) * chunk, len(data))
    assert index > 0, "the flipped bit must lie past the header's chunk"
    actual = digest_bytes(bytes(data[lo:hi]), chunk).chunks[0]
    with pytest.raises(AssertionError) as failed:
        run_vllm(
            out, TP, "modelstage_safetensors", PROMPTS, DTYPE, env=plugin_env(digest), plugin=True
        )
    log = str(failed.value)
    refusal = re.escape(
        f"modelstage: refusing to load {victim}: chunk {index} (bytes {lo}-{hi - 1}) "
        f"has BLAKE3 {actual}, the manifest says "
    )
    assert re.search(refusal + "[0-9a-f]{64}; the file is corrupt: re-stage it", log), log[-3000:]
