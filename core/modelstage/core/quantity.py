"""Byte sizes as the command lines and the chart give them: plain bytes or Kubernetes-style
suffixes (one reader for the stager's and the node agent's flags)."""

from __future__ import annotations

import re

from .errors import SpecError

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKMGT]i?)?B?\s*$")
_UNITS = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip


def parse_bytes(text: str, flag: str) -> int:
    """``5368709120``, ``50M`` (10^6), ``512Mi`` (2^20), ``1G``, ``1Gi``: as Kubernetes reads
    quantities (the CRD's sizes use the same suffixes)."""
    match = _SIZE.match(text)
    if match is None:
        raise SpecError(
            f"{flag} {text!r}: expected a number of bytes, e.g. 5368709120, 50M (10^6 bytes) "
            "or 512Mi (2^20 bytes)"
        )
    number, unit = match.groups()
    value = float(number) * (_UNITS[unit] if unit else 1)
    if value < 1 or not value.is_integer():
        raise SpecError(f"{flag} {text!r}: must be a positive whole number of bytes")
    return int(value)
