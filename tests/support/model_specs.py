"""A valid ModelDeployment spec and the merge that tests vary it with (the operator's and the
API's tests)."""

from __future__ import annotations

import copy
from typing import Any

BASE_SPEC: dict[str, Any] = {
    "model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "credentialsSecret": "hf-token"},
    "parallelism": {"tensor": 2},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "models", "path": "/artifacts"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm-llama"}, "containerName": "vllm"},
}


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in; a None value deletes the key (merge-patch style)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
