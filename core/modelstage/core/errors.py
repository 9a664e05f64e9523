"""One exception type per domain. Messages name the file, tensor or field and what to do.

The CLI prints ``str(error)`` as its last line (the pod's termination message) and exits 1;
a traceback is for bugs only. Never put a credential in a message.
"""


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
