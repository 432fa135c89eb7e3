"""One exception tree. The CLI maps each class to an exit code that scripts can rely on.

Exit codes: 0 success, 1 runtime error (bad checkpoint, mismatch, failed output check),
2 recipe / usage error.
"""


class MoemergeError(Exception):
    """Base of every error moemerge raises on purpose. Its message is meant for the user."""

    exit_code = 1


class RecipeError(MoemergeError):
    """The recipe (or a CLI option) is invalid: names the file and the field."""

    exit_code = 2


class CheckpointError(MoemergeError):
    """A checkpoint is missing, truncated, unreadable or in a refused format: names the file."""


class MismatchError(MoemergeError):
    """Models that must agree do not (architecture, shape, vocabulary): names tensor and models."""


class OutputError(MoemergeError):
    """The output cannot be written safely, or failed its own check after writing."""


class CacheError(MoemergeError):
    """A cache entry that someone else could have written is not used: names the path."""


class ToolError(MoemergeError):
    """An outside tool moemerge runs (llama.cpp's converter, the C compiler) failed, timed out
    or left no proper output: names the tool and what it did."""


class Note(UserWarning):
    """Something the user should know that is not a problem with their input (the kernel being
    compiled, a fallback taken); the CLI prints it as `note: ...` on stderr."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every cleanup an interrupt runs (temporary
    directories removed, old outputs kept) runs for it too. Exit code 143 (128 + SIGTERM)."""
