"""Where an artifact is written: one strategy per file behind ``Destination``."""
