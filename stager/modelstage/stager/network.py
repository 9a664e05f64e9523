"""How long the stager waits on the network, and how often it retries: one setting for every
remote it reads or writes (the Hugging Face Hub, S3).

A request that cannot connect within ``connect`` seconds, or that receives nothing for
``read`` seconds, is abandoned and retried (``retries`` times for Hub requests; S3 requests
are retried by botocore, see ``s3_client.S3Options.max_attempts``), so an endpoint that
accepts a connection and never answers fails with one clear line instead of hanging.
``--connect-timeout``, ``--read-timeout`` and ``--retries`` set them, else the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from modelstage.core.errors import SpecError

ENV_CONNECT = "MODELSTAGE_CONNECT_TIMEOUT"
ENV_READ = "MODELSTAGE_READ_TIMEOUT"
ENV_RETRIES = "MODELSTAGE_RETRIES"


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0
    """Seconds to establish a connection (TCP and TLS)."""
    read: float = 60.0
    """Seconds without a byte of the answer before the request is abandoned."""
    retries: int = 3
    """Further attempts of a Hub request that timed out or failed transiently (5xx, 429)."""

    def __post_init__(self) -> None:
        for name in ("connect", "read"):
            value = getattr(self, name)
            if not value > 0:
                raise SpecError(f"the {name} timeout must be a positive number of seconds")
        if self.retries < 0:
            raise SpecError("retries must be 0 or more")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        connect: float | None = None,
        read: float | None = None,
        retries: int | None = None,
    ) -> Timeouts:
        """Explicit values (the CLI's flags) first, then ``MODELSTAGE_*``, then defaults."""
        env = os.environ if env is None else env
        return cls(
            connect=connect if connect is not None else _number(env, ENV_CONNECT, cls.connect),
            read=read if read is not None else _number(env, ENV_READ, cls.read),
            retries=retries if retries is not None else int(_number(env, ENV_RETRIES, cls.retries)),
        )


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SpecError(f"{name}={raw!r} is not a number") from None
    if name == ENV_RETRIES and not value.is_integer():
        raise SpecError(f"{name}={raw!r} is not a whole number")
    return value
