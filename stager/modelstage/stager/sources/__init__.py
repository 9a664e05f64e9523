"""Where a checkpoint's bytes come from: one strategy per file behind ``Source``."""

from .base import Source, open_source

__all__ = ["Source", "open_source"]
