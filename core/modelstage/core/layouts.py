"""vLLM's per-rank on-disk layout rules, versioned by the vLLM version they target.

Names and buffers can change between vLLM releases, so every artifact records the layout
version it was written for, and the loader refuses one that does not match the running vLLM.
A layout version names a layout, not a release: the releases whose per-rank state was proven
equal (the layout oracle: each release's own weight loaders against the same checkpoints)
share one, so moving a workload between them restages nothing, and a release with another
layout gets a version of its own and a new artifact digest.
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
    pp_rank_files: bool = False
    """Its sharded-state loader names a rank's files by pipeline stage and tensor-parallel
    rank when the pipeline has more than one stage (``Format.pp_rank_file``); before 0.32 by
    the tensor-parallel rank alone, so stages collide and only pipeline size 1 is staged."""
    architectures: frozenset[str] | None = None
    """The architectures this release's per-rank state was proven for; None: every one of
    the stager's rule table (the release the rules are written and proven against). Any other
    is staged in the Hugging Face layout, which vLLM splits itself at load."""

    def splits(self, architecture: str) -> bool:
        """Whether ``architecture`` may be staged per rank for this release."""
        return self.architectures is None or architecture in self.architectures


LAYOUT_32 = "vllm-0.32/1"
"""The per-rank layout of vLLM 0.28 to 0.32 (named after the release it was first written
for): the same names, dtypes, shapes and values of every rank's state."""
PROVEN_BEFORE_32 = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)
"""The architectures whose per-rank state the layout oracle proved equal to 0.32's on the
older releases (tests/vllm/test_vllm_versions.py)."""


def _shared_32(vllm_version: str) -> Layout:
    return Layout(
        vllm_version=vllm_version,
        layout_version=LAYOUT_32,
        vocab_padding=64,
        attention_scale_buffers=("_k_scale", "_v_scale", "_q_scale", "_prob_scale"),
        architectures=PROVEN_BEFORE_32,
    )


LAYOUTS: dict[str, Layout] = {
    "0.28": _shared_32("0.28"),
    "0.29": _shared_32("0.29"),
    "0.30": _shared_32("0.30"),
    "0.31": _shared_32("0.31"),
    "0.32": Layout(
        vllm_version="0.32",
        layout_version=LAYOUT_32,
        vocab_padding=64,
        attention_scale_buffers=("_k_scale", "_v_scale", "_q_scale", "_prob_scale"),
        pp_rank_files=True,
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
