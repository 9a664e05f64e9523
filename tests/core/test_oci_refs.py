"""The pure parts of the OCI support: references, the credentials file, one-file tar layers."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path

import pytest
from modelstage.core.oci_image import tar_header, tar_trailer
from modelstage.core.oci_registry import (
    OciReference,
    RegistryError,
    auth_file_path,
    credentials_for,
)


def test_references_parse_registry_repository_tag_and_digest() -> None:
    ref = OciReference.parse("oci://registry.example:5000/team/llama:v1")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (
        "registry.example:5000", "team/llama", "v1", None)  # fmt: skip
    digest = "sha256:" + "a" * 64
    pinned = OciReference.parse(f"oci://localhost/llama@{digest}")
    assert pinned.reference == digest and pinned.tag is None
    assert ref.pinned(digest) == f"registry.example:5000/team/llama@{digest}"


@pytest.mark.parametrize(
    "uri",
    ["oci://llama:v1", "oci://registry.example/Upper:v1", "oci://r.example/x@sha256:12",
     "oci://r.example/x:bad tag", "oci://r.example/"],
)  # fmt: skip
def test_bad_references_are_refused_with_the_expected_form(uri: str) -> None:
    with pytest.raises(RegistryError, match=r"oci://|digest|tag|repository"):
        OciReference.parse(uri)


def test_credentials_come_from_a_docker_config_by_registry_host(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    auth = base64.b64encode(b"robot:s3cret-Quokka").decode()
    config.write_text(json.dumps({"auths": {"https://r.example:5000": {"auth": auth},
                                            "other.example": {"username": "u",
                                                              "password": "p"}}}))  # fmt: skip
    assert credentials_for(config, "r.example:5000") == ("robot", "s3cret-Quokka")
    assert credentials_for(config, "other.example") == ("u", "p")
    assert credentials_for(config, "absent.example") is None
    config.write_text(json.dumps({"auths": {"r.example": {"auth": "bm9jb2xvbg=="}}}))
    with pytest.raises(RegistryError, match="no usable `auth`") as bad:
        credentials_for(config, "r.example")
    assert "nocolon" not in str(bad.value)


def test_the_credentials_file_is_looked_up_as_skopeo_does(tmp_path: Path) -> None:
    assert auth_file_path("/x.json", {"REGISTRY_AUTH_FILE": "/y"}) == Path("/x.json")
    assert auth_file_path(None, {"REGISTRY_AUTH_FILE": "/y", "DOCKER_CONFIG": "/d"}) == Path("/y")
    assert auth_file_path(None, {"DOCKER_CONFIG": "/d"}) == Path("/d/config.json")
    assert auth_file_path(None, {"HOME": str(tmp_path)}) is None


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 100_000])
def test_a_one_file_tar_layer_unpacks_to_the_file(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    layer = tar_header("model-rank-0-part-0.safetensors", size) + data + tar_trailer(size)
    assert len(layer) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        (member,) = tar.getmembers()
        assert member.name == "model-rank-0-part-0.safetensors" and member.mode == 0o644
        extracted = tar.extractfile(member)
        assert extracted is not None and extracted.read() == data
