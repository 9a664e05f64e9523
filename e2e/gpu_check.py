"""GPU check: the loader plugin's pipelined reader vs vLLM's stock sharded-state path.

For a machine with an NVIDIA GPU and no vLLM: imports only torch, safetensors and this
checkout's core, plugin and stager source (the ``core/``, ``plugin/`` and ``stager/`` source
roots of the script's own checkout go on ``sys.path``; nothing installed, nothing on
PYTHONPATH). It writes a synthetic per-rank artifact of a few GiB (bf16 matrices in vLLM's
``model-rank-0-part-N.safetensors`` naming), then moves it into device memory four ways,
every one from a cold page cache (the files' pages are dropped with
``posix_fadvise(DONTNEED)``, which needs no root):

- ``ceiling``: pinned host buffer -> device, no disk: the host-to-device copy ceiling;
- ``raw_read``: a sequential ``readinto`` of the files (what ``cat`` does), no copy;
- ``stock``: vLLM's path emulated: ``safe_open`` + ``get_tensor`` + ``param.copy_``;
- ``plugin``: ``PipelinedReader`` into the same parameters (checked equal to ``stock``).

With ``blake3`` importable (vLLM depends on it; on a bare machine carry its wheel) a fifth way:

- ``plugin_verified``: the same reader with every byte hashed against BLAKE3 chunk hashes as
  it lands (``MODELSTAGE_VERIFY=1``, the plugin's default in pods).

``--startup`` adds the engine cache's start-up timeline on this device, with no vLLM: a
Llama-shaped stack of torch modules is compiled by ``torch.compile`` (inductor; Triton kernels
on a GPU) in a child process with fresh cache roots, as ``capture-engine-cache`` runs vLLM; what
it wrote is made an engine-cache artifact (chunk hashes, manifest last), placed and verified by
``prepare``'s code into new folders, and a second child started on them. Reported: each
child's time to its first output (the "ready" of this emulation), its compile seconds and
torch's cache counters (hits, no misses), the two ratios (compile, ready: with / without the
cache) and whether the outputs are equal.

Prints one small table and one JSON line; well under five minutes at the default size, under
ten with ``--startup``. On a machine without CUDA it runs the same comparison into host memory
(a reduced mode, so the script is tested where no GPU is). Usage::

    python e2e/gpu_check.py [--size-gib 4] [--dir /tmp] [--chunk-mib 16] [--depth 4] [--startup]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

ROWS, COLS = 4096, 4096  # one bf16 matrix: 32 MiB
PART_BYTES = 2 * 1024**3


def import_project(checkout: Path) -> None:
    """Put the checkout's source roots first on ``sys.path``: ``modelstage`` is a namespace
    package spread over them (``core/modelstage/core``, ``plugin/modelstage/plugin``, ...)."""
    sys.path[:0] = [str(checkout / root) for root in ("core", "plugin", "stager")]


def write_artifact(directory: Path, total_bytes: int, encode_header: Any) -> list[Path]:
    """Rank 0's part files of ``total_bytes`` of random bf16 matrices (plus a 1-D norm each)."""
    matrices = max(1, total_bytes // (ROWS * COLS * 2))
    per_part = max(1, PART_BYTES // (ROWS * COLS * 2))
    paths: list[Path] = []
    gen = torch.Generator().manual_seed(0)
    for part, first in enumerate(range(0, matrices, per_part)):
        names = range(first, min(first + per_part, matrices))
        tensors = []
        for i in names:
            tensors += [(f"model.layers.{i}.mlp.weight", "BF16", (ROWS, COLS)),
                        (f"model.layers.{i}.norm.weight", "BF16", (COLS,))]  # fmt: skip
        header, _ = encode_header(tensors, {"format": "pt"})
        path = directory / f"model-rank-0-part-{part}.safetensors"
        with open(path, "wb") as f:
            f.write(header)
            for _, _, shape in tensors:
                data = torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
                f.write(data.view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    return paths


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def measure(
    files: list[tuple[Path, Any]], chunk: int, depth: int, device: torch.device
) -> tuple[dict[str, float], bool]:
    """GB/s of each way into device memory (cold cache), and whether the plugin's reader put
    the same values as vLLM's stock path."""
    from modelstage.plugin.reader import PipelinedReader, Target, flat_bytes

    cuda = device.type == "cuda"
    paths = [p for p, _ in files]
    infos = [t for _, h in files for t in h.tensors.values()]
    nbytes = sum(t.nbytes for t in infos)
    size = sum(p.stat().st_size for p in paths)

    def params() -> dict[str, torch.Tensor]:
        return {t.name: torch.empty(t.shape, dtype=torch.bfloat16, device=device)
                for t in infos}  # fmt: skip

    pinned = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
    sink = torch.empty(chunk, dtype=torch.uint8, device=device)

    def ceiling() -> None:
        for _ in range(math.ceil(nbytes / chunk)):
            sink.copy_(pinned, non_blocking=True)

    def raw_read() -> None:
        buf = bytearray(chunk)
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

    stock_params = params()

    def stock() -> None:
        for p in paths:
            with safe_open(str(p), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    stock_params[key].copy_(f.get_tensor(key))

    plugin_params = params()
    reader = PipelinedReader(chunk_bytes=chunk, depth=depth, device=device)

    def plugin() -> None:
        reader.read(files, lambda info: Target(flat_bytes(plugin_params[info.name])))

    ways: list[tuple[str, Callable[[], None]]] = [
        ("ceiling", ceiling), ("raw_read", raw_read), ("stock", stock), ("plugin", plugin),
    ]  # fmt: skip
    verified_params = params()
    ways += verified_way(files, paths, reader, verified_params)
    compared = [plugin_params, verified_params][: len(ways) - 3]
    results: dict[str, float] = {}
    for name, fn in ways:
        drop_cache(paths)
        seconds = timed(fn, device)
        results[name] = round((size if name == "raw_read" else nbytes) / seconds / 1e9, 3)
    equal = all(torch.equal(stock_params[k], p[k]) for p in compared for k in stock_params)
    return results, equal


def verified_way(
    files: list[tuple[Path, Any]], paths: list[Path], reader: Any, params: dict[str, torch.Tensor]
) -> list[tuple[str, Callable[[], None]]]:
    """``plugin_verified``: the plugin's reader with a fresh ``ChunkChecker`` per read over the
    files' chunk hashes (hashed once, beforehand); none without ``blake3``."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        print("blake3 not importable: plugin_verified skipped", file=sys.stderr)
        return []
    from modelstage.core.integrity import ChunkChecker, hash_local_files
    from modelstage.plugin.reader import Target, flat_bytes

    digests = hash_local_files(paths)
    named = [(str(p), d) for p, d in zip(paths, digests, strict=True)]

    def read() -> None:
        reader.read(files, lambda info: Target(flat_bytes(params[info.name])), ChunkChecker(named))

    return [("plugin_verified", read)]


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=4.0 if cuda else 0.5)
    parser.add_argument("--dir", help="where to write the artifact (default: a temp dir)")
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]),
                        help="the modelstage checkout (default: this script's)")  # fmt: skip
    parser.add_argument(
        "--startup",
        action="store_true",
        help="also the engine cache's start-up timeline (torch.compile)",
    )
    parser.add_argument("--compile-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4, help="--startup: decoder layers")
    args = parser.parse_args()

    import_project(Path(args.source))
    if args.compile_child:
        compile_child(args.layers)
        return
    from modelstage.core.safetensors_format import encode_header, read_local_header

    device = torch.device("cuda" if cuda else "cpu")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="modelstage-gpu-check-", dir=args.dir) as tmp:
        paths = write_artifact(Path(tmp), int(args.size_gib * 1024**3), encode_header)
        files = [(p, read_local_header(p)) for p in paths]
        nbytes = sum(t.nbytes for _, h in files for t in h.tensors.values())
        results, equal = measure(files, args.chunk_mib * 1024 * 1024, args.depth, device)
    summary = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (reduced mode)",
        "torch": torch.__version__,
        "bytes": nbytes,
        "files": len(files),
        "chunk_mib": args.chunk_mib,
        "depth": args.depth,
        "gb_per_s": results,
        "plugin_vs_stock": round(results["plugin"] / results["stock"], 2),
        "plugin_equals_stock": equal,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.startup:
        summary["startup"] = startup_timeline(Path(args.source), args.layers, args.dir)
        started_ok = summary["startup"]["hit"] and summary["startup"]["outputs_equal"]
        equal = equal and started_ok
    for name, rate in results.items():
        print(f"{name:>9}: {rate:8.3f} GB/s")
    print(json.dumps(summary, sort_keys=True))
    if not equal:
        sys.exit("plugin-loaded parameters differ from the stock path's")


HIDDEN, HEADS, VOCAB, TOKENS = 1024, 16, 32000, 64
COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"))


class Layer(torch.nn.Module):
    """One Llama-shaped decoder layer: RMSNorm, fused qkv, SDPA, o, gate_up, SiLU, down."""

    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(HIDDEN), torch.nn.RMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * 4 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.n1(x)).view(1, -1, 3, HEADS, HIDDEN // HEADS).unbind(2)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.o(att.transpose(1, 2).reshape(1, -1, HIDDEN))
        gate, up = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        out: torch.Tensor = x + self.down(torch.nn.functional.silu(gate) * up)
        return out


def compile_child(layers: int) -> None:
    """One "start": build, compile, first output; one JSON line (the cache roots come from
    ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` in the environment)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    stack = [torch.nn.Embedding(VOCAB, HIDDEN), *(Layer() for _ in range(layers))]
    model = torch.nn.Sequential(*stack, torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    model = model.to(device).eval()
    ids = torch.arange(TOKENS, device=device).remainder(VOCAB).unsqueeze(0)
    with torch.no_grad():
        out = torch.compile(model)(ids)
    sync(device)
    print(json.dumps({
        "ready": round(time.perf_counter() - started, 3),
        "compile": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 3),
        "counters": {name: int(counters[group][name]) for group, name in COUNTERS},
        "argmax": out.argmax(-1).flatten().tolist(),
    }))  # fmt: skip


def start(source: Path, layers: int, roots: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, "-S", str(Path(__file__).resolve()), "--compile-child",
            "--layers", str(layers), "--source", str(source)]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(argv, env={**os.environ, **roots}, capture_output=True, text=True,
                          timeout=540, check=True)  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result | {"process": round(time.perf_counter() - t0, 3)}


def startup_timeline(source: Path, layers: int, where: str | None) -> dict[str, Any]:
    """Capture (a cold start with fresh roots), package, place and verify, start again."""
    from modelstage.core.engine_key import EngineArgs, ServingConfig, gpu_class, key_factors
    from modelstage.stager.engine_capture import write_engine_cache
    from modelstage.stager.engine_hardware import this_node
    from modelstage.stager.engine_place import cache_env, place_engine_cache

    hardware = this_node()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        hardware = gpu_class(torch.cuda.get_device_name(), f"{major}.{minor}")
    config = ServingConfig("none (gpu_check)", torch.__version__, "gpu_check",
                           EngineArgs(maxModelLen=TOKENS))  # fmt: skip
    factors = key_factors(f"gpu-check-{layers}-layers", config, hardware)
    with tempfile.TemporaryDirectory(prefix="modelstage-startup-", dir=where) as tmp:
        capture_dir, pod = Path(tmp) / "capture", Path(tmp) / "pod"
        cold = start(source, layers, cache_env(capture_dir))
        manifest = write_engine_cache(capture_dir, factors, cold["process"], cold["compile"])
        placed = place_engine_cache(str(capture_dir), pod, factors)
        warm = start(source, layers, cache_env(pod))
        again = start(source, layers, cache_env(Path(tmp) / "empty"))
    base = min(cold, again, key=lambda r: r["process"])
    return {
        "cache_files": len(manifest.files), "cache_bytes": manifest.bytes,
        "placed": placed["result"], "place_seconds": placed["seconds"],
        "without_cache": {k: base[k] for k in ("ready", "compile", "process", "counters")},
        "with_cache": {k: warm[k] for k in ("ready", "compile", "process", "counters")},
        "compile_ratio": round(warm["compile"] / base["compile"], 3),
        "ready_ratio": round(warm["process"] / base["process"], 3),
        "hit": placed["result"] == "hit" and warm["counters"]["fxgraph_cache_miss"] == 0
        and warm["counters"]["fxgraph_cache_hit"] > 0,
        "outputs_equal": warm["argmax"] == cold["argmax"] == again["argmax"],
    }  # fmt: skip


if __name__ == "__main__":
    main()
