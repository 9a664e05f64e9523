"""A checkpoint on the Hugging Face Hub (``hf://org/name`` + revision), fetched into the hub cache.

The revision (branch, tag or commit; default ``main``) is resolved to a commit sha once, and
every file is then fetched at that commit, so a branch that moves while staging cannot mix
two commits; the sha is the source identity the manifest and the status record. Only the
files the stager reads are fetched: the weight files named by the index (or the top-level
``*.safetensors``), the index, and ``checkpoint.CARRIED_OVER`` (config, tokenizer,
generation config) -- never pickles, ``original/`` copies or READMEs.

Files land in the standard hub cache (``--cache-dir``, else ``HF_HUB_CACHE``), which makes
them reusable by vLLM and ``huggingface-cli`` and lets a rerun skip finished files. Resuming
is what ``huggingface_hub`` offers: a connection dropped mid-file is resumed with a Range
request within the run, and files completed by an earlier (killed) run are not fetched again;
a partial file of a killed run is discarded by the library and fetched from the start.

**Timeouts and progress.** Every request has a connect and a read timeout and is retried on
timeouts, dropped connections, 429 and 5xx (``network.Timeouts``: ``--connect-timeout``,
``--read-timeout``, ``--retries`` or ``MODELSTAGE_*``); huggingface_hub's own client waits
forever on the model-info call, so an endpoint that accepts and never answers would hang the
stager. Downloads report bytes, rate and ETA (``progress.Progress``) every few seconds.
Transfers through ``hf_xet`` (Xet-backed repositories on the real Hub) use that library's
own timeouts; set ``HF_HUB_DISABLE_XET=1`` to have them go through the HTTP path above.

With ``HF_HUB_OFFLINE=1`` nothing is requested: the revision resolves through the cache's
``refs/`` and the snapshot folder is read as it is (a pre-filled cache on a volume).

The token comes from ``--hf-token-file`` (a mounted Secret) or ``HF_TOKEN``; it is sent only
in the Authorization header and is removed from every message this module produces.
"""

from __future__ import annotations

import math
import os
import posixpath
import random
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

from modelstage.core.durable import write_atomic
from modelstage.core.errors import CheckpointError
from modelstage.core.manifest import CARRIED_OVER, INDEX
from modelstage.core.progress import Progress, human_bytes

from ..network import Timeouts
from .base import INDEX_VALUES, MAX_JSON_BYTES, parse_json, safe_name
from .local import LocalSource

SCHEME = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
DEFAULT_REVISION = "main"
DOWNLOAD_WORKERS = 4
RETRY_BASE_S = 1.0
RETRY_CAP_S = 16.0
T = TypeVar("T")


def parse_hf_uri(uri: str) -> str:
    """``hf://org/name`` -> ``org/name``; anything else (a token, a revision) is refused."""
    repo_id = uri.removeprefix(SCHEME).strip("/")
    if not uri.startswith(SCHEME) or not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        # user:token@ would put the token into the log: name the URI only up to the host part
        shown = uri if "@" not in uri else SCHEME + "***@" + uri.rsplit("@", 1)[1]
        raise CheckpointError(
            f"{shown!r}: expected hf://ORG/NAME (the revision goes in --revision; a token never "
            "goes into the URI: use HF_TOKEN or --hf-token-file)"
        )
    return repo_id


def check_revision(revision: str) -> str:
    """Branch, tag or sha; it names a file under the cache's ``refs/``, so it must stay there
    (``refs/pr/1`` is a valid revision, ``../x`` is not)."""
    if posixpath.normpath(revision) != revision or revision.startswith(("/", "..")):
        raise CheckpointError(f"--revision {revision!r}: not a branch, tag or commit sha")
    return revision


def read_token(token_file: str | None) -> str | None:
    """The token from a mounted Secret file, else ``HF_TOKEN``; never echoed in messages."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise CheckpointError(
                f"{token_file}: cannot read the token file: {e.strerror}"
            ) from None
        if not token:
            raise CheckpointError(f"{token_file}: the token file is empty")
        return token
    return os.environ.get("HF_TOKEN") or None


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as set now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return constants.is_offline_mode() or value in {"1", "ON", "YES", "TRUE"}


class HfSource(LocalSource):
    """The commit's snapshot folder in the hub cache, read as a local folder."""

    def __init__(
        self,
        uri: str,
        *,
        revision: str | None = None,
        token_file: str | None = None,
        cache_dir: str | None = None,
        endpoint: str | None = None,
        commit: str | None = None,
        fetch: bool = True,
        timeouts: Timeouts | None = None,
    ) -> None:
        """``commit``: the one ``resolve`` found for ``revision`` (fetched, and recorded as the
        revision's ref); ``fetch=False`` (``resolve``): the commit only, no source then."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        self.timeouts = timeouts or Timeouts.from_env()
        self.repo_id = parse_hf_uri(uri)
        self.revision = check_revision(revision or DEFAULT_REVISION)
        if commit is not None and not _COMMIT.fullmatch(commit):
            raise CheckpointError(f"{commit!r}: not a commit sha")
        self.pinned = commit
        self._token = read_token(token_file)
        self.cache_dir = Path(cache_dir or constants.HF_HUB_CACHE).absolute()
        endpoint = endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        self.endpoint = endpoint.rstrip("/")
        self.storage = self.cache_dir / repo_folder_name(repo_id=self.repo_id, repo_type="model")
        try:
            if hub_offline():
                self.commit = self._from_cache()
            elif not fetch:
                pinned = _COMMIT.fullmatch(self.revision)  # a commit never moves: no request
                self.commit = self.revision if pinned else str(self._model_info().sha)
            else:
                self.commit = self._download()
        except CheckpointError as e:
            raise CheckpointError(self._redact(str(e))) from None
        except Exception as e:
            raise CheckpointError(self._redact(self._describe(e))) from None
        if not fetch:
            return
        super().__init__(str(self.storage / "snapshots" / self.commit), allowed_root=self.storage)
        self.uri = f"{SCHEME}{self.repo_id}"

    @classmethod
    def from_uri(
        cls,
        uri: str,
        *,
        revision: str | None = None,
        hf_token_file: str | None = None,
        cache_dir: str | None = None,
        timeouts: Timeouts | None = None,
        commit: str | None = None,
        **_: Any,
    ) -> HfSource:
        return cls(
            uri,
            revision=revision,
            token_file=hf_token_file,
            cache_dir=cache_dir,
            timeouts=timeouts,
            commit=commit,
        )

    @classmethod
    def resolve(
        cls,
        uri: str,
        *,
        revision: str | None = None,
        hf_token_file: str | None = None,
        cache_dir: str | None = None,
        timeouts: Timeouts | None = None,
        **_: Any,
    ) -> str:
        """The commit ``revision`` names now, without fetching a file: the source identity the
        digest is taken from, before any download (and for ``modelstage resolve``)."""
        return cls(
            uri,
            revision=revision,
            token_file=hf_token_file,
            cache_dir=cache_dir,
            timeouts=timeouts,
            fetch=False,
        ).commit

    @classmethod
    def resolve_config(
        cls,
        uri: str,
        *,
        revision: str | None = None,
        hf_token_file: str | None = None,
        cache_dir: str | None = None,
        timeouts: Timeouts | None = None,
        **_: Any,
    ) -> tuple[str, Any]:
        """The commit ``revision`` names now and ``config.json`` at it (one small file, into the
        hub cache): ``modelstage resolve`` reports the architecture and quantization it names."""
        hub = cls(
            uri,
            revision=revision,
            token_file=hf_token_file,
            cache_dir=cache_dir,
            timeouts=timeouts,
            fetch=False,
        )
        try:
            return hub.commit, hub._config()
        except CheckpointError as e:
            raise CheckpointError(hub._redact(str(e))) from None
        except Exception as e:
            raise CheckpointError(hub._redact(hub._describe(e))) from None

    def _config(self) -> Any:
        from huggingface_hub import hf_hub_download

        timeout = self._http_timeout()

        def download() -> str:
            return hf_hub_download(
                self.repo_id,
                "config.json",
                revision=self.commit,
                cache_dir=self.cache_dir,
                endpoint=self.endpoint,
                token=self._token,
                library_name="modelstage",
                etag_timeout=timeout,
            )

        path = Path(self._retrying("config.json", download))
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{SCHEME}{self.repo_id}: config.json is too large")
        return parse_json(path.read_bytes(), "config.json")

    # --- resolving and fetching -------------------------------------------------------------
    def _from_cache(self) -> str:
        """Offline: the commit from ``refs/<revision>`` (or the revision itself, a sha)."""
        commit = self.pinned or self.revision
        if not _COMMIT.fullmatch(commit):
            ref = self.storage / "refs" / self.revision
            commit = ref.read_text().strip() if ref.is_file() else ""
        if not _COMMIT.fullmatch(commit) or not (self.storage / "snapshots" / commit).is_dir():
            raise CheckpointError(
                f"{SCHEME}{self.repo_id}: HF_HUB_OFFLINE is set and the hub cache "
                f"{self.cache_dir} holds no snapshot for revision {self.revision!r}; fill the "
                "cache first (e.g. `hf download`) or unset HF_HUB_OFFLINE"
            )
        return commit

    def _download(self) -> str:
        from huggingface_hub import constants
        from huggingface_hub.utils.tqdm import disable_progress_bars

        disable_progress_bars()  # carriage-return bars garble pod logs; Progress reports below
        # Downloads read this at each request (a whole number of seconds, for its retries).
        constants.HF_HUB_DOWNLOAD_TIMEOUT = math.ceil(self.timeouts.read)
        timeout = self._http_timeout()
        info = self._model_info(files_metadata=True)
        commit = str(info.sha)
        siblings = info.siblings or []
        files = sorted(s.rfilename for s in siblings)
        sizes = {s.rfilename: s.size for s in siblings if isinstance(s.size, int)}
        snapshot = self.storage / "snapshots" / commit
        progress: Progress | None = None

        def fetch(name: str) -> str:
            bar = _bar_class(progress, known=name in sizes) if progress is not None else None
            return self._fetch(name, commit, timeout, bar)

        needed = self._needed(files, fetch)
        missing = [n for n in needed if not (snapshot / n).exists()]
        total = sum(sizes.get(n, 0) for n in missing)
        unknown = sum(1 for n in missing if n not in sizes)
        print(
            f"hf: fetching {len(missing)} of {len(needed)} files ({human_bytes(total)}"
            f"{f' + {unknown} of unknown size' if unknown else ''}) of {self.repo_id} at "
            f"{commit} (revision {self.revision}) into {self.cache_dir}",
            file=sys.stderr,
        )
        progress = Progress(
            total, len(missing), label=f"hf: downloading {self.repo_id}", items="files"
        )

        def fetch_counted(name: str) -> str:
            path = fetch(name)
            if name in missing:
                assert progress is not None
                progress.tensor_done()
            return path

        with ThreadPoolExecutor(DOWNLOAD_WORKERS, thread_name_prefix="hf-get") as pool:
            list(pool.map(fetch_counted, needed))
        if missing:
            progress.finish()
        self._write_ref(commit)
        return commit

    def _fetch(self, name: str, commit: str, timeout: float, bar: Any) -> str:
        """One file of the commit into the hub cache (retried); its path."""
        from huggingface_hub import hf_hub_download

        def download() -> Any:
            return hf_hub_download(
                self.repo_id, name, revision=commit, cache_dir=self.cache_dir,
                endpoint=self.endpoint, token=self._token, library_name="modelstage",
                etag_timeout=timeout, tqdm_class=bar,
            )  # fmt: skip

        return str(self._retrying(name, download))

    def _model_info(self, *, files_metadata: bool = False) -> Any:
        """The Hub's model info at the revision (or the commit ``resolve`` pinned), with its
        commit sha checked: one request, retried on transient failures."""
        from huggingface_hub import HfApi, constants

        # Telemetry makes huggingface_hub fetch a registry from the endpoint (and cache it
        # under HF_HOME) to describe the caller in its User-Agent: a request the stager does
        # not need, from pods whose egress may allow only the Hub's file endpoints.
        constants.HF_HUB_DISABLE_TELEMETRY = True
        timeout = self._http_timeout()
        api = HfApi(endpoint=self.endpoint, token=self._token, library_name="modelstage")
        info = self._retrying(
            "the model info",
            lambda: api.model_info(
                self.repo_id,
                revision=self.pinned or self.revision,
                files_metadata=files_metadata,
                timeout=timeout,
            ),
        )
        if not _COMMIT.fullmatch(str(info.sha or "")):
            raise CheckpointError(
                f"{SCHEME}{self.repo_id}: the Hub answered without a commit sha for revision "
                f"{self.revision!r}; is HF_ENDPOINT a Hugging Face Hub?"
            )
        return info

    def _http_timeout(self) -> float:
        """huggingface_hub hands its ``timeout`` arguments on to its httpx client, which takes
        a ``Timeout`` with separate connect and read limits (the annotations say float)."""
        import httpx2

        t = self.timeouts
        return cast(float, httpx2.Timeout(t.read, connect=t.connect))

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call`` with retries on transient failures (timeouts, dropped connections, 429,
        5xx), each announced on stderr; exponential backoff with full jitter."""
        attempts = self.timeouts.attempts
        for attempt in range(1, attempts + 1):
            try:
                return call()
            except Exception as e:
                if attempt == attempts or not _transient(e):
                    raise
                print(
                    f"hf: {what}: {self._redact(_reason(e, self.timeouts))}; retrying "
                    f"({attempt}/{self.timeouts.retries})",
                    file=sys.stderr,
                )
                time.sleep(random.uniform(0, min(RETRY_CAP_S, RETRY_BASE_S * 2**attempt)))
        raise AssertionError("unreachable")

    def _needed(self, files: list[str], fetch: Callable[[str], str]) -> list[str]:
        """The files the stager reads, from the repo's listing (and its index, fetched first)."""
        top = [f for f in files if "/" not in f]
        if INDEX in top:
            path = Path(fetch(INDEX))
            if path.stat().st_size > MAX_JSON_BYTES:
                raise CheckpointError(f"{INDEX}: too large for a JSON file here")
            index = parse_json(path.read_bytes(), INDEX, max_values=INDEX_VALUES)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{INDEX}: 'weight_map' must map tensor names to file names")
            weights = sorted({safe_name(str(v), INDEX) for v in weight_map.values()})
            absent = [w for w in weights if w not in files]
            if absent:
                raise CheckpointError(
                    f"{SCHEME}{self.repo_id}: {INDEX} names files the repo does not hold: "
                    + ", ".join(absent[:5])
                )
            weights.append(INDEX)
        else:
            weights = [f for f in top if f.endswith(".safetensors")]
        if not weights:
            others = [f for f in top if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
            raise CheckpointError(
                f"{SCHEME}{self.repo_id}@{self.revision}: no safetensors weights"
                + (
                    f" (only {', '.join(others[:3])}); modelstage reads safetensors only, since "
                    "unpickling can run arbitrary code"
                    if others
                    else ""
                )
            )
        return sorted({*weights, *(f for f in CARRIED_OVER if f in top)})

    def _write_ref(self, commit: str) -> None:
        """Record ``refs/<revision>`` as the library does, so an offline rerun by branch name
        finds this snapshot; best effort (a read-only cache still works for this run)."""
        if self.revision == commit:
            return
        ref = self.storage / "refs" / self.revision
        try:
            ref.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(ref, commit.encode(), 0o644)
        except OSError:
            pass

    # --- errors ------------------------------------------------------------------------------
    def _describe(self, e: BaseException) -> str:
        """One line a person can act on, for what huggingface_hub and httpx raise."""
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo = f"{SCHEME}{self.repo_id}"
        token = "HF_TOKEN or --hf-token-file"
        if isinstance(e, GatedRepoError):
            return (
                f"{repo} is gated: {'the token (' + token + ') has' if self._token else 'no token'}"
                " no access; accept the model's terms on the Hub with the token's account, and "
                f"pass a token with read access ({token})"
            )
        if isinstance(e, RepositoryNotFoundError):
            return f"{repo}: repository not found, or private and " + (
                f"the token ({token}) cannot read it"
                if self._token
                else f"no token given ({token})"
            )
        if isinstance(e, RevisionNotFoundError):
            return f"{repo}: revision {self.revision!r} not found (a branch, tag or commit sha)"
        if isinstance(e, RemoteEntryNotFoundError):
            return f"{repo}@{self.revision}: a listed file is missing on the Hub: {_first_line(e)}"
        if isinstance(e, HfHubHTTPError):
            status = e.response.status_code if e.response is not None else "?"
            hint = f"; check the token's permissions ({token})" if status in (401, 403) else ""
            return f"{repo}: the Hub refused the request (HTTP {status}){hint}"
        cause = _network_cause(e)
        if cause is not None and "Timeout" in type(cause).__name__:
            return (
                f"{repo}: the Hub at {self.endpoint} did not answer in time "
                f"({_reason(cause, self.timeouts)}, {self.timeouts.attempts} attempts); check "
                "HF_ENDPOINT and the network, raise --read-timeout / --retries, or stage from a "
                "pre-filled cache with HF_HUB_OFFLINE=1"
            )
        if cause is not None:
            e = cause
        if type(e).__module__.startswith(("httpx", "httpcore")):
            return (
                f"{repo}: cannot reach the Hub at {self.endpoint} ({type(e).__name__}); check "
                "HF_ENDPOINT and the network, or stage from a pre-filled cache with "
                "HF_HUB_OFFLINE=1"
            )
        if isinstance(e, OSError):
            return f"{repo}: writing the hub cache {self.cache_dir} failed: {_first_line(e)}"
        return f"{repo}: {type(e).__name__}: {_first_line(e)}"

    def _redact(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text

    # --- identity ----------------------------------------------------------------------------
    def identity(self, files: list[str]) -> dict[str, Any]:
        """The commit pins every byte of the repo; names and sizes make the manifest readable."""
        return {
            "kind": "hf",
            "repo": self.repo_id,
            "commit": self.commit,
            "files": [{"name": n, "size": self.size(n)} for n in files],
        }


def _network_cause(e: BaseException) -> BaseException | None:
    """The HTTP client's exception behind ``e``: itself, or what huggingface_hub wrapped
    (it reports a failed metadata request as ``LocalEntryNotFoundError`` from it)."""
    seen = 0
    while e is not None and seen < 5:
        if type(e).__module__.startswith(("httpx", "httpcore")):
            return e
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
        seen += 1
    return None


def _transient(e: BaseException) -> bool:
    """Worth another attempt: a timeout, a dropped or refused connection, 429 or 5xx."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else 0
        return status == 429 or status >= 500
    cause = _network_cause(e)
    if cause is None:
        return False
    name = type(cause).__name__
    return "Timeout" in name or name in (
        "ConnectError",
        "ReadError",
        "WriteError",
        "NetworkError",
        "RemoteProtocolError",
        "CloseError",
    )


def _reason(e: BaseException, timeouts: Timeouts) -> str:
    """``no answer within 60 s (ReadTimeout)``, ``ConnectError: ...``: what went wrong."""
    cause = _network_cause(e) or e
    name = type(cause).__name__
    if name == "ConnectTimeout":
        return f"no connection within {timeouts.connect:g} s ({name})"
    if "Timeout" in name:
        return f"no answer within {timeouts.read:g} s ({name})"
    return f"{name}: {_first_line(cause)}"


def _bar_class(progress: Progress, *, known: bool) -> type:
    """A stand-in for tqdm that huggingface_hub's ``http_get`` drives (``tqdm_class``): it
    counts the bytes of one file into ``progress``. ``known``: the file's size is already in
    the total (from the model info); otherwise the bar adds it when the response says it."""

    class Bar:
        def __init__(self, *_: Any, total: int | None = None, initial: int = 0, **__: Any) -> None:
            if not known and total:
                progress.add_total(total)
            if initial:
                progress.advance(initial)

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def update(self, n: int | float | None = 1) -> None:
            if n:
                progress.advance(int(n))

        def close(self) -> None:
            pass

    return Bar


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
