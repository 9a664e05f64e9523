"""GPU check: the loader plugin's pipelined reader vs vLLM's stock sharded-state path.

For a machine with an NVIDIA GPU and no vLLM: imports only torch, safetensors and this
checkout's core and plugin source (the ``core/`` and ``stager/`` source roots of the script's
own checkout go on ``sys.path``; nothing installed, nothing on PYTHONPATH). It writes a
synthetic per-rank artifact of a few GiB (bf16 matrices in vLLM's
``model-rank-0-part-N.safetensors`` naming), then moves it into device memory four ways,
every one from a cold page cache (the files' pages are dropped with
``posix_fadvise(DONTNEED)``, which needs no root):

- ``ceiling``: pinned host buffer -> device, no disk: the host-to-device copy ceiling;
- ``raw_read``: a sequential ``readinto`` of the files (what ``cat`` does), no copy;
- ``stock``: vLLM's path emulated: ``safe_open`` + ``get_tensor`` + ``param.copy_``;
- ``plugin``: ``PipelinedReader`` into the same parameters (checked equal to ``stock``).

Prints one small table and one JSON line; well under five minutes at the default size. On a
machine without CUDA it runs the same comparison into host memory (a reduced mode, so the
script is tested where no GPU is). Usage::

    python e2e/gpu_check.py [--size-gib 4] [--dir /tmp] [--chunk-mib 16] [--depth 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
    package spread over them (``core/modelstage/core``, ``stager/modelstage/plugin``)."""
    sys.path[:0] = [str(checkout / "core"), str(checkout / "stager")]


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

    results: dict[str, float] = {}
    for name, fn in (("ceiling", ceiling), ("raw_read", raw_read), ("stock", stock),
                     ("plugin", plugin)):  # fmt: skip
        drop_cache(paths)
        seconds = timed(fn, device)
        results[name] = round((size if name == "raw_read" else nbytes) / seconds / 1e9, 3)
    equal = all(torch.equal(stock_params[k], plugin_params[k]) for k in stock_params)
    return results, equal


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=4.0 if cuda else 0.5)
    parser.add_argument("--dir", help="where to write the artifact (default: a temp dir)")
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]),
                        help="the modelstage checkout (default: this script's)")  # fmt: skip
    args = parser.parse_args()

    import_project(Path(args.source))
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
    for name, rate in results.items():
        print(f"{name:>9}: {rate:8.3f} GB/s")
    print(json.dumps(summary, sort_keys=True))
    if not equal:
        sys.exit("plugin-loaded parameters differ from the stock path's")


if __name__ == "__main__":
    main()
