"""Errors a user can cause and fix. Each carries a one-line message that names the problem;
the CLI, the server and the TUI show that message instead of a traceback."""

from __future__ import annotations


class LucedeskError(Exception):
    """Base of every error that is the user's to fix (a file, a field, a setting)."""


class ModelLoadError(LucedeskError):
    """A model file or folder that cannot be loaded: says which file and which tensor or key."""


class ConfigError(LucedeskError):
    """A profile or setting that is not valid: says which file, which key and what is allowed."""


class RequestError(LucedeskError):
    """A request that can never be served as asked (invalid sampling field, too long...)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextOverflow(RequestError):
    """A prompt longer than the context holds (with room for at least one output token):
    each protocol answers it in its own words, so clients know to compact."""

    def __init__(self, num_tokens: int, limit: int, field: str | None = None) -> None:
        super().__init__(
            f"the prompt ({num_tokens} tokens) leaves no room in the context of {limit} tokens",
            field,
        )
        self.num_tokens, self.limit = num_tokens, limit


class PullError(LucedeskError):
    """The default model could not be fetched or verified."""
