from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint in three files, with q/k/v and gate/up spread across them."""
    spec = SyntheticModel(num_shards=3, split_fused=True)
    return write_checkpoint(spec, tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture
def make_ckpt(tmp_path: Path) -> Callable[..., Path]:
    def make(**kw: object) -> Path:
        return write_checkpoint(SyntheticModel(**kw), tmp_path / "ckpt")  # type: ignore[arg-type]

    return make
