"""The format table: everything modelstage knows about each artifact format, in one place.

A format is what ``--format`` (the stager), ``spec.loadFormat`` (the operator) and the
manifest's ``format`` name: which files the artifact holds, where it may be staged, which
writer produces it and which vLLM load format reads it. Every other module reads this table;
none decides by a format's name. Adding a format is a row here, a writer (if no existing one
fits) and its tests (docs/architecture.md).
"""

from __future__ import annotations

import re
from collections.abc import KeysView, Mapping
from dataclasses import dataclass
from enum import Enum

from .architectures import ARCHITECTURES, QUANTIZED, Architecture
from .errors import SpecError
from .layouts import DEFAULT_VLLM_VERSION, Layout, layout_for

LOCAL, S3, AZURE = "local", "s3", "az"
"""Where an artifact lives: a directory (a mounted PVC), an S3 prefix or an Azure Blob prefix
(``az://CONTAINER/PREFIX``)."""
OCI = "oci"
"""An OCI image in a registry: unpacked (an image volume) it is a directory, so it takes the
formats a local directory takes."""
PER_RANK_SAFETENSORS = re.compile(r"^model-(rank-\d+|pp-\d+-tp-\d+)-part-\d+\.safetensors$")
"""vLLM's ``ShardedStateLoader`` names (the pipeline-parallel spelling included)."""
PP_RANK_FILE = "model-pp-{pp_rank}-tp-{rank}-part-{part}.safetensors"
"""vLLM 0.32's ``ShardedStateLoader`` pattern when the pipeline has more than one stage."""


class S3Env(Enum):
    """Variables every S3 reader in a serving pod gets (each set when the ModelDeployment's S3
    connection has that setting; credentials by a reference to its Secret). A format whose
    loader reads one under a name of its own copies it (``Format.s3_serving_env``)."""

    ENDPOINT = "AWS_ENDPOINT_URL"
    CA_BUNDLE = "AWS_CA_BUNDLE"
    ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
    SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"


@dataclass(frozen=True)
class Format:
    name: str
    per_rank: bool
    """Each tensor-parallel rank reads files of its own, split here (else vLLM splits the
    checkpoint's own files at load)."""
    writer: str
    """The stager writer that produces it (``modelstage.stager.writers``)."""
    rank_file: str | None
    """``str.format`` pattern (``rank``, ``part``) of a rank's files; None: not per rank."""
    weight_files: re.Pattern[str]
    """The weight files a manifest of this format may list (besides the carried-over files)."""
    destinations: tuple[str, ...]
    """Where ``modelstage stage --out`` may write it (``LOCAL``, ``S3``)."""
    storage: tuple[str, ...]
    """Where a ModelDeployment may keep it (``pvc``, ``s3``): where vLLM can load it from in
    a pod (vLLM 0.32 refuses ``--model s3://`` but for its Run:ai formats; the Run:ai formats
    are offered for S3 only, where they pay off)."""
    scale_out: bool
    """An Indexed Job's workers can write its files in parallel (``stage --group i/n``)."""
    casts: bool
    """The bytes can be cast to another dtype while staging (``--dtype``); else ``auto``."""
    stock_loader: str
    """vLLM's ``--load-format`` name for it."""
    plugin_loader: str | None
    """The modelstage plugin's load format for it (None: served by vLLM's own loader)."""
    loads: tuple[str, ...]
    """Artifact formats its loaders read (the per-rank safetensors formats share one layout)."""
    pp_rank_file: str | None = None
    """The pattern (``pp_rank``, ``rank``, ``part``) of a rank's files when the pipeline has
    more than one stage, where the layout's vLLM names them so (``Layout.pp_rank_files``);
    None: its vLLM loader cannot tell the stages' files apart (pipeline parallel size 1 only)."""
    extra_config_keys: frozenset[str] = frozenset()
    """The user's ``--model-loader-extra-config`` keys kept on rollout (file-naming keys such as
    ``pattern`` are dropped: the artifact's layout is fixed; credentials never go on a command
    line)."""
    vllm_extra_config: tuple[tuple[str, str], ...] = ()
    """Loader extra-config the rollout sets, ``{artifact}`` replaced by the artifact's path."""
    s3_serving_env: tuple[tuple[str, S3Env], ...] = ()
    """Variables of its own the serving pod gets when the artifact is on S3: each a copy of
    one every S3 reader gets (``S3Env``), under the name this format's loader reads."""
    index_file: bool = False
    """The artifact carries the checkpoint's ``model.safetensors.index.json``."""
    splits_quantized: bool = False
    """A per-rank format that takes checkpoints of ``PER_RANK_QUANTIZATIONS`` (their rank
    files are proven against vLLM's own loaders); the other per-rank formats refuse them."""

    def vllm_load_format(self, *, plugin: bool, local: bool) -> str:
        """vLLM's ``--load-format`` for an artifact of this format: the plugin's loader when
        the plugin is on and the artifact is a local path (vLLM 0.32 refuses ``--model s3://``
        with any load format but its own Run:ai names, before a plugin loader could run)."""
        chosen = self.plugin_loader if plugin and local else None
        return chosen or self.stock_loader

    def vllm_loader_config(self, artifact_path: str) -> dict[str, str]:
        """The ``--model-loader-extra-config`` the format needs for the artifact at
        ``artifact_path`` (the operator's rollout and ``serve-local`` give the same)."""
        return {key: value.format(artifact=artifact_path) for key, value in self.vllm_extra_config}

    def rank_file_name(self, rank: int, part: int = 0, pp_rank: int = 0, pp: int = 1) -> str:
        """The one naming function of rank files: tensor-parallel ``rank`` of pipeline stage
        ``pp_rank`` of ``pp``."""
        return self._pattern(pp).format(pp_rank=pp_rank, rank=rank, part=part)

    def rank_glob(self, rank: int, pp_rank: int = 0, pp: int = 1) -> str:
        """A glob of the rank's files (every part)."""
        return self._pattern(pp).format(pp_rank=pp_rank, rank=rank, part="*")

    def is_rank_file(self, name: str, rank: int, pp_rank: int = 0, pp: int = 1) -> bool:
        """Whether ``name`` is one of the rank's files (any part)."""
        if self.rank_file is None or (pp > 1 and self.pp_rank_file is None):
            return False
        marker = "\0part\0"
        pattern = re.escape(self._pattern(pp).format(pp_rank=pp_rank, rank=rank, part=marker))
        return re.fullmatch(pattern.replace(re.escape(marker), r"\d+"), name) is not None

    def _pattern(self, pp: int) -> str:
        if self.rank_file is None:
            raise ValueError(f"format {self.name} has no per-rank files")
        if pp == 1:
            return self.rank_file
        if self.pp_rank_file is None:
            raise ValueError(f"format {self.name} has no files per pipeline stage")
        return self.pp_rank_file

    def check_pipeline(self, pp: int, layout: Layout) -> None:
        """Refuse a pipeline parallel size whose rank files this format's vLLM loader of the
        layout's release cannot tell apart, saying what would work."""
        if pp == 1 or not self.per_rank:
            return
        if self.pp_rank_file is None:
            takes = [f.name for f in FORMATS.values() if f.pp_rank_file is not None]
            raise SpecError(
                f"format {self.name}: vLLM's loader names a rank's file by its tensor-parallel "
                f"rank alone, so pipeline stages would read one file; with --pp {pp} use "
                f"--format {' or '.join(takes)}, or a Hugging Face layout format"
            )
        if not layout.pp_rank_files:
            raise SpecError(
                f"vLLM {layout.vllm_version}'s sharded-state loader names a rank's files by "
                f"its tensor-parallel rank alone, so pipeline stages would read one file; "
                f"stage --pp {pp} for vLLM {DEFAULT_VLLM_VERSION} or use a Hugging Face "
                "layout format"
            )

    def check_destination(self, kind: str) -> None:
        """Refuse a destination this format cannot be staged to, saying what would work."""
        if kind in self.destinations:
            return
        same = [
            f"{f.name} (the same per-rank files)"
            for f in FORMATS.values()
            if kind in f.destinations and f.loads == self.loads
        ]
        copies = [f.name for f in FORMATS.values() if kind in f.destinations and not f.per_rank]
        names = {LOCAL: "local directories", S3: "S3", AZURE: "Azure Blob"}
        where = " or ".join(
            names[d] for d in self.destinations if d != LOCAL or len(self.destinations) == 1
        )
        raise SpecError(
            f"format {self.name} is read from {where} only; stage to {names.get(kind, kind)} with "
            f"--format {' or '.join(same + copies)}"
        )


RUNAI_KEYS = frozenset({"distributed", "concurrency", "memory_limit"})

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            name="sharded_state",
            per_rank=True,
            writer="rank_files",
            rank_file="model-rank-{rank}-part-{part}.safetensors",
            pp_rank_file=PP_RANK_FILE,
            weight_files=PER_RANK_SAFETENSORS,
            destinations=(LOCAL,),  # vLLM's ShardedStateLoader reads local directories only
            storage=("pvc",),
            scale_out=True,
            casts=True,
            stock_loader="sharded_state",
            plugin_loader="modelstage_sharded_state",
            loads=("sharded_state", "runai_streamer_sharded"),
            splits_quantized=True,
        ),
        Format(
            name="runai_streamer",
            per_rank=False,
            writer="hf_copy",
            rank_file=None,
            weight_files=re.compile(r"^.+\.safetensors$"),
            destinations=(LOCAL, S3, AZURE),  # vLLM reads az:// with Run:ai's Azure backend
            storage=("s3",),
            scale_out=False,
            casts=False,  # the checkpoint as it is; vLLM casts at load with its own --dtype
            stock_loader="runai_streamer",
            plugin_loader="modelstage_runai_streamer",
            loads=("runai_streamer",),
            extra_config_keys=RUNAI_KEYS,
            index_file=True,
        ),
        Format(
            name="runai_streamer_sharded",
            per_rank=True,
            writer="rank_files",
            rank_file="model-rank-{rank}-part-{part}.safetensors",
            pp_rank_file=PP_RANK_FILE,
            weight_files=PER_RANK_SAFETENSORS,
            # vLLM 0.32's sharded-state loader lists rank files on s3:// only; the Azure
            # artifact is the same bytes, for a reader that lists az:// (README).
            destinations=(LOCAL, S3, AZURE),
            storage=("s3",),
            scale_out=True,
            casts=True,
            stock_loader="runai_streamer_sharded",
            plugin_loader="modelstage_runai_streamer_sharded",
            loads=("sharded_state", "runai_streamer_sharded"),
            splits_quantized=True,
            # vLLM serves it with its ShardedStateLoader, which refuses every extra-config key
            # but `pattern` (fixed by the layout): Run:ai tuning goes by RUNAI_* env.
        ),
        Format(
            name="safetensors",
            per_rank=False,
            writer="hf_copy",
            rank_file=None,
            weight_files=re.compile(r"^.+\.safetensors$"),
            destinations=(LOCAL,),  # vLLM's default loader reads local directories only
            storage=("pvc",),
            scale_out=False,
            casts=False,  # the checkpoint as it is; vLLM casts at load with its own --dtype
            stock_loader="safetensors",
            plugin_loader="modelstage_safetensors",
            loads=("safetensors",),
            # What vLLM's default loader accepts (it refuses any other key).
            extra_config_keys=frozenset(
                {"enable_multithread_load", "num_threads", "enable_weights_track"}
            ),
            index_file=True,
        ),
        Format(
            name="tensorizer",
            per_rank=True,
            writer="tensorizer",
            rank_file="model-rank-{rank:03d}.tensors",
            pp_rank_file=None,  # vLLM formats its tensorizer_uri with the TP rank alone
            weight_files=re.compile(r"^model-rank-\d+\.tensors$"),
            destinations=(LOCAL, S3),
            storage=("pvc", "s3"),
            scale_out=False,
            casts=True,
            stock_loader="tensorizer",
            plugin_loader=None,
            loads=("tensorizer",),
            extra_config_keys=frozenset(
                {
                    "verify_hash",
                    "num_readers",
                    "encryption_keyfile",
                    "stream_kwargs",
                    "deserialization_kwargs",
                }
            ),
            # vLLM formats `% rank` into the URI it is given.
            vllm_extra_config=(("tensorizer_uri", "{artifact}/model-rank-%03d.tensors"),),
            # vLLM's tensorizer reads S3 settings from variables of its own (vllm/envs.py), but
            # vLLM 0.32 does not hand those to tensorizer's open_stream: tensorizer then takes
            # the endpoint from AWS_ENDPOINT_URL and boto3 the credentials from AWS_*, and it
            # downloads with the curl binary, which trusts a CA only via CURL_CA_BUNDLE.
            s3_serving_env=(
                ("CURL_CA_BUNDLE", S3Env.CA_BUNDLE),
                ("S3_ENDPOINT_URL", S3Env.ENDPOINT),
                ("S3_ACCESS_KEY_ID", S3Env.ACCESS_KEY_ID),
                ("S3_SECRET_ACCESS_KEY", S3Env.SECRET_ACCESS_KEY),
            ),
        ),
    )
}
"""Every format, in the order ``--format`` and the CRD list them."""
S3_READER_FORMAT = "runai_streamer_sharded"
"""The stock load format the plugin's own S3 reader takes over (``MODELSTAGE_S3_READER=1``):
vLLM 0.32 accepts ``--model s3://`` only with its Run:ai names, so the plugin registers its
reader under this one."""


def format_for(name: str) -> Format:
    """The format called ``name``; ``SpecError`` naming the supported ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise SpecError(
            f"format {name!r} is not supported; supported: {', '.join(FORMATS)}"
        ) from None


def plugin_load_formats() -> dict[str, tuple[str, ...]]:
    """Each load format the plugin registers -> the artifact formats it can load."""
    found = {f.plugin_loader: f.loads for f in FORMATS.values() if f.plugin_loader}
    return {**found, S3_READER_FORMAT: FORMATS[S3_READER_FORMAT].loads}


PER_RANK_ARCHITECTURES: KeysView[str] = ARCHITECTURES.keys()
"""The architectures the stager splits per rank: the family table's names (a view, never a
copy), by which ``loadFormat: auto`` decides."""
PER_RANK_QUANTIZATIONS: Mapping[str, Mapping[str, Architecture]] = QUANTIZED
"""Quantization -> the architectures whose checkpoints in it the stager splits per rank (the
family table's quantized rows, by name)."""
AUTO = "auto"
"""``loadFormat: auto``: per-rank staging where the stager can split the checkpoint, the
Hugging Face layout otherwise (``choose_format``)."""
AUTO_FORMATS = {
    ("pvc", True): "sharded_state",
    ("pvc", False): "safetensors",
    ("s3", True): "runai_streamer_sharded",
    ("s3", False): "runai_streamer",
}
"""(storage, per rank) -> the format ``auto`` picks."""


@dataclass(frozen=True)
class Choice:
    """The format ``auto`` picked and why, in words for the status."""

    format: str
    reason: str


def choose_format(
    storage: str,
    architecture: str | None,
    quantization: str | None,
    vllm_version: str | None = None,
) -> Choice:
    """``loadFormat: auto`` for a checkpoint of ``architecture`` (config.json's), quantized
    by ``quantization`` (its ``quant_method``; None: unquantized) kept on ``storage`` (``pvc``
    or ``s3``) for vLLM ``vllm_version`` (None: the default): per rank when the stager has
    rules for it, proven for that vLLM, the Hugging Face layout otherwise."""
    layout = layout_for(vllm_version)
    if architecture is None:
        why = "config.json names no single architecture"
    elif quantization is not None and quantization not in PER_RANK_QUANTIZATIONS:
        why = f"the checkpoint is quantized ({quantization}), which is not split per rank"
    elif quantization is not None and architecture not in PER_RANK_QUANTIZATIONS[quantization]:
        why = f"architecture {architecture} has no per-rank rules for {quantization}"
    elif architecture not in PER_RANK_ARCHITECTURES:
        why = f"architecture {architecture} has no per-rank rules"
    elif not layout.splits(architecture):
        why = f"architecture {architecture} is not proven per rank for vLLM {layout.vllm_version}"
    else:
        name = AUTO_FORMATS[(storage, True)]
        what = architecture + (f" ({quantization})" if quantization else "")
        return Choice(name, f"architecture {what} is split per rank: staged as {name}")
    name = AUTO_FORMATS[(storage, False)]
    return Choice(name, f"{why}: cached in the Hugging Face layout ({name})")
