"""OpenAI-compatible HTTP on the shared engine."""

from lucedesk.server.app import create_app
from lucedesk.server.run import RunningServer, allowed_hosts_for, check_host, start_server

__all__ = ["RunningServer", "allowed_hosts_for", "check_host", "create_app", "start_server"]
