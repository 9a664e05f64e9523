"""Rewriting a vLLM container's command line onto a staged artifact.

The operator changes only the flags it owns (``--model``, ``--load-format``,
``--tensor-parallel-size``, ``--model-loader-extra-config``; it adds ``--served-model-name`` so
clients keep the model name they know) and leaves every other token where it was, in the list
(``command`` or ``args``) it was in. Recognised invocations: ``vllm serve [MODEL] ...``,
``python -m vllm.entrypoints.openai.api_server ...`` and a bare argument list for images whose
entrypoint is vLLM, recognised by vLLM's own flags (``VLLM_FLAGS``): a container whose
arguments show no vLLM at all is not taken for one. Both ``--flag value`` and ``--flag=value``
are handled, as are vLLM's ``-tp`` alias and underscore spellings. Rewriting its own output
changes nothing.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelstage.core.errors import SpecError

API_SERVER_MODULES = frozenset(
    {"vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server"}
)
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})
SCRIPT_MARKERS = ("vllm serve", "vllm.entrypoints")
"""Text that shows a token is a whole command line (a shell script), not one argument."""
ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
MODEL = "--model"
LOAD_FORMAT = "--load-format"
TP = "--tensor-parallel-size"
PP = "--pipeline-parallel-size"
EXTRA_CONFIG = "--model-loader-extra-config"
SERVED_NAME = "--served-model-name"
OWNED = frozenset({MODEL, LOAD_FORMAT, TP, PP, EXTRA_CONFIG, SERVED_NAME})
VLLM_FLAGS = OWNED | {
    "--max-model-len",
    "--gpu-memory-utilization",
    "-pp",
}
"""Flags that mark a bare argument list as vLLM's (an image whose entrypoint is vLLM)."""

COMMAND, ARGS = 0, 1
Token = tuple[str, int]
"""A token and the list it came from (``COMMAND`` or ``ARGS``)."""


@dataclass(frozen=True)
class VllmSettings:
    """What the artifact needs from vLLM's command line."""

    model: str
    load_format: str
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    """Set on the command line when above 1 or already there (a command line without it runs
    vLLM's default, 1)."""
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    """Keys the operator sets in ``--model-loader-extra-config``."""
    kept_extra_keys: frozenset[str] = frozenset()
    """Keys of the user's extra config that the chosen loader accepts and that are kept."""
    own_models: tuple[str, ...] = ()
    """Prefixes of model values that are earlier artifacts, not names clients know: moving
    from one of those adds no ``--served-model-name``."""


@dataclass(frozen=True)
class Flag:
    """One occurrence of an owned flag: where its name and its value sit."""

    name: str
    at: int
    value_at: int
    inline: bool


def _flag_name(token: str) -> str | None:
    """The flag a token names, spelled canonically (``--tensor_parallel_size=2`` ->
    ``--tensor-parallel-size``); None for a value."""
    if not token.startswith("-"):
        return None
    name = token.split("=", 1)[0]
    name = ALIASES.get(name, name)
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return name


def flag_name(token: str) -> str | None:
    """The flag a token names, spelled canonically; None for a value (``_flag_name``)."""
    return _flag_name(token)


def vllm_arguments(command: list[str] | None, args: list[str] | None) -> list[str]:
    """The tokens vLLM parses (after ``vllm serve`` or the API server module), for planners
    that read its flags; raises ``SpecError`` like ``rewrite`` when vLLM is not found."""
    argv = [*(command or []), *(args or [])]
    start, _, _ = _vllm_start(argv, has_command=bool(command))
    return argv[start:]


def _canonical(token: str) -> str | None:
    """The owned flag a token names, or None."""
    name = _flag_name(token)
    return name if name in OWNED else None


def _vllm_start(argv: list[str], has_command: bool) -> tuple[int, bool, bool]:
    """Index of vLLM's first argument; whether a positional model may stand there; whether the
    invocation is an explicit ``vllm serve`` (where a missing model is added as positional)."""
    for i, token in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        shell = posixpath.basename(token) in SHELLS and nxt == "-c"
        script = any(c.isspace() for c in token) and any(m in token for m in SCRIPT_MARKERS)
        if shell or script:
            raise SpecError(
                "the vLLM container starts vLLM through a shell script; modelstage rewrites only "
                "argument lists: put `vllm serve MODEL ...` in command/args as separate items"
            )
    for i, token in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if posixpath.basename(token) == "vllm" and nxt == "serve":
            return i + 2, True, True
        if token == "-m" and nxt in API_SERVER_MODULES:
            return i + 2, False, False
    if not has_command and any(_flag_name(t) in VLLM_FLAGS for t in argv):
        # Args only: the image's entrypoint is `vllm serve` (positional model allowed) or the
        # API server module (--model only); --model works with both.
        return 0, True, False
    raise SpecError(
        "found no vLLM invocation in the container's command/args: expected `vllm serve MODEL`, "
        "`python -m vllm.entrypoints.openai.api_server`, or, for an image whose entrypoint is "
        "vLLM, args with vLLM's own flags (" + ", ".join(sorted(VLLM_FLAGS)) + ")"
    )


def _flags(argv: list[str], start: int) -> list[Flag]:
    flags: list[Flag] = []
    i = start
    while i < len(argv):
        name = _canonical(argv[i])
        if name is None:
            i += 1
            continue
        inline = "=" in argv[i]
        value_at = i if inline else i + 1
        flags.append(Flag(name=name, at=i, value_at=value_at, inline=inline))
        i = value_at + 1
    return flags


def _value(argv: list[str], flag: Flag) -> str | None:
    if flag.inline:
        return argv[flag.at].split("=", 1)[1]
    return argv[flag.value_at] if flag.value_at < len(argv) else None


def _set(tokens: list[Token], flag: Flag, value: str) -> None:
    if flag.inline:
        text, origin = tokens[flag.at]
        tokens[flag.at] = (f"{text.split('=', 1)[0]}={value}", origin)
    elif flag.value_at < len(tokens):
        tokens[flag.value_at] = (value, tokens[flag.value_at][1])
    else:
        tokens.append((value, tokens[flag.at][1]))


def _extra_config(argv: list[str], flags: list[Flag], settings: VllmSettings) -> dict[str, Any]:
    """The user's last extra config, filtered to the kept keys, plus the operator's keys."""
    current: dict[str, Any] = {}
    for flag in flags:
        if flag.name == EXTRA_CONFIG:
            try:
                parsed = json.loads(_value(argv, flag) or "{}")
            except (ValueError, RecursionError):  # not JSON, too deep, too many digits
                parsed = {}
            current = parsed if isinstance(parsed, dict) else {}
    kept = {k: v for k, v in current.items() if k in settings.kept_extra_keys}
    return {**kept, **settings.extra_config}


def _set_flags(
    tokens: list[Token],
    by_name: dict[str, list[Flag]],
    wanted: dict[str, str | None],
    *,
    skip_model: bool,
) -> tuple[set[int], list[str]]:
    """Set each wanted flag in place (every occurrence); returns the token indices to remove
    (flags wanted away: value None) and the flags to add (wanted but absent; not ``--model``
    when ``skip_model``: the positional model was replaced instead)."""
    removals: set[int] = set()
    additions: list[str] = []
    for name, value in wanted.items():
        found = by_name.get(name, [])
        for flag in found:
            if value is None:
                removals.update({flag.at, flag.value_at})
            else:
                _set(tokens, flag, value)
        if not found and value is not None and not (name == MODEL and skip_model):
            additions += [name, value]
    return removals, additions


def rewrite(
    command: list[str] | None, args: list[str] | None, settings: VllmSettings
) -> tuple[list[str] | None, list[str] | None]:
    """The container's new ``command`` and ``args``; raises ``SpecError`` when vLLM is not found."""
    tokens: list[Token] = [(t, COMMAND) for t in command or []] + [(t, ARGS) for t in args or []]
    argv = [t for t, _ in tokens]
    start, positional_ok, serve = _vllm_start(argv, has_command=bool(command))
    flags = _flags(argv, start)
    by_name: dict[str, list[Flag]] = {}
    for flag in flags:
        by_name.setdefault(flag.name, []).append(flag)
    has_positional = positional_ok and start < len(argv) and not argv[start].startswith("-")

    original_model = argv[start] if has_positional else None
    for flag in by_name.get(MODEL, []):
        original_model = _value(argv, flag) or original_model

    # Edit in place first (indices stay valid), then remove, then add at the end.
    tail_origin = tokens[-1][1] if tokens else ARGS
    if has_positional:
        tokens[start] = (settings.model, tokens[start][1])
    extra = _extra_config(argv, flags, settings)
    wanted = {
        MODEL: settings.model,
        LOAD_FORMAT: settings.load_format,
        TP: str(settings.tensor_parallel_size),
        EXTRA_CONFIG: json.dumps(extra, sort_keys=True, separators=(",", ":")) if extra else None,
    }
    if settings.pipeline_parallel_size > 1 or PP in by_name:
        wanted[PP] = str(settings.pipeline_parallel_size)
    removals, additions = _set_flags(tokens, by_name, wanted, skip_model=has_positional)
    if (
        SERVED_NAME not in by_name
        and original_model is not None
        and original_model != settings.model
        and not original_model.startswith(settings.own_models)
    ):
        additions += [SERVED_NAME, original_model]

    tokens = [tok for i, tok in enumerate(tokens) if i not in removals]
    if MODEL in additions and serve:
        # `vllm serve`'s positional model overrides --model: place ours where it would stand,
        # so a positional we could not see makes vLLM fail loudly instead of serving it.
        i = additions.index(MODEL)
        model = additions[i + 1]
        del additions[i : i + 2]
        origin = tokens[start][1] if start < len(tokens) else tail_origin
        tokens.insert(start, (model, origin))
    tokens += [(t, tail_origin) for t in additions]

    new_command = [t for t, origin in tokens if origin == COMMAND]
    new_args = [t for t, origin in tokens if origin == ARGS]
    return (
        new_command if command is not None or new_command else None,
        new_args if args is not None or new_args else None,
    )
