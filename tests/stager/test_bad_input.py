"""Every kind of bad input exits non-zero with one line naming the file or tensor, and
publishes nothing."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint

Mutation = Callable[[Path], None]


def _header(path: Path) -> tuple[int, dict[str, object], bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def _rewrite_header(path: Path, edit: Callable[[dict[str, object]], None]) -> None:
    _n, header, body = _header(path)
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _first_shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.safetensors"))[0]


def truncate_data(ckpt: Path) -> None:
    f = _first_shard(ckpt)
    f.write_bytes(f.read_bytes()[:-100])


def truncate_prefix(ckpt: Path) -> None:
    _first_shard(ckpt).write_bytes(b"\x10\x00\x00")


def header_beyond_file(ckpt: Path) -> None:
    f = _first_shard(ckpt)
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])


def invalid_json(ckpt: Path) -> None:
    f = _first_shard(ckpt)
    n, _, body = _header(f)
    f.write_bytes(struct.pack("<Q", n) + b"{" * n + body)


def offsets_out_of_bounds(ckpt: Path) -> None:
    def edit(h: dict[str, object]) -> None:
        t = h["model.embed_tokens.weight"]
        assert isinstance(t, dict)
        t["data_offsets"] = [t["data_offsets"][0], 10**12]

    _rewrite_header(_first_shard(ckpt), edit)


def offsets_overlap(ckpt: Path) -> None:
    def edit(h: dict[str, object]) -> None:
        names = [k for k in h if k != "__metadata__"]
        a, b = h[names[0]], h[names[1]]
        assert isinstance(a, dict) and isinstance(b, dict)
        size = b["data_offsets"][1] - b["data_offsets"][0]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]

    _rewrite_header(_first_shard(ckpt), edit)


def shape_mismatch(ckpt: Path) -> None:
    def edit(h: dict[str, object]) -> None:
        t = h["model.norm.weight"] if "model.norm.weight" in h else h["model.embed_tokens.weight"]
        assert isinstance(t, dict)
        t["shape"] = [t["shape"][0] + 1, *t["shape"][1:]]

    for f in ckpt.glob("*.safetensors"):
        _, h, _ = _header(f)
        if "model.norm.weight" in h:
            _rewrite_header(f, edit)


def index_names_missing_file(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def index_path_traversal(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def missing_tensor(ckpt: Path) -> None:
    for f in ckpt.glob("*.safetensors"):
        _, h, _ = _header(f)
        if "model.layers.1.mlp.up_proj.weight" in h:
            _rewrite_header(f, lambda h: h.pop("model.layers.1.mlp.up_proj.weight"))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def pickle_only(ckpt: Path) -> None:
    for f in ckpt.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    (ckpt / "model.safetensors.index.json").unlink()


def unsupported_architecture(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))


def quantized(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (ckpt / "config.json").write_text(json.dumps(config))


BAD_INPUTS: list[tuple[Mutation, int, str]] = [
    # (mutation, tp, a phrase the one-line reason must contain)
    (truncate_data, 2, "out of bounds"),
    (truncate_prefix, 2, "truncated safetensors file"),
    (header_beyond_file, 2, "runs beyond the end of the file"),
    (invalid_json, 2, "invalid header JSON"),
    (offsets_out_of_bounds, 2, "'model.embed_tokens.weight': data_offsets"),
    (offsets_overlap, 2, "overlap"),
    (shape_mismatch, 2, "'model.norm.weight': dtype F32 and shape"),
    (index_names_missing_file, 2, "model-00009-of-00009.safetensors"),
    (index_path_traversal, 2, "unsafe file name '../../etc/passwd'"),
    (missing_tensor, 2, "model.layers.1.mlp.up_proj.weight"),
    (pickle_only, 2, "only pickle weights"),
    (unsupported_architecture, 2, "'GPT2LMHeadModel' is not supported per rank; supported:"),
    (quantized, 2, "quantization_config"),
    (lambda ckpt: None, 3, "does not divide the 8 attention heads"),
    (lambda ckpt: None, 16, "does not divide the 8 attention heads"),
]


@pytest.mark.parametrize(
    ("mutate", "tp", "reason"), BAD_INPUTS, ids=[f"{m.__name__}-tp{t}" for m, t, _ in BAD_INPUTS]
)
def test_bad_input_fails_with_one_clear_line_and_publishes_nothing(
    mutate: Mutation, tp: int, reason: str, tmp_path: Path
) -> None:
    ckpt = write_checkpoint(SyntheticModel(num_shards=2), tmp_path / "ckpt")
    mutate(ckpt)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "modelstage.stager.cli", "stage", str(ckpt), "--tp", str(tp),
         "--out", str(out)],
        capture_output=True, text=True, cwd="/", env=dict(os.environ),
        check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and reason in last, last
    assert "Traceback" not in done.stderr
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def test_intermediate_size_not_divisible_is_refused(tmp_path: Path) -> None:
    from modelstage.core.errors import SpecError
    from modelstage.stager.stage import StageRequest, stage

    ckpt = write_checkpoint(SyntheticModel(intermediate_size=510), tmp_path / "ckpt")
    with pytest.raises(SpecError, match="does not divide the intermediate size 510"):
        stage(StageRequest(source=str(ckpt), out=str(tmp_path / "out"), tp=4))
