"""Where an artifact is written: one strategy per file behind ``Destination``, and the
location -> destination registry (``open_destination``)."""

from __future__ import annotations

from modelstage.core.azure_client import AzureOptions
from modelstage.core.errors import SpecError
from modelstage.core.formats import AZURE, LOCAL, OCI, S3, Format
from modelstage.core.location import parse_location
from modelstage.core.oci_registry import RegistryOptions
from modelstage.core.s3_client import S3Options

from .base import Destination
from .local import LocalDestination

__all__ = ["Destination", "open_destination"]


def open_destination(
    out: str,
    fmt: Format,
    *,
    s3: S3Options | None,
    tp: int,
    oci: RegistryOptions | None = None,
    oci_form: str | None = None,
    azure: AzureOptions | None = None,
) -> Destination:
    """The destination strategy for ``--out``: an S3 or Azure Blob prefix, an OCI image tag or
    a local directory."""
    location = parse_location(out)
    # A per-rank writer has every rank's file open at once.
    open_files = tp if fmt.per_rank else 1
    if location.kind == OCI:
        fmt.check_destination(LOCAL)  # an image is unpacked (or mounted) as a directory
        from .oci import OciDestination

        return OciDestination(out, oci, form=oci_form or "modelpack", open_files=open_files)
    if location.kind == S3:
        fmt.check_destination(S3)
        from .s3 import S3Destination

        return S3Destination(out, s3, open_files=open_files)
    if location.kind == AZURE:
        fmt.check_destination(AZURE)
        from .azure import AzureDestination

        return AzureDestination(out, azure, open_files=open_files)
    if location.kind != LOCAL:
        raise SpecError(
            f"--out {out!r}: only s3://, az:// and oci:// URIs and local paths are supported"
        )
    return LocalDestination(str(location.path))
