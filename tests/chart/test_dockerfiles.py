"""The three Dockerfiles, without a Docker daemon: hadolint clean, and honest about the tree.

Every path they COPY from the build context exists and is not excluded by ``.dockerignore``;
every entry point they name is installed by the package (the ``modelstage`` console script,
``python -m modelstage.operator``); the package version they pin is pyproject's. What only a
real build proves: that the pinned base image, apt and pip versions resolve, and the images'
size.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from support.charts import ROOT, run, tool

DOCKERFILES = ("Dockerfile.operator", "Dockerfile.stager", "Dockerfile.agent")
IMAGE_ROOTS = {
    "Dockerfile.operator": {"core", "api", "operator"},
    "Dockerfile.agent": {"core", "api", "agent"},
    # the operator for the offline `modelstage plan`; the agent for the copy Jobs' node-copy
    "Dockerfile.stager": {"core", "api", "stager", "plugin", "agent", "operator"},
}
"""The source roots each image's wheel is built from: the dev tools are in none."""
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [p.strip().rstrip("/") for p in lines if p.strip() and not p.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    for pattern in patterns:
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(
                prefix, pattern.removeprefix("**/")
            ):
                return True
    return False


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_is_clean(name: str) -> None:
    result = run([tool("hadolint"), "--no-color", str(ROOT / name)], check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_exists_in_the_build_context(name: str) -> None:
    patterns = _dockerignore()
    copies = [rest for keyword, rest in _instructions(name) if keyword in ("COPY", "ADD")]
    from_context = [c for c in copies if not c.startswith("--from=")]
    assert from_context
    for copy in from_context:
        *sources, _dest = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path"
            assert not _ignored(source, patterns), f"{name}: COPY {source} is in .dockerignore"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_pinned_and_non_root(name: str) -> None:
    instructions = _instructions(name)
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert len(froms) >= 2, "multi-stage: build the wheel in a stage of its own"
    args = dict(
        rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest
    )
    base = args.get("PYTHON_IMAGE", "")
    assert re.fullmatch(r"python:\d+\.\d+(\.\d+)?-slim-\w+(@sha256:[0-9a-f]{64})?", base), base
    assert [rest for keyword, rest in instructions if keyword == "FROM"][-1] == "${PYTHON_IMAGE}"
    assert "PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:" in (ROOT / name).read_text(), (
        "the Dockerfile says how to pin the base by digest"
    )
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert args.get("MODELSTAGE_VERSION") == PYPROJECT["project"]["version"]
    installs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    for requirement in re.findall(r'"([A-Za-z][\w.-]*(?:\[[\w,]+\])?[=<>!~][^"]*)"', installs):
        assert "==" in requirement, f"{name}: unpinned {requirement}"


def test_the_stager_user_is_the_one_the_operator_runs_pods_as() -> None:
    from modelstage.operator.kube import NONROOT_UID

    for name in DOCKERFILES:
        (user,) = [r for k, r in _instructions(name) if k == "USER"]
        assert user == f"{NONROOT_UID}:{NONROOT_UID}"
    chart = (ROOT / "charts" / "modelstage" / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {NONROOT_UID}" in chart


def source_file(module: str, name: str = "") -> Path:
    """The file of ``module`` (or ``name`` in its package) under the source roots that
    pyproject.toml's package discovery searches."""
    roots = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]
    path = Path(*module.split("."))
    for root in roots:
        found = ROOT / root / path / name if name else ROOT / root / path.with_suffix(".py")
        if found.exists():
            return found
    raise AssertionError(f"{module}: not under the source roots {roots}")


def _entrypoint(name: str) -> list[str]:
    (entry,) = [rest for keyword, rest in _instructions(name) if keyword == "ENTRYPOINT"]
    command: list[str] = json.loads(entry)
    return command


def test_stager_entrypoint_is_the_packages_console_script() -> None:
    (command,) = _entrypoint("Dockerfile.stager")
    target = PYPROJECT["project"]["scripts"][command]
    module, _, func = target.partition(":")
    assert module == "modelstage.stager.cli" and source_file(module).is_file()
    assert re.search(rf"^def {func}\(", source_file(module).read_text(), re.M)


def test_operator_entrypoint_is_a_module_of_the_package() -> None:
    command = _entrypoint("Dockerfile.operator")
    assert command[:2] == ["python", "-m"]
    module = command[2]
    main = source_file(module, "__main__.py")
    assert main.is_file(), f"`python -m {module}` needs {main.relative_to(ROOT)}"
    assert 'if __name__ == "__main__":' in main.read_text()


@pytest.mark.parametrize("image", ["operator", "agent"])
def test_the_operator_and_agent_images_install_no_torch(image: str) -> None:
    installs = " ".join(r for k, r in _instructions(f"Dockerfile.{image}") if k == "RUN")
    assert "torch" not in installs and f"[{image}]" in installs
    deps = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"][image]
    assert not {"torch", "numpy", "safetensors", "vllm"} & _names(deps)


def test_agent_entrypoint_runs_the_agent_command() -> None:
    command = _entrypoint("Dockerfile.agent")
    assert command == ["python", "-m", "modelstage.agent"]
    main = source_file("modelstage.agent", "__main__.py")
    assert 'if __name__ == "__main__":' in main.read_text()
    chart = (ROOT / "charts" / "modelstage" / "templates" / "node-agent.yaml").read_text()
    assert "args:\n            - agent\n" in chart, "the DaemonSet passes the `agent` command"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_image_copies_only_its_source_roots(name: str) -> None:
    copies = [rest.split()[0] for k, rest in _instructions(name)
              if k == "COPY" and not rest.startswith("--from=")]  # fmt: skip
    roots = set(PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"])
    assert {c.rstrip("/") for c in copies} & roots == IMAGE_ROOTS[name]
    assert "devtools" not in IMAGE_ROOTS[name]


@pytest.mark.parametrize("name", ["Dockerfile.agent", "Dockerfile.stager"])
def test_the_wheel_built_from_an_images_roots_holds_only_their_packages(
    name: str, tmp_path: Path
) -> None:
    """What the build stage does: the wheel of a context holding only the image's roots."""
    context = tmp_path / "context"
    context.mkdir()
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, context / file)
    for root in IMAGE_ROOTS[name]:
        shutil.copytree(ROOT / root, context / root,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
    done = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--wheel-dir", str(tmp_path / "wheels"), str(context)], check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "wheels").glob("modelstage-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packages = {n.split("/")[1] for n in archive.namelist() if n.startswith("modelstage/")}
    assert packages == IMAGE_ROOTS[name]


def test_images_ship_the_extras_they_need() -> None:
    installs = " ".join(r for k, r in _instructions("Dockerfile.stager") if k == "RUN")
    for needed in ("[stager]", "torch==", "tensorizer==", "runai-model-streamer[s3]==", "curl="):
        assert needed in installs, f"Dockerfile.stager does not install {needed}"


def _stages(name: str) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, rest in _instructions(name):
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, rest))
    return stages


def _lock(name: str) -> dict[str, tuple[str, list[str]]]:
    """{package: (version, sha256 hashes)} of requirements/<name>.lock."""
    text = re.sub(r"\\\n", " ", (ROOT / "requirements" / f"{name}.lock").read_text())
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            requirement, *options = line.split()
            package, _, version = requirement.partition("==")
            hashes = [o.removeprefix("--hash=sha256:") for o in options]
            assert version and hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), line
            out[package] = (version, hashes)
    return out


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_wheels_are_hash_checked_and_installed_without_an_index(name: str) -> None:
    """The build stage downloads every locked wheel with --require-hashes; the image installs
    the package with --no-index from those wheels only: no index is asked for it, so a
    published ``modelstage`` of the same version cannot win."""
    build, final = _stages(name)
    build_runs = " ".join(" ".join(rest.split()) for keyword, rest in build if keyword == "RUN")
    image = name.removeprefix("Dockerfile.")
    assert "--require-hashes -r requirements/build.lock" in build_runs
    assert f"--require-hashes --only-binary=:all: --no-deps --dest /wheels -r requirements/{image}.lock" in build_runs
    assert "--no-build-isolation" in build_runs, "the build backend comes from the lock too"
    final_runs = " ".join(" ".join(rest.split()) for keyword, rest in final if keyword == "RUN")
    installs = re.findall(r"pip install[^&]*modelstage\[", final_runs)
    assert installs and all("--no-index --find-links /wheels" in i for i in installs)


@pytest.mark.parametrize("image", ["operator", "stager", "agent"])
def test_the_locks_cover_what_the_images_install(image: str) -> None:
    locked = _lock(image)
    wanted = _names(PYPROJECT["project"]["dependencies"])
    wanted |= _names([r for r in PYPROJECT["project"]["optional-dependencies"][image]
                      if not r.startswith("torch")])  # fmt: skip
    if image == "stager":
        wanted |= {"tensorizer", "runai-model-streamer", "runai-model-streamer-s3"}
    assert wanted <= set(locked), sorted(wanted - set(locked))
    assert "torch" not in locked and "modelstage" not in locked
    build = _lock("build")
    assert set(build) == {"pip", "setuptools"}
