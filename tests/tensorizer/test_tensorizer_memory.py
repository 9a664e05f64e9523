"""The tensorizer writer's memory does not grow with the model's largest tensor.

A tensorizer record's header holds the hashes of its data and precedes it; gathering each
rank's share of a tensor whole before writing it made the stager's peak RSS grow with an MoE
layer's expert stack (a rank's ``w13_weight`` is ``E x 2I/tp x H``). Measured as the peak RSS
(``VmHWM``, the stager's own summary line) of two stager processes on two Mixtral-shaped
checkpoints that differ only in the experts' size (8x), compared with each other: no timing,
and a margin far from both the bound and what gathering whole tensors costs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from modelstage.devtools.measure import run_child, stager_argv
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint

MiB = 1024 * 1024


def mixtral(intermediate: int) -> SyntheticModel:
    return SyntheticModel(
        architecture="MixtralForCausalLM", hidden_size=512, intermediate_size=intermediate,
        num_layers=1, num_heads=8, num_kv_heads=2, vocab_size=1000, num_experts=8,
        dtype="bfloat16", seed=13,
    )  # fmt: skip


@pytest.mark.parametrize("fmt", ["tensorizer", "sharded_state"])
def test_peak_rss_stays_flat_when_the_expert_stack_grows_eightfold(
    tmp_path: Path, fmt: str
) -> None:
    """Experts of 48 MiB and of 384 MiB per layer (a rank's ``w13_weight`` 16 and 128 MiB
    at TP 2): gathering each rank's stack whole adds ~220 MiB to the larger run."""
    peaks = []
    for intermediate in (2048, 16384):
        src = write_checkpoint(mixtral(intermediate), tmp_path / f"src-{intermediate}")
        out = tmp_path / f"out-{intermediate}"
        _, peak = run_child(stager_argv(src, out, 2, "--format", fmt, "--dtype", "auto"))
        assert peak > 0, "the stager reports its peak RSS"
        peaks.append(peak)
    growth = peaks[1] - peaks[0]
    assert growth < 64 * MiB, (
        f"{fmt}: peak RSS {peaks[0] / MiB:.0f} MiB -> {peaks[1] / MiB:.0f} MiB "
        "with experts 8x larger"
    )
