"""``StageRequest``: what one ``modelstage stage`` (or ``resolve``, ``finalize``) is asked to do."""

from __future__ import annotations

from dataclasses import dataclass

from modelstage.core.azure_client import AzureOptions
from modelstage.core.oci_registry import RegistryOptions
from modelstage.core.s3_client import S3Options

from .network import Timeouts


@dataclass(frozen=True)
class StageRequest:
    source: str
    out: str
    tp: int
    pp: int = 1
    pp_partition: tuple[int, ...] | None = None
    """Decoder layers per pipeline stage, as the serving pods' ``VLLM_PP_LAYER_PARTITION``
    gives them (None: vLLM's default partition)."""
    dtype: str = "auto"
    format: str = "sharded_state"
    vllm_version: str | None = None
    digest: str | None = None
    """The operator passes its own (computed from the spec and the resolved source identity);
    the CLI computes it otherwise."""
    revision: str | None = None
    source_uri: str | None = None
    """The logical URI (e.g. ``pvc://claim/path``) when ``source`` is where it is mounted."""
    s3: S3Options | None = None
    """How to reach ``s3://`` sources and destinations (endpoint, region, addressing, CA,
    credentials)."""
    azure: AzureOptions | None = None
    """How to reach ``az://`` sources and destinations (default: the ``AZURE_STORAGE_*``
    variables, ``core/azure_client.py``)."""
    oci: RegistryOptions | None = None
    """How to reach ``oci://`` sources and destinations (credentials file, CA, insecure)."""
    oci_form: str | None = None
    """``--out oci://``: ``modelpack`` (default) or ``image`` (``core/oci_image.py``)."""
    hf_token_file: str | None = None
    """A mounted Secret holding a Hub token for ``hf://`` sources (default: ``HF_TOKEN``)."""
    cache_dir: str | None = None
    """The hub cache ``hf://`` sources download into (default: ``HF_HUB_CACHE``)."""
    timeouts: Timeouts | None = None
    """Connect/read timeouts and retries of Hub requests (default: ``MODELSTAGE_*`` or
    network.py's defaults); S3 takes its own from ``s3``."""
    max_part_bytes: int | None = None
    """Largest part file per rank (default: the layout's). It shapes the bytes: every
    worker and the finalize step of one artifact must use the same value."""
    allow_pickle: bool = False
    """Accept a checkpoint with only pickle weights, loaded with ``torch.load(weights_only=
    True)`` and converted to safetensors first (``sources/pickled.py``); refused by default."""
    expect_identity: str | None = None
    """The source identity resolved earlier (the operator's resolve step): a source that no
    longer has it is refused instead of staged under a digest that does not describe it."""
    force: bool = False
    """Replace an artifact already at ``out`` (another digest, or the same one re-staged)."""
    chunk_bytes: int | None = None
    """Chunk size of the files' content hashes (default ``integrity.DEFAULT_CHUNK_BYTES``)."""
