"""Faults on Azure Blob: the endpoint killed in the middle of an upload leaves nothing that
looks complete, the stager says so in one credential-free line, and a rerun finishes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelstage.core.azure_client import AzureOptions
from modelstage.core.errors import ArtifactError, DestinationError
from modelstage.core.location import open_artifact, verify
from modelstage.core.manifest import MANIFEST
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.azurite import ACCOUNT, KEY, Azurite, azurite, require_azurite
from support.fault_proxy import fault_proxy

MiB = 1024 * 1024


@pytest.fixture
def own_az(tmp_path: Path) -> Iterator[Azurite]:
    """An Azurite of this test's own: it gets killed."""
    require_azurite()
    with azurite(tmp_path / "azurite") as server:
        yield server


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~45 MB of float32 weights (about 45 blocks of 1 MiB): an upload long enough to lose
    the endpoint in the middle of it."""
    spec = SyntheticModel(hidden_size=1024, intermediate_size=2048, num_layers=2,
                          vocab_size=4000, num_shards=2)  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("azbig") / "ckpt")


@pytest.mark.slow  # a second Azurite and the retries running out: ~60 s; the next test is exact
def test_azurite_killed_mid_upload_leaves_no_manifest_and_a_rerun_finishes(
    own_az: Azurite, big_ckpt: Path
) -> None:
    own_az.container("faults")
    out = "az://faults/art/"
    req = StageRequest(
        source=str(big_ckpt), out=out, tp=2, format="runai_streamer_sharded",
        azure=own_az.options(block_bytes=1 * MiB, concurrency=2, max_attempts=2,
                             connect_timeout=2, read_timeout=5),
    )  # fmt: skip
    failure: list[BaseException] = []
    stager = threading.Thread(target=lambda: _run(req, failure))
    stager.start()
    deadline = time.monotonic() + 120
    while own_az.requests("StageBlock") < 8 and stager.is_alive():
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.05)
    assert stager.is_alive(), "the upload finished before the endpoint could be killed"
    own_az.kill()
    stager.join(timeout=300)
    assert not stager.is_alive()
    assert failure and isinstance(failure[0], DestinationError), failure
    message = str(failure[0])
    assert "\n" not in message and KEY not in message and "az://faults/art/" in message

    own_az.start()  # same workspace: what was committed before the kill is there
    listed = {
        b.name: b
        for b in own_az.container("faults").list_blobs(
            name_starts_with="art/", include=["metadata"]
        )
    }
    assert "art/" + MANIFEST not in listed
    for blob in listed.values():  # a blob is visible only whole, with its content hash
        assert {"blake3", "modelstage_run"} <= set(blob.metadata), blob.name
    with pytest.raises(ArtifactError, match="incomplete"):
        verify(open_artifact(out, azure=own_az.options()))

    summary = stage(req)
    assert not summary["alreadyStaged"]
    verify(open_artifact(out, azure=own_az.options()))


def test_the_endpoint_lost_mid_upload_leaves_exactly_no_manifest_and_a_rerun_resumes(
    az: Azurite, container: str, big_ckpt: Path
) -> None:
    """The same fault with Azurite alive behind a proxy that goes down: what Azurite holds
    is then exactly what the stager committed (a SIGKILLed Azurite forgets its last seconds,
    so the test above cannot see a manifest written too early; this one can)."""
    out = f"az://{container}/cut/"
    with fault_proxy(az.endpoint.rsplit("/", 1)[0]) as proxy:
        endpoint = f"{proxy.endpoint}/{ACCOUNT}"
        options = AzureOptions.from_env(
            {"AZURE_STORAGE_ACCOUNT": ACCOUNT, "AZURE_STORAGE_KEY": KEY,
             "AZURE_STORAGE_BLOB_ENDPOINT": endpoint},
            block_bytes=1 * MiB, concurrency=2, max_attempts=2, connect_timeout=2,
            read_timeout=5,
        )  # fmt: skip
        req = StageRequest(source=str(big_ckpt), out=out, tp=2, format="runai_streamer_sharded",
                           azure=options)  # fmt: skip
        blocks = az.requests("StageBlock")
        failure: list[BaseException] = []
        stager = threading.Thread(target=lambda: _run(req, failure))
        stager.start()
        deadline = time.monotonic() + 120
        while az.requests("StageBlock") < blocks + 20 and stager.is_alive():
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.02)
        proxy.down()
        stager.join(timeout=300)
        assert failure and isinstance(failure[0], DestinationError), failure
        assert KEY not in str(failure[0]) and "\n" not in str(failure[0])

        listed = {
            b.name: b
            for b in az.container(container).list_blobs(
                name_starts_with="cut/", include=["metadata"]
            )
        }
        assert "cut/" + MANIFEST not in listed
        for blob in listed.values():
            assert {"blake3", "modelstage_run"} <= set(blob.metadata), blob.name
        with pytest.raises(ArtifactError, match="incomplete"):
            verify(open_artifact(out, azure=az.options()))

        proxy.up()
        stage(req)
    verify(open_artifact(out, azure=az.options()))


def _run(req: StageRequest, failure: list[BaseException]) -> None:
    try:
        stage(req)
    except BaseException as e:
        failure.append(e)


def test_throttling_is_retried_with_backoff_and_the_artifact_is_whole(
    az: Azurite, container: str, multiblock_ckpt: Path
) -> None:
    """Every other request of 6 answered 503 (as a throttled account is): the SDK's retry
    policy waits and retries each, and the artifact verifies."""
    out = f"az://{container}/slow/"
    with fault_proxy(az.endpoint.rsplit("/", 1)[0]) as proxy:
        options = AzureOptions.from_env(
            {"AZURE_STORAGE_ACCOUNT": ACCOUNT, "AZURE_STORAGE_KEY": KEY,
             "AZURE_STORAGE_BLOB_ENDPOINT": f"{proxy.endpoint}/{ACCOUNT}"},
            block_bytes=1 * MiB, concurrency=2, max_attempts=3,
        )  # fmt: skip
        proxy.throttle(6, every=2)
        stage(StageRequest(source=str(multiblock_ckpt), out=out, tp=2,
                           format="runai_streamer_sharded", azure=options))  # fmt: skip
        assert proxy.throttled == 6
    verify(open_artifact(out, azure=az.options()))
