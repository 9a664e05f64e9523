"""Malformed input: a corpus of broken safetensors files and config files, and a bounded-time
fuzzer over the header parser and the shard planner.

The guarantee: only clean ``ModelstageError``s (one line, naming the file or field), never
another exception, a hang, an allocation proportional to a number the file claims, or a
published artifact. Allocation is measured with tracemalloc around each parse: a header that
claims exabytes must cost what its bytes cost.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelstage.stager.errors import ModelstageError
from modelstage.stager.layouts import layout_for
from modelstage.stager.model_config import ModelConfig
from modelstage.stager.safetensors_format import MAX_HEADER_BYTES, parse_header, read_header
from modelstage.stager.shard_plan import SourceTensor, plan_shards
from modelstage.stager.stage import StageRequest, stage

MiB = 1024 * 1024
ALLOC_LIMIT = 16 * MiB
"""Peak Python allocation allowed while refusing one corrupt file, plus JSON_FACTOR bytes per
byte of input: parsing JSON into Python objects costs about 10x the text."""
JSON_FACTOR = 16


def encode(doc: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F16", "shape": [4], "data_offsets": [16, 24]}}  # fmt: skip
GOOD_FILE = encode(GOOD, bytes(24))
HEADER_END = 8 + len(json.dumps(GOOD).encode())


def with_tensor(**entry: Any) -> bytes:
    base = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    return encode({"a": {**base, **entry}}, bytes(16))


CORPUS: dict[str, bytes] = {
    # truncated at every structural boundary
    "empty": b"",
    "truncated in the length prefix": GOOD_FILE[:7],
    "length prefix only": GOOD_FILE[:8],
    "truncated inside the header": GOOD_FILE[: HEADER_END - 10],
    "truncated at the end of the header": GOOD_FILE[:HEADER_END],
    "truncated inside the first tensor": GOOD_FILE[: HEADER_END + 8],
    "truncated one byte before the end": GOOD_FILE[:-1],
    # the header length lies
    "header length 2**64-1": encode(GOOD, bytes(24), length=2**64 - 1),
    "header length above the limit": encode(GOOD, bytes(24), length=MAX_HEADER_BYTES + 1),
    "header length short of the JSON": encode(GOOD, bytes(24), length=20),
    "header length swallowing the data": encode(GOOD, b"\xff" * 24, length=HEADER_END - 8 + 24),
    "header length zero": encode(GOOD, bytes(24), length=0),
    # not UTF-8, not JSON, not an object
    "invalid UTF-8": encode(b'{"\xff\xfe": 1}'),
    "invalid JSON": encode(b'{"a": {"dtype": "F32",'),
    "JSON array": encode([1, 2, 3]),
    "JSON nested 100000 deep": encode(b"[" * 100_000 + b"]" * 100_000),
    "NaN in offsets": encode(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [NaN, 4]}}'),
    # names, offsets, shapes, dtypes
    "duplicate names": encode(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
                              b' "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}',
                              bytes(2)),
    "entry not an object": encode({"a": [1, 2]}, bytes(16)),
    "negative begin": with_tensor(data_offsets=[-16, 0]),
    "end before begin": with_tensor(data_offsets=[16, 0]),
    "offsets beyond the data": with_tensor(data_offsets=[0, 1 << 40]),
    "three offsets": with_tensor(data_offsets=[0, 8, 16]),
    "float offsets": with_tensor(data_offsets=[0.0, 16.0]),
    "overlapping tensors": encode({
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }, bytes(24)),
    "negative dimension": with_tensor(shape=[-2, -2]),
    "byte size overflows 64 bits": with_tensor(shape=[2**40, 2**40, 2**40]),
    "shape of floats": with_tensor(shape=[2.0, 2.0]),
    "shape not a list": with_tensor(shape="2x2"),
    "boolean dimension": with_tensor(shape=[True, 16]),
    "unknown dtype": with_tensor(dtype="F128"),
    "dtype missing": encode({"a": {"shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16)),
    "metadata not strings": encode({"__metadata__": {"format": 1}, **GOOD}, bytes(24)),
    "huge header of many tensors claiming exabytes": encode({
        f"t{i}": {"dtype": "F64", "shape": [2**30, 2**30], "data_offsets": [0, 2**63]}
        for i in range(20_000)
    }),
}


def refuse_bounded(call: Callable[[], object], input_bytes: int = 0) -> ModelstageError:
    """``call`` must raise a ModelstageError, allocating no more than ALLOC_LIMIT plus
    JSON_FACTOR per byte of input: never in proportion to a size the input claims."""
    tracemalloc.start()
    try:
        call()
    except ModelstageError as e:
        error = e
    else:
        raise AssertionError("accepted")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < ALLOC_LIMIT + JSON_FACTOR * input_bytes, f"{peak} bytes allocated to refuse it"
    assert "\n" not in str(error)
    return error


def read_bytes_header(data: bytes) -> object:
    return read_header("model.safetensors", len(data), lambda o, n: data[o : o + n])


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_each_corrupt_safetensors_file_is_refused_by_name_with_bounded_memory(name: str) -> None:
    error = refuse_bounded(lambda: read_bytes_header(CORPUS[name]), len(CORPUS[name]))
    assert "model.safetensors" in str(error)


def test_the_corpus_holds_at_least_twenty_cases_and_its_base_file_parses() -> None:
    assert len(CORPUS) >= 20
    header = read_bytes_header(GOOD_FILE)
    assert sorted(header.tensors) == ["a", "b"]  # type: ignore[attr-defined]


def copy_ckpt(small_ckpt: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(small_ckpt, ckpt)
    return ckpt


@pytest.mark.parametrize("name", ["truncated inside the first tensor", "header length 2**64-1",
                                  "overlapping tensors", "byte size overflows 64 bits",
                                  "invalid UTF-8", "unknown dtype"])  # fmt: skip
def test_a_stage_over_a_corrupt_weight_file_publishes_nothing(
    name: str, small_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(small_ckpt, tmp_path)
    weights = sorted(ckpt.glob("*.safetensors"))[0]
    weights.write_bytes(CORPUS[name])
    out = tmp_path / "out"
    error = refuse_bounded(lambda: stage(StageRequest(source=str(ckpt), out=str(out), tp=2)))
    assert weights.name in str(error)
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def config_cases(base: dict[str, Any]) -> dict[str, dict[str, Any] | bytes]:
    def without(key: str) -> dict[str, Any]:
        return {k: v for k, v in base.items() if k != key}

    return {
        "no architectures": without("architectures"),
        "two architectures": {**base, "architectures": ["LlamaForCausalLM", "X"]},
        "unknown architecture": {**base, "architectures": ["NoSuchForCausalLM"]},
        "no hidden_size": without("hidden_size"),
        "no num_hidden_layers": without("num_hidden_layers"),
        "hidden_size zero": {**base, "hidden_size": 0},
        "hidden_size negative": {**base, "hidden_size": -256},
        "hidden_size as a string": {**base, "hidden_size": "256"},
        "hidden_size 2**40": {**base, "hidden_size": 2**40},
        "vocab_size 10**12": {**base, "vocab_size": 10**12},
        "num_hidden_layers 10**9": {**base, "num_hidden_layers": 10**9},
        "heads not dividing hidden": {**base, "num_attention_heads": 7},
        "quantized": {**base, "quantization_config": {"quant_method": "gptq"}},
        "array instead of object": b"[1, 2]",
        "invalid JSON": b'{"hidden_size": ',
        "invalid UTF-8": b'{"\xff": 1}',
    }


def test_each_corrupt_config_is_refused_cleanly_and_publishes_nothing(
    small_ckpt: Path, tmp_path: Path
) -> None:
    base = json.loads((small_ckpt / "config.json").read_text())
    cases = config_cases(base)
    assert len(cases) >= 15
    for name, config in cases.items():
        ckpt = copy_ckpt(small_ckpt, tmp_path / name.replace(" ", "-"))
        raw = config if isinstance(config, bytes) else json.dumps(config).encode()
        (ckpt / "config.json").write_bytes(raw)
        out = tmp_path / name.replace(" ", "-") / "out"
        try:
            refuse_bounded(lambda c=ckpt, o=out: stage(StageRequest(source=str(c), out=str(o),
                                                                   tp=2)))  # fmt: skip
        except AssertionError as e:
            raise AssertionError(f"config case {name!r}: {e}") from None
        assert not out.exists(), name


def test_an_oversized_config_is_refused_before_it_is_read(small_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(small_ckpt, tmp_path)
    with open(ckpt / "config.json", "r+b") as f:
        f.truncate(65 * MiB)  # sparse: costs no disk
    error = refuse_bounded(lambda: stage(StageRequest(source=str(ckpt), out=str(tmp_path / "o"),
                                                      tp=2)))  # fmt: skip
    assert "config.json" in str(error) and "too large" in str(error)


# --- fuzzing --------------------------------------------------------------------------------
FUZZ = settings(max_examples=400, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
"""Bounded work: a fixed number of examples (derandomized, so a run is reproducible). No
per-example deadline (a busy CI machine must not fail a test); a hang is caught by the
``timeout`` mark on each fuzz test, far above its normal few seconds."""

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
dims = st.integers(-4, 2**64) | st.sampled_from([0, 1, 2, 16, 2**31, 2**62])
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "BOOL", "F128", "", "f32"]) | json_values,
        "shape": st.lists(dims, max_size=4) | json_values,
        "data_offsets": st.lists(st.integers(-(2**64), 2**64), min_size=0, max_size=3) | json_values,
    },
)
headers = st.dictionaries(st.text(max_size=12) | st.just("__metadata__"), entries | json_values, max_size=6)


def accept_or_refuse_cleanly(call: Callable[[], object]) -> None:
    try:
        call()
    except ModelstageError as e:
        assert str(e).strip(), "an error without a message"


@pytest.mark.timeout(300)
@FUZZ
@given(raw=st.binary(max_size=512), file_size=st.integers(0, 2**64))
def test_fuzzed_header_bytes_parse_or_fail_cleanly(raw: bytes, file_size: int) -> None:
    accept_or_refuse_cleanly(lambda: parse_header("f.safetensors", raw, file_size))


@pytest.mark.timeout(300)
@FUZZ
@given(doc=headers, slack=st.integers(0, 4096))
def test_fuzzed_header_documents_parse_or_fail_cleanly_and_stay_in_bounds(
    doc: dict[str, Any], slack: int
) -> None:
    raw = json.dumps(doc).encode()
    file_size = 8 + len(raw) + slack
    try:
        header = parse_header("f.safetensors", raw, file_size)
    except ModelstageError:
        return
    for t in header.tensors.values():  # what was accepted is consistent with the file
        assert header.data_start <= t.begin <= t.end <= file_size
        assert t.nbytes == math.prod(t.shape) * t.itemsize


@pytest.mark.timeout(300)
@FUZZ
@given(prefix=st.binary(min_size=0, max_size=16), body=st.binary(max_size=256),
       claimed=st.integers(0, 2**64 - 1))  # fmt: skip
def test_fuzzed_files_through_read_header_never_read_past_the_claimed_bounds(
    prefix: bytes, body: bytes, claimed: int
) -> None:
    data = struct.pack("<Q", claimed % (len(body) + 64) if claimed % 3 else claimed) + prefix + body
    reads: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        reads.append((offset, length))
        assert offset >= 0 and offset + length <= len(data), "read beyond the file"
        return data[offset : offset + length]

    accept_or_refuse_cleanly(lambda: read_header("f.safetensors", len(data), read))


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 100}  # fmt: skip
config_values = st.integers(-2, 2**40) | st.sampled_from([1, 2, 4, 8, 64, 100, 128]) | json_values


@pytest.mark.timeout(300)
@FUZZ
@given(edits=st.dictionaries(st.sampled_from([*LLAMA, "head_dim", "tie_word_embeddings",
                                              "torch_dtype"]), config_values, max_size=4),
       tp=st.integers(-1, 17), dtype=st.sampled_from(["auto", "float16", "bfloat16", "float32", "int4"]),
       shapes=st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "lm_head.weight",
                                               "model.norm.weight", "model.layers.0.mlp.up_proj.weight",
                                               "model.layers.0.self_attn.q_proj.weight", "x.weight"]),
                              st.lists(st.integers(0, 2**33), max_size=3), max_size=6))  # fmt: skip
def test_fuzzed_configs_and_tensors_plan_or_fail_cleanly(
    edits: dict[str, Any], tp: int, dtype: str, shapes: dict[str, list[int]]
) -> None:
    def plan() -> object:
        config = ModelConfig.from_dict({**LLAMA, **edits})
        sources = {n: SourceTensor("F32", tuple(s)) for n, s in shapes.items()}
        return plan_shards(config, sources, tp, layout_for(None), dtype)

    accept_or_refuse_cleanly(plan)
