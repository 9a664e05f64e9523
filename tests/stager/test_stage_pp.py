"""``modelstage stage --pp``: every (stage, TP rank) gets files of its own, named as vLLM 0.32
names them, holding that stage's tensors byte for byte as the PP 1 artifact holds them; the
manifest, the digest, ``verify --pp`` and ``prepare --pp`` know the pipeline size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from modelstage.core.errors import ArtifactError, SpecError
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST, read_manifest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.plugin.checks import check_layer_partition
from modelstage.stager.prepare import verify_artifact
from modelstage.stager.scale_out import Group, stage_group
from modelstage.stager.stage import StageRequest, stage
from safetensors.numpy import load_file

LAYERS = 5  # vLLM's default at PP 2: 3 + 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = SyntheticModel(num_layers=LAYERS, tie_word_embeddings=True, vocab_size=300)
    return write_checkpoint(spec, tmp_path_factory.mktemp("llama-pp"))


def _tensors(files: list[Path]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in files:
        part = load_file(f)
        assert not set(part) & set(out), "a key in two files of one rank"
        out.update(part)
    return out


def test_each_stage_rank_holds_its_layers_as_the_pp_1_artifact_does(
    llama: Path, tmp_path: Path
) -> None:
    flat, piped = tmp_path / "pp1", tmp_path / "pp2"
    stage(StageRequest(source=str(llama), out=str(flat), tp=2))
    stage(StageRequest(source=str(llama), out=str(piped), tp=2, pp=2))
    weights = sorted(p.name for p in piped.glob("*.safetensors"))
    assert weights == [f"model-pp-{p}-tp-{t}-part-0.safetensors" for p in (0, 1) for t in (0, 1)]
    for t in (0, 1):
        whole = _tensors(sorted(flat.glob(f"model-rank-{t}-part-*.safetensors")))
        stages = [_tensors(sorted(piped.glob(f"model-pp-{p}-tp-{t}-part-*"))) for p in (0, 1)]
        layers = [{int(m.group(1)) for n in s if (m := re.match(r"model\.layers\.(\d+)\.", n))}
                  for s in stages]  # fmt: skip
        assert layers == [{0, 1, 2}, {3, 4}]
        # tied: the first stage keeps the embeddings' name, the last the head's (vLLM's)
        assert np.array_equal(stages[0].pop("model.embed_tokens.weight"), whole["lm_head.weight"])
        assert "lm_head.weight" in stages[1] and "model.norm.weight" in stages[1]
        merged = {**stages[0], **stages[1]}
        assert sorted(merged) == sorted(whole)
        for name, tensor in whole.items():
            assert merged[name].dtype == tensor.dtype and np.array_equal(merged[name], tensor)
    manifest = json.loads((piped / MANIFEST).read_text())
    assert manifest["pipelineParallelSize"] == 2 and "pipelineLayerPartition" not in manifest


def test_verify_and_prepare_refuse_another_pipeline_size(llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    stage(StageRequest(source=str(llama), out=str(out), tp=2, pp=2))
    digest = verify_directory(out, tp=2, pp=2).digest
    with pytest.raises(ArtifactError, match="pipeline parallel size 2, but the workload runs 1"):
        verify_directory(out, pp=1)
    with pytest.raises(ArtifactError, match="pipeline parallel size 2, but the workload runs 4"):
        verify_artifact(str(out), digest=digest, tp=2, pp=4, hash_content=False)
    summary = verify_artifact(str(out), digest=digest, tp=2, pp=2, hash_content=True)
    assert summary["pipelineParallelSize"] == 2


def test_a_stage_missing_from_the_manifest_is_refused(llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    stage(StageRequest(source=str(llama), out=str(out), tp=2, pp=2))
    doc = json.loads((out / MANIFEST).read_text())
    for name in [n for n in doc["files"] if n.startswith("model-pp-1-tp-1-")]:
        del doc["files"][name]
        (out / name).unlink()
    (out / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="no file for rank 1 of pipeline stage 1"):
        verify_directory(out)


def test_the_digest_and_manifest_hold_pp_and_an_explicit_partition(
    llama: Path, tmp_path: Path
) -> None:
    one = stage(StageRequest(source=str(llama), out=str(tmp_path / "a"), tp=2))
    two = stage(StageRequest(source=str(llama), out=str(tmp_path / "b"), tp=2, pp=2))
    split = stage(StageRequest(source=str(llama), out=str(tmp_path / "c"), tp=2, pp=2,
                               pp_partition=(1, 4)))  # fmt: skip
    assert len({one["digest"], two["digest"], split["digest"]}) == 3
    manifest = read_manifest(tmp_path / "c")
    assert manifest is not None and manifest.pipelineLayerPartition == "1,4"
    assert sorted(_tensors([tmp_path / "c" / "model-pp-0-tp-0-part-0.safetensors"])) == [
        n for n in sorted(_tensors([tmp_path / "b" / "model-pp-0-tp-0-part-0.safetensors"]))
        if not n.startswith(("model.layers.1.", "model.layers.2."))
    ]  # fmt: skip


def test_the_serving_partition_must_be_the_staged_one(llama: Path, tmp_path: Path) -> None:
    stage(StageRequest(source=str(llama), out=str(tmp_path / "c"), tp=2, pp=2,
                       pp_partition=(1, 4)))  # fmt: skip
    manifest = read_manifest(tmp_path / "c")
    assert manifest is not None
    check_layer_partition("c", manifest, LAYERS, "1,4")
    check_layer_partition("c", manifest, LAYERS, " 1, 4")
    with pytest.raises(ArtifactError, match=r"hold 1,4 decoder layers, but vLLM builds 3,2"):
        check_layer_partition("c", manifest, LAYERS, None)
    default = stage(StageRequest(source=str(llama), out=str(tmp_path / "d"), tp=2, pp=2))
    manifest = read_manifest(Path(default["uri"]))
    assert manifest is not None
    check_layer_partition("d", manifest, LAYERS, "3,2")  # vLLM's default, spelled out
    with pytest.raises(ArtifactError, match="VLLM_PP_LAYER_PARTITION=2,3"):
        check_layer_partition("d", manifest, LAYERS, "2,3")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"format": "tensorizer"}, "tensorizer: vLLM's loader names a rank's file by its"),
        ({"vllm_version": "0.31"}, "vLLM 0.31's sharded-state loader names"),
        ({"pp": 1, "pp_partition": (5,)}, "--pp-layer-partition applies to per-rank formats"),
        ({"pp_partition": (2, 2)}, "holds 4 layers, but the model has 5"),
        ({"pp": 0}, "parallel sizes are at least 1"),
    ],
)
def test_what_cannot_be_served_at_pp_is_refused_before_writing(
    llama: Path, tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    out = tmp_path / "a"
    request = {"source": str(llama), "out": str(out), "tp": 2, "pp": 2, **fields}
    with pytest.raises(SpecError, match=re.escape(message)):
        stage(StageRequest(**request))  # type: ignore[arg-type]
    assert not out.exists()


def test_scale_out_staging_says_it_stages_pp_1_only(llama: Path, tmp_path: Path) -> None:
    request = StageRequest(source=str(llama), out=str(tmp_path / "a"), tp=2, pp=2)
    with pytest.raises(SpecError, match="pipeline parallel size 1 only"):
        stage_group(request, Group(0, 2))


def test_the_hugging_face_layout_is_copied_at_any_pp(llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    stage(StageRequest(source=str(llama), out=str(out), tp=2, pp=2, format="safetensors"))
    assert verify_directory(out, pp=2).pipelineParallelSize == 2
