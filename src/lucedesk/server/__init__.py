"""OpenAI-compatible HTTP on the shared engine."""

from lucedesk.server.app import create_app
from lucedesk.server.run import RunningServer, check_host, start_server

__all__ = ["RunningServer", "check_host", "create_app", "start_server"]
