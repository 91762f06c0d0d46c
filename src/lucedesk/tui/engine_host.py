"""The TUI's engine and in-process HTTP server: started, switched to another profile, stopped.
Blocking methods here run on a worker thread, never on the event loop."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from lucedesk import profile as profiles
from lucedesk.engine import BuiltEngine, Engine, check_device, kernel_build_notice, launch_engine
from lucedesk.errors import LucedeskError
from lucedesk.server import RunningServer, create_app, start_server

log = logging.getLogger(__name__)


class EngineHost:
    def __init__(
        self,
        model: str | None,
        profile_name: str | None,
        overrides: list[str],
        http: bool = True,
        host: str = "127.0.0.1",
        port: int = 8642,
    ) -> None:
        self.model_arg = model
        self.profile_name = profile_name
        self.overrides = overrides
        self.http, self.host, self.port = http, host, port
        self.model_path: Path | None = None
        self.built: BuiltEngine | None = None
        self.profile: profiles.Profile | None = None
        self.config = None
        self.why = ""
        self.server: RunningServer | None = None
        self.http_error: str | None = None

    @property
    def engine(self) -> Engine:
        assert self.built is not None, "the engine is not started yet"
        return self.built.engine

    @property
    def url(self) -> str | None:
        return self.server.url if self.server else None

    def start(self, progress: Callable[[str], None]) -> None:
        from lucedesk.pull import resolve_model

        self.profile, self.config, self.why = profiles.resolve(self.profile_name, self.overrides)
        progress(f"profile {self.profile.name}: {self.why}")
        self.model_path = resolve_model(self.model_arg, progress)
        notice = kernel_build_notice(self.config)  # built while the model loads
        progress(f"loading {self.model_path.name}" + (f"; {notice}" if notice else ""))
        self.built = launch_engine(self.model_path, self.config, progress)
        if self.http:
            progress(f"starting HTTP on {self.host}:{self.port}")
            try:
                self.server = start_server(create_app(lambda: self.engine), self.host, self.port)
            except Exception as exc:  # the TUI works without HTTP; say why it is off
                self.http_error = str(exc)
                log.warning("HTTP server not started: %s", exc)

    def switch(
        self,
        profile_name: str,
        drain: bool,
        progress: Callable[[str], None],
        model: str | None = None,
    ) -> None:
        """Rebuild the engine with another profile (or model): running requests finish
        (drain) or end cancelled, then the model is loaded under the new settings. What can
        be checked first is (the profile, the device, the model file): such a switch fails
        with the engine untouched. One that fails while loading brings the old settings
        back with the KV pool it had, and says so."""
        chosen, config, why = profiles.resolve(profile_name, self.overrides)
        check_device(config)
        new_path = self.model_path
        if model is not None:
            from lucedesk.engine import read_model_config

            read_model_config(model)  # a bad path or file fails here, before anything stops
            new_path = Path(model).expanduser()
        old = self.built
        progress("finishing running requests" if drain else "cancelling running requests")
        if old is not None:
            old.engine.shutdown(drain=drain, timeout=60)
        progress(f"loading {new_path.name} with profile {chosen.name}")
        try:
            self.built = launch_engine(new_path, config)
        except Exception as exc:
            log.exception("switch to profile %s failed", chosen.name)
            # the same pool as before: the memory the failed load left may differ
            pool = old.pool_tokens if old is not None else self.config.kv_pool_tokens
            self.built = launch_engine(
                self.model_path, dataclasses.replace(self.config, kv_pool_tokens=pool)
            )
            raise LucedeskError(
                f"{exc}; the engine runs again with profile {self.profile.name} and "
                f"{self.model_path.name}"
            ) from None
        self.model_path = new_path
        self.profile, self.profile_name, self.config, self.why = chosen, chosen.name, config, why

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.built is not None:
            self.built.engine.shutdown()
