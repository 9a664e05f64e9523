"""``modelstage_runai_streamer``: a Hugging Face layout artifact read by vLLM's Run:ai loader.

vLLM splits each tensor per rank at load (the model's own ``load_weights``); this wraps the
stock loader unchanged, adding the artifact checks (every safetensors file of the artifact,
since every rank reads all of them) and the phase metrics. Tied embeddings follow vLLM's
rule for Hugging Face checkpoints, so nothing is re-tied here.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from modelstage.core.formats import FORMATS
from vllm.model_executor.model_loader.runai_streamer_loader import RunaiModelStreamerLoader

from .base import HfLayoutLoader, TimedStock, timed_weights


class _TimedRunai(RunaiModelStreamerLoader, TimedStock):
    def _get_weights_iterator(
        self, model_or_path: str, revision: str | None
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        assert self.moved is not None
        return timed_weights(super()._get_weights_iterator(model_or_path, revision), self.moved)


class ModelstageRunaiStreamerLoader(HfLayoutLoader):
    format = FORMATS["runai_streamer"]
    stock_class = _TimedRunai
