"""``oci://`` as a source, against a real registry: a ModelPack image and a modelcar image
(pushed by skopeo from an OCI layout made here) stage to the same rank files as the local
checkpoint; a layer altered in the registry's storage is refused by its digest."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
from modelstage.core.errors import CheckpointError
from modelstage.core.manifest import MANIFEST
from modelstage.stager.stage import StageRequest, stage
from support.registry_server import Registry


def rank_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name != MANIFEST}


def push_checkpoint(registry: Registry, ckpt: Path, tag: str) -> dict[str, object]:
    """The Hugging Face layout as a ModelPack image (``--format safetensors`` copies it)."""
    out = f"oci://{registry.host}/src/llama:{tag}"
    return stage(StageRequest(source=str(ckpt), out=out, tp=1, format="safetensors"))


def test_a_modelpack_image_stages_to_the_same_rank_files_as_the_checkpoint(
    registry: Registry, ckpt: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    stage(StageRequest(source=str(ckpt), out=str(local), tp=2))
    pushed = push_checkpoint(registry, ckpt, "hf")
    digest = str(pushed["address"]).split("@")[1]
    out = tmp_path / "from-oci"
    done = stage(StageRequest(source=f"oci://{registry.host}/src/llama:hf", out=str(out), tp=2))
    assert done["sourceIdentity"] == f"oci:{digest}"
    assert rank_files(out) == rank_files(local)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["source"]["manifestDigest"] == digest
    # Pinned by digest, the same image is the same source: the same artifact digest.
    again = stage(StageRequest(source=f"oci://{registry.host}/src/llama:hf", out=str(out), tp=2))
    assert again["alreadyStaged"] and again["digest"] == done["digest"]


def test_a_layer_altered_in_the_registry_is_refused_by_its_digest(
    registry: Registry, ckpt: Path, tmp_path: Path
) -> None:
    pushed = push_checkpoint(registry, ckpt, "alter")
    image = json.loads((registry.blob_path(str(pushed["address"]).split("@")[1])).read_bytes())
    weights = [la for la in image["layers"] if la["mediaType"].endswith("weight.v1.raw")]
    path = registry.blob_path(weights[0]["digest"])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte of a tensor: a header read alone would not notice
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="corrupt in the registry") as refused:
        stage(StageRequest(source=f"oci://{registry.host}/src/llama:alter", out=str(out), tp=2))
    assert weights[0]["digest"] in str(refused.value)
    assert not out.exists()


def _blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def _tar(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def modelcar_layout(ckpt: Path, layout: Path) -> None:
    """An OCI layout of a modelcar image: a base layer (a shell, a stale model file), then the
    checkpoint under ./models/ (gzip), which also whites out the stale file."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    base = _tar({"bin/sh": b"#!", "models/stale.safetensors": b"old", "README": b"base"})
    files = {f"./models/{p.name}": p.read_bytes() for p in sorted(ckpt.iterdir())}
    model = _tar({**files, "models/.wh.stale.safetensors": b""})
    layers = [(base, "application/vnd.oci.image.layer.v1.tar"),
              (gzip.compress(model, mtime=0), "application/vnd.oci.image.layer.v1.tar+gzip")]  # fmt: skip
    diff_ids = [f"sha256:{hashlib.sha256(t).hexdigest()}" for t in (base, model)]
    config = {"architecture": "amd64", "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": diff_ids}}  # fmt: skip
    c_digest, c_size = _blob(layout, json.dumps(config).encode())
    descriptors = []
    for data, media_type in layers:
        digest, size = _blob(layout, data)
        descriptors.append({"mediaType": media_type, "digest": digest, "size": size})
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": c_digest, "size": c_size}, "layers": descriptors}  # fmt: skip
    m_digest, m_size = _blob(layout, json.dumps(manifest).encode())
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_digest,
        "size": m_size, "annotations": {"org.opencontainers.image.ref.name": "car"}}]}  # fmt: skip
    (layout / "index.json").write_text(json.dumps(index))


def test_a_modelcar_image_pushed_by_skopeo_stages_from_its_models_folder(
    registry: Registry, ckpt: Path, tmp_path: Path
) -> None:
    layout = tmp_path / "layout"
    modelcar_layout(ckpt, layout)
    image = f"{registry.host}/cars/llama:v1"
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:car",
                    f"docker://{image}"], check=True, capture_output=True)  # fmt: skip
    local, out = tmp_path / "local", tmp_path / "from-car"
    stage(StageRequest(source=str(ckpt), out=str(local), tp=2))
    done = stage(StageRequest(source=f"oci://{image}", out=str(out), tp=2))
    assert str(done["sourceIdentity"]).startswith("oci:sha256:")
    assert rank_files(out) == rank_files(local)
    recorded = json.loads((out / MANIFEST).read_text())["source"]["files"]
    assert "stale.safetensors" not in {f["name"] for f in recorded}
