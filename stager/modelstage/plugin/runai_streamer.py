"""``modelstage_runai_streamer``: a Hugging Face layout artifact read by vLLM's Run:ai loader.

vLLM splits each tensor per rank at load (the model's own ``load_weights``); this wraps the
stock loader unchanged, adding the artifact checks (every safetensors file of the artifact,
since every rank reads all of them) and the phase metrics. Tied embeddings follow vLLM's
rule for Hugging Face checkpoints, so nothing is re-tied here.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import ClassVar

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.runai_streamer_loader import RunaiModelStreamerLoader

from .base import ModelstageLoader, Transfer, run_timed, timed_weights
from .checks import VerifiedArtifact, verify_local


class _TimedRunai(RunaiModelStreamerLoader):
    moved: Transfer | None = None

    def _get_weights_iterator(
        self, model_or_path: str, revision: str | None
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        assert self.moved is not None
        return timed_weights(super()._get_weights_iterator(model_or_path, revision), self.moved)


class ModelstageRunaiStreamerLoader(ModelstageLoader):
    load_format: ClassVar[str] = "modelstage_runai_streamer"
    stock_format: ClassVar[str] = "runai_streamer"
    stock_class = _TimedRunai
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
        assert isinstance(self.stock, _TimedRunai)
        self.stock.moved = moved = Transfer(files=len(verified.files))
        return run_timed(lambda: self.stock.load_weights(model, model_config), moved)
