"""The small base every modelstage load format shares: verify first, time every phase, publish.

Each format wraps one of vLLM's stock loaders (composition, not a copy of its logic): the
stock loader keeps its own extra-config validation and its download/glob behaviour, and a
subclass only says which stock loader, how to verify, and how to move the weights. The base
adds what the stock loaders lack: the artifact refusal before the model is allocated on the
device (``load_model`` runs ``verify`` before ``create_model``), content verification of
every byte the rank loads (``checks.py``: while streaming where the plugin's reader moves the
bytes, in a pass before loading otherwise; off only with ``MODELSTAGE_VERIFY=0``, which is
logged and published), the phase timings and their publication (``metrics.py``).
"""

from __future__ import annotations

import os
import time
from abc import abstractmethod
from collections.abc import Callable, Generator, Iterable
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from modelstage.core.formats import Format
from modelstage.core.layouts import layout_for
from modelstage.core.node_cache import MISS
from modelstage.core.pipeline_parallel import PARTITION_ENV
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from .checks import (
    VerifiedArtifact,
    check_layer_partition,
    refuse,
    verify_content,
    verify_local,
)
from .metrics import LOG, LoadRecord, publish, serve
from .settings import ENV_VERIFY, PluginSettings

STREAM, PASS, OFF = "stream", "pass", "off"
"""How a load verifies content: as the plugin's reader streams the bytes in, in a pass of its
own before loading, or not at all (``MODELSTAGE_VERIFY=0``)."""


@dataclass
class Transfer:
    """What moving the weights measured; ``weights_seconds`` is set by the base."""

    bytes: int = 0
    files: int = 0
    read_seconds: float = 0.0
    copy_seconds: float = 0.0
    read_wait_seconds: float = 0.0
    verified_bytes: int = 0
    hash_seconds: float = 0.0
    node_cache: str = ""
    """Set when the transfer left the node copy for the artifact (``corrupt``)."""


class ModelstageLoader(BaseModelLoader):
    format: ClassVar[Format]
    """The format table's row this loader reads; the three names below come from it."""
    takes_stock_name: ClassVar[bool] = False
    """Registered under the row's stock loader name instead of its plugin loader's."""
    load_format: ClassVar[str]
    """The name registered with vLLM (``--load-format``): the row's plugin loader."""
    stock_format: ClassVar[str]
    """The stock format whose loader this one wraps: the row's stock loader."""
    stock_class: ClassVar[type[BaseModelLoader]]
    per_rank: ClassVar[bool]
    """Whether the files hold per-rank state dicts (vLLM then keeps tied embeddings tied)."""
    reads_s3: ClassVar[bool] = False
    """Whether ``s3://`` locations are read by this loader (else refused, see below)."""
    streams_verification: ClassVar[bool] = False
    """Whether ``transfer`` moves the bytes through the plugin's reader, which checks each hash
    chunk as it lands; else content is verified in a pass before loading."""
    reads_node_copy: ClassVar[bool] = False
    """Whether ``transfer`` reads the verified files wherever they are, so they may be the
    node-local copy's (``node_copy.py``); a stock reader reads vLLM's ``--model`` instead."""
    running_pp: int = 1
    """The pipeline parallel size vLLM runs, read before ``verify`` (which refuses an artifact
    staged for another)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Take the names from the row a loader names (an abstract base names none)."""
        super().__init_subclass__(**kwargs)
        row: Format | None = getattr(cls, "format", None)
        if row is None:
            return
        name = row.stock_loader if cls.takes_stock_name else row.plugin_loader
        if name is None:
            raise TypeError(
                f"{cls.__qualname__} reads format {row.name}, whose row in core/formats.py "
                "has no plugin_loader: name the load format it registers there"
            )
        cls.load_format, cls.stock_format, cls.per_rank = name, row.stock_loader, row.per_rank

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        stock_config = copy(load_config)
        # The stock loaders branch on their own format name (e.g. ShardedStateLoader picks
        # the Run:ai iterator for "runai_streamer_sharded"): hand them the stock name.
        stock_config.load_format = self.stock_format
        self.stock = self.stock_class(stock_config)
        self.settings = PluginSettings.from_env()
        self._record: LoadRecord | None = None
        self._verified: VerifiedArtifact | None = None
        self._weights_done: float | None = None
        self.verification = OFF

    @abstractmethod
    def verify(self, location: str, running_tp: int, vllm_version: str) -> VerifiedArtifact:
        """Refuse (``ArtifactError``) anything but the expected artifact; no device work."""

    @abstractmethod
    def transfer(
        self, model: nn.Module, model_config: ModelConfig, verified: VerifiedArtifact
    ) -> Transfer:
        """Move the weights into ``model``; the stock semantics for keys and shapes hold."""

    def download_model(self, model_config: ModelConfig) -> None:
        self.stock.download_model(model_config)

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> nn.Module:
        started = time.perf_counter()
        record = self._begin(model_config)
        if self.per_rank:
            keep_tied_embeddings(model_config)
        try:
            model: nn.Module = super().load_model(vllm_config, model_config, prefix)
        except BaseException:
            self._record = self._verified = None  # a later load_weights starts afresh
            raise
        ended = time.perf_counter()
        record.seconds["post_process"] = ended - (self._weights_done or ended)
        record.seconds["total"] = ended - started
        self._publish(record)
        return model

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        standalone = self._record is None  # vLLM may reload weights without load_model
        started = time.perf_counter()
        record = self._begin(model_config) if standalone else self._record
        assert record is not None and self._verified is not None
        t0 = time.perf_counter()
        moved = self.transfer(model, model_config, self._verified)
        self._weights_done = t1 = time.perf_counter()
        record.bytes, record.files = moved.bytes, moved.files
        record.node_cache = moved.node_cache or record.node_cache
        record.seconds["read"] = moved.read_seconds
        record.seconds["host_to_device"] = moved.copy_seconds
        record.read_wait_seconds = moved.read_wait_seconds
        record.weights_seconds = t1 - t0
        if self.verification == STREAM:
            record.verified_bytes, record.hash_seconds = moved.verified_bytes, moved.hash_seconds
        if standalone:
            record.seconds["total"] = t1 - started
            self._publish(record)

    def _begin(self, model_config: ModelConfig) -> LoadRecord:
        rank, tp = tensor_parallel_rank_and_size()
        pp_rank, self.running_pp = pipeline_rank_and_size()
        location = weights_location(model_config)
        record = LoadRecord(
            rank=rank,
            tensor_parallel_size=tp,
            load_format=self.load_format,
            artifact=self.settings.artifact or location,
        )
        if self.settings.metrics_port is not None:  # up before the load: a hang is visible
            # one port per process: the stages' ranks of one TP rank share a pod
            serve(self.settings.metrics_port + pp_rank * tp + rank, self.settings.metrics_addr)
        t0 = time.perf_counter()
        verified = self.verify(location, tp, vllm_version())
        if self.per_rank:
            check_proven(verified.location, model_config, vllm_version())
            check_layer_partition(
                verified.location,
                verified.manifest,
                model_config.hf_config.get_text_config().num_hidden_layers,
                os.environ.get(PARTITION_ENV),
            )
        record.node_cache = self._node_cache(verified)
        self.verification = record.verification = self._verify_content(verified, record)
        record.seconds["verify"] = time.perf_counter() - t0
        manifest = verified.manifest
        record.digest, record.artifact_format = manifest.digest, manifest.format
        record.layout_version = manifest.layoutVersion
        self._record, self._verified, self._weights_done = record, verified, None
        return record

    def _node_cache(self, verified: VerifiedArtifact) -> str:
        """``hit``/``miss`` when a node cache is configured (logged where chosen), else ""."""
        if self.settings.node_cache is None or verified.node_cache:
            return verified.node_cache
        LOG.info(
            "modelstage: node cache miss: --load-format %s reads %s through vLLM's reader",
            self.load_format,
            verified.location,
        )
        return MISS

    def _verify_content(self, verified: VerifiedArtifact, record: LoadRecord) -> str:
        """Decide how this load verifies content, and run the pass when it is one."""
        if not self.settings.verify:
            LOG.warning(
                "modelstage: %s=0: loading %s WITHOUT verifying its content against "
                "the manifest; corrupt bytes would be served",
                ENV_VERIFY,
                verified.location,
            )
            return OFF
        schema1 = any(f.entry.digest is None for f in verified.files)
        if self.streams_verification and not schema1:
            LOG.info(
                "modelstage: verifying every byte of %d file(s) of %s as it streams in",
                len(verified.files),
                verified.location,
            )
            return STREAM
        why = (
            "the artifact has no chunk hashes (manifest schema 1; re-stage to verify while "
            "streaming)"
            if schema1
            else f"{self.load_format} reads through vLLM's reader"
        )
        LOG.info("modelstage: verifying %s in a pass before loading: %s", verified.location, why)
        stats = verify_content(verified)
        record.verified_bytes, record.hash_seconds = stats.bytes, stats.seconds
        return PASS

    def _publish(self, record: LoadRecord) -> None:
        self._record = self._verified = None
        publish(record, port=self.settings.metrics_port, addr=self.settings.metrics_addr)

    def verify_local_location(self, location: str) -> Path:
        """Per-rank and layout formats read local directories; object storage is refused
        with the reason (vLLM 0.32 refuses object-store URIs for non-stock format names
        before any loader runs, so this is a second line)."""
        if "://" in location:
            raise refuse(
                location,
                f"--load-format {self.load_format} reads local artifacts only; for object "
                f"storage use the stock --load-format {self.stock_format} (with "
                "MODELSTAGE_S3_READER=1 the plugin reads runai_streamer_sharded artifacts)",
            )
        return Path(location)


def weights_location(model_config: ModelConfig) -> str:
    """Where vLLM reads weights from: ``model_weights`` (set for object storage) or ``model``."""
    return str(getattr(model_config, "model_weights", "") or model_config.model)


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def pipeline_rank_and_size() -> tuple[int, int]:
    """This process's pipeline stage and vLLM's pipeline parallel size."""
    from vllm.distributed import get_pp_group

    group = get_pp_group()
    return int(group.rank_in_group), int(group.world_size)


def vllm_version() -> str:
    import vllm

    version: str = vllm.__version__
    return version


def check_proven(where: str, model_config: Any, version: str) -> None:
    """Refuse per-rank files of an architecture whose per-rank state is not proven for the
    running vLLM (its layout names the architectures proven on it)."""
    architectures = getattr(model_config.hf_config, "architectures", None) or []
    layout = layout_for(version)
    unproven = [a for a in architectures if not layout.splits(a)]
    if unproven:
        raise refuse(
            where,
            f"per-rank files of {unproven[0]} are not proven for vLLM {version}; stage it "
            "in the Hugging Face layout (safetensors, runai_streamer) for this vLLM",
        )


def keep_tied_embeddings(model_config: Any) -> None:
    """Undo vLLM's untying of word embeddings for per-rank artifacts.

    vLLM 0.32 unties ``tie_word_embeddings`` when the checkpoint holds an ``lm_head`` of its
    own, except for the format names ``sharded_state`` and ``runai_streamer_sharded``: a
    per-rank state dict stores tied embeddings under ``lm_head`` only. Our names are not in
    that list, so vLLM unties and the model then wants an ``embed_tokens`` the artifact never
    has. Restoring the config before the model is created gives the stock formats' behaviour.
    """
    if not getattr(model_config, "word_embeddings_untied_by_checkpoint", False):
        return
    model_config.hf_config.tie_word_embeddings = True
    model_config.hf_config.get_text_config().tie_word_embeddings = True
    model_config.word_embeddings_untied_by_checkpoint = False


def timed_weights(
    weights: Iterable[tuple[str, torch.Tensor]], moved: Transfer
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Wrap a stock weights iterator: time spent inside it is ``read`` (the stock iterators
    read and materialise each tensor there), the rest of the stock loop is the copy."""
    iterator = iter(weights)
    while True:
        t0 = time.perf_counter()
        try:
            name, tensor = next(iterator)
        except StopIteration:
            return
        moved.read_seconds += time.perf_counter() - t0
        moved.bytes += tensor.numel() * tensor.element_size()
        yield name, tensor


def run_timed(transfer: Callable[[], None], moved: Transfer) -> Transfer:
    """Run a stock ``load_weights`` whose iterator feeds ``moved``; the copy is the rest."""
    t0 = time.perf_counter()
    transfer()
    moved.copy_seconds = max(time.perf_counter() - t0 - moved.read_seconds, 0.0)
    return moved


class TimedStock(BaseModelLoader):
    """A stock loader whose weights iterator feeds ``moved`` (``timed_weights``)."""

    moved: Transfer | None = None


class HfLayoutLoader(ModelstageLoader):
    """A Hugging Face layout artifact read by a stock loader: every rank reads (and checks)
    every safetensors file of the artifact, and vLLM splits each tensor itself at load."""

    stock_class: ClassVar[type[TimedStock]]

    def verify(self, location: str, running_tp: int, vllm_version: str) -> VerifiedArtifact:
        return verify_local(
            self.verify_local_location(location),
            load_format=self.load_format,
            settings=self.settings,
            running_tp=running_tp,
            vllm_version=vllm_version,
            rank_glob=None,
            running_pp=self.running_pp,
        )

    def transfer(
        self, model: nn.Module, model_config: ModelConfig, verified: VerifiedArtifact
    ) -> Transfer:
        assert isinstance(self.stock, TimedStock)
        self.stock.moved = moved = Transfer(files=len(verified.files))
        return run_timed(lambda: self.stock.load_weights(model, model_config), moved)
