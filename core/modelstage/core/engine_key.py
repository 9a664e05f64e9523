"""The engine cache's key: what must be equal for vLLM's compile caches to be reused.

An engine cache (``engine_cache.py``) is what vLLM and torch wrote to their cache roots while
compiling one model; a start reuses it only when it would have produced the same files. The
key is a hash of *factors*, each of which the installed vLLM (0.32) or torch puts into its
own cache key and which the capture controls:

- the weights artifact's digest (the graph's shapes and constants come from its config);
- the vLLM version (``VllmConfig.compute_hash`` in ``vllm/config/vllm.py`` starts with it) and
  the torch version (``torch_key`` and ``CacheBase.get_system`` in the inductor factors,
  ``get_inductor_factors`` in ``vllm/compilation/compiler_interface.py``);
- the model path string vLLM is given (``ModelConfig.compute_hash`` hashes it, so vLLM's own
  cache folder under ``VLLM_CACHE_ROOT/torch_compile_cache/`` differs per path, see
  ``vllm/compilation/backends.py`` and ``decorators.py``);
- the engine arguments that ``compute_hash`` summarises: TP/PP (``ParallelConfig``),
  max-model-len, dtype and quantization (``ModelConfig``), the compilation config and
  enforce-eager (``CompilationConfig``), the load format (``LoadConfig``);
- the environment: every ``VLLM_*`` variable vLLM does not list as location-only or runtime
  (``compile_factors`` in ``vllm/envs.py``: ``VLLM_CACHE_ROOT`` does not count,
  ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_USE_AOT_COMPILE`` do), and the ``TORCHINDUCTOR_*``
  variables that set inductor's config (not its cache directory);
- the hardware class: the GPU's name and compute capability (inductor's system factors), or
  for CPUs the instruction-set flags the compiled C++ kernels are built for (``-march`` of
  each ``.so``: not in torch's graph key, so a cache from another CPU would load and fault).

Pure functions, torch-free: the capture computes the key it records, ``prepare`` computes the
key of the configuration it serves and compares; on a mismatch ``differences`` names which
factors differ, for the log line.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .digest import DIGEST_HEX_CHARS
from .errors import SpecError

KEY_VERSION = 1
"""Bumped when the factors change meaning: every older cache becomes a miss."""
CPU_ISA_FLAGS = frozenset({
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2",
    "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512ifma", "avx512vbmi",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512_vbmi2", "avx512_bitalg",
    "avx512_vpopcntdq", "avx_vnni", "avx_vnni_int8", "avx_ne_convert",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex",
    "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm", "sme",
    "vsx", "vsx3", "mma",
})  # fmt: skip
"""The flags of ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``, POWER ``cpu``) that change
which kernels a compiler emits; the others (``ht``, ``vmx``, mitigations) do not."""
ENV_PREFIXES = ("VLLM_", "TORCHINDUCTOR_")
IGNORED_ENV = frozenset({
    "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_XLA_CACHE_PATH", "VLLM_ASSETS_CACHE",
    "VLLM_RPC_BASE_PATH", "VLLM_PORT", "VLLM_HOST_IP", "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_COLOR", "VLLM_LOG_STATS_INTERVAL", "VLLM_NO_USAGE_STATS",
    "VLLM_DO_NOT_TRACK", "VLLM_USAGE_STATS_SERVER", "VLLM_WORKER_MULTIPROC_METHOD",
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_DEBUG_DUMP_PATH",
    "VLLM_SERVER_DEV_MODE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
    "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "VLLM_TUNED_CONFIG_FOLDER",
    "TORCHINDUCTOR_CACHE_DIR",
})  # fmt: skip
"""Location-only and runtime variables: vLLM leaves them out of its own key (``vllm/envs.py``,
``compile_factors``), and where the cache lives must not decide whether it is used."""
_SECRET = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.IGNORECASE)
"""Never recorded in a manifest, whatever vLLM does with them."""


@dataclass(frozen=True)
class HardwareClass:
    """What the compiled kernels are built for: ``cpu`` with its architecture and ISA flags,
    or ``gpu`` with the device name and compute capability (``"9.0"``)."""

    kind: str
    arch: str = ""
    isa: tuple[str, ...] = ()
    gpu: str = ""
    capability: str = ""

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["isa"] = list(self.isa)
        return doc

    @staticmethod
    def from_doc(doc: Mapping[str, Any], where: str) -> HardwareClass:
        try:
            return HardwareClass(
                kind=str(doc["kind"]),
                arch=str(doc.get("arch", "")),
                isa=tuple(sorted(str(f) for f in doc.get("isa", ()))),
                gpu=str(doc.get("gpu", "")),
                capability=str(doc.get("capability", "")),
            )
        except (KeyError, TypeError) as e:
            raise SpecError(f"{where}: hardware class: expected kind, arch, isa, gpu, "
                            f"capability: {e}") from None  # fmt: skip


def cpu_class(cpuinfo: str, arch: str) -> HardwareClass:
    """The CPU class from ``/proc/cpuinfo``'s text: the ISA flags that matter, of the first
    processor (a node's cores share one flag set)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features", "cpu"):
            flags = sorted(set(value.split()) & CPU_ISA_FLAGS)
            if flags:
                return HardwareClass("cpu", arch=arch, isa=tuple(flags))
    return HardwareClass("cpu", arch=arch)


def gpu_class(name: str, capability: str) -> HardwareClass:
    return HardwareClass("gpu", gpu=name.strip(), capability=capability.strip())


@dataclass(frozen=True)
class EngineArgs:
    """The engine arguments that go into vLLM's ``compute_hash``, spelled as the CRD and the
    JSON of ``--engine-args`` spell them."""

    maxModelLen: int
    tensorParallelSize: int = 1
    pipelineParallelSize: int = 1
    dtype: str = "auto"
    quantization: str = ""
    enforceEager: bool = False
    compilationConfig: str = ""
    """Canonical JSON (sorted keys), or "" for vLLM's default."""
    loadFormat: str = ""

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def parse(text: str, where: str) -> EngineArgs:
        """From ``--engine-args`` JSON; unknown keys and wrong types are refused by name."""
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise SpecError(f"{where}: not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise SpecError(f"{where}: expected a JSON object of engine arguments")
        known = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(doc) - known)
        if unknown:
            raise SpecError(f"{where}: unknown engine argument {unknown[0]!r}; known: "
                            f"{', '.join(sorted(known))}")  # fmt: skip
        if "maxModelLen" not in doc:
            raise SpecError(f"{where}: maxModelLen is required (it shapes the compiled graph)")
        comp = doc.get("compilationConfig", "")
        if isinstance(comp, dict):
            doc["compilationConfig"] = json.dumps(comp, sort_keys=True, separators=(",", ":"))
        return _typed(doc, where)


def _typed(doc: dict[str, Any], where: str) -> EngineArgs:
    args = EngineArgs(**doc)
    for name, kind in (("maxModelLen", int), ("tensorParallelSize", int),
                       ("pipelineParallelSize", int), ("enforceEager", bool), ("dtype", str),
                       ("quantization", str), ("compilationConfig", str),
                       ("loadFormat", str)):  # fmt: skip
        value = getattr(args, name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise SpecError(f"{where}: {name} must be a {kind.__name__}, not {value!r}")
    if args.maxModelLen < 1 or args.tensorParallelSize < 1 or args.pipelineParallelSize < 1:
        raise SpecError(f"{where}: maxModelLen, tensorParallelSize and pipelineParallelSize "
                        "must be at least 1")  # fmt: skip
    return args


def compile_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that change what vLLM and inductor compile."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(ENV_PREFIXES) and name not in IGNORED_ENV and not _SECRET.search(name)
    }


@dataclass(frozen=True)
class ServingConfig:
    """Everything a start is keyed by besides the weights: what ``prepare`` is told about the
    vLLM container it prepares for, and what the capture ran with."""

    vllmVersion: str
    torchVersion: str
    modelPath: str
    engineArgs: EngineArgs
    environment: dict[str, str] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        return {
            "vllmVersion": self.vllmVersion,
            "torchVersion": self.torchVersion,
            "modelPath": self.modelPath,
            "engineArgs": self.engineArgs.to_doc(),
            "environment": dict(sorted(self.environment.items())),
        }

    @staticmethod
    def parse(text: str, where: str) -> ServingConfig:
        """From JSON (``prepare --engine-config``; the capture's summary prints it)."""
        try:
            doc = json.loads(text)
            return ServingConfig(
                vllmVersion=str(doc["vllmVersion"]),
                torchVersion=str(doc["torchVersion"]),
                modelPath=str(doc["modelPath"]),
                engineArgs=EngineArgs.parse(json.dumps(doc["engineArgs"]), f"{where}.engineArgs"),
                environment=compile_environment(dict(doc.get("environment", {}))),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpecError(
                f"{where}: expected a JSON object with vllmVersion, torchVersion, modelPath, "
                f"engineArgs and environment (as `capture-engine-cache` prints): {e!r}"
            ) from None


def key_factors(
    weights_digest: str, config: ServingConfig, hardware: HardwareClass
) -> dict[str, Any]:
    return {
        "keyVersion": KEY_VERSION,
        "weightsDigest": weights_digest,
        **config.to_doc(),
        "hardware": hardware.to_doc(),
    }


def key_of(factors: Mapping[str, Any]) -> str:
    """The key: sha256 over the factors' canonical JSON, as long as an artifact digest."""
    canonical = json.dumps(factors, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_HEX_CHARS]


def differences(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """``name: cache X, this start Y`` for each factor that differs (nested mappings by
    dotted name): the reason a cache is not used, in the words of its factors."""
    out: list[str] = []
    for name in sorted(set(recorded) | set(wanted)):
        have, want = recorded.get(name), wanted.get(name)
        if isinstance(have, Mapping) and isinstance(want, Mapping):
            out += [f"{name}.{d}" for d in differences(have, want)]
        elif have != want:
            out.append(f"{name}: cache {_short(have)}, this start {_short(want)}")
    return out


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."
