"""The TUI's engine and in-process HTTP server: started, switched to another profile or
model, stopped. Blocking methods here run on a worker thread, never on the event loop."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lucedesk import profile as profiles
from lucedesk.catalog.resolve import Resolved, resolve
from lucedesk.catalog.settings import chat_template
from lucedesk.catalog.summary import summarize_path
from lucedesk.engine import (
    BuiltEngine,
    Engine,
    EngineNotReady,
    check_device,
    fit_now,
    kernel_build_notice,
    launch_engine,
)
from lucedesk.errors import ConfigError, LucedeskError
from lucedesk.server import RunningServer, allowed_hosts_for, create_app, start_server

log = logging.getLogger(__name__)
Say = Callable[[str], None]


def transfer_line(say: Say, every: float = 0.5) -> Callable[[str, int, int], None]:
    """A download's progress as one line said at most every `every` seconds."""
    from lucedesk.catalog.download import transfer_text

    last = [0.0]

    def transferred(path: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < every and done < total:
            return
        last[0] = now
        say("downloading " + transfer_text(path, done, total))

    return transferred


class EngineHost:
    def __init__(
        self,
        model: str | None,
        profile_name: str | None,
        overrides: list[str],
        http: bool = True,
        host: str = "127.0.0.1",
        port: int = 8642,
        allowed_hosts: list[str] | None = None,
        allowed_origins: list[str] | None = None,
        chat_template_file: str | None = None,
        remembered: str | None = None,
    ) -> None:
        self.model_arg = model  # --model; without it, the model last used (`remembered`)
        self.remembered = remembered
        self.chat_template_file = chat_template_file
        self.profile_name = profile_name
        self.overrides = overrides
        self.http, self.host, self.port = http, host, port
        self.allowed_hosts = allowed_hosts_for(host, allowed_hosts or [])
        self.allowed_origins = allowed_origins or []
        self.model: Resolved | None = None
        self.built: BuiltEngine | None = None
        self.profile: profiles.Profile | None = None
        self.config = None
        self.why = ""
        self.server: RunningServer | None = None
        self.http_error: str | None = None
        self.stopped_because: str | None = None  # a switch and its way back both failed
        self._switching = threading.Lock()

    @property
    def engine(self) -> Engine:
        """The running engine; while one loads (start, a switch), requests are refused as a
        full queue is (HTTP 503: try again)."""
        built = self.built
        if built is None:
            if self.stopped_because:
                raise EngineNotReady(f"no model runs: {self.stopped_because}")
            raise EngineNotReady("the engine is loading a model; try again in a moment")
        return built.engine

    @property
    def model_path(self) -> Path | None:
        return self.model.path if self.model else None

    @property
    def model_name(self) -> str:
        """What the running model is called, as --model and /model take it (a file by its
        whole path, so it means the same from any folder)."""
        if self.model is None:
            return ""
        return self.model.name or str(self.model.path.resolve())

    @property
    def url(self) -> str | None:
        return self.server.url if self.server else None

    def _template(self, model: Resolved) -> str | None:
        return chat_template(model.name or str(model.path), self.chat_template_file)

    def start(self, progress: Say) -> None:
        self.profile, self.config, self.why = profiles.resolve(self.profile_name, self.overrides)
        progress(f"profile {self.profile.name}: {self.why}")
        if self.http:  # listening first: clients get 503 "starting" until the model serves
            progress(f"starting HTTP on {self.host}:{self.port}")
            try:
                app = create_app(
                    lambda: self.engine,
                    allowed_hosts=self.allowed_hosts,
                    allowed_origins=self.allowed_origins,
                )
                self.server = start_server(app, self.host, self.port)
            except Exception as exc:  # the TUI works without HTTP; say why it is off
                self.http_error = str(exc)
                log.warning("HTTP server not started: %s", exc)
        self.model = self._first_model(progress)
        template = self._template(self.model)
        notice = kernel_build_notice(self.config)  # built while the model loads
        shown = self.model.name or self.model.path.name
        progress(f"loading {shown}" + (f"; {notice}" if notice else ""))
        self.built = launch_engine(
            self.model.path, self.config, progress, self.model.name, template
        )

    def _first_model(self, progress: Say) -> Resolved:
        """--model, else the model last used, else the default; a remembered one no longer
        on this machine gives way to the default, saying so (nothing is fetched unasked)."""
        fit = fit_now(self.config)
        if self.model_arg is not None or self.remembered is None:
            return resolve(self.model_arg, progress, fit, transfer_line(progress))
        try:
            return resolve(self.remembered, progress, fit, fetch=False)
        except LucedeskError as exc:
            progress(f"the model last used is not available ({exc}); starting the default")
            return resolve(None, progress, fit, transfer_line(progress))

    def given_back(self, device) -> int:
        """About what the running engine holds on `device` (its KV pool and weights): what
        a switch to a model on the same device may count as free."""
        built = self.built
        if built is None or self.model is None or built.device.type != device.type:
            return 0
        return built.pool_bytes + fit_now(self.config).need(summarize_path(self.model.path)).weights

    def switch(
        self,
        profile_name: str,
        drain: bool,
        progress: Say,
        model: str | None = None,
    ) -> None:
        """Rebuild the engine with another profile (or model: any name `resolve` takes,
        fetched first where it is not here): running requests finish (drain) or end
        cancelled, then the model is loaded under the new settings. What can be checked
        first is (the profile, the device, the model's files and whether it fits): such a
        switch fails with the engine untouched. One that fails while loading brings the old
        settings back with the KV pool it had, and says so."""
        if not self._switching.acquire(blocking=False):
            raise LucedeskError("another switch is under way; wait for it to end")
        try:
            self._switch(profile_name, drain, progress, model)
        finally:
            self._switching.release()

    def _switch(self, profile_name: str, drain: bool, progress: Say, model: str | None) -> None:
        chosen, config, why = profiles.resolve(profile_name, self.overrides)
        device = check_device(config)
        fit = fit_now(config, self.given_back(device))
        target = self.model
        if model is not None:
            target = resolve(model, progress, fit, transfer_line(progress))
        assert target is not None
        problem = fit.why_not(summarize_path(target.path))
        if problem is not None:
            raise ConfigError(f"{target.name or target.path.name}: {problem}")
        template = self._template(target)
        old_pool = self.built.pool_tokens if self.built is not None else self.config.kv_pool_tokens
        progress("finishing running requests" if drain else "cancelling running requests")
        self._release(drain)
        progress(f"loading {target.name or target.path.name} with profile {chosen.name}")
        try:
            self.built = launch_engine(
                target.path, config, name=target.name, chat_template=template
            )
        except Exception as exc:
            log.exception("switch to profile %s failed", chosen.name)
            self._free_device(device)
            try:  # the model that ran, with the pool it had, unchecked: it ran in this memory
                self.built = launch_engine(
                    self.model.path,
                    dataclasses.replace(self.config, kv_pool_tokens=old_pool),
                    name=self.model.name,
                    chat_template=self._template(self.model),
                    check_fit=False,
                )
            except Exception as again:
                log.exception("the engine could not be started again")
                self.stopped_because = f"{exc}; starting {self.model_name} again failed: {again}"
                raise LucedeskError(
                    f"{self.stopped_because}; no model runs now (/model or F7 loads one)"
                ) from None
            raise LucedeskError(
                f"{exc}; the engine runs again with profile {self.profile.name} and "
                f"{self.model_name}"
            ) from None
        self.model = target
        self.stopped_because = None
        self.profile, self.profile_name, self.config, self.why = chosen, chosen.name, config, why

    def _release(self, drain: bool) -> None:
        """The running engine stopped and its memory given back before another loads."""
        built, self.built = self.built, None
        if built is None:
            return
        built.engine.shutdown(drain=drain, timeout=60)
        device = built.device
        del built
        self._free_device(device)

    @staticmethod
    def _free_device(device) -> None:
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def stop(self) -> None:
        """Generation first (every request cancelled, so open HTTP streams end at once),
        then the server: stopped the other way round it waited for those streams."""
        if self.built is not None:
            self.built.engine.shutdown()
        if self.server is not None:
            self.server.stop()
            self.server = None
