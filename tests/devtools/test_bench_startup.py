"""``bench --startup``'s arithmetic and picture, on made-up starts (the real ones need vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelstage.devtools.bench_startup import CONDITIONS, chart, load_line, summarise, timeline

CAPTURED = {"key": "k", "files": 3, "bytes": 10, "captureSeconds": 90.0, "compileSeconds": 60.0}


def start(compile_s: float, engine: float, wall: float, tokens: list[int]) -> dict[str, Any]:
    ran = {"seconds": {"import": 5.0, "engine": engine, "compile": compile_s, "firstToken": 0.5},
           "tokenIds": tokens, "counters": {}}  # fmt: skip
    load = {"seconds": {"total": 2.0}}
    return {"ran": ran, "timeline": timeline(0.25, wall, ran, load)}


def test_timeline_splits_the_start_into_its_phases() -> None:
    parts = start(60.0, 70.0, 80.0, [1])["timeline"]
    assert parts == {"prepare": 0.25, "import": 9.5, "weights": 2.0, "compile": 60.0,
                     "engine_other": 8.0, "first_token": 0.5, "total": 80.25}  # fmt: skip


def test_summary_reports_both_ratios_and_token_agreement(tmp_path: Path) -> None:
    runs = {
        name: [start(6.0 if cached else 60.0, 20.0 if cached else 70.0,
                     30.0 if cached else 80.0, [7]) for _ in range(3)]
        for name, cached, _ in CONDITIONS
    }  # fmt: skip
    result = summarise(runs, CAPTURED, (1.0, 2.0, 3.0), 3)
    assert result["ratios"]["compile_warm"] == 0.1
    assert result["ratios"]["first_token_cold"] == round(30.25 / 80.25, 3)
    assert result["sameTokens"] is True
    runs["engine cache, weights cold"][1]["ran"]["tokenIds"] = [8]
    assert summarise(runs, CAPTURED, (1.0, 2.0, 3.0), 3)["sameTokens"] is False
    chart(result, tmp_path / "startup.png")
    assert (tmp_path / "startup.png").read_bytes()[:4] == b"\x89PNG"


def test_the_plugins_load_line_is_found_among_vllms_logs() -> None:
    doc = {"seconds": {"total": 1.5}}
    text = (
        f"INFO 12-03 x.py:1] hello\nINFO 12-03 [metrics.py:9] modelstage load {json.dumps(doc)}\n"
    )
    assert load_line(text) == doc
    assert load_line("nothing") == {}
