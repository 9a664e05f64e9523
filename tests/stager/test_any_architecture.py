"""The Hugging Face layout formats (``runai_streamer``, ``safetensors``) cache any checkpoint:
an architecture outside the per-rank table, or a quantized one, is copied byte for byte with
its config; the per-rank formats refuse both, naming the formats that take them; ``auto``
picks between them by the same facts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from modelstage.core.architectures import ARCHITECTURES
from modelstage.core.errors import SpecError
from modelstage.core.formats import AUTO_FORMATS, FORMATS, PER_RANK_ARCHITECTURES, choose_format
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.resolve import resolve
from modelstage.stager.stage import StageRequest, stage

HF_LAYOUT = ["runai_streamer", "safetensors"]
PER_RANK = [f.name for f in FORMATS.values() if f.per_rank]
OLMO2 = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"}
FP8 = {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                               "config_groups": {"group_0": {"targets": ["Linear"]}}}}  # fmt: skip


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(SyntheticModel(num_shards=2), tmp_path_factory.mktemp("base") / "c")


def variant(base: Path, where: Path, **config: object) -> Path:
    """``base`` with ``config`` merged into its config.json (the weights as they are)."""
    shutil.copytree(base, where)
    merged = {**json.loads((where / "config.json").read_text()), **config}
    (where / "config.json").write_text(json.dumps(merged, indent=1))
    return where


CONFIGS = {"olmo2": OLMO2, "quantized": FP8, "unknown-shape": {
    "architectures": ["SomeVisionForConditionalGeneration"], "hidden_size": None,
    "text_config": {"hidden_size": 128}}}  # fmt: skip


@pytest.mark.parametrize("fmt", HF_LAYOUT)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_hugging_face_layout_formats_copy_any_checkpoint_with_its_config(
    fmt: str, kind: str, base_ckpt: Path, tmp_path: Path
) -> None:
    src = variant(base_ckpt, tmp_path / "src", **CONFIGS[kind])
    out = tmp_path / "out"
    summary = stage(StageRequest(source=str(src), out=str(out), tp=2, format=fmt))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == fmt and summary["format"] == fmt
    copied = {p.name for p in src.iterdir()} - {"modelstage.json"}
    assert set(manifest["files"]) == copied == {p.name for p in out.iterdir()} - {MANIFEST}
    for name in copied:  # byte for byte, quantization_config included
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert manifest["schemaVersion"] == 2
    assert all(entry["chunks"] for entry in manifest["files"].values()), "chunk hashes"
    verify_directory(out)  # every chunk of every file hashed against the manifest
    assert not list(tmp_path.glob("out.tmp-*"))


@pytest.mark.parametrize("fmt", PER_RANK)
@pytest.mark.parametrize(
    ("kind", "reason"),
    [("olmo2", "architecture 'Olmo2ForCausalLM' is not supported per rank; supported: "
                + ", ".join(sorted(ARCHITECTURES))),
     ("quantized", "quantized checkpoints (quantization_config: compressed-tensors) are not "
                   "split per rank")],
)  # fmt: skip
def test_per_rank_formats_refuse_what_they_cannot_split_naming_the_way_out(
    fmt: str, kind: str, reason: str, base_ckpt: Path, tmp_path: Path
) -> None:
    src = variant(base_ckpt, tmp_path / "src", **CONFIGS[kind])
    with pytest.raises(SpecError) as refused:
        stage(StageRequest(source=str(src), out=str(tmp_path / "out"), tp=2, format=fmt))
    message = str(refused.value)
    assert reason in message, message
    assert "--format safetensors (a directory) or runai_streamer (S3)" in message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_a_tp_that_vllm_cannot_run_is_refused_before_the_copy(
    base_ckpt: Path, tmp_path: Path
) -> None:
    src = variant(base_ckpt, tmp_path / "src", **OLMO2)
    with pytest.raises(SpecError, match="tensor parallel size 3 does not divide the 8 attention"):
        stage(StageRequest(source=str(src), out=str(tmp_path / "out"), tp=3, format="safetensors"))
    assert not (tmp_path / "out").exists()


def test_safetensors_is_staged_to_directories_only_naming_the_s3_copy() -> None:
    with pytest.raises(SpecError) as refused:
        FORMATS["safetensors"].check_destination("s3")
    assert str(refused.value) == (
        "format safetensors is read from local directories only; stage to S3 with --format "
        "runai_streamer"
    )


@pytest.mark.parametrize("kind", ["olmo2", "quantized"])
def test_resolve_reports_the_architecture_and_quantization_auto_decides_by(
    kind: str, base_ckpt: Path, tmp_path: Path
) -> None:
    src = variant(base_ckpt, tmp_path / "src", **CONFIGS[kind])
    resolved = resolve(StageRequest(source=str(src), out="", tp=1), config=True)
    resolved.close()
    summary = resolved.summary()
    if kind == "olmo2":
        assert (summary["architecture"], summary["quantization"]) == ("Olmo2ForCausalLM", None)
    else:
        assert (summary["architecture"], summary["quantization"]) == (
            "LlamaForCausalLM",
            "compressed-tensors",
        )


@pytest.mark.parametrize("storage", ["pvc", "s3"])
def test_auto_picks_per_rank_for_the_table_and_the_hf_layout_otherwise(storage: str) -> None:
    per_rank, copy = AUTO_FORMATS[(storage, True)], AUTO_FORMATS[(storage, False)]
    assert FORMATS[per_rank].per_rank and not FORMATS[copy].per_rank
    assert storage in FORMATS[per_rank].storage and storage in FORMATS[copy].storage
    for arch in PER_RANK_ARCHITECTURES:
        assert choose_format(storage, arch, None).format == per_rank
    olmo = choose_format(storage, "Olmo2ForCausalLM", None)
    assert olmo.format == copy
    assert olmo.reason == (
        f"architecture Olmo2ForCausalLM has no per-rank rules: cached in the Hugging Face "
        f"layout ({copy})"
    )
    quantized = choose_format(storage, "LlamaForCausalLM", "fp8")
    assert quantized.format == copy and "quantized (fp8)" in quantized.reason
    assert choose_format(storage, None, None).format == copy


def test_a_multimodal_config_has_its_language_models_heads_checked(
    base_ckpt: Path, tmp_path: Path
) -> None:
    src = variant(base_ckpt, tmp_path / "src", architectures=["SomeVisionForConditionalGeneration"],
                  num_attention_heads=None, text_config={"num_attention_heads": 6})  # fmt: skip
    with pytest.raises(SpecError, match="tensor parallel size 4 does not divide the 6 attention"):
        stage(StageRequest(source=str(src), out=str(tmp_path / "out"), tp=4, format="safetensors"))
    stage(StageRequest(source=str(src), out=str(tmp_path / "ok"), tp=2, format="safetensors"))
