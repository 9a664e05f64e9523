"""CI's rotation of the oracles' slow cases (``MODELSTAGE_CI_ROTATION``, ``.ci/run``): the
four slots together select every slow case once, so four consecutive commits run them all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROTATED = [
    *(f"tests/vllm/{name}" for name in ("test_vllm_oracle.py", "test_layout_oracle.py",
                                         "test_layout_oracle_pp.py", "test_vllm_pp.py")),
    "tests/s3/test_s3_engine_cache_vllm.py", "tests/oci/test_oci_vllm.py",
    "tests/azure/test_azure_vllm.py",
]  # fmt: skip


def collected(rotation: str | None) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "MODELSTAGE_CI_ROTATION"}
    if rotation is not None:
        env["MODELSTAGE_CI_ROTATION"] = rotation
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", *ROTATED,
         "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if line.startswith(tuple(ROTATED))}


def test_four_slots_run_every_slow_oracle_case_exactly_once() -> None:
    every = collected(None)
    slots = [collected(f"{k}/4") for k in range(4)]
    assert len(every) >= 16 + 15 + 14 + 3, sorted(every)  # e2e, PP, DeepSeek/FP8, S3/OCI/Azure
    assert set().union(*slots) == every
    assert sum(len(s) for s in slots) == len(every), "a case in two slots"
    assert all(len(s) >= len(every) // 4 for s in slots), [len(s) for s in slots]
