"""Rewriting vLLM command lines: a corpus of real-world invocations, and properties (the
operator's flags are set, every other token stays where it was, rewriting is idempotent)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelstage.core.errors import SpecError
from modelstage.operator.vllm_args import VllmSettings, rewrite

ART = "/mnt/modelstage/artifacts/llm/0123456789abcdef0123"
SETTINGS = VllmSettings(model=ART, load_format="modelstage_sharded_state", tensor_parallel_size=4)
TENSORIZER = VllmSettings(
    model=ART,
    load_format="tensorizer",
    tensor_parallel_size=2,
    extra_config={"tensorizer_uri": f"{ART}/model-rank-%03d.tensors"},
    kept_extra_keys=frozenset({"num_readers", "verify_hash"}),
)
RUNAI = VllmSettings(
    model="s3://models/llm/0123",
    load_format="runai_streamer",
    tensor_parallel_size=2,
    kept_extra_keys=frozenset({"distributed", "concurrency", "memory_limit"}),
)


@dataclass(frozen=True)
class Case:
    """A container's command/args as found in the wild, and what the rewrite must give."""

    name: str
    command: list[str] | None
    args: list[str] | None
    want_command: list[str] | None
    want_args: list[str] | None
    settings: VllmSettings = SETTINGS


CORPUS = [
    Case(
        "vllm-openai image, args only, --model flag (the upstream Kubernetes docs)",
        None,
        [
            "--model",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            "--tensor-parallel-size",
            "2",
            "--max-model-len",
            "8192",
            "--gpu-memory-utilization",
            "0.9",
        ],
        None,
        [
            "--model",
            ART,
            "--tensor-parallel-size",
            "4",
            "--max-model-len",
            "8192",
            "--gpu-memory-utilization",
            "0.9",
            "--load-format",
            "modelstage_sharded_state",
            "--served-model-name",
            "meta-llama/Meta-Llama-3-8B-Instruct",
        ],
    ),
    Case(
        "vllm serve in command, positional model and --flag=value in args",
        ["vllm", "serve"],
        [
            "meta-llama/Llama-3.1-70B-Instruct",
            "--tensor-parallel-size=8",
            "--enable-prefix-caching",
            "--max-num-seqs",
            "256",
            "--disable-log-requests",
        ],
        ["vllm", "serve"],
        [
            ART,
            "--tensor-parallel-size=4",
            "--enable-prefix-caching",
            "--max-num-seqs",
            "256",
            "--disable-log-requests",
            "--load-format",
            "modelstage_sharded_state",
            "--served-model-name",
            "meta-llama/Llama-3.1-70B-Instruct",
        ],
    ),
    Case(
        "python -m api_server with every flag in command (KServe-style)",
        [
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model=/mnt/models",
            "--served-model-name=llama",
            "--port=8080",
            "--load-format=safetensors",
        ],
        None,
        [
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={ART}",
            "--served-model-name=llama",
            "--port=8080",
            "--load-format=modelstage_sharded_state",
            "--tensor-parallel-size",
            "4",
        ],
        None,
    ),
    Case(
        "everything in command, -tp alias, an existing --load-format (production-stack style)",
        [
            "vllm",
            "serve",
            "Qwen/Qwen2.5-7B-Instruct",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "-tp",
            "2",
            "--max-num-seqs",
            "32",
            "--load-format",
            "safetensors",
            "--trust-remote-code",
        ],
        None,
        [
            "vllm",
            "serve",
            ART,
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "-tp",
            "4",
            "--max-num-seqs",
            "32",
            "--load-format",
            "modelstage_sharded_state",
            "--trust-remote-code",
            "--served-model-name",
            "Qwen/Qwen2.5-7B-Instruct",
        ],
        None,
    ),
    Case(
        "absolute vllm path, underscore spelling, a stale extra config with a foreign pattern",
        ["/usr/local/bin/vllm", "serve", "/models/deepseek"],
        [
            "--tensor_parallel_size",
            "2",
            "--model-loader-extra-config",
            '{"pattern": "x-{rank}"}',
            "--enforce-eager",
        ],
        ["/usr/local/bin/vllm", "serve", ART],
        [
            "--tensor_parallel_size",
            "4",
            "--enforce-eager",
            "--load-format",
            "modelstage_sharded_state",
            "--served-model-name",
            "/models/deepseek",
        ],
    ),
    Case(
        "vllm serve with --model flag instead of a positional, served name already set",
        [
            "vllm",
            "serve",
            "--model",
            "mistralai/Mistral-7B-Instruct-v0.3",
            "--served-model-name",
            "mistral",
            "mistral-7b",
            "--port",
            "8000",
        ],
        None,
        [
            "vllm",
            "serve",
            "--model",
            ART,
            "--served-model-name",
            "mistral",
            "mistral-7b",
            "--port",
            "8000",
            "--load-format",
            "modelstage_sharded_state",
            "--tensor-parallel-size",
            "4",
        ],
        None,
    ),
    Case(
        "vllm serve with no model at all gets it as the positional",
        ["vllm", "serve"],
        ["--config", "/etc/vllm/config.yaml"],
        ["vllm", "serve"],
        [
            ART,
            "--config",
            "/etc/vllm/config.yaml",
            "--load-format",
            "modelstage_sharded_state",
            "--tensor-parallel-size",
            "4",
        ],
    ),
    Case(
        "LoRA, chat template and JSON-valued flags are left alone",
        ["vllm", "serve", "meta-llama/Llama-2-7b-hf"],
        [
            "--enable-lora",
            "--lora-modules",
            "sql=/loras/sql",
            "chat=/loras/chat",
            "--chat-template",
            "/templates/llama.jinja",
            "--override-generation-config",
            '{"temperature": 0.2}',
            "--tensor-parallel-size",
            "4",
        ],
        ["vllm", "serve", ART],
        [
            "--enable-lora",
            "--lora-modules",
            "sql=/loras/sql",
            "chat=/loras/chat",
            "--chat-template",
            "/templates/llama.jinja",
            "--override-generation-config",
            '{"temperature": 0.2}',
            "--tensor-parallel-size",
            "4",
            "--load-format",
            "modelstage_sharded_state",
            "--served-model-name",
            "meta-llama/Llama-2-7b-hf",
        ],
    ),
    Case(
        "tensorizer: extra config keeps the loader's tuning keys and drops credentials",
        None,
        [
            "--model",
            "EleutherAI/pythia-1.4b",
            "--model-loader-extra-config",
            '{"num_readers": 4, "s3_secret_access_key": "leaked", "tensorizer_uri": "s3://old"}',
        ],
        None,
        [
            "--model",
            ART,
            "--model-loader-extra-config",
            json.dumps(
                {"num_readers": 4, "tensorizer_uri": f"{ART}/model-rank-%03d.tensors"},
                sort_keys=True,
                separators=(",", ":"),
            ),
            "--load-format",
            "tensorizer",
            "--tensor-parallel-size",
            "2",
            "--served-model-name",
            "EleutherAI/pythia-1.4b",
        ],
        TENSORIZER,
    ),
    Case(
        "runai streamer: concurrency kept, the rest of the extra config dropped",
        ["vllm", "serve", "s3://models/llm/0123"],
        [
            '--model-loader-extra-config={"concurrency": 16, "pattern": "p"}',
            "-tp=2",
            "--served-model-name",
            "qwen",
        ],
        ["vllm", "serve", "s3://models/llm/0123"],
        [
            '--model-loader-extra-config={"concurrency":16}',
            "-tp=2",
            "--served-model-name",
            "qwen",
            "--load-format",
            "runai_streamer",
        ],
        RUNAI,
    ),
    Case(
        "env wrapper before vllm serve",
        ["/usr/bin/env", "VLLM_LOGGING_LEVEL=DEBUG", "vllm", "serve", "facebook/opt-125m"],
        None,
        [
            "/usr/bin/env",
            "VLLM_LOGGING_LEVEL=DEBUG",
            "vllm",
            "serve",
            ART,
            "--load-format",
            "modelstage_sharded_state",
            "--tensor-parallel-size",
            "4",
            "--served-model-name",
            "facebook/opt-125m",
        ],
        None,
    ),
]


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_corpus_rewrites_as_expected(case: Case) -> None:
    assert rewrite(case.command, case.args, case.settings) == (case.want_command, case.want_args)


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_corpus_rewrite_is_idempotent(case: Case) -> None:
    once = rewrite(case.command, case.args, case.settings)
    assert rewrite(*once, case.settings) == once


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_moving_to_another_artifact_keeps_the_served_model_name(case: Case) -> None:
    first = rewrite(case.command, case.args, case.settings)
    other = VllmSettings(
        model="/mnt/other", load_format="sharded_state", tensor_parallel_size=1, own_models=(ART,)
    )
    tokens = [t for part in rewrite(*first, other) for t in part or []]
    first_tokens = [t for part in first for t in part or []]
    served = [t for t in first_tokens if t.startswith("--served-model-name")]
    assert [t for t in tokens if t.startswith("--served-model-name")] == served
    assert tokens.count("--served-model-name") <= 1


@pytest.mark.parametrize(
    ("command", "args"),
    [
        (["/bin/sh", "-c"], ["vllm serve meta-llama/Llama-3-8B --tensor-parallel-size 2"]),
        (["bash", "-c", "exec python3 -m vllm.entrypoints.openai.api_server --model x"], None),
    ],
)
def test_shell_scripts_are_refused_with_a_way_out(
    command: list[str], args: list[str] | None
) -> None:
    with pytest.raises(SpecError, match="shell script"):
        rewrite(command, args, SETTINGS)


def test_a_container_that_does_not_run_vllm_is_refused() -> None:
    with pytest.raises(SpecError, match="no vLLM invocation"):
        rewrite(["nginx", "-g", "daemon off;"], None, SETTINGS)


@pytest.mark.parametrize(
    "args",
    [None, [], ["--port", "8080"], ["serve", "--config", "/etc/app.yaml"], ["payments-api"]],
)
def test_args_without_any_vllm_flag_are_not_taken_for_vllm(args: list[str] | None) -> None:
    with pytest.raises(SpecError, match=r"no vLLM invocation.*--model"):
        rewrite(None, args, SETTINGS)


def test_args_only_with_a_vllm_flag_and_a_positional_model_are_vllm() -> None:
    assert rewrite(None, ["acme/llama", "--max-model-len", "2048"], SETTINGS) == (
        None,
        [
            ART,
            "--max-model-len",
            "2048",
            "--load-format",
            "modelstage_sharded_state",
            "--tensor-parallel-size",
            "4",
            "--served-model-name",
            "acme/llama",
        ],
    )


def test_moving_from_an_earlier_artifact_adds_no_served_model_name() -> None:
    new = VllmSettings(model="/mnt/new", load_format="f", tensor_parallel_size=1, own_models=(ART,))
    command, _ = rewrite(["vllm", "serve", ART], None, new)
    assert command == [
        "vllm",
        "serve",
        "/mnt/new",
        "--load-format",
        "f",
        "--tensor-parallel-size",
        "1",
    ]


@pytest.mark.parametrize("value", ["[" * 5000, "1" + "0" * 5000, "{not json"])
def test_an_extra_config_that_is_no_json_object_is_dropped(value: str) -> None:
    command, _ = rewrite(
        ["vllm", "serve", "m", "--model-loader-extra-config", value], None, TENSORIZER
    )
    assert command is not None
    assert json.loads(command[command.index("--model-loader-extra-config") + 1]) == {
        "tensorizer_uri": f"{ART}/model-rank-%03d.tensors"
    }


def test_an_extra_config_that_ends_up_empty_is_removed() -> None:
    command = [
        "vllm",
        "serve",
        "m",
        "--model-loader-extra-config",
        '{"pattern": "p"}',
        "--port",
        "1",
    ]
    new_command, _ = rewrite(command, None, SETTINGS)
    assert new_command is not None
    assert "--model-loader-extra-config" not in new_command
    assert new_command[new_command.index("--port") + 1] == "1"


# Property: arbitrary unrelated flags around the owned ones survive, in order, and a second
# rewrite changes nothing.
OTHER_FLAGS = [
    "--port",
    "--host",
    "--max-model-len",
    "--enforce-eager",
    "--trust-remote-code",
    "--gpu-memory-utilization",
    "--disable-log-stats",
    "--seed",
    "--swap-space",
]
values = st.text(alphabet="abcdefghij0123456789./:", min_size=1, max_size=8)
other = st.tuples(st.sampled_from(OTHER_FLAGS), st.one_of(st.none(), values), st.booleans())
owned = st.tuples(
    st.sampled_from(
        ["--model", "--load-format", "--tensor-parallel-size", "-tp", "--tensor_parallel_size"]
    ),
    values,
    st.booleans(),
)


def render(flags: list[tuple[str, str | None, bool]]) -> list[str]:
    out: list[str] = []
    for name, value, inline in flags:
        if value is None:
            out.append(name)
        elif inline:
            out.append(f"{name}={value}")
        else:
            out += [name, value]
    return out


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flags=st.lists(st.one_of(other, owned), max_size=10),
    entry=st.sampled_from(
        [None, ["vllm", "serve"], ["python", "-m", "vllm.entrypoints.openai.api_server"]]
    ),
    split=st.integers(min_value=0, max_value=10),
)
def test_rewrite_keeps_other_tokens_in_order_and_is_idempotent(
    flags: list[tuple[str, str | None, bool]], entry: list[str] | None, split: int
) -> None:
    argv = render(flags)
    command = None if entry is None else entry + argv[:split]
    args = argv if entry is None else argv[split:]
    vllm_flags = {"--max-model-len", "--gpu-memory-utilization", "--model", "--load-format",
                  "--tensor-parallel-size", "-tp", "--tensor_parallel_size"}  # fmt: skip
    if entry is None and not any(name in vllm_flags for name, _, _ in flags):
        with pytest.raises(SpecError, match="no vLLM invocation"):
            rewrite(command, args, SETTINGS)
        return
    once = rewrite(command, args, SETTINGS)
    assert rewrite(*once, SETTINGS) == once
    before = [t for t in render([f for f in flags if f[0] in OTHER_FLAGS])]
    after = [t for part in once for t in part or []]
    kept = [t for t in after if t in before]
    # Unrelated tokens keep their relative order (values may repeat, so compare subsequences).
    it = iter(after)
    assert all(tok in it for tok in before), (before, after)
    assert len(kept) >= len(before)
    joined = " ".join(after)
    assert f"{ART}" in joined and "modelstage_sharded_state" in joined


# vLLM's own argument parser on the rewritten command lines: what `vllm serve` and the API
# server module build (`make_arg_parser`), for every load format, location and plugin setting.
API_SERVER = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
OWNED_DESTS = frozenset(
    {"model", "model_tag", "load_format", "tensor_parallel_size",
     "model_loader_extra_config", "served_model_name"}
)  # fmt: skip
ARTIFACTS = [
    ("sharded_state", True),
    ("tensorizer", True),
    ("tensorizer", False),
    ("runai_streamer", False),
    ("runai_streamer_sharded", False),
]
"""(format, on a PVC): every pairing the API allows (per-rank safetensors on a PVC, Run:ai on S3)."""


@dataclass(frozen=True)
class VllmParser:
    parse: Any
    """``argv -> argparse.Namespace``, raising ``SystemExit`` as vLLM's CLI does."""
    stock_formats: frozenset[str]
    """Load formats stock vLLM registers (no plugin loaded in this process)."""
    default_model: str
    """``--model``'s default, what vLLM serves when no model is given."""


@pytest.fixture(scope="module")
def vllm_parser() -> VllmParser:
    """vLLM's ``vllm serve`` parser (importing vLLM takes ~10 s: once per module)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    stock = frozenset(_LOAD_FORMAT_TO_MODEL_LOADER)
    return VllmParser(parser.parse_args, stock, parser.parse_args([]).model)


def vllm_argv(command: list[str] | None, args: list[str] | None) -> list[str]:
    """What vLLM's parser gets: the tokens after ``vllm serve`` or ``-m <api server>``, or
    the whole args list of an image whose entrypoint is vLLM."""
    argv = (command or []) + (args or [])
    for i, token in enumerate(argv):
        if token.rsplit("/", 1)[-1] == "vllm" and argv[i + 1 : i + 2] == ["serve"]:
            return argv[i + 2 :]
        if token == "-m" and argv[i + 1 : i + 2] and argv[i + 1] in API_SERVER:
            return argv[i + 2 :]
    assert command is None, argv
    return argv


def for_this_vllm(tokens: list[str] | None, config_file: str) -> list[str] | None:
    """The corpus's tokens with what vLLM 0.32 no longer accepts replaced by its equivalent
    (a flag renamed since), and the config file pointed at one that exists."""
    if tokens is None:
        return None
    swap = {"--disable-log-requests": "--no-enable-log-requests",
            "/etc/vllm/config.yaml": config_file}  # fmt: skip
    return [swap.get(t, t) for t in tokens]


def vllm_model(ns: Any) -> str | None:
    """The model vLLM serves: `vllm serve`'s positional overrides ``--model``."""
    return ns.model_tag if ns.model_tag is not None else ns.model


@pytest.mark.parametrize("plugin", [True, False], ids=["plugin", "stock"])
@pytest.mark.parametrize(("load_format", "on_pvc"), ARTIFACTS,
                         ids=[f"{f}-{'pvc' if p else 's3'}" for f, p in ARTIFACTS])  # fmt: skip
@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_vllms_own_parser_reads_the_rewritten_command_line_as_intended(
    case: Case, load_format: str, on_pvc: bool, plugin: bool, vllm_parser: VllmParser,
    tmp_path: Path,
) -> None:  # fmt: skip
    from modelstage.operator.artifact import Artifact, location_from_uri
    from modelstage.operator.rollout_plan import vllm_settings
    from modelstage.plugin import plugin_rows

    config_file = tmp_path / "config.yaml"
    config_file.write_text("max-model-len: 4096\n")
    command = for_this_vllm(case.command, str(config_file))
    args = for_this_vllm(case.args, str(config_file))
    digest = "0123456789abcdef0123"
    uri = f"pvc://models/llm/{digest}" if on_pvc else f"s3://models/llm/{digest}"
    artifact = Artifact(location_from_uri(uri, digest), load_format, 2)  # type: ignore[arg-type]
    settings = vllm_settings(artifact, plugin)
    before = vllm_parser.parse(vllm_argv(command, args))
    after = vllm_parser.parse(vllm_argv(*rewrite(command, args, settings)))

    assert vllm_model(after) == settings.model and after.model_tag in (None, settings.model)
    assert after.load_format == settings.load_format
    if settings.load_format.startswith("modelstage_"):
        assert plugin and on_pvc and settings.load_format in {r.plugin_loader for r in plugin_rows()}
    else:
        assert settings.load_format in vllm_parser.stock_formats
    assert after.tensor_parallel_size == 2
    kept = {k: v for k, v in (before.model_loader_extra_config or {}).items()
            if k in settings.kept_extra_keys}  # fmt: skip
    assert (after.model_loader_extra_config or {}) == {**kept, **settings.extra_config}
    given = before.model_tag is not None or before.model != vllm_parser.default_model
    if before.served_model_name is not None:
        assert after.served_model_name == before.served_model_name
    elif given:  # clients keep the name they know
        assert after.served_model_name == [vllm_model(before)]
    else:  # no model given: vLLM's default was never a name clients used
        assert after.served_model_name is None
    changed = {
        k for k in vars(before) if k not in OWNED_DESTS and vars(before)[k] != vars(after)[k]
    }
    assert not changed, {k: (vars(before)[k], vars(after)[k]) for k in changed}


def test_the_pipeline_size_is_the_artifacts_and_absent_when_it_is_one() -> None:
    piped = VllmSettings(model=ART, load_format="sharded_state", tensor_parallel_size=2,
                         pipeline_parallel_size=2)  # fmt: skip
    _, args = rewrite(["vllm", "serve"], ["m", "-pp", "4", "--max-model-len", "64"], piped)
    assert args is not None and args[args.index("-pp") + 1] == "2"
    _, args = rewrite(["vllm", "serve"], ["m"], piped)
    assert args is not None and args[args.index("--pipeline-parallel-size") + 1] == "2"
    _, args = rewrite(["vllm", "serve"], ["m", "--pipeline-parallel-size=2"], SETTINGS)
    assert args is not None and "--pipeline-parallel-size=1" in args
    _, args = rewrite(["vllm", "serve"], ["m"], SETTINGS)
    assert args is not None and not any("pipeline" in a for a in args)
