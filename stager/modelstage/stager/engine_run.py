"""One vLLM start, one generated token: the child process of engine-cache capture and of
``modelstage bench --startup``.

A fresh interpreter per start (vLLM keeps process-wide state; torch's compile caches live in
the process too), with the cache roots given by the parent's environment. It prints one JSON
line on stdout: the token ids, the versions, and where the seconds went (import, engine
construction, the compile inside it, the first token) with torch's cache counters, read in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank in-process at TP=1; at TP>1 the
ranks are other processes and their compile figures are not seen here).

Where the compile seconds come from: on the CPU platform vLLM compiles in mode
``DYNAMO_TRACE_ONCE`` with torch's ``inductor`` backend (``vllm/platforms/cpu.py``,
``check_and_update_config``), which does not add to vLLM's ``compilation_time``
(``vllm/compilation/monitor.py`` counts only ``VLLM_COMPILE``); torch's own
``compilation_time_metrics`` time every Dynamo compile, in any mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

PROMPT = [1, 17, 42, 99, 7, 3, 250, 31]
"""Token ids (the tokenizer is never loaded)."""
COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
)
"""torch's cache counters: a warm start from a placed cache shows hits and no misses."""
COMPILE_METRIC = "_compile.compile_inner"
"""The torch._dynamo timing that spans one whole compile (trace, AOT autograd, inductor)."""


def engine_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``LLM(...)`` keyword arguments from the engine-argument mapping
    (``core/engine_key.EngineArgs.to_doc``)."""
    tp = int(args.get("tensorParallelSize", 1))
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": int(args.get("pipelineParallelSize", 1)),
        "max_model_len": int(args["maxModelLen"]),
        "dtype": args.get("dtype", "auto"),
        "enforce_eager": bool(args.get("enforceEager", False)),
        "distributed_executor_backend": "uni" if tp == 1 else "mp",
    }
    if args.get("quantization"):
        kwargs["quantization"] = args["quantization"]
    if args.get("compilationConfig"):
        kwargs["compilation_config"] = json.loads(args["compilationConfig"])
    if args.get("loadFormat"):
        kwargs["load_format"] = args["loadFormat"]
    return kwargs


def run(model: str, args: dict[str, Any], max_tokens: int = 1) -> dict[str, Any]:
    started = time.monotonic()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from torch._dynamo.utils import compilation_time_metrics, counters
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    imported = time.monotonic()
    llm = LLM(model=model, skip_tokenizer_init=True, seed=0, max_num_seqs=1, **engine_kwargs(args))
    constructed = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    generated = time.monotonic()
    return {
        "vllmVersion": vllm.__version__,
        "torchVersion": torch.__version__,
        "tokenIds": list(outputs[0].outputs[0].token_ids),
        "seconds": {
            "import": round(imported - started, 3),
            "engine": round(constructed - imported, 3),
            "compile": round(sum(compilation_time_metrics.get(COMPILE_METRIC, [])), 3),
            "firstToken": round(generated - constructed, 3),
        },
        "counters": {name: int(counters[group][name]) for group, name in COUNTERS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="the staged artifact directory")
    parser.add_argument("--engine-args", required=True, help="JSON engine-argument mapping")
    parser.add_argument("--max-tokens", type=int, default=1)
    ns = parser.parse_args()
    result = run(ns.model, json.loads(ns.engine_args), ns.max_tokens)
    sys.stderr.flush()
    print(json.dumps(result, sort_keys=True, separators=(",", ":")), flush=True)
    # vLLM's orderly shutdown costs seconds here; the result is out, rank workers exit when
    # they see their parent gone.
    os._exit(0)


if __name__ == "__main__":
    main()
