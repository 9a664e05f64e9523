"""One exception type per domain. Messages name the file, tensor or field and what to do.

The CLI prints ``str(error)`` as its last line (the pod's termination message) and exits 1;
a traceback is for bugs only. Never put a credential in a message.
"""

import sys


class ModelstageError(Exception):
    """Base of every error a user can act on."""


class CheckpointError(ModelstageError):
    """The source checkpoint is unreadable, malformed or unsupported."""


class SpecError(ModelstageError):
    """The request (TP, dtype, format, versions) can never work for this checkpoint."""


class ArtifactError(ModelstageError):
    """An artifact is incomplete, foreign, corrupt or does not match what was expected."""


class DestinationError(ModelstageError):
    """The destination cannot be written (permissions, space, remote store errors)."""


def json_fault(error: ValueError) -> str:
    """Why untrusted JSON did not parse, in the reader's words: Python's digit limit names the
    interpreter's own setting, which the person who wrote the file cannot change."""
    text = str(error)
    if "integer string conversion" in text:
        return f"a number of more than {sys.get_int_max_str_digits()} digits"
    return text.splitlines()[0][:200]
