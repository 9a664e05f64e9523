"""The vLLM loader plugin: ``modelstage_*`` load formats that check the artifact and export
load-phase metrics (docs/architecture.md).

vLLM runs ``register()`` (entry-point group ``vllm.general_plugins``) in every one of its
processes: the front end, the engine core and each worker. So importing this package imports
only the format table, and ``register()`` imports only vLLM's loader registry and the loader
modules (torch and vLLM are loaded by then anyway); ``prometheus_client`` waits for the first
load. What it registers is the format table's: each row with a plugin loader has its loader
class in ``plugin/<row name>.py``, which names the row (``format = FORMATS[...]``) and takes
its names from it. The package and the core it uses are pure Python, so ``modelstage
prepare`` can copy them into a folder that a stock vLLM image gets on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from modelstage.core.formats import FORMATS, Format

if TYPE_CHECKING:
    from .base import ModelstageLoader

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "modelstage"
ENTRY_POINT = f"{__name__}:register"

_registered = False


def plugin_rows() -> list[Format]:
    """The format table's rows the plugin loads (those naming a plugin loader), in table order;
    each row's loader class is in ``plugin/<row name>.py``."""
    return [f for f in FORMATS.values() if f.plugin_loader]


def loader_for(row: Format) -> type[ModelstageLoader]:
    """The loader class in ``plugin/<row name>.py`` that names ``row``."""
    from .base import ModelstageLoader

    module = importlib.import_module(f"{__name__}.{row.name}")
    found = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, ModelstageLoader)
        and getattr(value, "format", None) is row
        and not value.takes_stock_name
    ]
    if len(found) != 1:
        raise ImportError(
            f"{module.__name__} must hold one loader class with format = FORMATS[{row.name!r}] "
            f"(the row's plugin loader {row.plugin_loader}); it holds {len(found)}"
        )
    return found[0]


def register() -> None:
    """Register every ``modelstage_*`` load format with vLLM, and with
    ``MODELSTAGE_S3_READER=1`` the S3 reader under vLLM's ``runai_streamer_sharded``
    (``s3_sharded_state.py``); idempotent."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from .s3_sharded_state import ModelstageS3ShardedStateLoader
    from .settings import ENV_S3_READER, PluginSettings

    loaders = [loader_for(row) for row in plugin_rows()]
    if PluginSettings.from_env().s3_reader:
        logging.getLogger("vllm.modelstage").info(
            "modelstage: %s=1, runai_streamer_sharded is read by modelstage's S3 reader",
            ENV_S3_READER,
        )
        loaders.append(ModelstageS3ShardedStateLoader)
    for loader in loaders:
        register_model_loader(loader.load_format)(loader)
    _registered = True
