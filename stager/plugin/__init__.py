"""The vLLM loader plugin: ``modelstage_*`` load formats that check the artifact and export
load-phase metrics (DESIGN.md section 5).

vLLM runs ``register()`` (entry-point group ``vllm.general_plugins``) in every one of its
processes: the front end, the engine core and each worker. So importing this package imports
nothing, and ``register()`` imports only vLLM's loader registry and the loader modules (torch
and vLLM are loaded by then anyway); ``prometheus_client`` waits for the first load. The
package and the stager modules it uses are pure Python, so ``modelstage prepare`` can copy
them into a folder that a stock vLLM image gets on ``PYTHONPATH``.
"""

from __future__ import annotations

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "modelstage"
ENTRY_POINT = f"{__name__}:register"
LOAD_FORMATS = (
    "modelstage_sharded_state",
    "modelstage_runai_streamer_sharded",
    "modelstage_runai_streamer",
)

_registered = False


def register() -> None:
    """Register every ``modelstage_*`` load format with vLLM; idempotent."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from .runai_streamer import ModelstageRunaiStreamerLoader
    from .runai_streamer_sharded import ModelstageRunaiStreamerShardedLoader
    from .sharded_state import ModelstageShardedStateLoader

    for loader in (
        ModelstageShardedStateLoader,
        ModelstageRunaiStreamerShardedLoader,
        ModelstageRunaiStreamerLoader,
    ):
        register_model_loader(loader.load_format)(loader)
    _registered = True
