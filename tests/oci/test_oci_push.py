"""Staging to an OCI registry (``--out oci://``) against a real registry: the pushed image,
pulled by skopeo and unpacked by umoci, is exactly the artifact directory; a ModelPack push
has ModelPack's media types and file titles; pushing again uploads nothing; TLS with basic
auth; a registry killed mid-push leaves no tag; ``verify oci://`` reads it where it is."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import ArtifactError
from modelstage.core.manifest import MANIFEST
from modelstage.core.oci_image import (
    DIGEST_ANNOTATION,
    MANIFEST_ANNOTATION,
    MODEL_ARTIFACT,
    MODEL_CONFIG,
    TITLE,
    WEIGHT_CONFIG_RAW,
    WEIGHT_RAW,
)
from modelstage.stager.stage import StageRequest, stage
from support.registry_server import Registry, docker_config, require, run_registry
from support.registry_tokens import registry_auth_config, token_service

MODELSTAGE = str(Path(sys.executable).with_name("modelstage"))


def modelstage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MODELSTAGE, *args], capture_output=True, text=True, cwd="/",
                          env=env, timeout=300)  # fmt: skip


def summary(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    doc: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return doc


def local_stage(src: Path, out: Path) -> Path:
    stage(StageRequest(source=str(src), out=str(out), tp=2))
    return out


def get_json(registry: Registry, path: str) -> Any:
    request = urllib.request.Request(
        f"http://{registry.host}{path}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def blob(registry: Registry, repo: str, digest: str) -> bytes:
    url = f"http://{registry.host}/v2/{repo}/blobs/{digest}"
    with urllib.request.urlopen(url, timeout=30) as response:
        return bytes(response.read())


def same_files(a: Path, b: Path) -> None:
    """Every file byte for byte; the manifests (their times differ) by digest and files."""
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        if p.name == MANIFEST:
            ours, theirs = json.loads(p.read_text()), json.loads((b / p.name).read_text())
            assert (ours["digest"], ours["files"]) == (theirs["digest"], theirs["files"])
            continue
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name


def pull_and_unpack(image: str, work: Path, *skopeo_flags: str) -> Path:
    """skopeo copies the image into an OCI layout, umoci unpacks its layers (rootless)."""
    layout, rootfs = work / "layout", work / "rootfs"
    subprocess.run(["skopeo", "copy", *skopeo_flags, f"docker://{image}", f"oci:{layout}:pulled"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    subprocess.run(["umoci", "raw", "unpack", "--rootless", "--image", f"{layout}:pulled",
                    str(rootfs)], check=True, capture_output=True, timeout=300)  # fmt: skip
    return rootfs


def test_tp2_image_pulled_by_skopeo_and_unpacked_by_umoci_is_the_artifact_byte_for_byte(
    registry: Registry, ckpt: Path, tmp_path: Path
) -> None:
    local = local_stage(ckpt, tmp_path / "local")
    out = f"oci://{registry.host}/models/llama:tp2"
    pushed = summary(modelstage("stage", str(ckpt), "--tp", "2", "--out", out, "--oci-form",
                                "image"))  # fmt: skip
    address = pushed["address"]
    assert address.startswith(f"{registry.host}/models/llama@sha256:") and pushed["uri"] == out
    rootfs = pull_and_unpack(address, tmp_path, "--src-tls-verify=false")
    same_files(local, rootfs)
    checked = summary(modelstage("verify", str(rootfs), "--tp", "2"))
    in_registry = summary(modelstage("verify", f"oci://{address}"))  # read in its tar layers
    assert in_registry["digest"] == checked["digest"] and in_registry["address"] == address
    assert (
        checked["digest"]
        == pushed["digest"]
        == json.loads((local / MANIFEST).read_text())["digest"]
    )


def test_modelpack_push_has_modelpack_media_types_and_one_titled_layer_per_file(
    registry: Registry, ckpt: Path, tmp_path: Path
) -> None:
    local = local_stage(ckpt, tmp_path / "local")
    pushed = stage(StageRequest(source=str(ckpt), out=f"oci://{registry.host}/m/pack:v1", tp=2))
    digest = pushed["address"].split("@")[1]
    manifest = get_json(registry, f"/v2/m/pack/manifests/{digest}")
    assert manifest["artifactType"] == MODEL_ARTIFACT
    assert manifest["config"]["mediaType"] == MODEL_CONFIG
    config = json.loads(blob(registry, "m/pack", manifest["config"]["digest"]))
    layers = manifest["layers"]
    assert config["modelfs"] == {"type": "layers", "diff_ids": [la["digest"] for la in layers]}
    # ModelPack's config schema: these three objects, of these string properties only.
    assert set(config) == {"descriptor", "config", "modelfs"}
    assert set(config["descriptor"]) <= {"createdAt", "name", "revision"}
    assert config["descriptor"]["name"] == f"file://{ckpt}"
    assert config["config"] == {"format": "sharded_state"}  # dtype auto: no precision claimed
    titles = {la["annotations"][TITLE]: la for la in layers}
    assert sorted(titles) == sorted(p.name for p in local.iterdir())
    for name, layer in titles.items():
        if name == MANIFEST:
            continue
        want = WEIGHT_RAW if name.endswith(".safetensors") else WEIGHT_CONFIG_RAW
        assert layer["mediaType"] == want, name
        data = blob(registry, "m/pack", layer["digest"])
        assert data == (local / name).read_bytes(), name  # raw: the layer is the file
        assert layer["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert manifest["annotations"][MANIFEST_ANNOTATION] == titles[MANIFEST]["digest"]
    # skopeo, a stock client, copies the artifact whole: every blob by its title is the file.
    layout = tmp_path / "layout"
    subprocess.run(["skopeo", "copy", "--src-tls-verify=false", f"docker://{pushed['address']}",
                    f"oci:{layout}:x"], check=True, capture_output=True)  # fmt: skip
    for name, layer in titles.items():
        if name == MANIFEST:
            continue
        on_disk = layout / "blobs" / "sha256" / layer["digest"].removeprefix("sha256:")
        assert on_disk.read_bytes() == (local / name).read_bytes(), name


def test_pushing_the_same_artifact_again_uploads_no_blob(registry: Registry, ckpt: Path) -> None:
    out = f"oci://{registry.host}/m/again:v1"
    first = stage(StageRequest(source=str(ckpt), out=out, tp=2))
    uploads, patches = registry.uploads(), registry.requests("PATCH")
    assert uploads == first["files"] + 2  # every file, modelstage.json and the config
    assert registry.requests("PUT", "/manifests/") == 1
    second = stage(StageRequest(source=str(ckpt), out=out, tp=2))
    assert second["alreadyStaged"] and second["address"] == first["address"]
    assert registry.uploads() == uploads, "a blob was uploaded again"
    assert registry.requests("PATCH") == patches
    assert registry.requests("PUT", "/manifests/") == 1


def test_small_files_the_registry_holds_are_not_uploaded_again(
    registry: Registry, ckpt: Path
) -> None:
    """Another tag of the same repository: files that fit one buffer are hashed first and
    skipped by HEAD (config, tokenizer, and here the rank files: all below 16 MiB)."""
    stage(StageRequest(source=str(ckpt), out=f"oci://{registry.host}/m/dedupe:a", tp=2))
    before = registry.uploads()
    other = stage(StageRequest(source=str(ckpt), out=f"oci://{registry.host}/m/dedupe:b", tp=2,
                               digest="0" * 20))  # fmt: skip
    assert other["digest"] == "0" * 20 and not other["alreadyStaged"]
    # Only modelstage.json (it names the other digest) and the config are new blobs.
    assert registry.uploads() - before == 2


def test_tls_and_basic_auth_push_and_verify_without_showing_the_password(
    secure_registry: Registry, ckpt: Path, tmp_path: Path
) -> None:
    reg = secure_registry
    assert reg.auth_file is not None and reg.ca_file is not None
    out = f"oci://{reg.host}/secure/llama:v1"
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_CONFIG", "REGISTRY_AUTH_FILE")}
    refused = modelstage("stage", str(ckpt), "--tp", "2", "--out", out, "--registry-ca",
                         str(reg.ca_file), env={**env, "HOME": str(tmp_path)})  # fmt: skip
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr.splitlines()[-1]
    untrusted = modelstage("stage", str(ckpt), "--tp", "2", "--out", out, "--registry-ca",
                           "/etc/ssl/certs/ca-certificates.crt", "--registry-auth",
                           str(reg.auth_file))  # fmt: skip
    assert untrusted.returncode == 1 and "cannot reach" in untrusted.stderr.splitlines()[-1]
    done = modelstage("stage", str(ckpt), "--tp", "2", "--out", out, "--registry-ca",
                      str(reg.ca_file), env={**env, "REGISTRY_AUTH_FILE": str(reg.auth_file)})  # fmt: skip
    pushed = summary(done)
    checked = modelstage("verify", f"oci://{pushed['address']}", "--registry-ca",
                         str(reg.ca_file), "--registry-auth", str(reg.auth_file))  # fmt: skip
    assert summary(checked)["digest"] == pushed["digest"]
    for output in (refused, untrusted, done, checked):
        assert reg.password not in output.stdout + output.stderr
    certs = tmp_path / "certs"  # skopeo trusts the *.crt files of a folder
    certs.mkdir()
    (certs / "ca.crt").write_bytes(reg.ca_file.read_bytes())
    rootfs_flags = ["--src-cert-dir", str(certs), "--src-creds", f"docker:{reg.password}"]
    layout = tmp_path / "layout"
    subprocess.run(["skopeo", "copy", *rootfs_flags, f"docker://{pushed['address']}",
                    f"oci:{layout}:x"], check=True, capture_output=True)  # fmt: skip
    assert (layout / "index.json").is_file()


def test_registry_killed_mid_push_leaves_no_manifest(big_ckpt: Path, tmp_path: Path) -> None:
    root = tmp_path / "registry"
    with run_registry(root) as reg:
        out = f"oci://{reg.host}/m/killed:v1"
        proc = subprocess.Popen([MODELSTAGE, "stage", str(big_ckpt), "--tp", "2", "--out", out],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while reg.requests("PATCH") < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the push ended before the registry could be killed"
        reg.process.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "cannot reach the registry" in err.splitlines()[-1]
    with run_registry(root) as again:  # the same storage, started anew
        with pytest.raises(urllib.error.HTTPError) as absent:
            get_json(again, "/v2/m/killed/manifests/v1")  # asked as OCI: else always 404
        assert absent.value.code == 404


def test_verify_oci_refuses_a_layer_altered_in_the_registry(registry: Registry, ckpt: Path) -> None:
    pushed = stage(StageRequest(source=str(ckpt), out=f"oci://{registry.host}/m/alter:v1", tp=2))
    ok = summary(modelstage("verify", f"oci://{pushed['address']}"))
    assert ok["address"] == pushed["address"]
    manifest = get_json(registry, f"/v2/m/alter/manifests/{pushed['address'].split('@')[1]}")
    rank = next(la for la in manifest["layers"] if la["annotations"][TITLE].startswith("model-"))
    path = registry.blob_path(rank["digest"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    bad = modelstage("verify", f"oci://{pushed['address']}")
    assert bad.returncode == 1
    assert rank["annotations"][TITLE] in bad.stderr.splitlines()[-1]


def test_out_must_be_a_tag_and_plan_shows_the_oci_location(ckpt: Path) -> None:
    pinned = modelstage("stage", str(ckpt), "--tp", "2", "--out",
                        "oci://127.0.0.1:1/m/x@sha256:" + "a" * 64)  # fmt: skip
    assert pinned.returncode == 1 and "push to a tag" in pinned.stderr.splitlines()[-1]
    plan = modelstage("plan", str(ckpt), "--tp", "2", "--out", "oci://registry.example/m/x:v1",
                      "-o", "json")  # fmt: skip
    report = json.loads(plan.stdout)
    assert report["artifact"]["uri"] == "oci://registry.example/m/x:v1"
    assert "REGISTRY/REPOSITORY@sha256" in report["artifact"]["address"]
    command = report["jobs"][0]["command"]
    assert command[command.index("--out") + 1] == "oci://registry.example/m/x:v1"


def test_plan_of_an_oci_source_names_it_and_the_resolve_step(tmp_path: Path) -> None:
    source = "oci://registry.example/models/llama:v1"
    plan = modelstage("plan", source, "--tp", "2", "--out", str(tmp_path / "a"), "-o", "json")
    report = json.loads(plan.stdout)
    assert report["source"]["uri"] == source and report["digest"] is None
    resolving = [c for c in report["checks"] if c["reason"] == "Resolving"]
    assert resolving and f"modelstage resolve {source}" in resolving[0]["message"]
    text = modelstage("plan", str(source), "--tp", "2", "--out", "oci://registry.example/m/x:v1")
    assert "pinned: REGISTRY/REPOSITORY@sha256" in text.stdout


def test_force_repoints_the_tag_and_delete_leaves_images_to_the_registry_tools(
    registry: Registry, ckpt: Path
) -> None:
    out = f"oci://{registry.host}/m/force:v1"
    first = stage(StageRequest(source=str(ckpt), out=out, tp=2))
    other = StageRequest(source=str(ckpt), out=out, tp=2, digest="1" * 20)
    with pytest.raises(ArtifactError, match="already holds artifact"):
        stage(other)
    second = stage(dataclasses.replace(other, force=True))
    assert second["address"] != first["address"] and second["digest"] == "1" * 20
    tagged = get_json(registry, "/v2/m/force/manifests/v1")
    assert tagged["annotations"][DIGEST_ANNOTATION] == "1" * 20
    old = get_json(registry, f"/v2/m/force/manifests/{first['address'].split('@')[1]}")
    assert old["annotations"][DIGEST_ANNOTATION] == first["digest"]  # still there, by digest
    refused = modelstage("delete", "--artifact", out)
    assert refused.returncode == 1 and "skopeo delete" in refused.stderr.splitlines()[-1]


def test_bearer_token_auth_push_verify_and_pull_as_a_source(ckpt: Path, tmp_path: Path) -> None:
    """The registry sends clients to a token service (distribution's ``token`` auth): the
    credentials file's user and password buy a bearer token for the repository's scope."""
    require("docker-registry", "openssl")
    password = "tok-Pelican+Marmot-8841"
    with (
        token_service(tmp_path / "tokens", "robot", password) as tokens,
        run_registry(tmp_path / "registry", auth=registry_auth_config(tokens)) as reg,
    ):
        auth = docker_config(tmp_path / "auth.json", reg.host, "robot", password)
        out = f"oci://{reg.host}/team/llama:v1"
        done = modelstage("stage", str(ckpt), "--tp", "2", "--out", out, "--registry-auth",
                          str(auth))  # fmt: skip
        pushed = summary(done)
        assert "repository:team/llama:pull,push" in tokens.granted
        checked = modelstage("verify", f"oci://{pushed['address']}", "--registry-auth", str(auth))
        assert summary(checked)["digest"] == pushed["digest"]
        wrong = docker_config(tmp_path / "wrong.json", reg.host, "robot", "not-the-password")
        refused = modelstage("verify", out, "--registry-auth", str(wrong))
        assert refused.returncode == 1 and "token service refused" in refused.stderr
        assert tokens.refused >= 1
        for output in (done, checked, refused):
            assert password not in output.stdout + output.stderr


def test_rank_files_larger_than_a_buffer_go_up_in_chunks_and_verify_in_the_registry(
    registry: Registry, big_ckpt: Path, tmp_path: Path
) -> None:
    local = local_stage(big_ckpt, tmp_path / "local")
    pushed = stage(StageRequest(source=str(big_ckpt), out=f"oci://{registry.host}/m/big:v1",
                                tp=2))  # fmt: skip
    ranks = [p for p in local.iterdir() if p.name.startswith("model-rank-")]
    assert min(p.stat().st_size for p in ranks) > 16 * 1024 * 1024
    assert registry.requests("PATCH") >= len(ranks), "not streamed in chunks"
    manifest = get_json(registry, f"/v2/m/big/manifests/{pushed['address'].split('@')[1]}")
    for layer in manifest["layers"]:
        name = layer["annotations"][TITLE]
        if name != MANIFEST:
            assert blob(registry, "m/big", layer["digest"]) == (local / name).read_bytes(), name
    checked = summary(modelstage("verify", f"oci://{pushed['address']}"))
    assert checked["digest"] == pushed["digest"] and checked["files"] == pushed["files"]
