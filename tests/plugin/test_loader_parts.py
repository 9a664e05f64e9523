"""Pieces of the loader that need vLLM importable but not running: parameter targets, metrics,
which loader reads which row of the format table."""

from __future__ import annotations

import urllib.request
from dataclasses import replace

import pytest
import torch
from modelstage.core.errors import ArtifactError
from modelstage.core.formats import FORMATS, S3_READER_FORMAT, plugin_load_formats
from modelstage.core.safetensors_format import TensorInfo
from modelstage.plugin import loader_for, plugin_rows
from modelstage.plugin.base import HfLayoutLoader
from modelstage.plugin.metrics import PHASES, LoadRecord, publish
from modelstage.plugin.reader import flat_bytes
from modelstage.plugin.s3_sharded_state import ModelstageS3ShardedStateLoader
from modelstage.plugin.sharded_state import check_keys, target_for
from prometheus_client.parser import text_string_to_metric_families
from support.serving import free_ports


def info(shape: tuple[int, ...], dtype: str = "F32") -> TensorInfo:
    n = 1
    for d in shape:
        n *= d
    return TensorInfo("w", dtype, shape, 0, n * (4 if dtype == "F32" else 2), "f.safetensors")


def fill(target_flat: torch.Tensor, values: torch.Tensor) -> None:
    target_flat.copy_(flat_bytes(values.contiguous()))


def test_matching_parameter_takes_bytes_directly_into_its_memory() -> None:
    param = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    target = target_for(info((4, 3)), param)
    assert target.finish is None
    assert target.flat.data_ptr() == param.data_ptr()


def test_smaller_tensor_is_narrowed_into_the_parameter_like_the_stock_loader() -> None:
    param = torch.nn.Parameter(torch.full((6, 5), -1.0), requires_grad=False)
    values = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    target = target_for(info((4, 3)), param)  # narrow on dim 1: not contiguous -> staging
    fill(target.flat, values)
    assert target.finish is not None
    target.finish()
    assert torch.equal(param[:4, :3], values)
    assert (param[4:] == -1).all() and (param[:, 3:] == -1).all()


def test_other_dtype_goes_through_staging_and_is_converted() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float32), requires_grad=False)
    values = torch.tensor([[1.5, -2.0], [0.25, 3.0]], dtype=torch.bfloat16)
    target = target_for(info((2, 2), "BF16"), param)
    fill(target.flat, values)
    assert target.finish is not None
    target.finish()
    assert torch.equal(param.data, values.float())


def test_larger_tensor_or_other_rank_is_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    with pytest.raises(ArtifactError, match=r"larger than its parameter \[2, 2\]"):
        target_for(info((3, 2)), param)
    with pytest.raises(ArtifactError, match=r"has shape \[4\], the parameter \[2, 2\]"):
        target_for(info((4,)), param)


def test_key_mismatch_is_refused_naming_the_keys() -> None:
    with pytest.raises(ArtifactError, match=r"the model has no parameter extra\.weight"):
        check_keys("a", {"a.weight", "extra.weight"}, {"a.weight"})
    with pytest.raises(ArtifactError, match=r"the artifact lacks b\.weight"):
        check_keys("a", {"a.weight"}, {"a.weight", "b.weight"})
    check_keys("a", {"a.weight"}, {"a.weight"})


def test_published_load_is_scrapable_and_parses_with_every_phase() -> None:
    record = LoadRecord(rank=1, tensor_parallel_size=2, load_format="modelstage_sharded_state",
                        artifact="pvc://m/d", digest="d1", artifact_format="sharded_state",
                        layout_version="vllm-0.32/1", bytes=1000, files=1,
                        seconds={p: 0.5 for p in PHASES}, weights_seconds=0.25)  # fmt: skip
    base = free_ports(2)
    assert publish(record, port=base, addr="127.0.0.1") == base + 1
    with urllib.request.urlopen(f"http://127.0.0.1:{base + 1}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples = {
        (s.name, s.labels.get("phase")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("rank") == "1"
    }
    assert all(samples[("modelstage_load_phase_seconds", p)] == 0.5 for p in PHASES)
    assert samples[("modelstage_load_bytes_total", None)] >= 1000
    assert samples[("modelstage_load_throughput_bytes_per_second", None)] == 4000
    assert '"throughput_bytes_per_second":4000' in record.log_line()


def test_each_plugin_row_is_read_by_the_loader_in_its_module_with_the_rows_names() -> None:
    for row in plugin_rows():
        loader = loader_for(row)
        assert loader.__module__ == f"modelstage.plugin.{row.name}"
        assert (loader.load_format, loader.stock_format, loader.per_rank) == (
            row.plugin_loader, row.stock_loader, row.per_rank)  # fmt: skip
    assert plugin_rows() == [f for f in FORMATS.values() if f.plugin_loader]
    reader = ModelstageS3ShardedStateLoader
    assert (reader.load_format, reader.stock_format, reader.per_rank) == (
        S3_READER_FORMAT, S3_READER_FORMAT, True)  # fmt: skip
    assert set(plugin_load_formats()) == {*(r.plugin_loader for r in plugin_rows()),
                                          S3_READER_FORMAT}  # fmt: skip


def test_a_row_whose_module_holds_no_loader_naming_it_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    impostor = replace(FORMATS["sharded_state"], extra_config_keys=frozenset({"x"}))
    monkeypatch.setitem(FORMATS, "sharded_state", impostor)
    with pytest.raises(ImportError, match=r"modelstage\.plugin\.sharded_state must hold one "
                       r"loader class with format = FORMATS\['sharded_state'\]"):  # fmt: skip
        loader_for(impostor)
    missing = replace(FORMATS["safetensors"], name="listing", plugin_loader="modelstage_listing")
    with pytest.raises(ModuleNotFoundError, match=r"modelstage\.plugin\.listing"):
        loader_for(missing)


def test_a_loader_naming_a_row_without_a_plugin_loader_is_refused_where_defined() -> None:
    with pytest.raises(TypeError, match=r"format tensorizer, whose row in core/formats\.py"):

        class _Tensorizer(HfLayoutLoader):
            format = FORMATS["tensorizer"]
