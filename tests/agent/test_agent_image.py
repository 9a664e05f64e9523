"""The agent image holds the core, the API and the agent only (Dockerfile.agent): its entry
point, ``python -m modelstage.agent``, must run where torch, the stager, the plugin and the
operator cannot be imported, and refuse bad input with one line."""

from __future__ import annotations

import subprocess
import sys

ABSENT = ("torch", "numpy", "safetensors", "vllm", "boto3", "kopf", "modelstage.stager",
          "modelstage.plugin", "modelstage.operator", "modelstage.devtools")  # fmt: skip

WITHOUT_THE_REST = f"""
import runpy, sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if any(name == a or name.startswith(a + ".") for a in {ABSENT!r}):
            raise ModuleNotFoundError(f"not in the agent image: {{name}}")
        return None
sys.meta_path.insert(0, Absent())
import modelstage.agent.agent, modelstage.agent.copy, modelstage.agent.server
sys.argv = ["python -m modelstage.agent", *sys.argv[1:]]
runpy.run_module("modelstage.agent", run_name="__main__")
"""


def run_agent_image(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-c", WITHOUT_THE_REST, *args],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


def test_the_agent_command_runs_without_torch_or_the_stager() -> None:
    done = run_agent_image("agent", "--help")
    assert done.returncode == 0, done.stderr
    assert "--budget" in done.stdout and "--allow-tokens-without-node" in done.stdout


def test_bad_input_is_one_line_naming_the_flag() -> None:
    done = run_agent_image("agent", "--node", "n1", "--root", "/nonexistent", "--budget", "12Q")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: --budget '12Q': expected a number of bytes")
    assert done.stderr.count("\n") == 1
