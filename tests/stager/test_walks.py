"""The two walks of docs/architecture.md, proven: a new family is one row of the family table,
a new format one row of the format table and its writer (its plugin loader and the API take the
row as it is). Each test adds its row to the
tables for its own duration only (``monkeypatch``); every other module reads the tables, so
``modelstage stage`` and ``modelstage verify`` (the CLI, in-process) take the new row with no
other change, and the synthetic checkpoint comes from the row's rules.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from modelstage.core import architectures, formats
from modelstage.core.architectures import Architecture, Rule, Split, When
from modelstage.core.formats import FORMATS, Format, choose_format
from modelstage.core.integrity import FileDigest
from modelstage.core.manifest import MANIFEST
from modelstage.core.progress import Progress
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager import cli
from modelstage.stager.destinations.base import Destination
from modelstage.stager.writers import WRITERS
from modelstage.stager.writers.base import PlannedFile, WriteJob, Writer
from safetensors.numpy import load_file

FAMILY = "ScratchForCausalLM"
BLOCK = "blocks.{L}"
SCRATCH_RULES = (
    Rule("embed.weight", "model.embed_tokens.weight", Split.VOCAB, ("vocab", "hidden")),
    *(Rule(f"{BLOCK}.attn.{x}.weight", "model.layers.{L}.self_attn.qkv_proj.weight", Split.QKV,
           (rows, "hidden"), x) for x, rows in (("q", "q"), ("k", "kv"), ("v", "kv"))),
    Rule(f"{BLOCK}.attn.out.weight", "model.layers.{L}.self_attn.o_proj.weight", Split.ROW,
         ("hidden", "q")),
    Rule(f"{BLOCK}.ffn.up.weight", "model.layers.{L}.mlp.up_proj.weight", Split.COLUMN,
         ("inter", "hidden")),
    Rule(f"{BLOCK}.ffn.down.weight", "model.layers.{L}.mlp.down_proj.weight", Split.ROW,
         ("hidden", "inter")),
    Rule(f"{BLOCK}.ffn.down.bias", "model.layers.{L}.mlp.down_proj.bias", Split.REPLICATED,
         ("hidden",), when=When.MLP_BIAS),
    Rule(f"{BLOCK}.norm.weight", "model.layers.{L}.norm.weight", Split.REPLICATED, ("hidden",)),
    Rule("final_norm.weight", "model.norm.weight", Split.REPLICATED, ("hidden",)),
    Rule("head.weight", "lm_head.weight", Split.VOCAB, ("vocab", "hidden"), when=When.UNTIED),
)  # fmt: skip
"""A family none of the table's rows resembles by name: every source tensor is named its own
way, a plain column-split MLP, a bias that exists only when config.json says so."""
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_heads": 4,
    "num_kv_heads": 2,
    "vocab_size": 100,
    "num_layers": 2,
    "num_shards": 2,
}
"""The synthetic checkpoint's size (built while the row is in the table)."""


def _modelstage(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    """One ``modelstage`` command in-process; its one-line JSON result (exit code 0)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.fixture
def scratch_family(monkeypatch: pytest.MonkeyPatch) -> Architecture:
    row = Architecture(FAMILY, "scratch", SCRATCH_RULES)
    monkeypatch.setitem(architectures.ARCHITECTURES, FAMILY, row)
    return row


def test_a_family_row_alone_stages_and_verifies_per_rank(
    scratch_family: Architecture, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = SyntheticModel(architecture=FAMILY, **SHAPE)  # type: ignore[arg-type]
    src = write_checkpoint(spec, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    assert (config["model_type"], config["head_dim"]) == ("scratch", 16)
    out = tmp_path / "artifact"
    staged = _modelstage(capsys, "stage", str(src), "--tp", "2", "--out", str(out))
    assert (staged["format"], staged["tensorParallelSize"]) == ("sharded_state", 2)
    verified = _modelstage(capsys, "verify", str(out), "--tp", "2")
    assert verified["format"] == "sharded_state" and verified["files"] == staged["files"]

    source = {**load_file(str(src / "model-00001-of-00002.safetensors")),
              **load_file(str(src / "model-00002-of-00002.safetensors"))}  # fmt: skip
    assert set(source) == {name for name, _ in spec.tensors()}
    rank1 = load_file(str(out / "model-rank-1-part-0.safetensors"))
    q, kv = source["blocks.1.attn.q.weight"], source["blocks.1.attn.k.weight"]
    assert np.array_equal(rank1["model.layers.1.self_attn.qkv_proj.weight"][: len(q) // 2],
                          q[len(q) // 2 :])  # fmt: skip
    assert np.array_equal(rank1["model.layers.1.self_attn.qkv_proj.weight"][32:48], kv[16:])
    assert np.array_equal(rank1["model.layers.0.mlp.up_proj.weight"],
                          source["blocks.0.ffn.up.weight"][48:])  # fmt: skip
    assert np.array_equal(rank1["model.layers.0.mlp.down_proj.weight"],
                          source["blocks.0.ffn.down.weight"][:, 48:])  # fmt: skip
    assert np.array_equal(rank1["model.norm.weight"], source["final_norm.weight"])
    assert "model.layers.0.mlp.down_proj.bias" not in rank1  # mlp_bias is false


def test_auto_picks_per_rank_for_the_new_row_and_nothing_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert choose_format("pvc", FAMILY, None).format == "safetensors"
    with pytest.raises(ValueError, match=FAMILY):
        SyntheticModel(architecture=FAMILY)
    monkeypatch.setitem(architectures.ARCHITECTURES, FAMILY,
                        Architecture(FAMILY, "scratch", SCRATCH_RULES))  # fmt: skip
    assert FAMILY in formats.PER_RANK_ARCHITECTURES
    assert choose_format("pvc", FAMILY, None).format == "sharded_state"
    assert choose_format("s3", FAMILY, None).format == "runai_streamer_sharded"


def test_without_its_row_the_family_is_refused_per_rank(
    scratch_family: Architecture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_checkpoint(SyntheticModel(architecture=FAMILY, **SHAPE), tmp_path / "src")  # type: ignore[arg-type]
    monkeypatch.delitem(architectures.ARCHITECTURES, FAMILY)
    code = cli.main(["stage", str(src), "--tp", "2", "--out", str(tmp_path / "out")])
    assert code == 1 and not (tmp_path / "out").exists()


class ListingWriter(Writer):
    """A trivial per-rank format: each rank's file lists the tensors the shard plan gives
    that rank, one ``name shape`` line each."""

    @staticmethod
    def _files(job: WriteJob) -> dict[str, bytes]:
        lines = "".join(f"{t.name} {list(t.shape)}\n" for t in job.plan.targets).encode()
        return {job.format.rank_file_name(r): lines for r in range(job.plan.tp)}

    def write(self, job: WriteJob, dest: Destination, progress: Progress) -> dict[str, FileDigest]:
        return {name: dest.write_small(name, data) for name, data in self._files(job).items()}

    def planned(self, job: WriteJob) -> list[PlannedFile]:
        return [PlannedFile(name, len(data), rank)
                for rank, (name, data) in enumerate(self._files(job).items())]  # fmt: skip


LISTING = Format(
    name="listing",
    per_rank=True,
    writer="listing",
    rank_file="model-rank-{rank}.txt",
    weight_files=re.compile(r"^model-rank-\d+\.txt$"),
    destinations=(formats.LOCAL,),
    storage=("pvc",),
    scale_out=False,
    casts=False,
    stock_loader="listing",
    plugin_loader=None,
    loads=("listing",),
)


def test_a_format_row_and_its_writer_alone_stage_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(FORMATS, LISTING.name, LISTING)
    monkeypatch.setitem(WRITERS, LISTING.writer, ListingWriter())
    src = write_checkpoint(SyntheticModel(num_shards=2), tmp_path / "src")
    out = tmp_path / "artifact"
    staged = _modelstage(capsys, "stage", str(src), "--tp", "2", "--format", "listing",
                         "--out", str(out))  # fmt: skip
    assert staged["format"] == "listing"
    verified = _modelstage(capsys, "verify", str(out), "--tp", "2")
    assert verified["format"] == "listing"
    manifest = json.loads((out / MANIFEST).read_text())
    assert {"model-rank-0.txt", "model-rank-1.txt", "config.json"} <= set(manifest["files"])
    rank1 = (out / "model-rank-1.txt").read_text().splitlines()
    assert "model.layers.1.self_attn.qkv_proj.weight [192, 256]" in rank1  # (128 + 2 * 32) rows

    (out / "model-rank-1.txt").write_text("tampered\n")
    assert cli.main(["verify", str(out), "--tp", "2"]) == 1
    assert "model-rank-1.txt" in capsys.readouterr().err


API_WITH_ROW = """
import json, pickle, sys
from modelstage.core import formats
row = pickle.load(sys.stdin.buffer)
formats.FORMATS[row.name] = row
from modelstage.api import crd
from modelstage.api import modeldeployment as api
spec = json.loads(sys.argv[1])
loaded = api.ModelDeploymentSpec.model_validate(spec).load_format
schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
print(json.dumps([loaded, schema["spec"]["properties"]["loadFormat"]["enum"]]))
"""
"""A fresh interpreter whose format table has the row before the API is imported (pydantic
builds its models once, at import): the spec it accepts and the CRD's ``loadFormat`` enum."""
SPEC = {
    "model": {"uri": "hf://org/model"},
    "parallelism": {"tensor": 2},
    "loadFormat": "listing",
    "storage": {"pvc": {"claimName": "models", "path": "/artifacts"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm"}, "containerName": "vllm"},
}


def test_a_format_rows_plugin_loader_is_registered_and_the_api_accepts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from modelstage.api.modeldeployment import ModelDeploymentSpec
    from modelstage.operator.artifact import Artifact, location_from_uri
    from modelstage.operator.rollout_plan import vllm_settings
    from modelstage.plugin import plugin_rows
    from pydantic import ValidationError

    row = replace(LISTING, plugin_loader="modelstage_listing")
    with pytest.raises(ValidationError, match="loadFormat"):
        ModelDeploymentSpec.model_validate(SPEC)
    assert row not in plugin_rows()
    monkeypatch.setitem(FORMATS, row.name, row)
    assert row in plugin_rows()  # register() loads plugin/listing.py's loader for it
    assert formats.plugin_load_formats()["modelstage_listing"] == ("listing",)
    location = location_from_uri("pvc://models/llm/0123456789abcdef0123", "0123456789abcdef0123")
    served = vllm_settings(Artifact(location, "listing", 2), plugin=True)
    assert served.load_format == "modelstage_listing"

    api = subprocess.run(
        [sys.executable, "-c", API_WITH_ROW, json.dumps(SPEC)],
        input=pickle.dumps(row), capture_output=True, timeout=120,
    )  # fmt: skip
    assert api.returncode == 0, api.stderr.decode()[-1500:]
    loaded, enum = json.loads(api.stdout)
    assert loaded == "listing" and enum == ["auto", *FORMATS]


ROOT = Path(__file__).resolve().parents[2]
def _walk_paths(section: str) -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return {p for p in re.findall(r"`([\w./-]+\.(?:py|yaml|md))[`\s]", body) if "/" in p}


def _checkout_path(path: str) -> Path:
    """A package's module path as docs/architecture.md gives it (each package's source root is
    the checkout's folder of its name), or a path from the checkout root."""
    package = path.split("/", 1)[0]
    is_module = (ROOT / package / "modelstage" / package).is_dir()
    return ROOT / (f"{package}/modelstage/{path}" if is_module else path)


@pytest.mark.parametrize("section", ["How to add a format", "How to add an architecture"])
def test_every_file_the_walks_name_exists(section: str) -> None:
    paths = _walk_paths(section)
    assert len(paths) >= 4, paths
    missing = sorted(p for p in paths if not _checkout_path(p).is_file())
    assert not missing, (
        f"docs/architecture.md's {section!r} names files that do not exist: {missing}"
    )
