"""vLLM's pipeline-parallel layer partition: which decoder layers each pipeline stage holds.

vLLM builds on stage ``p`` only the decoder layers ``[start, end)`` its ``get_pp_indices``
gives (the others are placeholders without parameters), so a stage's rank files hold exactly
those layers. The partition is vLLM's default (equal shares; the remainder one layer each to
the stages just before the last, which also holds the final norm) unless the serving pod sets
``VLLM_PP_LAYER_PARTITION`` (a comma-separated count per stage), which is an argument here,
never read from the environment. Torch-free: the operator, the stager and the plugin share it.
"""

from __future__ import annotations

from .errors import SpecError

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
"""vLLM's variable for an explicit partition (the plugin reads it in the serving process)."""


def parse_layer_partition(text: str) -> tuple[int, ...]:
    """A partition as ``VLLM_PP_LAYER_PARTITION`` spells it (``"3,5"``) -> layers per stage."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecError(
            f"layer partition {text!r} is not a comma-separated list of layer counts per "
            "pipeline stage, e.g. 3,5"
        ) from None
    if any(count < 0 for count in counts):
        raise SpecError(f"layer partition {text!r} gives a stage a negative number of layers")
    return counts


def layer_partition(
    num_layers: int, pp: int, partition: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The number of decoder layers of each of the ``pp`` stages: ``partition`` checked
    against the model, else vLLM's default (``get_pp_indices``)."""
    if pp < 1:
        raise SpecError(f"pipeline parallel size must be at least 1, not {pp}")
    if partition is not None:
        spelled = spell_layer_partition(partition)
        if len(partition) != pp:
            raise SpecError(
                f"layer partition {spelled} has {len(partition)} stages, but the pipeline "
                f"parallel size is {pp}"
            )
        if sum(partition) != num_layers:
            raise SpecError(
                f"layer partition {spelled} holds {sum(partition)} layers, but the model has "
                f"{num_layers}"
            )
        return partition
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):  # the remainder: the stages before the last
        counts[-i] += 1
    return tuple(counts)


def stage_layers(
    num_layers: int, pp_rank: int, pp: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """Decoder layers ``[start, end)`` of stage ``pp_rank`` of ``pp``, as vLLM builds them."""
    if not 0 <= pp_rank < pp:
        raise SpecError(f"pipeline rank {pp_rank} is not one of the {pp} stages")
    counts = layer_partition(num_layers, pp, partition)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def spell_layer_partition(partition: tuple[int, ...] | None) -> str:
    """A partition as ``VLLM_PP_LAYER_PARTITION`` spells it; "" for vLLM's default."""
    return "" if partition is None else ",".join(map(str, partition))
