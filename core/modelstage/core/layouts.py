"""vLLM's per-rank on-disk layout rules, versioned by the vLLM version they target.

Names and buffers change between vLLM releases, so every artifact records the layout version
it was written for, and the loader refuses one that does not match the running vLLM.
Torch-free: the operator uses this to compute digests.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecError


@dataclass(frozen=True)
class Layout:
    vllm_version: str
    layout_version: str
    vocab_padding: int
    """Vocab rows are padded with zeros to a multiple of this before the per-rank split."""
    attention_scale_buffers: tuple[str, ...]
    """0-d float32 buffers (value 1.0) that vLLM keeps under ``self_attn.attn`` per layer."""
    max_part_bytes: int = 5 * 1024**3


LAYOUTS: dict[str, Layout] = {
    "0.32": Layout(
        vllm_version="0.32",
        layout_version="vllm-0.32/1",
        vocab_padding=64,
        attention_scale_buffers=("_k_scale", "_v_scale", "_q_scale", "_prob_scale"),
    ),
}
DEFAULT_VLLM_VERSION = "0.32"


def layout_for(vllm_version: str | None) -> Layout:
    """The layout for a vLLM version, matched on major.minor ("0.32.1" -> "0.32")."""
    version = vllm_version or DEFAULT_VLLM_VERSION
    key = ".".join(version.split(".")[:2])
    try:
        return LAYOUTS[key]
    except KeyError:
        known = ", ".join(sorted(LAYOUTS))
        raise SpecError(
            f"vLLM version {version!r} has no known sharded layout; supported: {known}"
        ) from None
