"""The vLLM loader plugin: ``modelstage_*`` load formats that check the artifact and export
load-phase metrics (docs/architecture.md).

vLLM runs ``register()`` (entry-point group ``vllm.general_plugins``) in every one of its
processes: the front end, the engine core and each worker. So importing this package imports
only the format table, and ``register()`` imports only vLLM's loader registry and the loader
modules (torch and vLLM are loaded by then anyway); ``prometheus_client`` waits for the first
load. The
package and the core it uses are pure Python, so ``modelstage prepare`` can copy them into a
folder that a stock vLLM image gets on ``PYTHONPATH``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from modelstage.core.formats import FORMATS

if TYPE_CHECKING:
    from .base import ModelstageLoader

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "modelstage"
ENTRY_POINT = f"{__name__}:register"
LOAD_FORMATS = tuple(f.plugin_loader for f in FORMATS.values() if f.plugin_loader)
"""The ``modelstage_*`` load formats ``register()`` adds (the format table's plugin loaders)."""

_registered = False


def register() -> None:
    """Register every ``modelstage_*`` load format with vLLM, and with
    ``MODELSTAGE_S3_READER=1`` the S3 reader under vLLM's ``runai_streamer_sharded``
    (``s3_sharded_state.py``); idempotent."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from .runai_streamer import ModelstageRunaiStreamerLoader
    from .runai_streamer_sharded import ModelstageRunaiStreamerShardedLoader
    from .s3_sharded_state import ModelstageS3ShardedStateLoader
    from .safetensors import ModelstageSafetensorsLoader
    from .settings import ENV_S3_READER, PluginSettings
    from .sharded_state import ModelstageShardedStateLoader

    loaders: list[type[ModelstageLoader]] = [
        ModelstageShardedStateLoader,
        ModelstageRunaiStreamerShardedLoader,
        ModelstageRunaiStreamerLoader,
        ModelstageSafetensorsLoader,
    ]
    if PluginSettings.from_env().s3_reader:
        logging.getLogger("vllm.modelstage").info(
            "modelstage: %s=1, runai_streamer_sharded is read by modelstage's S3 reader",
            ENV_S3_READER,
        )
        loaders.append(ModelstageS3ShardedStateLoader)
    for loader in loaders:
        register_model_loader(loader.load_format)(loader)
    _registered = True
