"""Where an artifact is written: one strategy per file behind ``Destination``, and the
location -> destination registry (``open_destination``)."""

from __future__ import annotations

from modelstage.core.errors import SpecError
from modelstage.core.formats import LOCAL, OCI, S3, Format
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
) -> Destination:
    """The destination strategy for ``--out``: an S3 prefix, an OCI image tag or a local
    directory."""
    location = parse_location(out)
    if location.kind == OCI:
        fmt.check_destination(LOCAL)  # an image is unpacked (or mounted) as a directory
        from .oci import OciDestination

        open_files = tp if fmt.per_rank else 1
        return OciDestination(out, oci, form=oci_form or "modelpack", open_files=open_files)
    if location.kind == S3:
        fmt.check_destination(S3)
        from .s3 import S3Destination

        # A per-rank writer has every rank's file open at once.
        return S3Destination(out, s3, open_files=tp if fmt.per_rank else 1)
    if location.kind != LOCAL:
        raise SpecError(
            f"--out {out!r}: only s3:// and oci:// URIs and local paths are supported"
        )
    return LocalDestination(str(location.path))
