"""Where an artifact is written: one strategy per file behind ``Destination``, and the
location -> destination registry (``open_destination``)."""

from __future__ import annotations

from modelstage.core.azure_client import AzureOptions
from modelstage.core.errors import SpecError
from modelstage.core.formats import AZURE, LOCAL, S3, Format
from modelstage.core.location import parse_location
from modelstage.core.s3_client import S3Options

from .base import Destination
from .local import LocalDestination

__all__ = ["Destination", "open_destination"]


def open_destination(
    out: str, fmt: Format, *, s3: S3Options | None, tp: int, azure: AzureOptions | None = None
) -> Destination:
    """The destination strategy for ``--out``: an S3 or Azure Blob prefix or a local
    directory."""
    location = parse_location(out)
    # A per-rank writer has every rank's file open at once.
    open_files = tp if fmt.per_rank else 1
    if location.kind == S3:
        fmt.check_destination(S3)
        from .s3 import S3Destination

        return S3Destination(out, s3, open_files=open_files)
    if location.kind == AZURE:
        fmt.check_destination(AZURE)
        from .azure import AzureDestination

        return AzureDestination(out, azure, open_files=open_files)
    if location.kind != LOCAL:
        raise SpecError(f"--out {out!r}: only s3:// and az:// URIs and local paths are supported")
    return LocalDestination(str(location.path))
