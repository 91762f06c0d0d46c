"""The one error a tool raises on purpose. A leaf module: the workspace, the tools and the
session all raise or catch it without importing each other."""

from __future__ import annotations


class ToolError(Exception):
    """A tool could not do what was asked; the message goes to the model as the result."""
