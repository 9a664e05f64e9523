"""``modelstage prepare``, the serving pod's initContainer, as the pod runs it (a subprocess).

Contract: on success the last stdout line is one JSON object and the plugin directory holds a
package that ``importlib.metadata`` finds as a ``vllm.general_plugins`` entry point; on any
failure the last line is ``error: <reason>``, the exit code 1, and nothing is installed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from modelstage.core.manifest import MANIFEST
from modelstage.stager.prepare import CAPTURE_PACKAGES, PLUGIN_PACKAGES, install_plugin
from support.serving import Artifact, base_env, last_line, prepare_cli

ALLOWED_IMPORTS = {"vllm", "torch", "prometheus_client", "pydantic", "boto3", "botocore", "blake3"}
"""What a stock vLLM image provides (vllm/vllm-openai installs boto3 for its S3 loaders; vLLM
itself depends on blake3); the copied plugin may import nothing else."""
STAGER_ONLY_IMPORTS = {"azure_client.py": {"azure"}}
"""The Azure SDK, imported inside ``core/azure_client.py``'s functions only, for ``az://``
locations, which nothing in a vLLM pod opens (vLLM reads ``az://`` with Run:ai's own
backend; ``prepare`` runs in the stager image): a vLLM image without it never reaches them.
Importing the module itself needs nothing (the clean-interpreter test below)."""


def run_prepare(
    artifact: Path | str, digest: str, tp: int, plugin_dir: Path, *extra: str
) -> tuple[int, str]:
    proc = prepare_cli("--artifact", str(artifact), "--digest", digest, "--tp", str(tp),
                       "--plugin-dir", str(plugin_dir), *extra, cwd=plugin_dir.parent)  # fmt: skip
    return proc.returncode, last_line(proc)


def copy_of(artifact: Artifact, tmp: Path) -> Path:
    return Path(shutil.copytree(artifact.path, tmp / "artifact"))


def test_complete_artifact_is_verified_and_the_plugin_installed_with_its_entry_point(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    plugin_dir = tmp_path / "plugins"
    code, line = run_prepare(tied_tp1.path, tied_tp1.digest, 1, plugin_dir)
    assert code == 0, line
    summary = json.loads(line)
    assert summary["digest"] == tied_tp1.digest and summary["tensorParallelSize"] == 1
    assert summary["format"] == "sharded_state" and summary["hashed"] is False
    assert summary["pluginDir"] == str(plugin_dir)

    dists = list(importlib.metadata.distributions(path=[str(plugin_dir)]))
    assert [d.metadata["Name"] for d in dists] == ["modelstage"]
    eps = [e for e in dists[0].entry_points if e.group == "vllm.general_plugins"]
    assert [(e.name, e.value) for e in eps] == [("modelstage", "modelstage.plugin:register")]
    for line_ in (dists[0].read_text("RECORD") or "").splitlines():
        name = line_.split(",")[0]
        assert (plugin_dir / name).is_file(), name


def test_prepare_twice_replaces_the_plugin_instead_of_failing(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    plugin_dir = tmp_path / "plugins"
    assert run_prepare(tied_tp1.path, tied_tp1.digest, 1, plugin_dir)[0] == 0
    (plugin_dir / "modelstage" / "plugin" / "stale.py").write_text("raise SystemExit\n")
    code, line = run_prepare(tied_tp1.path, tied_tp1.digest, 1, plugin_dir)
    assert code == 0, line
    assert not (plugin_dir / "modelstage" / "plugin" / "stale.py").exists()
    assert sorted(p.name for p in plugin_dir.iterdir()) == [
        "modelstage",
        "modelstage-0.1.0.dist-info",
        "startup.json",
    ]


def test_incomplete_artifact_without_manifest_is_refused_and_nothing_installed(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    artifact = copy_of(tied_tp1, tmp_path)
    (artifact / MANIFEST).unlink()
    plugin_dir = tmp_path / "plugins"
    code, line = run_prepare(artifact, tied_tp1.digest, 1, plugin_dir)
    assert code == 1
    assert line == f"error: {artifact}: no {MANIFEST}; the artifact is incomplete"
    assert not plugin_dir.exists()


def test_artifact_with_a_truncated_rank_file_is_refused(tied_tp1: Artifact, tmp_path: Path) -> None:
    artifact = copy_of(tied_tp1, tmp_path)
    rank_file = artifact / "model-rank-0-part-0.safetensors"
    size = rank_file.stat().st_size
    with open(rank_file, "r+b") as f:
        f.truncate(size - 4)
    code, line = run_prepare(artifact, tied_tp1.digest, 1, tmp_path / "plugins")
    assert code == 1
    assert line == f"error: {rank_file}: {size - 4} bytes, the manifest says {size}"


def test_foreign_artifact_of_another_spec_is_refused_by_digest(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    expected = "f" * len(tied_tp1.digest)
    code, line = run_prepare(tied_tp1.path, expected, 1, tmp_path / "plugins")
    assert code == 1
    assert line == (
        f"error: {tied_tp1.path}: artifact digest is {tied_tp1.digest}, expected {expected}; "
        "the artifact belongs to another spec; re-stage or point at the right artifact"
    )
    assert not (tmp_path / "plugins").exists()


def test_artifact_staged_for_another_tp_is_refused(llama_tp2: Artifact, tmp_path: Path) -> None:
    code, line = run_prepare(llama_tp2.path, llama_tp2.digest, 4, tmp_path / "plugins")
    assert code == 1
    assert line == (
        f"error: {llama_tp2.path}: artifact was staged for tensor parallel size 2, but the "
        "workload runs 4; stage it for 4"
    )


def test_a_directory_that_is_not_an_artifact_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "checkpoint"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    code, line = run_prepare(foreign, "abc", 1, tmp_path / "plugins")
    assert (code, line) == (1, f"error: {foreign}: no {MANIFEST}; the artifact is incomplete")


def test_content_hashing_is_opt_in_and_catches_same_size_corruption(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    artifact = copy_of(tied_tp1, tmp_path)
    rank_file = artifact / "model-rank-0-part-0.safetensors"
    size = rank_file.stat().st_size
    with open(rank_file, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    assert run_prepare(artifact, tied_tp1.digest, 1, tmp_path / "p1")[0] == 0
    code, line = run_prepare(artifact, tied_tp1.digest, 1, tmp_path / "p2", "--hash")
    assert code == 1
    assert re.fullmatch(
        rf"error: {rank_file}: chunk 0 \(bytes 0-{size - 1}\) has BLAKE3 [0-9a-f]{{64}}, the "
        r"manifest says [0-9a-f]{64}; the file is corrupt: re-stage it", line
    ), line  # fmt: skip


def test_content_hashing_reports_its_progress_and_plain_checks_stay_quiet(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    """Hashing a large artifact takes minutes in the initContainer: its log says how far."""
    common = ["--artifact", str(tied_tp1.path), "--digest", tied_tp1.digest, "--tp", "1"]
    hashed = prepare_cli(*common, "--plugin-dir", str(tmp_path / "p1"), "--hash", cwd=tmp_path)
    assert hashed.returncode == 0, hashed.stderr
    lines = [x for x in hashed.stderr.splitlines() if x.startswith(f"hashing {tied_tp1.path}:")]
    files = json.loads(hashed.stdout.strip().splitlines()[-1])["files"]
    assert lines and f"(100%), {files}/{files} files, " in lines[-1]
    plain = prepare_cli(*common, "--plugin-dir", str(tmp_path / "p2"), cwd=tmp_path)
    assert plain.returncode == 0 and "hashing" not in plain.stderr


def test_other_uri_schemes_are_refused_with_what_prepare_reads(tmp_path: Path) -> None:
    code, line = run_prepare("gs://bucket/x", "abc", 1, tmp_path / "plugins")
    assert code == 1 and line.startswith("error: gs://bucket/x: prepare reads local paths")
    assert line.endswith("not gs://")


CHECKOUT = Path(__file__).resolve().parents[2]


def test_the_plugin_install_is_the_core_and_plugin_roots_and_no_other_code(
    tmp_path: Path,
) -> None:
    """The serving pod gets exactly the Python files of the ``core/`` and ``plugin/`` source
    roots, byte for byte: no stager, operator, API, agent or dev-tools code."""
    install_plugin(tmp_path)
    assert PLUGIN_PACKAGES == ("core", "plugin")

    def python_files(root: Path) -> dict[str, bytes]:
        return {
            f.relative_to(root).as_posix(): f.read_bytes()
            for f in root.rglob("*")
            if f.suffix in (".py", ".typed") and "__pycache__" not in f.parts
        }

    copied = python_files(tmp_path / "modelstage")
    expected: dict[str, bytes] = {}
    for name in PLUGIN_PACKAGES:
        expected |= python_files(CHECKOUT / name / "modelstage")
    assert copied == expected
    for other in ("stager", "operator", "api", "agent", "devtools"):
        assert not any(name.startswith(f"{other}/") for name in copied), other


def test_copied_plugin_imports_only_copied_modules_and_what_vllm_images_have(
    tmp_path: Path,
) -> None:
    """The plugin must work where only the copied packages exist: every ``modelstage`` import
    (lazy ones included) names the core or the plugin, every other one is the standard library
    or a vLLM dependency."""
    install_plugin(tmp_path)
    root = tmp_path / "modelstage"
    assert sorted(p.name for p in root.iterdir()) == sorted(PLUGIN_PACKAGES)
    assert not (root / "__init__.py").exists()  # a namespace package, as in the images
    for path in root.rglob("*.py"):
        package = path.parent.relative_to(tmp_path).as_posix().split("/")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module or "").split(".")] if node.module else base
                assert target[:2] in (["modelstage", p] for p in PLUGIN_PACKAGES), (path, target)
                continue
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "modelstage":
                    assert parts[1:2] in ([p] for p in PLUGIN_PACKAGES), (path.name, module)
                else:
                    allowed = ALLOWED_IMPORTS | STAGER_ONLY_IMPORTS.get(path.name, set())
                    assert parts[0] in sys.stdlib_module_names or parts[0] in allowed, (
                        path.name,
                        module,
                    )


def test_copied_plugin_imports_in_a_clean_interpreter_with_only_the_copy(
    tmp_path: Path, pod_site: Path
) -> None:
    """Every module of the copy imports where only the copy and a stock vLLM image's packages
    are on the path (``python -S``: no modelstage installation), and none of the stager does."""
    plugin_dir = tmp_path / "plugins"
    install_plugin(plugin_dir)
    modules = sorted(
        ".".join(p.relative_to(plugin_dir).with_suffix("").parts).removesuffix(".__init__")
        for p in (plugin_dir / "modelstage").rglob("*.py")
    )
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "try:\n"
        "    import modelstage.stager\n"
        "    stager = True\n"
        "except ImportError:\n"
        "    stager = False\n"
        "files = {n: getattr(m, '__file__', None) for n, m in sys.modules.items()\n"
        "         if n.startswith('modelstage.')}\n"
        "print(json.dumps({'stager': stager, 'files': files}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={**base_env(), "PYTHONPATH": f"{plugin_dir}:{pod_site}"},
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stager"] is False
    assert set(result["files"]) >= set(modules)
    for name, file in result["files"].items():
        assert file is not None and file.startswith(str(plugin_dir)), (name, file)


def test_the_capture_command_runs_from_the_copy_in_a_vllm_image(
    tied_tp1: Artifact, tmp_path: Path, pod_site: Path
) -> None:
    """``prepare --install-capture`` (the capture Job's initContainer) also copies the stager,
    so a stock vLLM image runs ``python3 -m modelstage.stager.cli capture-engine-cache`` from
    the copy alone: here it gets as far as its first check (the artifact is not staged)."""
    plugin_dir = tmp_path / "plugins"
    proc = prepare_cli("--artifact", str(tied_tp1.path), "--digest", tied_tp1.digest, "--tp",
                       "1", "--plugin-dir", str(plugin_dir), "--install-capture", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, last_line(proc)
    assert sorted(p.name for p in (plugin_dir / "modelstage").iterdir()) == sorted(
        CAPTURE_PACKAGES
    )
    argv = [sys.executable, "-S", "-m", "modelstage.stager.cli", "capture-engine-cache",
            "--artifact", str(tmp_path), "--out", str(tmp_path / "out"),
            "--engine-args", '{"maxModelLen": 64}']  # fmt: skip
    done = subprocess.run(
        argv, env={**base_env(), "PYTHONPATH": f"{plugin_dir}:{pod_site}"},
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path}: no modelstage.json: stage the artifact first"
    )
