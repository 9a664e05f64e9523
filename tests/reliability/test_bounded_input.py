"""Any input costs little: tiny or huge, a malformed checkpoint is refused within seconds of
CPU and a few hundred MiB, with one line, by ``modelstage stage`` run as a fresh process.

Each case runs the CLI under a small wrapper process (a fresh interpreter that imports only
``resource`` and ``subprocess``), which reports its child's peak RSS (``ru_maxrss`` of the
waited-for child: the CLI after exec, plus the wrapper's few MiB at fork) and CPU seconds.
CPU seconds still grow on a loaded machine (shared cores and caches, a lower clock), so the
bound on them is relative: each case is compared with a fixed calibration workload (a fresh
interpreter importing the CLI and parsing a JSON document of 100,000 tensor entries) measured
right before and after it, under the same load. The bound is ``MAX_CPU_UNITS`` calibrations
(on a quiet machine here the calibration takes about 1 s: about the 5 s the stager promises),
and the CLI is killed at twice that, so a product that does quadratic work fails in seconds.
The bound on memory is under 300 MiB for every malformed input below (the issue that set the
bounds measured 1.6 GB and 7 s for a 611-byte config.json before).

Also here: the bounds on reads that no file size should drive (carried files, manifests,
pickles), names a manifest may hold, and leftovers planted as symbolic links.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import ArtifactError, CheckpointError, DestinationError
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest
from modelstage.core.safetensors_format import MAX_TENSORS_PER_HEADER
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.checkpoint import (
    INDEX_VALUES,
    MAX_CARRIED_BYTES,
    MAX_TENSORS,
    open_checkpoint,
)
from modelstage.stager.sources.base import Source
from modelstage.stager.sources.local import LocalSource

MiB = 1024 * 1024
MAX_RSS = 300 * MiB
MAX_CPU_UNITS = 5.0
"""CPU seconds of a refusal, in calibrations (``CALIBRATION``'s CPU seconds in this run)."""
CALIBRATION = """
import json
import modelstage.stager.cli
doc = json.dumps({f"t{i}": {"dtype": "F32", "shape": [i, 3], "data_offsets": [i, i]}
                  for i in range(100_000)})
json.loads(doc)
"""
WRAPPER = """
import json, resource, subprocess, sys
limit = int(sys.argv[1])
def capped():
    if limit:
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit))
done = subprocess.run(sys.argv[2:], capture_output=True, text=True, preexec_fn=capped)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": done.returncode, "stderr": done.stderr, "stdout": done.stdout,
                  "rss": usage.ru_maxrss * 1024, "cpu": usage.ru_utime + usage.ru_stime}))
"""
CLI = str(Path(sys.executable).with_name("modelstage"))


def run_measured(*args: str, cpu_limit: int = 0) -> dict[str, Any]:
    """``modelstage ARGS`` under the wrapper; killed (SIGXCPU) past ``cpu_limit`` seconds of
    CPU when one is given."""
    return _wrapped(CLI, *args, cpu_limit=cpu_limit)


def _wrapped(*command: str, cpu_limit: int = 0) -> dict[str, Any]:
    env = dict(os.environ)
    done = subprocess.run([sys.executable, "-I", "-c", WRAPPER, str(cpu_limit), *command],
                          env=env, cwd="/", capture_output=True, text=True, timeout=600,
                          check=True)  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def calibration_seconds() -> float:
    """CPU seconds of the fixed calibration workload, now."""
    done = _wrapped(sys.executable, "-c", CALIBRATION)
    assert done["rc"] == 0, done["stderr"][-2000:]
    return float(done["cpu"])


def within_cpu_bound(*args: str, bound: float = MAX_CPU_UNITS) -> tuple[dict[str, Any], str]:
    """``modelstage ARGS`` measured between two calibrations; the result and a failure
    message when its CPU seconds passed ``bound`` calibrations (else "")."""
    before = calibration_seconds()
    cap = max(1, int(2 * bound * before + 1))
    result = run_measured(*args, cpu_limit=cap)
    unit = max(before, calibration_seconds())
    units = result["cpu"] / unit
    why = "" if units < bound else (
        f"{result['cpu']:.1f} s of CPU{' (killed at the cap)' if result['rc'] < 0 else ''}: "
        f"{units:.1f} calibrations of {unit:.2f} s, more than {bound}"
    )  # fmt: skip
    return result, why


def refused_cheaply(ckpt: Path, out: Path, *extra: str, bound: float = MAX_CPU_UNITS) -> str:
    """Stage ``ckpt``; it must fail with one line, within the bounds (``bound`` calibrations
    of CPU), publishing nothing."""
    result, too_slow = within_cpu_bound("stage", str(ckpt), "--tp", "1", "--out", str(out),
                                        *extra, bound=bound)  # fmt: skip
    assert not too_slow, too_slow
    lines = result["stderr"].strip().splitlines()
    assert result["rc"] == 1, result["stderr"][-2000:]
    assert "Traceback" not in result["stderr"] and lines[-1].startswith("error: "), lines[-3:]
    assert result["rss"] < MAX_RSS, f"peak RSS {result['rss'] / MiB:.0f} MiB: {lines[-1]}"
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.tmp-*"))
    last: str = lines[-1]
    return last


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(SyntheticModel(num_shards=2), tmp_path / "ckpt")


def edit_config(ckpt: Path, **changes: Any) -> bytes:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    raw = json.dumps(config).encode()
    (ckpt / "config.json").write_bytes(raw)
    return raw


def one_weight_file(ckpt: Path, header: bytes, data: bytes = b"") -> None:
    """Replace the weights by one file with this raw header JSON."""
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    (ckpt / "model.safetensors.index.json").unlink(missing_ok=True)
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)


def empty_tensors(count: int, start: int = 0) -> bytes:
    entry = '"t{}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
    return ("{" + ",".join(entry.format(i) for i in range(start, start + count)) + "}").encode()


# --- every malformed input: one line, < 5 calibrations of CPU, < 300 MiB -----------------


@pytest.mark.parametrize("layers", [1_000_000, 1 << 24])
def test_a_tiny_config_claiming_millions_of_layers(ckpt: Path, tmp_path: Path, layers: int) -> None:
    raw = edit_config(ckpt, num_hidden_layers=layers)
    assert len(raw) < 1024
    last = refused_cheaply(ckpt, tmp_path / "out")
    assert f"config.json has {layers} layers, but the checkpoint holds only" in last


def test_a_header_of_a_hundred_megabytes_of_empty_tensors(ckpt: Path, tmp_path: Path) -> None:
    header = empty_tensors(1_750_000)
    assert 95 * MiB < len(header) < 100 * MiB  # under the safetensors reference limit
    one_weight_file(ckpt, header)
    last = refused_cheaply(ckpt, tmp_path / "out")
    assert "model.safetensors" in last


def test_a_header_of_more_tensors_than_a_file_may_hold(ckpt: Path, tmp_path: Path) -> None:
    one_weight_file(ckpt, empty_tensors(MAX_TENSORS_PER_HEADER + 1))
    last = refused_cheaply(ckpt, tmp_path / "out")
    assert f"more entries than the {MAX_TENSORS_PER_HEADER} tensors" in last


TOO_MANY_TENSORS_UNITS = 12.0
"""Refusing a checkpoint of more than ``MAX_TENSORS`` tensors parses every one of their header
entries first: about 6 calibrations of linear work, so twice that is its bound (work that grows
with the square of the tensors goes past it in seconds and is killed at the cap)."""


def test_files_that_together_declare_too_many_tensors(ckpt: Path, tmp_path: Path) -> None:
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    per_file = MAX_TENSORS_PER_HEADER
    for i in range(MAX_TENSORS // per_file + 1):
        header = empty_tensors(per_file, start=i * per_file)
        (ckpt / f"model-{i:05d}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    last = refused_cheaply(ckpt, tmp_path / "out", bound=TOO_MANY_TENSORS_UNITS)
    assert f"more than {MAX_TENSORS} tensors" in last


def test_a_sixty_megabyte_config_of_empty_objects(ckpt: Path, tmp_path: Path) -> None:
    body = ",".join(f'"k{i}":{{}}' for i in range(4_400_000))
    (ckpt / "config.json").write_text("{" + body + "}")
    assert 55 * MiB < (ckpt / "config.json").stat().st_size < 64 * MiB
    assert refused_cheaply(ckpt, tmp_path / "out") == (
        f"error: config.json: {(ckpt / 'config.json').stat().st_size} bytes is too large for a JSON file here"
    )


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("nesting", ["[", '{"a":'])
def test_deeply_nested_json(ckpt: Path, tmp_path: Path, name: str, nesting: str) -> None:
    (ckpt / name).write_text(nesting * 200_000)
    last = refused_cheaply(ckpt, tmp_path / "out")
    assert last == f"error: {name}: invalid JSON: nested too deeply"


def test_a_number_past_pythons_digit_limit(ckpt: Path, tmp_path: Path) -> None:
    raw = (
        (ckpt / "config.json")
        .read_text()
        .replace('"vocab_size": ', '"vocab_size": 1' + "0" * 5000 + ', "x": ')
    )
    (ckpt / "config.json").write_text(raw)
    assert refused_cheaply(ckpt, tmp_path / "out") == (
        "error: config.json: invalid JSON: a number of more than 4300 digits"
    )


def test_a_header_number_past_pythons_digit_limit(ckpt: Path, tmp_path: Path) -> None:
    one_weight_file(
        ckpt, b'{"a":{"dtype":"F32","shape":[1' + b"0" * 5000 + b'],"data_offsets":[0,4]}}'
    )
    assert refused_cheaply(ckpt, tmp_path / "out") == (
        "error: model.safetensors: invalid header JSON: a number of more than 4300 digits"
    )


def test_an_index_naming_more_tensors_than_a_checkpoint_may_have(
    ckpt: Path, tmp_path: Path
) -> None:
    weight_map = ",".join(
        f'"t{i}":"model-00001-of-00002.safetensors"' for i in range(MAX_TENSORS + 2000)
    )
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map":{' + weight_map + "}}")
    assert refused_cheaply(ckpt, tmp_path / "out") == (
        f"error: model.safetensors.index.json: holds about {MAX_TENSORS + 2001} JSON values, "
        f"more than the {INDEX_VALUES} it may have; refusing it"
    )


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json", "config.json"])
def test_a_gigabyte_file_beside_the_weights(ckpt: Path, tmp_path: Path, name: str) -> None:
    with open(ckpt / name, "ab") as f:  # sparse: costs no disk
        f.truncate(1024 * MiB)
    last = refused_cheaply(ckpt, tmp_path / "out")
    size = 1024 * MiB
    if name == "config.json":  # read as JSON by the stager itself: the JSON reader's bound
        assert last == f"error: config.json: {size} bytes is too large for a JSON file here"
    else:  # carried beside the weights unread: the carried-file bound, with the checkpoint
        assert last == (
            f"error: {ckpt}: {name} holds {size} bytes, more than the {MAX_CARRIED_BYTES}"
            " a file carried beside the weights may have; refusing it"
        )


def test_a_large_tokenizer_within_the_limit_is_streamed(ckpt: Path, tmp_path: Path) -> None:
    """Staged, not refused: 200 MiB beside the weights, in bounded memory (read whole, as
    before, it took twice that)."""
    with open(ckpt / "tokenizer.json", "wb") as f:
        f.truncate(200 * MiB)
    out = tmp_path / "out"
    result = run_measured("stage", str(ckpt), "--tp", "2", "--out", str(out))
    assert result["rc"] == 0, result["stderr"][-2000:]
    assert result["rss"] < MAX_RSS, f"peak RSS {result['rss'] / MiB:.0f} MiB"
    assert (out / "tokenizer.json").stat().st_size == 200 * MiB
    verify_directory(out)


# --- reads that no claimed size may drive ---------------------------------------------------


class Lying(Source):
    """A source that reports huge sizes (an S3 listing can say anything) and records reads."""

    def __init__(self, inner: LocalSource, sizes: dict[str, int]) -> None:
        self.inner, self.sizes, self.uri = inner, sizes, inner.uri
        self.reads: list[int] = []

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def size(self, name: str) -> int:
        return self.sizes.get(name, self.inner.size(name))

    def read_range(self, name: str, offset: int, out: memoryview) -> None:
        self.reads.append(len(out))
        self.inner.read_range(name, offset, out)

    def identity(self, files: list[str]) -> dict[str, Any]:
        return self.inner.identity(files)


@pytest.mark.parametrize(
    ("name", "size"),
    [("tokenizer.json", MAX_CARRIED_BYTES + 1), ("config.json", 10 << 30),
     ("model.safetensors.index.json", 10 << 30)],
)  # fmt: skip
def test_no_buffer_is_sized_by_what_a_source_claims(ckpt: Path, name: str, size: int) -> None:
    source = Lying(LocalSource(str(ckpt)), {name: size})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        open_checkpoint(source)
    assert max(source.reads, default=0) < 64 * MiB


def test_an_oversized_manifest_is_refused_unparsed(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "artifact"
    out.mkdir()
    with open(out / MANIFEST, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 10)
    with pytest.raises(ArtifactError, match="more than"):
        verify_directory(out)
    with pytest.raises(ArtifactError, match="more than"):
        Manifest.from_json(b" " * (MAX_MANIFEST_BYTES + 1), "m")


# --- manifest names ---------------------------------------------------------------------------


def staged(ckpt: Path, out: Path) -> dict[str, Any]:
    from modelstage.stager.stage import StageRequest, stage

    stage(StageRequest(source=str(ckpt), out=str(out), tp=2))
    doc: dict[str, Any] = json.loads((out / MANIFEST).read_text())
    return doc


@pytest.mark.parametrize(
    "name",
    ["/etc/hostname", "../../../../etc/os-release", "sub/model-rank-0-part-0.safetensors",
     ".hidden", "..", "", "model-rank-0-part-0.safetensors/../x", "evil.py", "a\\b",
     MANIFEST],
)  # fmt: skip
def test_a_manifest_naming_files_outside_the_format_is_refused(
    ckpt: Path, tmp_path: Path, name: str
) -> None:
    """Names are checked before any reader stats, hashes or loads them: with matching sizes
    and hashes, such a manifest passed ``verify`` before."""
    out = tmp_path / "out"
    doc = staged(ckpt, out)
    target = Path("/etc/hostname")
    doc["files"][name] = {"size": target.stat().st_size if target.exists() else 0,
                          "sha256": "0" * 64}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="not a file name a sharded_state artifact has"):
        verify_directory(out)


def test_the_names_the_stager_writes_pass(ckpt: Path, tmp_path: Path) -> None:
    for fmt in ("sharded_state", "runai_streamer", "runai_streamer_sharded"):
        from modelstage.stager.stage import StageRequest, stage

        out = tmp_path / fmt
        stage(StageRequest(source=str(ckpt), out=str(out), tp=2, format=fmt))
        assert verify_directory(out).format == fmt


def test_the_plugins_part_glob_stays_within_one_name() -> None:
    from modelstage.plugin.checks import _glob

    glob = _glob("model-rank-0-part-*.safetensors")
    assert glob.fullmatch("model-rank-0-part-12.safetensors")
    assert not glob.fullmatch("model-rank-0-part-../../x/0.safetensors")
    assert not glob.fullmatch("model-rank-0-part-a/b.safetensors")


# --- planted links ------------------------------------------------------------------------------

DIGEST = "0123456789abcdef0123"


def test_a_leftover_planted_as_a_link_does_not_block_delete_forever(
    ckpt: Path, tmp_path: Path
) -> None:
    from modelstage.stager.delete import delete_artifact

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    root = tmp_path / "pvc" / "ns"
    root.mkdir(parents=True)
    (root / f"{DIGEST}.tmp-evil").symlink_to(victim)
    (root / f"{DIGEST}.tmp-file").write_text("x")
    (root / DIGEST).symlink_to(victim)
    delete_artifact(str(root / DIGEST), digest=DIGEST)
    assert sorted(p.name for p in root.iterdir()) == []
    assert (victim / "keep").exists(), "links are removed, never followed"


@pytest.mark.parametrize("command", ["stage", "delete"])
def test_a_lock_file_planted_as_a_link_is_not_followed(
    ckpt: Path, tmp_path: Path, command: str
) -> None:
    from modelstage.stager import cli

    victim = tmp_path / "victim"
    victim.write_text("precious")
    root = tmp_path / "pvc"
    root.mkdir()
    (root / f".{DIGEST}.lock").symlink_to(victim)
    argv = (["stage", str(ckpt), "--tp", "1", "--out", str(root / DIGEST)] if command == "stage"
            else ["delete", "--artifact", str(root / DIGEST)])  # fmt: skip
    with pytest.raises(DestinationError, match="lock file is a symbolic link"):
        if command == "stage":
            from modelstage.stager.stage import StageRequest, stage

            stage(StageRequest(source=str(ckpt), out=str(root / DIGEST), tp=1))
        else:
            from modelstage.stager.delete import delete_artifact

            delete_artifact(str(root / DIGEST))
    assert cli.main(argv) == 1
    assert victim.read_text() == "precious"


def test_the_local_source_opens_what_it_checked_without_following_a_swapped_link(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link swapped in after the check (the resolve-then-open race) is refused, not read."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": true}')
    source = LocalSource(str(ckpt))
    real = LocalSource._resolved

    def swap_after_check(self: LocalSource, name: str) -> Path:
        resolved = real(self, name)
        resolved.unlink()
        resolved.symlink_to(secret)  # the race, won by the attacker
        return resolved

    monkeypatch.setattr(LocalSource, "_resolved", swap_after_check)
    with pytest.raises(CheckpointError, match="cannot open"):
        source.size("tokenizer.json" if (ckpt / "tokenizer.json").exists() else "config.json")


def test_allow_pickle_never_reads_a_pickle_whole(tmp_path: Path) -> None:
    """A remote pickle is copied to the spool in chunks and memory-mapped; a local one is
    mapped where it is. No read is sized by the file."""
    import torch
    from modelstage.stager.sources.pickled import SPOOL_CHUNK_BYTES, ConvertedPickleSource
    from safetensors.numpy import load_file

    folder = tmp_path / "pickled"
    folder.mkdir()
    tensors = {"a": torch.arange(6 * MiB, dtype=torch.float32), "b": torch.ones(3, 2)}
    tensors["tied"] = tensors["b"]  # shares storage: written once each, no error
    torch.save(tensors, folder / "pytorch_model.bin")
    (folder / "config.json").write_text("{}")
    remote = Lying(LocalSource(str(folder)), {})
    spool = tmp_path / "spool"
    spool.mkdir()
    converted = ConvertedPickleSource(remote, spool)
    try:
        assert (
            max(remote.reads) <= SPOOL_CHUNK_BYTES < (folder / "pytorch_model.bin").stat().st_size
        )
        loaded = load_file(str(spool / "pytorch_model.safetensors"))
        assert sorted(loaded) == ["a", "b", "tied"]
        assert (loaded["a"] == tensors["a"].numpy()).all() and (loaded["tied"] == 1).all()
        assert not list(spool.glob("*.pickle")), "the spooled copy is removed"
    finally:
        converted.close()


def test_an_oversized_s3_manifest_is_refused_after_reading_only_its_limit(
    s3: Any, bucket: str
) -> None:
    """The object's listed size is not read whole: the destination and the plugin read at most
    one byte past the limit, and refuse."""
    from modelstage.core.location import S3Artifact
    from modelstage.core.s3_client import S3Client, S3Location
    from modelstage.stager.destinations.s3 import S3Destination

    s3.client().put_object(
        Bucket=bucket, Key=f"big/{MANIFEST}", Body=b" " * (MAX_MANIFEST_BYTES + 4096)
    )
    with pytest.raises(ArtifactError, match="more than"):
        S3Destination(f"s3://{bucket}/big/", s3.options()).existing()
    with pytest.raises(ArtifactError, match="more than"):
        S3Artifact(S3Location.parse(f"s3://{bucket}/big/"), S3Client(s3.options())).read_manifest()
