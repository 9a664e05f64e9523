"""The Hugging Face layout cache, which takes any architecture without per-rank rules: a Gemma 2
checkpoint staged as ``safetensors`` and loaded through the plugin's checking loader
(``modelstage_safetensors``) gives exactly the token ids and log-probabilities of stock vLLM
on the original checkpoint (bf16, TP 2); the same artifact with one flipped bit is refused
before vLLM serves.

Three vLLM starts (the reference is cached on disk): the reference, the staged artifact, the
corrupt control.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from vllm_oracle import STAGE_TIMEOUT_S, VllmRun, differences, reference, run_vllm

pytestmark = pytest.mark.vllm

Timings = list[tuple[str, VllmRun]]
TP = 2
DTYPE = "bfloat16"
VOCAB = 512
PROMPTS = [[1, 5, 100, 255, 256, 300, 511, 42, 7, 64], [1, 511, 510, 3, 400], [1, 250]]
GEMMA2 = SyntheticModel(
    architecture="Gemma2ForCausalLM", hidden_size=128, intermediate_size=256, num_heads=4,
    num_kv_heads=2, head_dim=32, vocab_size=VOCAB, tie_word_embeddings=True, dtype="bfloat16",
    num_shards=2, seed=7,
)  # fmt: skip
"""A tiny Gemma 2 in bf16, two safetensors files with their index, norms as offsets from 1."""


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
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(checkpoint, its safetensors artifact, the artifact's digest)."""
    root = tmp_path_factory.mktemp("gemma2")
    src = write_checkpoint(GEMMA2, root / "ckpt")
    summary = stage_safetensors(src, root / "artifact")
    return src, root / "artifact", str(summary["digest"])


def plugin_env(digest: str) -> dict[str, str]:
    """What the operator sets on a serving pod (content verification is on by default)."""
    return {"MODELSTAGE_DIGEST": digest, "MODELSTAGE_FORMAT": "safetensors", "MODELSTAGE_TP": str(TP)}


def test_gemma2_cached_as_safetensors_gives_exactly_the_reference_logprobs(
    gemma2: tuple[Path, Path, str], timings: Timings
) -> None:
    src, artifact, digest = gemma2
    config = json.loads((artifact / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    ref = reference(src, TP, PROMPTS, DTYPE)
    timings.append((f"reference gemma2 tp{TP} {DTYPE}", ref))
    assert ref.output["plugin_load_formats"] == [] and ref.output["dtype"] == DTYPE
    got = run_vllm(artifact, TP, "modelstage_safetensors", PROMPTS, DTYPE,
                   env=plugin_env(digest), plugin=True)  # fmt: skip
    timings.append((f"staged    gemma2 tp{TP} modelstage_safetensors", got))
    assert "modelstage_safetensors" in got.output["plugin_load_formats"]
    assert got.output["load_format"] == "modelstage_safetensors"
    assert f'"digest":"{digest}"' in got.log, "the checking loader did not load it"
    found = differences(ref.output, got.output)
    assert not found, "the cached artifact differs from the checkpoint:\n" + "\n".join(found)


def test_a_flipped_bit_in_the_cached_checkpoint_is_refused_before_serving(
    gemma2: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Staged with small hash chunks, so the flipped bit sits in a chunk past the header's:
    the verify phase passes and the pass before loading (vLLM's default loader moves the
    bytes) refuses it, naming the file and the chunk."""
    from modelstage.core.integrity import digest_bytes
    from modelstage.stager.stage import StageRequest, stage

    src, _, _ = gemma2
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
