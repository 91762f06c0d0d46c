"""Serving the app with uvicorn: headless in the foreground, or on a thread beside the TUI."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from lucedesk.errors import ConfigError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(host: str, extra: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The Host names a server bound to `host` answers to: a loopback one to its own names
    and those `extra` allows ('*': any); one other machines reach (with a key) to any."""
    from lucedesk.server.app import LOOPBACK_HOSTS

    if not is_loopback(host) or "*" in extra:
        return None
    return (*LOOPBACK_HOSTS, host.strip("[]"), *extra)


def check_host(host: str, api_key: str | None) -> None:
    """Anything beyond this machine must present a key."""
    if not is_loopback(host) and not api_key:
        raise ConfigError(
            f"refusing to listen on {host}, which other machines can reach, without an API key "
            "(--api-key or LUCEDESK_API_KEY)"
        )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@dataclass
class RunningServer:
    server: uvicorn.Server
    thread: threading.Thread | None
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)


def make_server(app: FastAPI, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=2
    )
    return uvicorn.Server(config)


def start_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8642, log_level: str = "warning"
) -> RunningServer:
    """Serve on a background thread; returns once the socket is listening (port 0 picks a
    free port)."""
    sock = bind(host, port)
    server = make_server(app, log_level)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="lucedesk-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return RunningServer(server, thread, host, sock.getsockname()[1])


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    sock = bind(host, port)
    make_server(app, log_level).run(sockets=[sock])
