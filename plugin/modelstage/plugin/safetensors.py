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

import torch
from modelstage.core.formats import FORMATS
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .base import HfLayoutLoader, TimedStock, timed_weights


class _TimedDefault(DefaultModelLoader, TimedStock):
    def _get_weights_iterator(
        self, source: DefaultModelLoader.Source
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        assert self.moved is not None
        return timed_weights(super()._get_weights_iterator(source), self.moved)


class ModelstageSafetensorsLoader(HfLayoutLoader):
    format = FORMATS["safetensors"]
    stock_class = _TimedDefault
