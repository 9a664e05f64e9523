"""``modelstage_safetensors``: a Hugging Face layout artifact on a local directory (a mounted
PVC), read by vLLM's default loader (``--load-format safetensors``).

The cache for any architecture and quantization: vLLM splits each tensor per rank at load
with the model's own ``load_weights``, so this wraps the stock loader unchanged and adds what
it lacks: the artifact checks before the model is allocated (every safetensors file of the
artifact, since every rank reads all of them), content verification and the phase metrics.
vLLM's own reader moves the bytes, so every chunk of every file is hashed against the
manifest in a pass before loading (``MODELSTAGE_VERIFY``, on by default; ``checks.py``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import ClassVar

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .base import ModelstageLoader, Transfer, run_timed, timed_weights
from .checks import VerifiedArtifact, verify_local


class _TimedDefault(DefaultModelLoader):
    moved: Transfer | None = None

    def _get_weights_iterator(
        self, source: DefaultModelLoader.Source
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        assert self.moved is not None
        return timed_weights(super()._get_weights_iterator(source), self.moved)


class ModelstageSafetensorsLoader(ModelstageLoader):
    load_format: ClassVar[str] = "modelstage_safetensors"
    stock_format: ClassVar[str] = "safetensors"
    stock_class = _TimedDefault
    per_rank: ClassVar[bool] = False

    def verify(self, location: str, running_tp: int, vllm_version: str) -> VerifiedArtifact:
        return verify_local(
            self.verify_local_location(location),
            load_format=self.load_format,
            settings=self.settings,
            running_tp=running_tp,
            vllm_version=vllm_version,
            rank_glob=None,
        )

    def transfer(
        self, model: nn.Module, model_config: ModelConfig, verified: VerifiedArtifact
    ) -> Transfer:
        assert isinstance(self.stock, _TimedDefault)
        self.stock.moved = moved = Transfer(files=len(verified.files))
        return run_timed(lambda: self.stock.load_weights(model, model_config), moved)
