"""The artifact digest: a pure function of what changes the staged bytes.

The operator computes it from the spec alone (it never sees the source), the stager records it
in the manifest, and artifacts are stored under it, so equal requests share one artifact.
"""

from __future__ import annotations

import hashlib
import json

DIGEST_HEX_CHARS = 20
"""80 bits: collision-safe per namespace, short enough for Kubernetes names (<= 63 chars)."""


def artifact_digest(
    *,
    uri: str,
    revision: str | None,
    tensor_parallel: int,
    pipeline_parallel: int,
    dtype: str,
    load_format: str,
    layout_version: str,
) -> str:
    """Hex digest over the canonical JSON of the inputs; field order cannot change it."""
    canonical = json.dumps(
        {
            "uri": uri.rstrip("/"),
            "revision": revision or "",
            "tp": tensor_parallel,
            "pp": pipeline_parallel,
            "dtype": dtype,
            "format": load_format,
            "layout": layout_version,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_HEX_CHARS]
