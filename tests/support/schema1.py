"""Artifacts as a schema-1 stager wrote them (a sha256 per file, no chunk hashes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from modelstage.core.manifest import MANIFEST


def schema1_doc(doc: dict[str, object], contents: dict[str, bytes]) -> bytes:
    """``doc`` (a schema-2 manifest) rewritten as schema 1 from the files' ``contents``."""
    files = doc["files"]
    assert isinstance(files, dict)
    doc = {**doc, "schemaVersion": 1, "files": {
        name: {"size": entry["size"], "sha256": hashlib.sha256(contents[name]).hexdigest()}
        for name, entry in files.items()
    }}  # fmt: skip
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def downgrade_to_schema1(directory: Path) -> None:
    """Rewrite a local artifact's manifest as schema 1 (the files stay as they are)."""
    doc = json.loads((directory / MANIFEST).read_text())
    contents = {name: (directory / name).read_bytes() for name in doc["files"]}
    (directory / MANIFEST).write_bytes(schema1_doc(doc, contents))
