"""``modelstage_sharded_state``: vLLM's sharded-state format, read by the pipelined reader.

Same files, same key and shape semantics as the stock ``sharded_state`` loader (every key
must exist in the model, every parameter must be loaded, a smaller tensor is narrowed into
its parameter with a warning); what differs is how bytes move (``reader.py``) and that a
key mismatch is refused, naming the keys, before the first data byte is read.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch
from modelstage.core.errors import ArtifactError
from modelstage.core.formats import FORMATS
from modelstage.core.integrity import ChunkMismatch
from modelstage.core.node_cache import CORRUPT, HIT, MISS
from modelstage.core.s3_client import S3Client
from modelstage.core.safetensors_format import TensorInfo
from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

from .base import (
    STREAM,
    ModelstageLoader,
    Transfer,
    tensor_parallel_rank_and_size,
    vllm_version,
    weights_location,
)
from .checks import (
    REFUSING,
    VerifiedArtifact,
    content_checker,
    refuse,
    verify_local,
    verify_s3,
)
from .node_copy import choose_node_copy
from .reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes, staging_for
from .settings import PluginSettings, local_reads, serving_s3_options
from .stores import S3Objects, store_for

LOG = logging.getLogger("vllm.modelstage")


def verify_rank_files(
    loader: ModelstageLoader,
    location: str,
    running_tp: int,
    vllm_version: str,
    *,
    node_copy: bool = True,
) -> VerifiedArtifact:
    """Checks of a per-rank artifact whose stock loader is a ``ShardedStateLoader``: local,
    or on S3 where the loader reads object storage itself; with a node cache configured, a
    loader that reads the verified files itself and ``node_copy``, this node's copy when it is
    the artifact (a local directory, whatever the artifact's kind). A node copy that is the
    artifact's but fails these checks is read past: the artifact instead (``CORRUPT``)."""
    assert isinstance(loader.stock, ShardedStateLoader)
    settings = loader.settings
    rank_glob = rank_file_glob(loader.stock)

    def local(directory: Path) -> VerifiedArtifact:
        return verify_local(
            directory,
            load_format=loader.load_format,
            settings=settings,
            running_tp=running_tp,
            vllm_version=vllm_version,
            rank_glob=rank_glob,
            running_pp=loader.running_pp,
        )

    on_s3 = loader.reads_s3 and location.startswith("s3://")
    s3 = _s3_client(location, settings) if on_s3 else None
    outcome = ""
    if settings.node_cache is not None and loader.reads_node_copy and node_copy:
        node = choose_node_copy(Path(settings.node_cache), settings.digest, location, s3)
        outcome = MISS
        if node.path is not None:
            try:
                return replace(local(node.path), node_cache=HIT)
            except ArtifactError as e:
                outcome = corrupt_node_copy(str(e).removeprefix(REFUSING), node.path)
    elif settings.node_cache is not None and loader.reads_node_copy:
        outcome = CORRUPT
    if s3 is not None:
        verified = verify_s3(
            location,
            s3,
            load_format=loader.load_format,
            settings=settings,
            running_tp=running_tp,
            vllm_version=vllm_version,
            rank_glob=rank_glob,
            running_pp=loader.running_pp,
        )
    else:
        verified = local(loader.verify_local_location(location))
    return replace(verified, node_cache=outcome) if outcome else verified


def corrupt_node_copy(detail: str, directory: Path) -> str:
    """The node copy was the artifact's and failed its verification (``detail``: the file and
    what is wrong; bit rot, a torn or overwritten file on the node): never served, logged as an
    error with what to do, and the artifact read instead, so that a bad node disk costs one
    slower start, not a crash loop and a rollback of a good artifact."""
    for suffix in (": re-stage it", "; re-stage"):
        detail = detail.removesuffix(suffix)
    LOG.error(
        "modelstage: node cache: %s: %s; reading the artifact instead", detail,
        node_copy_remedy(directory),
    )  # fmt: skip
    return CORRUPT


def _s3_client(location: str, settings: PluginSettings) -> S3Client:
    try:
        return S3Client(serving_s3_options(), concurrency=settings.s3_depth)
    except ImportError as e:
        reason = f"the S3 reader needs boto3 ({e}); vLLM's images ship it: install it, "
        raise refuse(location, reason + "or unset MODELSTAGE_S3_READER to use Run:ai") from None


def rank_file_glob(stock: ShardedStateLoader) -> str:
    """This rank's part files, as the stock loader globs them: vLLM 0.32 renders its pattern
    with the TP and PP ranks (and validates it); 0.28 to 0.31 format their one pattern with
    the TP rank only."""
    render = getattr(ShardedStateLoader, "_render_default_pattern", None)
    if render is not None:
        rendered: str = render(stock.pattern, part="*")
        return rendered
    from vllm.distributed import get_tensor_model_parallel_rank

    pattern: str = stock.pattern
    return pattern.format(rank=get_tensor_model_parallel_rank(), part="*")


class ModelstageShardedStateLoader(ModelstageLoader):
    format = FORMATS["sharded_state"]
    stock_class = ShardedStateLoader
    streams_verification: ClassVar[bool] = True
    reads_node_copy: ClassVar[bool] = True

    def verify(self, location: str, running_tp: int, vllm_version: str) -> VerifiedArtifact:
        return verify_rank_files(self, location, running_tp, vllm_version)

    def transfer(
        self, model: nn.Module, model_config: ModelConfig, verified: VerifiedArtifact
    ) -> Transfer:
        state_dict = ShardedStateLoader._filter_subtensors(model.state_dict())
        check_keys(verified.location, verified.tensor_names, set(state_dict))
        device = next(iter(state_dict.values())).device
        store = store_for(verified)
        on_s3 = isinstance(store, S3Objects)
        checker = content_checker(verified) if self.verification == STREAM else None
        if on_s3:
            chunk_bytes, depth = self.settings.s3_chunk_bytes, self.settings.s3_depth
        else:
            chunk_bytes, depth = local_reads(
                self.settings, checker.read_bytes(1) if checker else None
            )
        buffered = device.type == "cuda"  # reads into reused buffers, which hold whole chunks
        reader = PipelinedReader(
            chunk_bytes=checker.read_bytes(chunk_bytes) if checker and buffered else chunk_bytes,
            depth=depth,
            device=device,
        )
        try:
            stats = reader.read(
                store, lambda info: target_for(info, state_dict[info.name]), checker
            )
        except ChunkMismatch as e:
            if verified.node_cache != HIT:
                raise refuse(e.where, f"{e.reason}: re-stage it") from None
            corrupt_node_copy(f"{e.where}: {e.reason}", Path(verified.location))
            # Every parameter is written again by the artifact's files (check_keys: the
            # same keys), so what the corrupt copy had put in place is overwritten.
            again = verify_rank_files(
                self, weights_location(model_config), tensor_parallel_rank_and_size()[1],
                vllm_version(), node_copy=False,
            )  # fmt: skip
            return replace(self.transfer(model, model_config, again), node_cache=CORRUPT)
        verified_note = (
            f", every byte verified ({checker.stats.seconds:.2f} s of hashing)" if checker else ""
        )
        LOG.info(
            "modelstage: read %d bytes of %s with the %s reader in %.2f s%s",
            stats.bytes,
            verified.location,
            "S3" if on_s3 else "local",
            stats.read_seconds,
            verified_note,
        )
        return Transfer(
            bytes=stats.bytes,
            files=stats.files,
            read_seconds=stats.read_seconds,
            copy_seconds=stats.copy_seconds,
            read_wait_seconds=stats.wait_seconds,
            verified_bytes=checker.stats.bytes if checker else 0,
            hash_seconds=checker.stats.seconds if checker else 0.0,
        )


def node_copy_remedy(directory: Path) -> str:
    return (
        f"the node-local copy {directory} is corrupt: the node agent's re-verification drops "
        "it and a copy Job copies it again"
    )


def check_keys(where: str, in_files: set[str], in_model: set[str]) -> None:
    """The stock loader's KeyError / "Missing keys", before any read, naming the keys."""
    unknown, missing = sorted(in_files - in_model), sorted(in_model - in_files)
    if unknown:
        raise refuse(
            where,
            f"the model has no parameter {', '.join(unknown[:5])}; the artifact "
            "was staged for another architecture or layout; re-stage",
        )
    if missing:
        raise refuse(
            where,
            f"the artifact lacks {', '.join(missing[:5])}; re-stage it for "
            "this model and vLLM version",
        )


def target_for(info: TensorInfo, param: torch.Tensor) -> Target:
    """Where ``info``'s bytes go in ``param``: straight into its memory when the bytes fit as
    they are, else through a staging tensor and ``copy_`` (the stock loader's semantics)."""
    data = param.data
    dtype = TORCH_DTYPES[info.dtype]
    if dtype != data.dtype:
        LOG.warning(
            "Attempted to load weight %s with dtype %s into parameter with dtype %s",
            info.name,
            dtype,
            data.dtype,
        )
    if len(info.shape) != data.dim():
        raise refuse(
            info.file,
            f"tensor {info.name!r} has shape {list(info.shape)}, the "
            f"parameter {list(data.shape)}; re-stage",
        )
    for dim, size in enumerate(info.shape):
        if size < data.shape[dim]:
            data = data.narrow(dim, 0, size)
    if tuple(info.shape) != tuple(param.shape):
        LOG.warning(
            "loading tensor of shape %s into parameter '%s' of shape %s",
            list(info.shape),
            info.name,
            list(param.shape),
        )
    if tuple(data.shape) != tuple(info.shape):
        raise refuse(
            info.file,
            f"tensor {info.name!r} of shape {list(info.shape)} is larger "
            f"than its parameter {list(param.shape)}; re-stage",
        )
    if dtype == data.dtype and data.is_contiguous():
        return Target(flat_bytes(data))
    return staging_for(info, data)
