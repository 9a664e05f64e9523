"""Where an artifact (or a checkpoint) is: a local directory or an S3 prefix, told apart once.

``parse_location`` reads the spellings every command takes (a path, ``file://PATH``,
``s3://BUCKET/PREFIX``, any other ``scheme://``); the callers say what they do with a scheme
they do not serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .formats import LOCAL, S3


@dataclass(frozen=True)
class Location:
    kind: str
    """``LOCAL``, ``S3``, or the URI's scheme when it is another one (``hf``, ``pvc``)."""
    text: str
    """As given."""

    @property
    def path(self) -> Path:
        """A local location's directory (``file://`` removed)."""
        return Path(self.text.removeprefix("file://"))


def parse_location(text: str) -> Location:
    if text.startswith("s3://"):
        return Location(S3, text)
    if "://" not in text or text.startswith("file://"):
        return Location(LOCAL, text)
    return Location(text.split("://", 1)[0], text)
