"""``modelstage bench``: ratios measured in one run on the same files, never absolute targets.

Staging is compared with ``cp`` + ``sync`` of the same source files to the same disk (the
stager fsyncs and hashes, so the baseline syncs too); peak RSS comes from the kernel's
accounting of the child process (``wait4``), at two checkpoint sizes to show it is flat.
Loading is compared with a raw sequential read of the same rank files and with vLLM's stock
sharded-state read path (``safe_open`` + ``get_tensor`` + ``copy_`` into preallocated tensors);
the plugin's reader runs twice, verifying every byte as it streams (its default) and not
(``MODELSTAGE_VERIFY=0``). ``modelstage verify`` of the whole artifact (every byte hashed against
the manifest) is compared with a raw read of the same files. Node caching: rank 0 read by
the plugin's reader (verified) from a node-local copy, cold and warm, against a raw read of
the PVC path; and copying the artifact to a node (``modelstage node-copy``, verified and
fsynced) against ``cp -r`` + ``sync``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from modelstage.core.formats import FORMATS
from modelstage.core.progress import human_bytes
from modelstage.core.s3_client import S3Options

from .measure import Measurement, compile_package, drop_page_cache, run_child, stager_argv
from .synthetic import SyntheticModel, write_checkpoint

GIB = 1024**3


def _layers_to_fit(size_bytes: int, hidden: int, kv: int, vocab: int, *, mlp_rows: int) -> int:
    """Decoder layers that bring a bf16 checkpoint near ``size_bytes``: per layer q and o
    (hidden x hidden), k and v (128-wide heads) and ``mlp_rows`` x hidden of MLP; embeddings
    and head besides."""
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * kv * 128 + hidden * mlp_rows)
    edges = 2 * 2 * vocab * hidden
    return max(1, round((size_bytes - edges) / per_layer))


def llama70b_scaled(size_bytes: int, *, shards: int = 4) -> SyntheticModel:
    """Llama-3-70B's shapes halved in width (head_dim 128, GQA 8:1), bf16, layers to fit."""
    hidden, inter, heads, kv, vocab = 4096, 14336, 32, 8, 32064
    layers = _layers_to_fit(size_bytes, hidden, kv, vocab, mlp_rows=3 * inter)
    return SyntheticModel(
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        vocab_size=vocab,
        dtype="bfloat16",
        num_shards=shards,
    )


def mixtral_scaled(size_bytes: int, *, shards: int = 4) -> SyntheticModel:
    """Mixtral-8x7B's shapes halved in width (hidden 2048, 8 experts of intermediate 7168,
    head_dim 128, GQA 4:1), bf16, layers to fit: 704 MiB of experts per layer, so each
    rank's stacked ``w13_weight`` is the largest tensor (235 MiB at TP=2)."""
    hidden, inter, heads, kv, vocab, experts = 2048, 7168, 16, 4, 32000, 8
    layers = _layers_to_fit(size_bytes, hidden, kv, vocab, mlp_rows=3 * experts * inter)
    return SyntheticModel(
        architecture="MixtralForCausalLM",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        vocab_size=vocab,
        num_experts=experts,
        dtype="bfloat16",
        num_shards=shards,
    )


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def bench_staging(source: Path, work: Path, tps: list[int], repeats: int) -> list[Measurement]:
    size = dir_bytes(source)
    cp = Measurement("cp + sync", nbytes=size)
    results = [cp]
    staged = {tp: Measurement(f"stage tp={tp}", nbytes=size) for tp in tps}
    results += staged.values()
    _read_all(source)  # both read the source from the page cache: what `cp` gets at best
    for _ in range(repeats):  # interleaved, so drift of the machine hits every row alike
        for tp, m in staged.items():
            _settle(source, work)
            secs, _ = run_child(["sh", "-c", f"cp -r '{source}' '{work / 'cp'}' && sync"])
            cp.seconds.append(secs)
            shutil.rmtree(work / "cp")
            _settle(source, work)
            secs, rss = run_child(stager_argv(source, work / f"tp{tp}", tp))
            m.seconds.append(secs)
            m.peak_rss = max(m.peak_rss, rss)
            shutil.rmtree(work / f"tp{tp}")
    return results


def _settle(source: Path, work: Path) -> None:
    """Start every timed run from the same disk state: right after an untimed `cp` of the
    source, synced and deleted. (On a thin-provisioned disk, whatever ran
    before matters: any writer is up to 40% slower right after the stager's preallocated
    output was deleted than right after a `cp` copy was.)"""
    os.sync()
    subprocess.run(["cp", "-r", str(source), str(work / "settle")], check=True)
    os.sync()
    shutil.rmtree(work / "settle")
    os.sync()


def _read_all(directory: Path) -> None:
    _raw_read(sorted(p for p in directory.iterdir() if p.is_file()))


def bench_rss(sizes: list[int], work: Path, tp: int) -> list[Measurement]:
    rows = []
    for size in sizes:
        src = write_checkpoint(llama70b_scaled(size), work / f"rss-{size}")
        m = Measurement(f"peak RSS, {human_bytes(dir_bytes(src))} source", nbytes=dir_bytes(src))
        secs, m.peak_rss = run_child(stager_argv(src, work / f"rss-{size}-out", tp))
        m.seconds.append(secs)
        rows.append(m)
        shutil.rmtree(src)
        shutil.rmtree(work / f"rss-{size}-out")
    return rows


MOE_FORMATS = ("sharded_state", "tensorizer")


def bench_moe_rss(sizes: list[int], work: Path, tp: int) -> list[Measurement]:
    """Peak RSS of the stager on Mixtral-shaped checkpoints, per format and size: flat when
    no writer holds a rank's expert stack (or any whole tensor) in memory."""
    rows = []
    for size in sizes:
        src = write_checkpoint(mixtral_scaled(size), work / f"moe-{size}")
        nbytes = dir_bytes(src)
        for fmt in MOE_FORMATS:
            m = Measurement(f"MoE {fmt}, {human_bytes(nbytes)} source", nbytes=nbytes)
            out = work / f"moe-{size}-{fmt}"
            secs, m.peak_rss = run_child(stager_argv(src, out, tp, "--format", fmt))
            m.seconds.append(secs)
            rows.append(m)
            shutil.rmtree(out)
        shutil.rmtree(src)
    return rows


def bench_loading(artifact: Path, rank: int, repeats: int, cold: bool) -> list[Measurement]:
    """Rank files into CPU tensors: raw read vs stock path vs the plugin's reader.

    Like vLLM's model before ``load_weights``, the parameters exist (and are touched) before
    the clock starts, so every row measures moving the bytes, not allocating memory."""
    files = sorted(artifact.glob(FORMATS["sharded_state"].rank_glob(rank)))
    size = sum(f.stat().st_size for f in files)
    params = _parameters(files)
    readers: dict[str, Callable[[list[Path], dict[str, Any]], None]] = {
        "raw sequential read": lambda fs, _: _raw_read(fs),
        "vLLM stock path": _stock_read,
    }
    plugin = _plugin_read()
    if plugin is not None:
        readers["modelstage reader, unverified"] = lambda fs, ps: plugin(fs, ps, False)
        readers["modelstage reader, verified"] = lambda fs, ps: plugin(fs, ps, True)
    rows = {name: Measurement(f"load rank {rank}: {name}", nbytes=size) for name in readers}
    if not cold:
        _raw_read(files)  # the stager wrote them with O_DIRECT: not in the page cache yet
    for i in range(repeats):
        for name in rotated(list(readers), i):
            if cold:
                drop_page_cache()
            start = time.perf_counter()
            readers[name](files, params)
            rows[name].seconds.append(time.perf_counter() - start)
    return list(rows.values())


def rotated(names: list[str], i: int) -> list[str]:
    """Repetition ``i``'s order: each row goes first in turn, so that what one row leaves
    behind (here: a virtual disk's host-side cache) does not favour the row after it."""
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def _parameters(files: list[Path]) -> dict[str, Any]:
    """One touched host tensor per tensor in ``files``, shaped and typed as stored."""
    import torch
    from modelstage.core.safetensors_format import read_local_header
    from modelstage.plugin.reader import TORCH_DTYPES

    params = {}
    for f in files:
        for name, info in read_local_header(f).tensors.items():
            params[name] = torch.zeros(info.shape, dtype=TORCH_DTYPES[info.dtype])
    return params


def _raw_read(files: list[Path]) -> None:
    buf = bytearray(16 * 1024 * 1024)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass


def _stock_read(files: list[Path], params: dict[str, Any]) -> None:
    from safetensors import safe_open

    for f in files:
        with safe_open(f, framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                params[key].copy_(st.get_tensor(key))


def bench_verify(artifact: Path, repeats: int, cold: bool) -> list[Measurement]:
    """``modelstage verify`` of the whole artifact (sizes, then every byte against its chunk
    hashes) vs a raw sequential read of the same files, interleaved."""
    from modelstage.core.location import verify_directory

    files = sorted(p for p in artifact.iterdir() if p.is_file() and p.name != "modelstage.json")
    size = sum(f.stat().st_size for f in files)
    raw = Measurement("raw sequential read, every file", nbytes=size)
    verify = Measurement("modelstage verify", nbytes=size)
    if not cold:
        _raw_read(files)
    runs: dict[str, tuple[Measurement, Callable[[], object]]] = {
        "raw": (raw, lambda: _raw_read(files)),
        "verify": (verify, lambda: verify_directory(artifact)),
    }
    for i in range(repeats):
        for name in rotated(list(runs), i):
            m, run = runs[name]
            if cold:
                drop_page_cache()
            start = time.perf_counter()
            run()
            m.seconds.append(time.perf_counter() - start)
    return [raw, verify]


NODE_COPY_MODULE = "modelstage.agent.copy"
"""Where the node agent's copy function lives (``copy_local``: what the agent does with a copy
Job's stream, minus the network): imported by name, so the bench runs (without its copy row)
in an install that lacks the agent."""


def remove_root(root: Path) -> None:
    """A node root the agent's copy wrote: its copies are 0550, made writable to go."""
    for directory, _, _ in os.walk(root):
        os.chmod(directory, 0o700)
    shutil.rmtree(root, ignore_errors=True)


def _node_copy_function() -> Callable[..., Any] | None:
    import importlib

    try:
        module = importlib.import_module(NODE_COPY_MODULE)
    except ImportError:
        return None
    copy: Callable[..., Any] = module.copy_local
    return copy


def bench_node_copy(artifact: Path, digest: str, root: Path, repeats: int) -> list[Measurement]:
    """The time to put an artifact on a node: ``cp -r`` + ``sync`` (the baseline) vs
    ``node-copy`` (every chunk verified against the manifest, files fsynced, renamed into
    place); the source in the page cache for both, as a warm PVC client would have it."""
    size = dir_bytes(artifact)
    cp = Measurement("copy to node: cp -r + sync", nbytes=size)
    rows = [cp]
    copy = _node_copy_function()
    if copy is None:
        print(f"bench: {NODE_COPY_MODULE} is not installed: no node-copy row", file=sys.stderr)
    else:
        rows.append(Measurement("copy to node: modelstage node-copy", nbytes=size))
    _read_all(artifact)
    by_name = {m.name: m for m in rows}
    for i in range(repeats):
        for row in (by_name[n] for n in rotated(list(by_name), i)):
            remove_root(root)
            root.mkdir(parents=True)
            os.sync()
            start = time.perf_counter()
            if row is cp:
                subprocess.run(["cp", "-r", str(artifact), str(root / digest)], check=True)
                os.sync()
            else:
                assert copy is not None
                copy(str(artifact), digest=digest, root=root)
            row.seconds.append(time.perf_counter() - start)
    return rows


def bench_node_cache_loading(
    artifact: Path, root: Path, rank: int, repeats: int, cold: bool
) -> list[Measurement]:
    """Rank ``rank`` read the way a serving pod on a node holding the copy reads it: the
    plugin's choice (the copy's manifest equal to the artifact's, its files' sizes), then
    its reader, every byte verified; cold (page cache dropped: a node copy not warmed) and
    warm (after warm-before-roll), against a raw read of the PVC path, cold."""
    from modelstage.core.manifest import MANIFEST, read_manifest
    from modelstage.core.node_cache import canonical_manifest
    from modelstage.plugin.node_copy import choose_node_copy

    pattern = FORMATS["sharded_state"].rank_glob(rank)
    pvc_files = sorted(artifact.glob(pattern))
    size = sum(f.stat().st_size for f in pvc_files)
    manifest = read_manifest(artifact)
    assert manifest is not None, f"{artifact}: no manifest"
    shutil.rmtree(root, ignore_errors=True)
    copy = root / "copy"
    shutil.copytree(artifact, copy)
    (copy / MANIFEST).write_bytes(canonical_manifest((artifact / MANIFEST).read_bytes()))
    params = _parameters(pvc_files)
    plugin = _plugin_read()
    assert plugin is not None, "the plugin's reader needs torch"

    def from_node() -> None:
        node = choose_node_copy(copy, manifest.digest, str(artifact))
        assert node.path is not None, node.reason
        plugin(sorted(node.path.glob(pattern)), params, True)

    raw = Measurement(f"load rank {rank}: raw read of the PVC path, cold", nbytes=size)
    node_cold = Measurement(f"load rank {rank}: plugin from node copy, cold", nbytes=size)
    node_warm = Measurement(f"load rank {rank}: plugin from node copy, warm", nbytes=size)
    runs: dict[str, tuple[Measurement, Callable[[], None], bool]] = {
        "raw": (raw, lambda: _raw_read(pvc_files), True),
        "cold": (node_cold, from_node, True),
        "warm": (node_warm, from_node, False),
    }
    if not cold:  # the page cache cannot be dropped here: warm rows only
        raw.name = f"load rank {rank}: raw read of the PVC path, warm"
        runs = {"raw": (raw, lambda: _raw_read(pvc_files), False), "warm": runs["warm"]}
    for i in range(repeats):
        for name in rotated(list(runs), i):
            m, run, drop = runs[name]
            if drop:
                drop_page_cache()
            else:
                run()  # once untimed: its files in the page cache, as warming leaves them
            start = time.perf_counter()
            run()
            m.seconds.append(time.perf_counter() - start)
    shutil.rmtree(root)
    return [m for m, _, _ in runs.values()]


def _plugin_read() -> Callable[[list[Path], dict[str, Any], bool], None] | None:
    """The loader plugin's pipelined reader, when the serving side is installed."""
    try:
        from .plugin_reads import read_files_for_bench
    except ImportError:
        return None
    return read_files_for_bench


def table(rows: list[Measurement], baseline: Measurement) -> str:
    lines = [f"{'measurement':44} {'median s':>9} {'GB/s':>7} {'x base':>7} {'peak RSS':>10}"]
    for m in rows:
        ratio = m.throughput / baseline.throughput if baseline.throughput else 0.0
        rss = human_bytes(m.peak_rss) if m.peak_rss else "-"
        lines.append(
            f"{m.name:44} {m.median:9.3f} {m.throughput / 1e9:7.3f} {ratio:7.2f} {rss:>10}"
        )
    return "\n".join(lines)


RSS_SECTION = "peak RSS"
MOE_RSS_SECTION = "peak RSS, MoE (Mixtral-shaped)"


def chart(sections: dict[str, list[Measurement]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sections), 1, figsize=(8, 2.2 * len(sections) + 0.5))
    axes_list = axes if len(sections) > 1 else [axes]
    for ax, (title, rows) in zip(axes_list, sections.items(), strict=True):
        rss = title.startswith(RSS_SECTION)
        values = [m.peak_rss / 2**20 if rss else m.throughput / 1e9 for m in rows]
        ax.barh([m.name for m in rows], values, color="#4878a8")
        ax.set_title(title)
        ax.set_xlabel("peak RSS (MiB)" if rss else "GB/s (median)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _bench_reading(
    src: Path,
    artifact: Path,
    load_tp: int,
    repeats: int,
    cold: bool,
    section: Callable[[str, list[Measurement]], None],
) -> str:
    """Loading and verifying an artifact staged at ``load_tp``, with the page cache dropped
    (where permitted) and warm; returns how the page cache was treated."""
    run_child(stager_argv(src, artifact, load_tp))
    cache = "dropped before each read" if cold and drop_page_cache() else "not dropped (warm)"
    if cache.startswith("dropped"):
        section(
            f"loading rank 0 of TP={load_tp}, page cache dropped",
            bench_loading(artifact, 0, repeats, cold=True),
        )
    section(
        f"loading rank 0 of TP={load_tp}, page cache warm",
        bench_loading(artifact, 0, repeats, cold=False),
    )
    if cache.startswith("dropped"):
        section(
            f"verify TP={load_tp} artifact, page cache dropped",
            bench_verify(artifact, repeats, cold=True),
        )
    section(
        f"verify TP={load_tp} artifact, page cache warm",
        bench_verify(artifact, repeats, cold=False),
    )
    bench_node_cache(artifact, artifact.parent / "node", load_tp, repeats, cache, section)
    shutil.rmtree(artifact)
    return cache


NODE_LOAD_SECTION = "node cache: loading rank 0 of TP={tp}"
NODE_COPY_SECTION = "node cache: copying the TP={tp} artifact to a node"


def bench_node_cache(
    artifact: Path,
    root: Path,
    load_tp: int,
    repeats: int,
    cache: str,
    section: Callable[[str, list[Measurement]], None],
) -> None:
    """The node-cache sections on a staged artifact; ``root``: the node root (scratch)."""
    from modelstage.core.manifest import read_manifest

    cold = cache.startswith("dropped")
    section(
        NODE_LOAD_SECTION.format(tp=load_tp),
        bench_node_cache_loading(artifact, root, 0, repeats, cold),
    )
    manifest = read_manifest(artifact)
    assert manifest is not None, f"{artifact}: no manifest"
    section(
        NODE_COPY_SECTION.format(tp=load_tp),
        bench_node_copy(artifact, manifest.digest, root, repeats),
    )
    remove_root(root)


def run_bench(
    *,
    size_gib: float,
    tps: list[int],
    load_tp: int,
    repeats: int,
    workdir: Path,
    rss_gib: list[float],
    cold: bool,
    out: Path,
    s3: str | None = None,
    s3_options: S3Options | None = None,
    s3_flags: Sequence[str] = (),
    moe_rss_gib: Sequence[float] = (),
    moe_only: bool = False,
    node_cache_only: bool = False,
) -> dict[str, Any]:
    """``s3_options``/``s3_flags``: how this process and a stager child reach ``s3``;
    ``moe_only``: only the MoE peak-RSS section; ``node_cache_only``: only the node-cache
    sections."""
    workdir.mkdir(parents=True, exist_ok=True)
    compile_package()
    log = sys.stderr
    sections: dict[str, list[Measurement]] = {}

    def section(title: str, rows: list[Measurement]) -> None:
        sections[title] = rows
        print(f"\n{title}\n{table(rows, rows[0])}", file=log)

    if moe_only:
        moe = bench_moe_rss([int(g * GIB) for g in moe_rss_gib], workdir, load_tp)
        section(MOE_RSS_SECTION, moe)
        return _write_results(sections, out, {"tp": load_tp})
    src = write_checkpoint(llama70b_scaled(int(size_gib * GIB)), workdir / "source")
    print(f"bench: source {human_bytes(dir_bytes(src))} in {src}", file=log)
    if node_cache_only:
        info = _node_cache_only(src, workdir, load_tp, repeats, cold, section)
        return _write_results(sections, out, info) | {"page_cache": info["page_cache"]}

    staging = bench_staging(src, workdir, tps, repeats)
    section("staging vs cp + sync (source in page cache)", staging)
    cache = _bench_reading(src, workdir / "artifact", load_tp, repeats, cold, section)
    if s3:
        from .bench_s3 import bench_s3

        options = s3_options or S3Options()
        for title, rows in bench_s3(src, s3, load_tp, repeats, options, list(s3_flags)).items():
            section(title, rows)
    if rss_gib:
        section(RSS_SECTION, bench_rss([int(g * GIB) for g in rss_gib], workdir, load_tp))
    if moe_rss_gib:
        moe = bench_moe_rss([int(g * GIB) for g in moe_rss_gib], workdir, load_tp)
        section(MOE_RSS_SECTION, moe)
    source_bytes = dir_bytes(src)
    shutil.rmtree(src)
    info = {"source_bytes": source_bytes, "page_cache": cache, "repeats": repeats}
    return _write_results(sections, out, info) | {"page_cache": cache}


def _node_cache_only(
    src: Path,
    workdir: Path,
    load_tp: int,
    repeats: int,
    cold: bool,
    section: Callable[[str, list[Measurement]], None],
) -> dict[str, Any]:
    """The node-cache sections alone, on an artifact staged from ``src`` (both removed after);
    the run's facts for the results file."""
    artifact = workdir / "artifact"
    run_child(stager_argv(src, artifact, load_tp))
    cache = "dropped before each cold read" if cold and drop_page_cache() else "warm only"
    bench_node_cache(artifact, workdir / "node", load_tp, repeats, cache, section)
    info = {"source_bytes": dir_bytes(src), "page_cache": cache, "repeats": repeats}
    shutil.rmtree(artifact)
    shutil.rmtree(src)
    return info


def _write_results(
    sections: dict[str, list[Measurement]], out: Path, info: dict[str, Any]
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    result = info | {
        "sections": {
            k: [asdict(m) | {"median": m.median, "throughput": m.throughput} for m in v]
            for k, v in sections.items()
        },
    }
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    chart(sections, out / "bench.png")
    return {"json": str(out / "bench.json"), "png": str(out / "bench.png")}
