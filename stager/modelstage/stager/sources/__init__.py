"""Where a checkpoint's bytes come from: one strategy per file behind ``Source``, and the
URI -> source registry (a new source is a module here and a line in ``SCHEMES``)."""

from __future__ import annotations

import importlib
from typing import Any

from modelstage.core.errors import CheckpointError
from modelstage.core.formats import LOCAL
from modelstage.core.location import parse_location

from .base import Source
from .local import LocalSource

__all__ = ["Source", "open_source"]

SCHEMES: dict[str, str] = {
    "hf": ".hf:HfSource",
    "s3": ".s3:S3Source",
    "az": ".azure:AzureSource",
    "oci": ".oci:OciSource",
}
"""URI scheme -> ``module:class`` in this package; each class has ``from_uri(uri, **options)``.
Imported lazily, so that a local stage never imports boto3, the Azure SDK or huggingface_hub."""


def open_source(uri: str, **options: Any) -> Source:
    """The source for a URI: a local path (or ``file://``), or a scheme from ``SCHEMES``.

    ``options`` are the request's source settings (``revision``, ``s3``, ``azure``,
    ``hf_token_file``, ``cache_dir``, the resolved hf ``commit``); each source takes the ones it
    understands and ignores the rest.
    """
    location = parse_location(uri)
    if location.kind == LOCAL:
        return LocalSource(str(location.path))
    scheme = location.kind
    if scheme == "pvc":
        raise CheckpointError(
            f"{uri}: pvc:// sources are read where the claim is mounted; pass the mount path as "
            "SOURCE and the pvc:// URI as --source-uri (the operator does this)"
        )
    target = SCHEMES.get(scheme)
    if target is None:
        raise CheckpointError(
            f"source scheme {scheme}:// is not supported by this stager; supported: a local "
            f"path, file://, {', '.join(s + '://' for s in SCHEMES)}"
        )
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module, __package__), name)
    source: Source = cls.from_uri(uri, **options)
    return source
