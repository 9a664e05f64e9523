"""vLLM's pipeline-parallel layer partition (``core/pipeline_parallel.py``), with golden
values worked out by hand from vLLM's rule: equal shares, the remainder one layer each to the
stages just before the last; an explicit partition as given. (``tests/vllm/
test_pipeline_partition_oracle.py`` holds the function equal to vLLM's own.)"""

from __future__ import annotations

import pytest
from modelstage.core.errors import SpecError
from modelstage.core.pipeline_parallel import (
    layer_partition,
    parse_layer_partition,
    stage_layers,
)


@pytest.mark.parametrize(
    ("layers", "pp", "counts"),
    [
        (4, 1, (4,)),
        (4, 2, (2, 2)),
        (5, 2, (3, 2)),  # one left over: the stage before the last
        (8, 4, (2, 2, 2, 2)),
        (5, 4, (1, 1, 2, 1)),  # one left over: stage 2 (just before the last)
        (6, 4, (1, 2, 2, 1)),  # two: stages 2 and 1; the first and the last keep their share
        (7, 4, (2, 2, 2, 1)),  # three: every stage but the last
        (2, 4, (0, 1, 1, 0)),  # fewer layers than stages: the edges hold none
        (32, 3, (11, 11, 10)),
        (61, 8, (7, 7, 8, 8, 8, 8, 8, 7)),  # 61 = 8*7 + 5: stages 6, 5, 4, 3, 2
    ],
)
def test_the_default_partition_is_vllms(layers: int, pp: int, counts: tuple[int, ...]) -> None:
    assert layer_partition(layers, pp) == counts
    starts = [sum(counts[:p]) for p in range(pp)]
    assert [stage_layers(layers, p, pp) for p in range(pp)] == [
        (s, s + c) for s, c in zip(starts, counts, strict=True)
    ]


def test_an_explicit_partition_is_taken_as_given() -> None:
    assert stage_layers(8, 0, 2, (3, 5)) == (0, 3)
    assert stage_layers(8, 1, 2, (3, 5)) == (3, 8)
    assert stage_layers(4, 1, 3, (2, 0, 2)) == (2, 2)  # an empty middle stage


def test_a_partition_is_parsed_as_vllm_reads_its_variable() -> None:
    assert parse_layer_partition("3,5") == (3, 5)
    assert parse_layer_partition(" 3, 5") == (3, 5)
    with pytest.raises(SpecError, match="comma-separated"):
        parse_layer_partition("3;5")
    with pytest.raises(SpecError, match="negative"):
        parse_layer_partition("9,-1")


@pytest.mark.parametrize(
    ("layers", "pp", "partition", "message"),
    [
        (8, 2, (3, 3, 2), "has 3 stages, but the pipeline parallel size is 2"),
        (8, 2, (3, 4), "holds 7 layers, but the model has 8"),
    ],
)
def test_a_partition_that_does_not_fit_is_refused(
    layers: int, pp: int, partition: tuple[int, ...], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        layer_partition(layers, pp, partition)


def test_a_rank_outside_the_pipeline_is_refused() -> None:
    with pytest.raises(SpecError, match="pipeline rank 2 is not one of the 2 stages"):
        stage_layers(4, 2, 2)
    with pytest.raises(SpecError, match="at least 1"):
        layer_partition(4, 0)
