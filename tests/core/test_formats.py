"""The format table (``modelstage.core.formats``): its rows agree with each other and with
every place that names formats (the CRD's enum, the plugin's loaders, the writers)."""

from __future__ import annotations

from typing import get_args

import pytest
from modelstage.api.modeldeployment import LoadFormat
from modelstage.core.errors import SpecError
from modelstage.core.formats import (
    FORMATS,
    S3_READER_FORMAT,
    Format,
    format_for,
    plugin_load_formats,
)


def test_the_operators_load_formats_are_the_tables() -> None:
    assert set(get_args(LoadFormat)) == set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_rank_files_are_named_by_one_function_and_pass_the_manifests_check(fmt: Format) -> None:
    if not fmt.per_rank:
        assert fmt.rank_file is None
        return
    for rank in range(12):
        name = fmt.rank_file_name(rank, part=3)
        assert fmt.weight_files.match(name), name
        assert fmt.is_rank_file(name, rank)
        assert not any(fmt.is_rank_file(name, other) for other in range(12) if other != rank)


def test_formats_that_load_each_other_share_their_files() -> None:
    for fmt in FORMATS.values():
        assert fmt.name in fmt.loads
        for other in fmt.loads:
            assert FORMATS[other].weight_files == fmt.weight_files
            assert FORMATS[other].rank_file == fmt.rank_file


def test_the_plugin_loads_what_the_table_says() -> None:
    loads = plugin_load_formats()
    assert loads[S3_READER_FORMAT] == FORMATS[S3_READER_FORMAT].loads
    for fmt in FORMATS.values():
        if fmt.plugin_loader is not None:
            assert loads[fmt.plugin_loader] == fmt.loads


def test_an_unknown_format_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(SpecError, match=r"^format 'pytorch' is not supported; supported: "
                       r"sharded_state, runai_streamer, runai_streamer_sharded, safetensors, "
                       r"tensorizer$"):  # fmt: skip
        format_for("pytorch")


def test_a_local_only_format_to_s3_is_refused_naming_the_alternatives() -> None:
    with pytest.raises(SpecError) as refused:
        FORMATS["sharded_state"].check_destination("s3")
    assert str(refused.value) == (
        "format sharded_state is read from local directories only; stage to S3 with --format "
        "runai_streamer_sharded (the same per-rank files) or runai_streamer"
    )
