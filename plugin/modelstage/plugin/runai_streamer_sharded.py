"""``modelstage_runai_streamer_sharded``: per-rank files read by vLLM's Run:ai streamer path.

The stock ``runai_streamer_sharded`` is vLLM's sharded-state loader with the Run:ai iterator;
this wraps it unchanged, adding the artifact checks and the phase metrics (``read`` is the
time inside the streamer's iterator, ``host_to_device`` the rest of the stock copy loop).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
from modelstage.core.formats import FORMATS
from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

from .base import ModelstageLoader, Transfer, run_timed, timed_weights
from .checks import VerifiedArtifact
from .sharded_state import verify_rank_files


class _TimedShardedState(ShardedStateLoader):
    moved: Transfer | None = None

    def iterate_over_files(self, paths: Any) -> Generator[tuple[str, torch.Tensor], None, None]:
        assert self.moved is not None
        return timed_weights(super().iterate_over_files(paths), self.moved)


class ModelstageRunaiStreamerShardedLoader(ModelstageLoader):
    format = FORMATS["runai_streamer_sharded"]
    stock_class = _TimedShardedState

    def verify(self, location: str, running_tp: int, vllm_version: str) -> VerifiedArtifact:
        return verify_rank_files(self, location, running_tp, vllm_version)

    def transfer(
        self, model: nn.Module, model_config: ModelConfig, verified: VerifiedArtifact
    ) -> Transfer:
        assert isinstance(self.stock, _TimedShardedState)
        self.stock.moved = moved = Transfer(files=len(verified.files))
        return run_timed(lambda: self.stock.load_weights(model, model_config), moved)
