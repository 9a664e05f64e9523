"""``modelstage prepare --engine-cache``: a captured engine cache is placed only when its key
matches this start and every byte verifies; otherwise the start goes on without it.

The cache here is built by the capture's own writer (``write_engine_cache``) over files shaped
like inductor's (``inductor/<xx>/<hash>.so``), so no vLLM runs; ``test_engine_cache_vllm.py``
captures a real one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.engine_cache import ENGINE_MANIFEST
from modelstage.core.engine_key import EngineArgs, ServingConfig, key_factors
from modelstage.plugin.metrics import LoadRecord, publish_startup, startup_phases, startup_record
from modelstage.stager.engine_capture import write_engine_cache
from modelstage.stager.engine_hardware import this_node
from support.serving import Artifact, base_env, last_line, prepare_cli

ARGS = EngineArgs(maxModelLen=128, dtype="float32")
FILES = {
    "inductor/zw/czwcq5kk7vsj4kplv6t7wviad6bihx.main.so": os.urandom(70_000),
    "inductor/fxgraph/ab/fabc/entry": b"graph" * 1000,
    "vllm/modelinfos/llama.json": b'{"x": 1}',
}


def config_for(artifact: Artifact) -> ServingConfig:
    return ServingConfig("0.32.0", "2.13.0+cpu", str(artifact.path), ARGS,
                         {"VLLM_USE_AOT_COMPILE": "0"})  # fmt: skip


def make_cache(tmp: Path, artifact: Artifact, config: ServingConfig | None = None) -> Path:
    cache = tmp / "engine-cache"
    for name, data in FILES.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    factors = key_factors(artifact.digest, config or config_for(artifact), this_node())
    write_engine_cache(cache, factors, 1.0, 30.0)
    return cache


def prepare(
    artifact: Artifact, tmp: Path, cache: Path | None, config: ServingConfig
) -> tuple[int, str, Path]:
    dest = tmp / "pod" / "engine-cache"
    extra = ["--engine-cache", str(cache)] if cache is not None else []
    proc = prepare_cli(
        "--artifact", str(artifact.path), "--digest", artifact.digest, "--tp", "1",
        "--plugin-dir", str(tmp / "pod" / "plugins"), "--engine-cache-dir", str(dest),
        "--engine-config", json.dumps(config.to_doc()), *extra, cwd=tmp,
    )  # fmt: skip
    return proc.returncode, last_line(proc), dest


def placed(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}


def test_a_matching_cache_is_verified_and_placed_where_the_env_points_vllm(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    cache = make_cache(tmp_path, tied_tp1)
    code, line, dest = prepare(tied_tp1, tmp_path, cache, config_for(tied_tp1))
    assert code == 0, line
    summary = json.loads(line)["engineCache"]
    assert summary["result"] == "hit", summary
    assert placed(dest) == FILES
    assert summary["env"] == {
        "VLLM_CACHE_ROOT": str(dest / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(dest / "inductor"),
        "TRITON_CACHE_DIR": str(dest / "triton"),
    }
    record = startup_record(tmp_path / "pod" / "plugins" / "startup.json")
    assert record["engineCache"] == "hit"
    assert {"prepare_verify", "engine_cache_verify", "engine_cache_copy"} <= set(record["phases"])


def test_a_flipped_byte_is_refused_before_vllm_starts_and_the_start_goes_on(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    cache = make_cache(tmp_path, tied_tp1)
    so = cache / "inductor/zw/czwcq5kk7vsj4kplv6t7wviad6bihx.main.so"
    data = bytearray(so.read_bytes())
    data[12345] ^= 0x01
    so.write_bytes(bytes(data))
    code, line, dest = prepare(tied_tp1, tmp_path, cache, config_for(tied_tp1))
    assert code == 0, line  # never fails the pod
    summary = json.loads(line)["engineCache"]
    assert summary["result"] == "corrupt"
    assert "czwcq5kk7vsj4kplv6t7wviad6bihx.main.so" in summary["reason"]
    assert "chunk 0" in summary["reason"]
    assert placed(dest) == {}  # vLLM finds empty folders and compiles
    assert sorted(p.name for p in dest.iterdir()) == ["inductor", "triton", "vllm"]


def test_a_cache_for_another_tp_is_not_used(tied_tp1: Artifact, tmp_path: Path) -> None:
    other = dataclasses.replace(
        config_for(tied_tp1), engineArgs=dataclasses.replace(ARGS, tensorParallelSize=2)
    )
    cache = make_cache(tmp_path, tied_tp1, other)
    code, line, dest = prepare(tied_tp1, tmp_path, cache, config_for(tied_tp1))
    assert code == 0, line
    summary = json.loads(line)["engineCache"]
    assert summary["result"] == "miss"
    assert "engineArgs.tensorParallelSize: cache 2, this start 1" in summary["reason"]
    assert placed(dest) == {}


def test_a_link_in_the_cache_is_refused(tied_tp1: Artifact, tmp_path: Path) -> None:
    cache = make_cache(tmp_path, tied_tp1)
    target = cache / "vllm/modelinfos/llama.json"
    secret = tmp_path / "secret.json"
    secret.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(secret)
    code, line, dest = prepare(tied_tp1, tmp_path, cache, config_for(tied_tp1))
    assert code == 0, line
    assert json.loads(line)["engineCache"]["result"] == "corrupt"
    assert placed(dest) == {}


def test_without_a_cache_the_folders_are_placed_empty(tied_tp1: Artifact, tmp_path: Path) -> None:
    code, line, dest = prepare(tied_tp1, tmp_path, None, config_for(tied_tp1))
    assert code == 0, line
    assert json.loads(line)["engineCache"]["result"] == "absent"
    assert sorted(p.name for p in dest.iterdir()) == ["inductor", "triton", "vllm"]


def test_a_cache_not_captured_yet_is_absent(tied_tp1: Artifact, tmp_path: Path) -> None:
    cache = make_cache(tmp_path, tied_tp1)
    (cache / ENGINE_MANIFEST).unlink()
    code, line, _ = prepare(tied_tp1, tmp_path, cache, config_for(tied_tp1))
    assert code == 0, line
    assert json.loads(line)["engineCache"]["result"] == "absent"


def test_engine_cache_without_a_destination_is_a_usage_error(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    proc = prepare_cli(
        "--artifact", str(tied_tp1.path), "--digest", tied_tp1.digest, "--tp", "1",
        "--plugin-dir", str(tmp_path / "plugins"), "--engine-cache", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert last_line(proc) == ("error: --engine-cache needs --engine-cache-dir (where to place it)")


def test_startup_phases_join_prepares_record_with_the_ranks_load() -> None:
    record = LoadRecord(rank=1, tensor_parallel_size=2, load_format="modelstage_sharded_state",
                        artifact="a", seconds={"verify": 0.5, "read": 2.0, "total": 3.0})  # fmt: skip
    prepared: dict[str, Any] = {"phases": {"prepare_verify": 0.1}, "engineCache": "miss"}
    phases = startup_phases(record, prepared)
    assert phases["prepare_verify"] == 0.1
    assert phases["weights_read"] == 2.0 and phases["weights_verify"] == 0.5
    assert phases["weights_total"] == 3.0 and phases["process_to_loaded"] > 0
    from prometheus_client import REGISTRY

    publish_startup(record, prepared)
    sample = REGISTRY.get_sample_value
    assert sample("modelstage_startup_phase_seconds", {"rank": "1", "phase": "weights_read"}) == 2.0
    assert sample("modelstage_engine_cache_result", {"rank": "1", "result": "miss"}) == 1.0
    assert sample("modelstage_engine_cache_result", {"rank": "1", "result": "hit"}) == 0.0


@pytest.mark.parametrize("content", ["", "not json", "[1]"])
def test_a_missing_or_bad_startup_record_is_empty(tmp_path: Path, content: str) -> None:
    path = tmp_path / "startup.json"
    if content:
        path.write_text(content)
    assert startup_record(path) == {}


def capture_cli(tmp: Path, artifact: Path, engine_args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "modelstage.stager.cli", "capture-engine-cache",
           "--artifact", str(artifact), "--out", str(tmp / "out" / "cache"),
           "--engine-args", engine_args]  # fmt: skip
    return subprocess.run(cmd, env=base_env(), cwd=tmp, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_capture_refuses_an_artifact_that_was_not_staged(tmp_path: Path) -> None:
    proc = capture_cli(tmp_path, tmp_path, '{"maxModelLen": 64}')
    assert proc.returncode == 1
    assert last_line(proc) == f"error: {tmp_path}: no modelstage.json: stage the artifact first"


def test_capture_refuses_bad_engine_arguments_by_name(tied_tp1: Artifact, tmp_path: Path) -> None:
    proc = capture_cli(tmp_path, tied_tp1.path, '{"maxModelLen": 64, "tp": 2}')
    assert proc.returncode == 1
    assert "unknown engine argument 'tp'" in last_line(proc)


def test_a_failed_vllm_start_leaves_nothing_that_looks_captured(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    proc = capture_cli(tmp_path, tied_tp1.path, '{"maxModelLen": 64, "loadFormat": "no_such"}')
    assert proc.returncode == 1
    line = last_line(proc)
    assert line.startswith(f"error: {tied_tp1.path}: vLLM failed (exit 1): "), line
    assert "no_such" in line
    assert list((tmp_path / "out").iterdir()) == []  # no cache, no .tmp- folder, no log


def test_the_ready_phase_is_the_process_age_at_the_first_200(tmp_path: Path) -> None:
    """A readiness endpoint on 127.0.0.1 that answers 503 twice, then 200."""
    import http.server
    import threading

    from modelstage.plugin.metrics import process_age, watch_ready
    from prometheus_client import REGISTRY

    answers = [503, 503, 200]

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(answers.pop(0) if len(answers) > 1 else answers[0])
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        before = process_age()
        age = watch_ready(f"http://127.0.0.1:{server.server_port}/health", interval=0.05)
    finally:
        server.shutdown()
        server.server_close()
    assert age is not None and before is not None and age >= before
    assert answers == [200]  # it waited through both 503s
    labels = {"rank": "0", "phase": "process_to_ready"}
    assert REGISTRY.get_sample_value("modelstage_startup_phase_seconds", labels) == age


def test_an_endpoint_that_never_answers_gives_up_at_the_deadline() -> None:
    from modelstage.plugin.metrics import watch_ready

    assert watch_ready("http://127.0.0.1:9/health", interval=0.05, deadline=0.2) is None


def test_an_unwritable_cache_folder_is_the_pods_error_named(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    (tmp_path / "not-a-dir").write_text("")
    proc = prepare_cli(
        "--artifact", str(tied_tp1.path), "--digest", tied_tp1.digest, "--tp", "1",
        "--plugin-dir", str(tmp_path / "plugins"),
        "--engine-cache-dir", str(tmp_path / "not-a-dir" / "cache"),
        "--engine-config", json.dumps(config_for(tied_tp1).to_doc()), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert last_line(proc).startswith(f"error: {tmp_path / 'not-a-dir' / 'cache'}: cannot prepare")
    assert "mount a writable volume" in last_line(proc)
