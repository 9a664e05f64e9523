"""JSON merge patches (RFC 7386): computing one between two documents, and applying one.

The operator never sends strategic merge patches (their list semantics differ between API
servers and test servers). A merge patch replaces lists whole, so the rollout planner sends the
complete, edited lists of the pod template; applying such a patch twice changes nothing.
"""

from __future__ import annotations

import copy
from typing import Any


def merge_diff(old: Any, new: Any) -> Any:
    """The merge patch that turns ``old`` into ``new`` (``{}`` when they are equal).

    ``new`` must not hold nulls: in a merge patch a null deletes a key.
    """
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return copy.deepcopy(new)
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif old[key] != value:
            if isinstance(old[key], dict) and isinstance(value, dict):
                patch[key] = merge_diff(old[key], value)
            else:
                patch[key] = copy.deepcopy(value)
    return patch


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 ``MergePatch(target, patch)``; returns a new document."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result
