"""The stager end to end on generated checkpoints, checked against the documented layout."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from modelstage.core import layouts
from modelstage.core.errors import ArtifactError, SpecError
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from safetensors import safe_open
from safetensors.numpy import load_file
from support.layout_reference import expected_rank, load_checkpoint_tensors, load_config

CASES = [
    # (label, model spec, tp values)
    ("llama", SyntheticModel(num_shards=3, split_fused=True), (1, 2, 4, 8)),
    ("llama-tied", SyntheticModel(tie_word_embeddings=True, vocab_size=1000), (1, 2)),
    ("llama-1kv", SyntheticModel(num_kv_heads=1, vocab_size=1024), (2, 4)),
    ("mistral", SyntheticModel(architecture="MistralForCausalLM", num_kv_heads=4), (2, 8)),
    ("qwen2", SyntheticModel(architecture="Qwen2ForCausalLM", vocab_size=777), (1, 2, 4)),
    ("qwen3", SyntheticModel(architecture="Qwen3ForCausalLM", head_dim=64, num_heads=4,
                             num_kv_heads=2, vocab_size=999, num_shards=2), (1, 2, 4)),
    ("mixtral", SyntheticModel(architecture="MixtralForCausalLM", hidden_size=64,
                               intermediate_size=128, num_experts=3, num_shards=3), (1, 2, 4, 8)),
    ("qwen2-moe", SyntheticModel(architecture="Qwen2MoeForCausalLM", hidden_size=64,
                                 intermediate_size=32, num_experts=8, vocab_size=333,
                                 num_shards=3), (1, 2, 4, 8)),
    ("qwen3-moe", SyntheticModel(architecture="Qwen3MoeForCausalLM", hidden_size=64,
                                 intermediate_size=32, num_experts=4, tie_word_embeddings=True,
                                 num_shards=2), (1, 2, 4)),
    ("gpt-oss", SyntheticModel(architecture="GptOssForCausalLM", hidden_size=64, num_heads=8,
                               num_kv_heads=8, intermediate_size=32, num_experts=3,
                               vocab_size=333, num_shards=3), (1, 2, 4, 8)),
    ("phi3", SyntheticModel(architecture="Phi3ForCausalLM", num_kv_heads=2, vocab_size=555,
                            num_shards=2), (1, 2, 4, 8)),
]  # fmt: skip


def rank_tensors(artifact: Path, rank: int) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(artifact.glob(f"model-rank-{rank}-part-*.safetensors")):
        part = load_file(f)
        assert not set(part) & set(tensors), "a key appears in two part files"
        tensors.update(part)
    return tensors


@pytest.mark.parametrize(("label", "spec", "tps"), CASES, ids=[c[0] for c in CASES])
def test_rank_files_hold_exactly_vllms_per_rank_tensors(
    label: str, spec: SyntheticModel, tps: tuple[int, ...], tmp_path: Path
) -> None:
    src = write_checkpoint(spec, tmp_path / "src")
    hf, config = load_checkpoint_tensors(src), load_config(src)
    for tp in tps:
        out = tmp_path / f"tp{tp}"
        stage(StageRequest(source=str(src), out=str(out), tp=tp))
        verify_directory(out)
        for r in range(tp):
            got, want = rank_tensors(out, r), expected_rank(hf, config, tp, r)
            assert sorted(got) == sorted(want), f"tp={tp} rank={r}: key sets differ"
            for name in want:
                assert got[name].dtype == want[name].dtype, name
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{tp}/{r}/{name}")
        assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
        assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()


def test_manifest_records_what_loaders_and_operators_check(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "a"
    summary = stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    m = json.loads((out / MANIFEST).read_text())
    assert m["format"] == "sharded_state" and m["tensorParallelSize"] == 2
    assert m["pipelineParallelSize"] == 1 and m["dtype"] == "auto"
    assert m["vllmVersion"] == "0.32" and m["layoutVersion"] == "vllm-0.32/1"
    assert m["digest"] == summary["digest"]
    files = {f["name"] for f in m["source"]["files"]}
    assert "model.safetensors.index.json" not in files  # identity: weights and carried files
    assert {"config.json", "model-00001-of-00003.safetensors"} <= files
    listed = set(m["files"])
    assert listed == {p.name for p in out.iterdir()} - {MANIFEST}
    for name, entry in m["files"].items():
        assert (out / name).stat().st_size == entry["size"]


def test_rerun_on_complete_artifact_does_nothing(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    assert again["alreadyStaged"] is True
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_output_of_another_digest_is_refused_not_overwritten(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "a"
    stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    with pytest.raises(ArtifactError, match="digest"):
        stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=1))
    verify_directory(out, tp=2)


def test_incomplete_output_directory_is_refused(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    out.mkdir()
    (out / "model-rank-0-part-0.safetensors").write_bytes(b"partial")
    with pytest.raises(ArtifactError, match="incomplete or foreign"):
        stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=1))
    assert (out / "model-rank-0-part-0.safetensors").read_bytes() == b"partial"


def test_leftovers_of_a_killed_run_are_removed(llama_ckpt: Path, tmp_path: Path) -> None:
    stale = tmp_path / "a.tmp-deadbeef"
    stale.mkdir()
    (stale / "model-rank-0-part-0.safetensors").write_bytes(b"x")
    stage(StageRequest(source=str(llama_ckpt), out=str(tmp_path / "a"), tp=1))
    assert not stale.exists()
    assert not list(tmp_path.glob("a.tmp-*"))


def test_failed_stage_publishes_nothing(tmp_path: Path) -> None:
    src = write_checkpoint(SyntheticModel(), tmp_path / "src")
    with pytest.raises(SpecError, match="does not divide"):
        stage(StageRequest(source=str(src), out=str(tmp_path / "a"), tp=3))
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob("a.tmp-*"))


def test_large_ranks_split_into_parts_that_together_hold_every_tensor(
    llama_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = dataclasses.replace(layouts.LAYOUTS["0.32"], max_part_bytes=300_000)
    monkeypatch.setitem(layouts.LAYOUTS, "0.32", small)
    out = tmp_path / "a"
    stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    parts = sorted(p.name for p in out.glob("model-rank-0-part-*.safetensors"))
    assert len(parts) > 2
    hf, config = load_checkpoint_tensors(llama_ckpt), load_config(llama_ckpt)
    got = rank_tensors(out, 0)
    want = expected_rank(hf, config, 2, 0)
    assert sorted(got) == sorted(want)


def test_dtype_cast_matches_torch_rounding(tmp_path: Path) -> None:
    import torch

    src = write_checkpoint(SyntheticModel(num_layers=1), tmp_path / "src")
    out = tmp_path / "bf16"
    stage(StageRequest(source=str(src), out=str(out), tp=2, dtype="bfloat16"))
    hf = load_checkpoint_tensors(src)
    with safe_open(out / "model-rank-1-part-0.safetensors", framework="pt") as f:
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = f.get_tensor("model.layers.0.self_attn.attn._k_scale")
    want = torch.from_numpy(
        np.array_split(hf["model.layers.0.mlp.down_proj.weight"], 2, 1)[1].copy()
    )
    assert down.dtype == torch.bfloat16
    assert torch.equal(down, want.to(torch.bfloat16))
    assert scale.dtype == torch.float32 and scale.item() == 1.0


def test_transposed_experts_cast_like_torch_and_stay_in_order(tmp_path: Path) -> None:
    """gpt-oss's transposed expert slices and the rank-0-only bias through a dtype cast."""
    import torch

    spec = SyntheticModel(architecture="GptOssForCausalLM", hidden_size=64, num_heads=4,
                          num_kv_heads=2, intermediate_size=32, num_experts=3, num_layers=1,
                          vocab_size=100)  # fmt: skip
    src = write_checkpoint(spec, tmp_path / "src")
    out = tmp_path / "bf16"
    stage(StageRequest(source=str(src), out=str(out), tp=2, dtype="bfloat16"))
    hf, config = load_checkpoint_tensors(src), load_config(src)
    for rank in range(2):
        want = expected_rank(hf, config, 2, rank)
        with safe_open(out / f"model-rank-{rank}-part-0.safetensors", framework="pt") as f:
            for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
                key = f"model.layers.0.mlp.experts.routed_experts.{name}"
                got = f.get_tensor(key)
                assert got.dtype == torch.bfloat16, key
                assert torch.equal(got, torch.from_numpy(want[key]).to(torch.bfloat16)), key


def test_verify_reports_a_corrupted_file(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2, chunk_bytes=1 << 20))
    victim = out / "model-rank-1-part-0.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    last = (len(data) - 1) // (1 << 20)
    with pytest.raises(ArtifactError, match=(
        rf"{victim}: chunk {last} \(bytes {last << 20}-{len(data) - 1}\) has BLAKE3 [0-9a-f]{{64}}, "
        r"the manifest says [0-9a-f]{64}; the file is corrupt: re-stage it$"
    )):  # fmt: skip
        verify_directory(out)
    verify_directory(out, hash_content=False)  # sizes alone cannot see it
    victim.write_bytes(bytes(data[:-1]))
    with pytest.raises(ArtifactError, match="bytes, the manifest says"):
        verify_directory(out, hash_content=False)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "modelstage.stager.cli", *args],
        capture_output=True, text=True, env=env, cwd="/", check=False,
    )  # fmt: skip


def test_cli_success_ends_with_one_line_json_summary(llama_ckpt: Path, tmp_path: Path) -> None:
    done = run_cli("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["tensorParallelSize"] == 2 and summary["bytes"] > 0
    assert summary["sourceIdentity"].startswith("sha256:")
    assert len(done.stdout.strip().splitlines()[-1]) < 4096  # fits a termination message
    verify = run_cli("verify", str(tmp_path / "a"), "--tp", "2", "--digest", summary["digest"])
    assert verify.returncode == 0, verify.stderr
    wrong = run_cli("verify", str(tmp_path / "a"), "--tp", "4")
    assert wrong.returncode == 1 and "tensor parallel size 2" in wrong.stderr.splitlines()[-1]


def test_cli_failure_ends_with_one_line_reason(tmp_path: Path) -> None:
    src = write_checkpoint(SyntheticModel(), tmp_path / "src")
    done = run_cli("stage", str(src), "--tp", "3", "--out", str(tmp_path / "a"))
    assert done.returncode == 1
    last = (done.stdout + done.stderr).strip().splitlines()[-1]
    assert last.startswith("error: ") and "does not divide the 8 attention heads" in last
    assert "Traceback" not in done.stderr


def rewrite_in_place(src: Path, seed: int) -> None:
    """New weights of the same shapes at the same path (a retrained checkpoint copied over the
    old one): names, shapes and offsets, so headers and sizes, stay exactly as they were."""
    fresh = write_checkpoint(SyntheticModel(num_shards=3, split_fused=True, seed=seed),
                             src.parent / f"fresh-{seed}")  # fmt: skip
    for path in sorted(fresh.glob("*.safetensors")):
        assert path.stat().st_size == (src / path.name).stat().st_size
        with open(src / path.name, "r+b") as f:  # in place: same inode, same path
            f.write(path.read_bytes())


def test_a_checkpoint_rewritten_in_place_is_a_new_artifact_never_the_stale_one(
    tmp_path: Path,
) -> None:
    src = write_checkpoint(SyntheticModel(num_shards=3, split_fused=True), tmp_path / "src")
    out = tmp_path / "a"
    first = stage(StageRequest(source=str(src), out=str(out), tp=2))
    again = stage(StageRequest(source=str(src), out=str(out), tp=2))
    assert again["alreadyStaged"] is True and again["digest"] == first["digest"]

    rewrite_in_place(src, seed=7)
    elsewhere = stage(StageRequest(source=str(src), out=str(tmp_path / "b"), tp=2))
    assert elsewhere["digest"] != first["digest"]
    assert elsewhere["sourceIdentity"] != first["sourceIdentity"]
    assert elsewhere["alreadyStaged"] is False
    with pytest.raises(ArtifactError) as refused:
        stage(StageRequest(source=str(src), out=str(out), tp=2))
    message = str(refused.value)
    assert f"already holds artifact {first['digest']}" in message
    assert f"source identity {first['sourceIdentity']}" in message
    assert f"would write artifact {elsewhere['digest']}" in message
    assert f"source identity {elsewhere['sourceIdentity']}" in message
    assert "they differ in source identity (the source changed since that artifact was staged)" in (
        message
    )
    assert "--force" in message
    verify_directory(out, digest=first["digest"])  # refused, untouched

    forced = stage(StageRequest(source=str(src), out=str(out), tp=2, force=True))
    assert forced["alreadyStaged"] is False and forced["digest"] == elsewhere["digest"]
    verify_directory(out, digest=elsewhere["digest"])
    hf, config = load_checkpoint_tensors(src), load_config(src)
    want = expected_rank(hf, config, 2, 1)
    got = rank_tensors(out, 1)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not list(tmp_path.glob("a.tmp-*"))


def test_the_manifest_records_the_identity_the_digest_was_taken_from(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    from modelstage.core.digest import artifact_digest

    summary = stage(StageRequest(source=str(llama_ckpt), out=str(tmp_path / "a"), tp=2))
    source = json.loads((tmp_path / "a" / MANIFEST).read_text())["source"]
    assert source["identity"] == summary["sourceIdentity"]
    assert summary["digest"] == artifact_digest(
        uri=f"file://{llama_ckpt}", source=source["identity"], tp=2,
        pp=1, dtype="auto", load_format="sharded_state",
        layout_version=layouts.layout_for(None).layout_version,
    )  # fmt: skip


def test_cli_resolve_prints_the_identity_stage_takes_the_digest_from(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    done = run_cli("resolve", str(llama_ckpt))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 4096
    resolved = json.loads(lines[0])
    staged = run_cli("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"))
    assert staged.returncode == 0, staged.stderr
    summary = json.loads(staged.stdout.strip().splitlines()[-1])
    assert resolved["identity"] == summary["sourceIdentity"]
    assert resolved["digestInputs"] == {"uri": f"file://{llama_ckpt}", "source": resolved["identity"]}
    assert resolved["kind"] == "local" and resolved["files"] > 0 and resolved["bytes"] > 0


def test_cli_stage_refuses_a_source_that_changed_since_it_was_resolved(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    stale = "sha256:" + "0" * 64
    done = run_cli("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"),
                   "--expect-identity", stale)  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "changed since it was resolved" in last
    assert f"expected source identity {stale}, found sha256:" in last
    assert not (tmp_path / "a").exists()
