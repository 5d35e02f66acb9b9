"""User-facing errors. The CLI prints their message and exits non-zero, without a traceback."""


class TpshardError(Exception):
    """An error the user can fix: bad input, bad options, a broken output. Exit code 2."""

    exit_code = 2


class CheckpointError(TpshardError):
    """The source checkpoint is missing, unreadable, or disagrees with its config."""


class TopologyError(TpshardError):
    """The requested parallel layout does not fit (sizes that do not divide).

    The message names Topology's fields (attn_dp=3); `flags` says the same in the CLI's options
    (--attn-dp 3), which the CLI prints instead."""

    def __init__(self, message: str, flags: str | None = None):
        super().__init__(message)
        self.flags = message if flags is None else flags


class PlanError(TpshardError):
    """A tensor cannot be sharded as asked (no rule, heads not dividing, misaligned quantization)."""


class OutputError(TpshardError):
    """The output folder exists, is incomplete, or is not a tpshard output."""


class UsageError(TpshardError):
    """An option value out of range (--workers, --ranks, ...)."""


class CheckFailed(TpshardError):
    """`check` or `verify` found a mismatch. Exit code 1: the output is wrong, not the command."""

    exit_code = 1
