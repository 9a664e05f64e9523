"""Run vLLM the way a serving pod does: the plugin comes only from the prepared directory.

Started by ``tests/serving`` as ``python -S pod_runner.py ...`` with ``PYTHONPATH`` set to
the plugin directory followed by a copy of the venv's site-packages without modelstage (see
``conftest.pod_env``). ``-S`` skips ``site``, so no ``.pth`` file runs and the checkout's
editable install is invisible; multiprocessing passes ``-S`` on to vLLM's workers. Runs the
shared vLLM runner (``tests/vllm/run_vllm.py``) unchanged, while a thread scrapes every
rank's metrics endpoint (workers exit with the engine, so the scrape happens during the
run), and writes one JSON: the runner's result, each rank's last scrape, and where
``modelstage`` was found, so the test can prove the isolation.

Usage: pod_runner.py --runner PATH --model DIR --tp N --load-format FMT --prompts JSON
                     --out FILE [--metrics-port BASE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

COMPLETED = "modelstage_load_completed_timestamp_seconds"


def where_modelstage_comes_from() -> dict[str, Any]:
    spec = importlib.util.find_spec("modelstage.plugin")
    try:
        dist = importlib.metadata.distribution("modelstage")
        dist_path = str(dist.locate_file(""))
        eps = [f"{e.group}:{e.value}" for e in dist.entry_points]
    except importlib.metadata.PackageNotFoundError:
        dist_path, eps = None, []
    return {
        "plugin_origin": spec.origin if spec else None,
        "dist_path": dist_path,
        "entry_points": eps,
    }


class Scraper(threading.Thread):
    """Polls each rank's endpoint and keeps the first scrape taken after its load finished."""

    def __init__(self, base: int, tp: int) -> None:
        super().__init__(daemon=True)
        self.urls = {r: f"http://127.0.0.1:{base + r}/metrics" for r in range(tp)}
        self.scraped: dict[int, str] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and len(self.scraped) < len(self.urls):
            for rank, url in self.urls.items():
                if rank in self.scraped:
                    continue
                try:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        text = response.read().decode()
                except OSError:
                    continue
                if COMPLETED in text:
                    self.scraped[rank] = text
            self.stop.wait(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runner", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--load-format", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--metrics-port", type=int)
    args = parser.parse_args()

    isolation = where_modelstage_comes_from()
    spec = importlib.util.spec_from_file_location("run_vllm", args.runner)
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)

    scraper = Scraper(args.metrics_port, args.tp) if args.metrics_port else None
    if scraper is not None:
        scraper.start()
    result = runner.run(args.model, args.tp, args.load_format, json.loads(args.prompts))
    if scraper is not None:
        deadline = time.monotonic() + 10
        while len(scraper.scraped) < args.tp and time.monotonic() < deadline:
            time.sleep(0.1)
        scraper.stop.set()
        scraper.join()
    Path(args.out).write_text(
        json.dumps(
            {
                "result": result,
                "metrics": {str(r): t for r, t in (scraper.scraped if scraper else {}).items()},
                "isolation": isolation,
            }
        )
    )


if __name__ == "__main__":
    main()
