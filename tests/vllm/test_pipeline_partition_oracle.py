"""The layer partition of ``core/pipeline_parallel.py`` equals vLLM's own ``get_pp_indices``
for every (layers, pipeline size, rank), with and without ``VLLM_PP_LAYER_PARTITION``."""

from __future__ import annotations

import itertools
import random

import pytest
from modelstage.core.errors import SpecError
from modelstage.core.pipeline_parallel import PARTITION_ENV, parse_layer_partition, stage_layers

pytestmark = pytest.mark.vllm


def test_the_default_partition_equals_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.delenv(PARTITION_ENV, raising=False)
    for layers, pp in itertools.product(range(1, 97), range(1, 17)):
        for rank in range(pp):
            assert stage_layers(layers, rank, pp) == get_pp_indices(layers, rank, pp), (
                layers, pp, rank,
            )  # fmt: skip


def test_an_explicit_partition_equals_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import get_pp_indices

    rng = random.Random(35)
    for _ in range(400):
        pp = rng.randint(1, 8)
        counts = [rng.randint(0, 9) for _ in range(pp)]
        text = ",".join(map(str, counts))
        monkeypatch.setenv(PARTITION_ENV, text)
        layers = sum(counts)
        for rank in range(pp):
            ours = stage_layers(layers, rank, pp, parse_layer_partition(text))
            assert ours == get_pp_indices(layers, rank, pp), (text, rank)


@pytest.mark.parametrize(("text", "layers", "pp"), [("3,3,2", 8, 2), ("3,4", 8, 2)])
def test_a_partition_vllm_refuses_is_refused(
    monkeypatch: pytest.MonkeyPatch, text: str, layers: int, pp: int
) -> None:
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.setenv(PARTITION_ENV, text)
    with pytest.raises(ValueError):
        get_pp_indices(layers, 0, pp)
    with pytest.raises(SpecError):
        stage_layers(layers, 0, pp, parse_layer_partition(text))
