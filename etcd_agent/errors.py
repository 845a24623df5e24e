"""One exception hierarchy for the whole agent.

Every error carries the exit code the CLI maps it to, and a one-line message meant for an
operator. Library code raises; only ``etcd_agent.cli.main`` turns errors into exit codes.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_BUSY = 4


class AgentError(Exception):
    """Base of every error the agent raises on purpose."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, details: Optional[Sequence[str]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = list(details or [])

    def to_json(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": self.message, "details": self.details,
                "exit_code": self.exit_code}


class UsageError(AgentError):
    """Bad command line or arguments."""

    exit_code = EXIT_USAGE


class ConfigError(AgentError):
    """The configuration is unreadable or invalid; ``details`` lists every problem found."""

    exit_code = EXIT_USAGE


class RefusedError(AgentError):
    """A pre-check refused the operation; nothing was touched."""

    exit_code = EXIT_REFUSED


class BusyError(AgentError):
    """Another operation holds the lock."""

    exit_code = EXIT_BUSY


class OperationFailed(AgentError):
    """An operation failed; what it touched was rolled back or can be resumed."""

    exit_code = EXIT_FAILED


class CommandError(OperationFailed):
    """An external command failed (non-zero exit, could not start, or timed out)."""

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class CommandTimedOut(CommandError):
    """An external command did not finish within its timeout."""


class ProtocolError(OperationFailed):
    """Another agent (or a file) sent a document that is not what the protocol says: a field
    missing or of the wrong type. Raised where it is read, naming the field, never later."""


class HostUnreachable(OperationFailed):
    """A host could not be reached (connect, auth or host key failure)."""


class HostKeyRejected(HostUnreachable):
    """An SSH host key was unknown or did not match known_hosts."""


class EtcdError(OperationFailed):
    """An etcd call failed."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered in time."""


class EtcdUnhealthyCluster(EtcdError):
    """etcd refused a membership change because the cluster is not (yet) healthy."""


class EtcdPeerExists(EtcdError):
    """``member add`` refused: the peer URL is already a member's."""


class EtcdMemberNotFound(EtcdError):
    """The member named or numbered does not exist."""


class BackupError(OperationFailed):
    """A backup could not be written or read."""


class BackupCorrupt(BackupError):
    """A backup failed verification; ``details`` says exactly what."""


class SnapshotFormatError(BackupCorrupt):
    """An etcd snapshot's bbolt database is malformed (``etcd/snapdb``); the message says where."""


class CiphertextCorrupt(BackupCorrupt):
    """An age-encrypted snapshot is malformed, truncated or fails authentication (``etcd_agent.age``)."""


class IdentityRefused(RefusedError):
    """An age identity (``--identity FILE``) is missing, unusable, open to others, or holds no key
    that opens this backup: a refusal, nothing touched."""


class PartialChainShort(RefusedError):
    """A partial delta chain (its first segments not here: a restore from the bucket fetched only
    those after a checkpoint) does not hold what the replay needs; ``restore --from-bucket``
    fetches the rest and checks the whole chain."""


class RecipientInvalid(ConfigError):
    """An ``encrypt_to`` entry is not a usable age recipient; the message never quotes a secret key."""


class Interrupted(AgentError):
    """The operator interrupted the command (Ctrl-C / SIGTERM)."""

    exit_code = 130


def _classes() -> "dict[str, type[AgentError]]":
    out: "dict[str, type[AgentError]]" = {}
    stack: "list[type[AgentError]]" = [AgentError]
    while stack:
        cls = stack.pop()
        out[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return out


def error_from_json(data: Any, *, where: str = "") -> AgentError:
    """Rebuild an error another agent sent (``AgentError.to_json``): the same class, so the same
    exit code, and its message prefixed with ``where``. An unknown class (a newer agent) becomes
    an OperationFailed that still carries the sender's exit code; a malformed document fails too."""
    if not isinstance(data, dict):
        return OperationFailed(f"{where}malformed error reply")
    name = data.get("error")
    message = data.get("message")
    details = data.get("details")
    text = message if isinstance(message, str) else "error without a message"
    lines = [d for d in details if isinstance(d, str)] if isinstance(details, list) else []
    cls = _classes().get(name) if isinstance(name, str) else None
    if cls is None:
        err: AgentError = OperationFailed(f"{where}{text}", details=lines)
        code = data.get("exit_code")
        if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256:
            err.exit_code = code
        return err
    err = cls.__new__(cls)
    AgentError.__init__(err, f"{where}{text}", details=lines)
    if isinstance(err, CommandError):
        err.result = None
    return err
