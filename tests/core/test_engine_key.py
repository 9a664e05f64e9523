"""The engine cache's key and the decision to use a cache (``core/engine_key.py``,
``core/engine_cache.py``): pure functions, no vLLM."""

from __future__ import annotations

import dataclasses
import json

import pytest
from modelstage.core.engine_cache import (
    CORRUPT,
    HIT,
    MISS,
    EngineCacheManifest,
    check_path,
    decide,
)
from modelstage.core.engine_key import (
    EngineArgs,
    HardwareClass,
    ServingConfig,
    compile_environment,
    cpu_class,
    key_factors,
    key_of,
)
from modelstage.core.errors import ArtifactError, SpecError

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse4_2 avx avx2 fma ht avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16
processor\t: 1
flags\t\t: fpu vme sse4_2 avx avx2 fma ht avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16
"""
DIGEST = "251ed163ad48fc7addc6"
ARGS = EngineArgs(maxModelLen=128, tensorParallelSize=1, dtype="float32")
CONFIG = ServingConfig(
    "0.32.0", "2.13.0+cpu", "/models/ns/abc", ARGS, {"VLLM_USE_AOT_COMPILE": "0"}
)
CPU = cpu_class(CPUINFO, "x86_64")


def manifest_for(factors: dict[str, object]) -> EngineCacheManifest:
    return EngineCacheManifest(key_of(factors), factors, {}, 0, "0.1.0", "t", 1.0, 1.0)


def test_cpu_class_keeps_the_isa_flags_that_change_codegen_and_drops_the_rest() -> None:
    assert CPU.isa == (
        "amx_bf16", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512_vnni", "avx512f", "fma",
        "sse4_2",
    )  # fmt: skip
    assert CPU.arch == "x86_64" and CPU.kind == "cpu"


def test_the_same_configuration_is_a_hit() -> None:
    factors = key_factors(DIGEST, CONFIG, CPU)
    assert decide(manifest_for(factors), key_factors(DIGEST, CONFIG, CPU)).result == HIT


@pytest.mark.parametrize(
    ("what", "config", "hardware", "named"),
    [
        ("vLLM version", dataclasses.replace(CONFIG, vllmVersion="0.31.0"), CPU, "vllmVersion"),
        ("TP", dataclasses.replace(CONFIG, engineArgs=dataclasses.replace(ARGS,
         tensorParallelSize=2)), CPU, "engineArgs.tensorParallelSize"),
        ("max-model-len", dataclasses.replace(CONFIG, engineArgs=dataclasses.replace(ARGS,
         maxModelLen=4096)), CPU, "engineArgs.maxModelLen"),
        ("CPU ISA", CONFIG, cpu_class(CPUINFO.replace(" amx_tile amx_bf16", ""), "x86_64"),
         "hardware.isa"),
        ("GPU", CONFIG, HardwareClass("gpu", gpu="NVIDIA H200", capability="9.0"),
         "hardware.kind"),
        ("torch", dataclasses.replace(CONFIG, torchVersion="2.12.0+cpu"), CPU, "torchVersion"),
        ("model path", dataclasses.replace(CONFIG, modelPath="/elsewhere"), CPU, "modelPath"),
        ("AOT mode", dataclasses.replace(CONFIG, environment={}), CPU,
         "environment.VLLM_USE_AOT_COMPILE"),
    ],
)  # fmt: skip
def test_a_cache_captured_for_another_configuration_is_not_used_and_the_reason_names_it(
    what: str, config: ServingConfig, hardware: HardwareClass, named: str
) -> None:
    captured = key_factors(DIGEST, CONFIG, CPU)
    verdict = decide(manifest_for(captured), key_factors(DIGEST, config, hardware))
    assert verdict.result == MISS, what
    assert named in verdict.reason, verdict.reason


def test_another_weights_digest_is_not_used() -> None:
    captured = key_factors(DIGEST, CONFIG, CPU)
    verdict = decide(manifest_for(captured), key_factors("0" * 20, CONFIG, CPU))
    assert verdict.result == MISS and "weightsDigest" in verdict.reason


def test_a_manifest_whose_factors_were_edited_to_match_is_corrupt_not_a_hit() -> None:
    captured = key_factors(DIGEST, dataclasses.replace(CONFIG, vllmVersion="0.31.0"), CPU)
    edited = manifest_for(captured)
    forged = dataclasses.replace(edited, factors=key_factors(DIGEST, CONFIG, CPU))
    assert decide(forged, key_factors(DIGEST, CONFIG, CPU)).result == CORRUPT


def test_compile_environment_drops_locations_runtime_settings_and_secrets() -> None:
    env = {
        "VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-7",
        "VLLM_CACHE_ROOT": "/x", "TORCHINDUCTOR_CACHE_DIR": "/y", "VLLM_PORT": "1",
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "VLLM_API_KEY": "s3cret", "HOME": "/root",
    }  # fmt: skip
    assert compile_environment(env) == {
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-7",
        "VLLM_USE_AOT_COMPILE": "0",
    }


def test_serving_config_round_trips_through_its_json() -> None:
    text = json.dumps(CONFIG.to_doc())
    assert ServingConfig.parse(text, "x") == CONFIG
    assert key_of(key_factors(DIGEST, ServingConfig.parse(text, "x"), CPU)) == key_of(
        key_factors(DIGEST, CONFIG, CPU)
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"tensorParallelSize": 1}', "maxModelLen is required"),
        ('{"maxModelLen": 128, "tp": 2}', "unknown engine argument 'tp'"),
        ('{"maxModelLen": "128"}', "maxModelLen must be a int"),
        ('{"maxModelLen": 0}', "at least 1"),
        ("[1]", "expected a JSON object"),
    ],
)
def test_bad_engine_arguments_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        EngineArgs.parse(text, "--engine-args")


def test_a_compilation_config_object_is_keyed_by_its_canonical_json() -> None:
    a = EngineArgs.parse('{"maxModelLen": 8, "compilationConfig": {"b": 1, "a": 2}}', "x")
    b = EngineArgs.parse('{"compilationConfig": {"a": 2, "b": 1}, "maxModelLen": 8}', "x")
    assert a == b and a.compilationConfig == '{"a":2,"b":1}'


@pytest.mark.parametrize(
    "name",
    ["../etc/passwd", "/etc/passwd", "inductor/../../x", "inductor/.hidden", "other/x",
     "inductor", "inductor//x", "inductor/" + "/".join(["d"] * 9)],
)  # fmt: skip
def test_paths_outside_the_cache_roots_are_refused(name: str) -> None:
    with pytest.raises(ArtifactError, match="not a path an engine cache holds"):
        check_path(name)


def test_a_manifest_naming_a_path_outside_the_roots_does_not_parse() -> None:
    doc = json.loads(manifest_for(key_factors(DIGEST, CONFIG, CPU)).to_json())
    doc["files"] = {"../x": {"size": 0, "blake3": "0" * 64, "chunkBytes": 1, "chunks": []}}
    with pytest.raises(ArtifactError, match="invalid engine-cache manifest"):
        EngineCacheManifest.from_json(json.dumps(doc), "m")
