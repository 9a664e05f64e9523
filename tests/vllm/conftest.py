"""Session fixtures of the vLLM oracle tier: generated checkpoints and staged artifacts are
made once per session and shared by every test that needs them; vLLM starts are timed and
listed at the end of the run (each start costs 20-60 s on a 2-core machine)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint

# The tests import the oracle helpers as a top-level module: this folder cannot be imported
# as a package from `tests/` on sys.path, its name would shadow the real `vllm`.
sys.path.insert(0, str(Path(__file__).parent))
from vllm_oracle import VllmRun, stage

TIMINGS: list[tuple[str, VllmRun]] = []
"""(what, run) of every oracle vLLM run this session."""


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, SyntheticModel], Path]:
    """``checkpoint(name, spec)``: the generated checkpoint, written once per session."""
    made: dict[str, Path] = {}

    def get(name: str, spec: SyntheticModel) -> Path:
        if name not in made:
            made[name] = write_checkpoint(spec, tmp_path_factory.mktemp(f"ckpt-{name}"))
        return made[name]

    return get


@pytest.fixture(scope="session")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``staged(name, src, tp, *cli_args)``: the sharded_state artifact, staged once."""
    made: dict[tuple[str, int], Path] = {}

    def get(name: str, src: Path, tp: int, *cli_args: str) -> Path:
        if (name, tp) not in made:
            out = tmp_path_factory.mktemp(f"staged-{name}-tp{tp}") / "artifact"
            stage(src, out, tp, *cli_args)
            made[(name, tp)] = out
        return made[(name, tp)]

    return get


ROTATED = (
    "test_vllm_oracle.py", "test_layout_oracle.py", "test_layout_oracle_pp.py", "test_vllm_pp.py",
    "test_s3_engine_cache_vllm.py", "test_oci_vllm.py", "test_azure_vllm.py",
)  # fmt: skip
"""The files whose slow cases CI rotates (``MODELSTAGE_CI_ROTATION``, set by ``.ci/run``):
the end-to-end oracle, the layout oracles (per rank and per pipeline stage) and the vLLM runs
on S3, OCI and Azure artifacts, each case a vLLM start or more. The hook sees every item of
the session, whatever its folder."""


def rotation(value: str) -> tuple[int, int]:
    """``"k/n"``: slot ``k`` of ``n``."""
    slot, _, slots = value.partition("/")
    if not (slot.isdigit() and slots.isdigit() and int(slot) < int(slots)):
        raise pytest.UsageError(
            f"MODELSTAGE_CI_ROTATION={value!r}: must be SLOT/SLOTS, 0 <= SLOT < SLOTS"
        )
    return int(slot), int(slots)


def rotated_out(items: list[pytest.Item], slot: int, slots: int) -> list[pytest.Item]:
    """The slow cases of the rotated files not in ``slot``: of those cases in node-id order,
    the ``i``-th belongs to slot ``i % slots``, so ``slots`` consecutive slots run each once."""
    cases = sorted(
        (i for i in items if i.path.name in ROTATED and i.get_closest_marker("slow")),
        key=lambda i: i.nodeid,
    )
    return [item for n, item in enumerate(cases) if n % slots != slot]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    value = os.environ.get("MODELSTAGE_CI_ROTATION")
    if not value:
        return
    out = {id(i) for i in rotated_out(items, *rotation(value))}
    if out:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in out])
        items[:] = [i for i in items if id(i) not in out]


@pytest.fixture(scope="session")
def timings() -> Iterator[list[tuple[str, VllmRun]]]:
    yield TIMINGS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    value = os.environ.get("MODELSTAGE_CI_ROTATION")
    if value:
        terminalreporter.write_line(
            f"slow cases of {', '.join(ROTATED)}: rotation slot {value} (MODELSTAGE_CI_ROTATION)"
        )
    chosen = os.environ.get("MODELSTAGE_VLLM_RELEASES")
    if chosen is not None:
        terminalreporter.write_line(
            f"vLLM releases besides the default proven in this run: {chosen} "
            "(MODELSTAGE_VLLM_RELEASES; unset, every release of the layout table)"
        )
    if not TIMINGS:
        return
    terminalreporter.section("vLLM oracle runs")
    for what, run in TIMINGS:
        took = "cached" if run.cached else f"{run.seconds:6.1f} s"
        waited = f"  (+{run.waited:.0f} s waiting for another vLLM)" if run.waited >= 1 else ""
        terminalreporter.write_line(f"{what:<55} {took}{waited}")
    fresh = sum(run.seconds for _, run in TIMINGS)
    terminalreporter.write_line(f"{'total of vLLM starts':<55} {fresh:6.1f} s")
