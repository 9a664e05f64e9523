"""``--format tensorizer`` on local disk, read back with tensorizer's own deserialiser.

The reference for every byte is the ``sharded_state`` artifact of the same checkpoint and TP
(itself proven against vLLM by tests/vllm): both come from one shard plan, so each rank file
must hold exactly that rank's tensors, plus what vLLM's tensorized layout adds.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from modelstage.core.location import verify_directory
from modelstage.stager.stage import StageRequest, stage
from readback import MARKER, rank_file, read_entries, sharded_state
from tensorizer import TensorDeserializer
from tensorizer.serialization import TensorType


@pytest.mark.parametrize(
    "model,tp",
    [("llama", 1), ("llama", 2), ("llama", 4), ("qwen2", 2), ("bf16", 2), ("mixtral", 2),
     ("gpt-oss", 2)],
)
def test_every_rank_file_holds_exactly_that_ranks_sharded_state_plus_the_marker(
    staged: Callable[..., Path], model: str, tp: int
) -> None:
    tz, ss = staged(model, "tensorizer", tp), staged(model, "sharded_state", tp)
    if model == "bf16":
        weights = {t.dtype for _, t in read_entries(rank_file(tz, 0)).values() if t.dim() > 1}
        assert weights == {torch.bfloat16}, "a bfloat16 source staged with dtype auto"
    for rank in range(tp):
        expected = sharded_state(ss, rank)
        got = read_entries(rank_file(tz, rank))
        assert set(got) == set(expected) | {MARKER}, rank
        for name, tensor in expected.items():
            _, actual = got[name]
            assert actual.dtype == tensor.dtype and actual.shape == tensor.shape, name
            assert torch.equal(actual, tensor), f"rank {rank}: {name} differs"


def test_rank_files_differ_between_ranks(staged: Callable[..., Path]) -> None:
    """Guards the test above against comparing rank 0 with itself."""
    tz = staged("llama", "tensorizer", 2)
    a, b = read_entries(rank_file(tz, 0)), read_entries(rank_file(tz, 1))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(a[name][1], b[name][1])


def test_marker_is_vllms_hollow_int64_parameter_on_the_root_module(
    staged: Callable[..., Path],
) -> None:
    """vLLM registers ``nn.Parameter(torch.tensor((1,), device="meta"))`` as
    ``vllm_tensorized_marker`` and ``is_vllm_tensorized`` looks for the key below."""
    path = rank_file(staged("llama", "tensorizer", 2), 1)
    with TensorDeserializer(str(path), device="cpu", lazy_load=True) as d:
        assert MARKER in d
        first = next(iter(d.read_tensors()))
    module_idx, kind, name, tensor = first
    assert (module_idx, name) == (0, MARKER)
    assert kind == TensorType.PARAM
    assert tensor.dtype == torch.int64 and tuple(tensor.shape) == (1,)
    raw = path.read_bytes()
    assert raw[:5] == b"|TZR|"
    assert int.from_bytes(raw[5:9], "little") == 4, "a hollow (meta) tensor needs format v4"


def test_attention_scales_are_buffers_and_weights_are_parameters(
    staged: Callable[..., Path],
) -> None:
    """``load_into_module`` registers each tensor by its type: a scale written as a parameter
    would collide with the buffer vLLM's Attention module already has."""
    got = read_entries(rank_file(staged("llama", "tensorizer", 2), 0))
    buffers = {n for n, (kind, _) in got.items() if kind == TensorType.BUFFER}
    assert buffers == {
        f"model.layers.{layer}.self_attn.attn.{s}"
        for layer in range(2) for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
    }  # fmt: skip
    assert all(got[n][1].item() == 1.0 and got[n][1].dtype == torch.float32 for n in buffers)


def test_tied_embeddings_are_written_under_both_names_vllms_modules_hold(
    staged: Callable[..., Path],
) -> None:
    tz, ss = staged("tied", "tensorizer", 2), staged("tied", "sharded_state", 2)
    for rank in range(2):
        got = read_entries(rank_file(tz, rank))
        head = sharded_state(ss, rank)["lm_head.weight"]
        assert "model.embed_tokens.weight" not in sharded_state(ss, rank)
        assert torch.equal(got["lm_head.weight"][1], head)
        assert torch.equal(got["model.embed_tokens.weight"][1], head)


def test_dtype_conversion_matches_the_sharded_state_conversion(
    staged: Callable[..., Path],
) -> None:
    tz = staged("llama", "tensorizer", 2, "bfloat16")
    ss = staged("llama", "sharded_state", 2, "bfloat16")
    got, expected = read_entries(rank_file(tz, 1)), sharded_state(ss, 1)
    weight = "model.layers.1.mlp.gate_up_proj.weight"
    assert got[weight][1].dtype == torch.bfloat16
    assert all(torch.equal(got[n][1], t) for n, t in expected.items())


def test_manifest_lists_every_rank_file_with_its_sha256_and_verifies(
    staged: Callable[..., Path],
) -> None:
    tz = staged("llama", "tensorizer", 4)
    manifest = verify_directory(tz, tp=4, hash_content=True)
    assert manifest.format == "tensorizer"
    ranks = sorted(n for n in manifest.files if n.endswith(".tensors"))
    assert ranks == [f"model-rank-{r:03d}.tensors" for r in range(4)]
    assert "config.json" in manifest.files
    leftovers = [p.name for p in tz.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == [], "no work area may be left behind"


def test_staging_twice_gives_identical_bytes(
    staged: Callable[..., Path], checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """S3 reruns reuse an object when the run key matches, which is only sound if the same
    plan always serialises to the same bytes."""
    first = json.loads((staged("llama", "tensorizer", 2) / "modelstage.json").read_text())
    stage(StageRequest(source=str(checkpoint("llama")), out=str(tmp_path / "again"), tp=2,
                       format="tensorizer"))  # fmt: skip
    second = json.loads((tmp_path / "again" / "modelstage.json").read_text())
    assert {n: e for n, e in first["files"].items() if n.endswith(".tensors")} == {
        n: e for n, e in second["files"].items() if n.endswith(".tensors")
    }


def test_a_failed_stage_leaves_no_artifact_and_no_work_area(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank file's sink fails in the middle of the stream (a full disk)."""
    from modelstage.stager.destinations.local import LocalFileSink

    write = LocalFileSink.write

    def failing(self: LocalFileSink, data: object) -> None:
        if self.path.name.endswith(".tensors") and self.written > 0:
            raise OSError("disk full")
        write(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalFileSink, "write", failing)
    with pytest.raises(OSError, match="disk full"):
        stage(StageRequest(source=str(checkpoint("llama")), out=str(tmp_path / "a"), tp=2,
                           format="tensorizer"))  # fmt: skip
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


@pytest.mark.parametrize(
    ("model", "tp", "dtype", "hold"),
    [
        ("llama", 2, "auto", None), ("tied", 2, "auto", None), ("qwen2", 1, "bfloat16", None),
        ("llama", 4, "float16", None), ("mixtral", 2, "auto", None),
        ("tied", 2, "auto", 0), ("mixtral", 2, "auto", 0), ("qwen2", 1, "bfloat16", 0),
    ],
)  # fmt: skip
def test_streamed_rank_files_equal_tensorizers_own_seeking_writes_to_a_file(
    checkpoint: Callable[[str], Path], staged: Callable[..., Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, model: str, tp: int, dtype: str, hold: int | None,
) -> None:  # fmt: skip
    """The stager plans every record and streams each rank file front to back; the reference
    is tensorizer's ``TensorSerializer`` writing the same plan into real files, seeking back
    and rewriting the prologue as it goes. ``hold=0``: no target is gathered in memory,
    every one is read twice (hashed, then written), the tied head's data three times."""
    from modelstage.core.layouts import layout_for
    from modelstage.core.progress import Progress
    from modelstage.stager.checkpoint import open_checkpoint
    from modelstage.stager.shard_plan import plan_shards
    from modelstage.stager.sources import open_source
    from modelstage.stager.writers import tensorizer as tensorizer_writer
    from reference_writer import serialize_ranks

    source = open_source(str(checkpoint(model)))
    ckpt = open_checkpoint(source)
    plan = plan_shards(ckpt.model, ckpt.source_tensors, tp, layout_for(None), dtype)
    paths = [tmp_path / f"ref-{r}.tensors" for r in range(tp)]
    files = [open(p, "wb+") for p in paths]  # noqa: SIM115 - the serializer closes them
    serialize_ranks(plan, ckpt, files, Progress(0, 0, label="ref", stream=io.StringIO()),
                    tied=ckpt.model.tie_word_embeddings)  # fmt: skip
    source.close()
    if hold is None:
        streamed = staged(model, "tensorizer", tp, dtype)
    else:
        monkeypatch.setattr(tensorizer_writer, "HOLD_BYTES", hold)
        streamed = tmp_path / "streamed"
        stage(StageRequest(source=str(checkpoint(model)), out=str(streamed), tp=tp,
                           format="tensorizer", dtype=dtype))  # fmt: skip
    for rank in range(tp):
        assert rank_file(streamed, rank).read_bytes() == paths[rank].read_bytes(), rank


def test_a_local_rank_file_is_written_once_in_place_without_a_spool(
    checkpoint: Callable[[str], Path], staged: Callable[..., Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """No temporary copy beside ``--out``: each rank file is written once, by its sink, into
    the artifact's work directory (the only files created are the artifact's own)."""
    import tempfile

    from modelstage.stager.destinations.local import LocalFileSink

    def no_spool(*args: object, **kwargs: object) -> str:
        raise AssertionError("a temporary directory was made")

    created: list[str] = []
    init = LocalFileSink.__init__

    def counting(self: LocalFileSink, path: Path, size: int, *rest: Any, **kw: Any) -> None:
        created.append(path.name)
        init(self, path, size, *rest, **kw)

    monkeypatch.setattr(tempfile, "mkdtemp", no_spool)
    monkeypatch.setattr(LocalFileSink, "__init__", counting)
    stage(StageRequest(source=str(checkpoint("llama")), out=str(tmp_path / "a"), tp=2,
                       format="tensorizer"))  # fmt: skip
    assert sorted(created) == sorted(p.name for p in (tmp_path / "a").iterdir())
    for rank in range(2):
        assert rank_file(tmp_path / "a", rank).read_bytes() == rank_file(
            staged("llama", "tensorizer", 2), rank
        ).read_bytes()


def test_a_rank_file_that_differs_from_the_planned_size_is_refused_and_nothing_published(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records the writer streams must add up to the size the plan gave the sinks (and
    the manifest): a drift between the two fails the stage instead of publishing."""
    from modelstage.stager.writers import tensorizer as tensorizer_writer

    plan_writes = tensorizer_writer.plan_writes

    def drifted(*args: object) -> tuple[list[tensorizer_writer.TensorWrite], Any]:
        writes, layout = plan_writes(*args)  # type: ignore[arg-type]
        return writes, tensorizer_writer.FileLayout(layout.prologue, layout.size + 8)

    monkeypatch.setattr(tensorizer_writer, "plan_writes", drifted)
    with pytest.raises(AssertionError, match=r"rank file of \d+ bytes, \d+ were planned"):
        stage(StageRequest(source=str(checkpoint("llama")), out=str(tmp_path / "a"), tp=2,
                           format="tensorizer"))  # fmt: skip
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


def test_cli_stages_tensorizer_and_prints_the_summary(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    cli = Path(sys.executable).with_name("modelstage")
    proc = subprocess.run(
        [str(cli), "stage", str(checkpoint("llama")), "--tp", "2", "--format", "tensorizer",
         "--out", str(tmp_path / "a")],
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["format"] == "tensorizer" and summary["tensorParallelSize"] == 2
    assert rank_file(tmp_path / "a", 1).exists()


@pytest.mark.parametrize("tp", [2, 4])
def test_phi3_rank_files_hold_the_sharded_state_cut_from_its_fused_sources(
    staged: Callable[..., Path], tp: int
) -> None:
    """Each part of a fused source read at its own rows: the same per-rank tensors as the
    ``sharded_state`` artifact (itself proven against vLLM by tests/vllm)."""
    tz, ss = staged("phi3", "tensorizer", tp), staged("phi3", "sharded_state", tp)
    for rank in range(tp):
        expected = sharded_state(ss, rank)
        assert "model.layers.0.self_attn.qkv_proj.weight" in expected
        got = read_entries(rank_file(tz, rank))
        assert set(got) == set(expected) | {MARKER}, rank
        for name, tensor in expected.items():
            assert torch.equal(got[name][1], tensor), f"rank {rank}: {name} differs"
