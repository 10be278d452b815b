"""The one exception type lithos raises for problems a user can fix.

Every message names the problem and the fix; the CLI prints it without a traceback.
"""


class LithosError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""


class CheckpointError(LithosError):
    """A checkpoint is missing, corrupt, or describes something lithos cannot run."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or an option in its config is not implemented."""


class CacheFullError(LithosError):
    """A prompt (plus the tokens asked for) does not fit in the KV cache."""
