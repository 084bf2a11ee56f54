"""The one error type for bad input.

Every rule of docs/rules.md that rejects input raises `InputError`. Its message names the offending
value and where it came from (``path:line``, ``path:row N``, or a field path), so the command
line can print it as is and exit with status 2.
"""

from __future__ import annotations


class InputError(ValueError):
    """Invalid input: a manifest, dataset, plan, contract, report or argument that breaks a rule.

    `where` is the location (file and line/row, or a field path); `message` says what is wrong and
    quotes the offending value.
    """

    def __init__(self, where: str, message: str):
        self.where = str(where)
        self.message = message
        super().__init__(f"{self.where}: {message}" if self.where else message)

    # Pickled whole, e.g. from a Ray worker to its driver.
    def __reduce__(self) -> tuple[type[InputError], tuple[str, str]]:
        return type(self), (self.where, self.message)


class InfrastructureError(RuntimeError):
    """The machinery that runs a job failed, not its input and not the code: a worker process died
    (the OOM killer, a crash), workers did not answer before the job's deadline, a reservation was
    not granted. The command line exits 1 (docs/operations.md#exit-codes) with this message, which
    names what failed and what was (not) published, and no traceback."""


def exc_summary(exc: BaseException) -> str:
    """'TypeName: first line of the message', for a warning that names why a fast path fell back."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def show(value: object, limit: int = 80) -> str:
    """A short printable rendering of an offending value for error messages."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        value = value[:limit]  # a 50 MB string is never copied whole into a repr
        return repr(value)[: limit - 3] + "..."
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def require_int(value: object, where: str, minimum: int = 1) -> int:
    """Return `value` if it is an integer (never a bool) >= `minimum`, else raise an InputError
    naming `where` and the value. The one check behind every count setting (sizes, steps, GPUs)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InputError(where, f"must be an integer >= {minimum}, got {show(value)}")
    return value


# Exit status of a command whose gate refused the critic (the report is published all the same).
EXIT_GATE_FAILED = 3
