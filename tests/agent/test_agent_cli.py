"""``modelstage agent``'s refusals: one ``error:`` line, before the loop starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelstage.stager.cli import main


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "0"], "error: --budget '0': must be a positive whole number of bytes"),
        (["--budget", "lots"], "error: --budget 'lots': expected a number of bytes"),
        (["--budget", "1Gi", "--interval", "0"], "error: --interval 0.0: must be a positive"),
        (["--budget", "1Gi", "--kubeconfig", "/nonexistent/kubeconfig"],
         "error: no Kubernetes credentials: "),
        (["--budget", "1Gi", "--verify-rate", "fast"], "error: --verify-rate 'fast': expected"),
        (["--budget", "1Gi", "--namespace-quota", "-1"],
         "error: --namespace-quota '-1': expected a number of bytes"),
    ],
)  # fmt: skip
def test_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code = main(["agent", "--node", "n1", "--root", str(tmp_path / "root"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith(message), err
