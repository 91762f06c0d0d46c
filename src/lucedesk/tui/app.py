"""The lucedesk Textual app: owns the engine host and the session store; screens do the rest."""

from __future__ import annotations

from pathlib import Path

from textual.app import App, SystemCommand
from textual.screen import Screen

from lucedesk.agent import Approvals, Limits
from lucedesk.store import Store
from lucedesk.tui.agents import AgentRunner
from lucedesk.tui.engine_host import EngineHost
from lucedesk.tui.log_view import KeptLog
from lucedesk.tui.screens.loading import LoadingScreen

MODEL_SETTING = "model"  # the model last run: the next start's without --model


class LucedeskApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "lucedesk"

    def __init__(
        self,
        host: EngineHost,
        store: Store,
        workspace: Path | None = None,
        agent_type: str = "general",
        approvals: Approvals | None = None,
        mcp_config: Path | None = None,
        limits: Limits | None = None,
    ) -> None:
        super().__init__()
        self.host = host
        self.store = store
        self.workspace = (workspace or Path.cwd()).resolve()  # where new sessions' tools work
        self.agent_type = agent_type  # of new sessions: general, explore or chat (no tools)
        self.agents = AgentRunner(
            self, store, lambda: self.host.engine, approvals or Approvals(), limits or Limits()
        )
        self.mcp_config = mcp_config  # None: no MCP servers
        self.mcp = None
        # Typed on the loading screen; the main screen puts it in its first pane's input.
        self.pending_input = ""
        self.drafts: dict[int, str] = {}  # typed, not sent, in a session no pane shows now
        self.warned_tools: set[int] = set()  # sessions told their model has no tool format
        self.kept_log = KeptLog()  # the log view's lines (F9)

    def forget_if_unused(self, session) -> None:
        """A chat left without a word sent (and nothing typed for it) is not kept."""
        if session.kind != "chat" or session.messages or self.drafts.get(session.id):
            return
        if not self.agents.running(session.id):
            self.store.delete_session(session.id)

    def on_mount(self) -> None:
        self.kept_log.install()
        self.push_screen(LoadingScreen())

    def engine_ready(self) -> None:
        from lucedesk.tui.screens.main import MainScreen

        loading = next((s for s in self.screen_stack if isinstance(s, LoadingScreen)), None)
        self.pending_input = loading.typed() if loading is not None else ""
        self.update_subtitle()
        self.store.set_setting(MODEL_SETTING, self.host.model_name)
        if self.host.http_error:
            self.notify(f"HTTP is off: {self.host.http_error}", severity="warning", timeout=8)
        self.switch_screen(MainScreen())
        self.run_worker(self.start_mcp(), group="mcp", exit_on_error=False)

    def switch_model(self, name: str, say=None) -> None:
        """Load another model in place of the running one (any name --model takes, fetched
        first where it is not here); conversations stay. `say` shows its progress from the
        worker thread (by default in the title bar, `show_progress`)."""
        self.notify(f"Loading {name}; running replies finish first.")
        self.run_worker(
            lambda: self._switch_model(name, say),
            thread=True,
            exclusive=True,
            group="switch",
            exit_on_error=False,
        )

    def _switch_model(self, name: str, say=None) -> None:
        from lucedesk.errors import LucedeskError

        def in_title(text: str) -> None:
            self.call_from_thread(self.show_progress, text)

        try:
            self.host.switch(self.host.profile.name, True, say or in_title, model=name)
        except Exception as exc:  # said, never a silent worker failure
            text = str(exc) if isinstance(exc, LucedeskError) else f"{type(exc).__name__}: {exc}"
            self.call_from_thread(self.switch_failed, f"Model switch failed: {text}")
            return
        self.call_from_thread(self.engine_switched)

    def show_progress(self, text: str) -> None:
        """A switch's progress line, in the title bar until it ends."""
        self.sub_title = text

    def switch_failed(self, message: str) -> None:
        self.notify(message, severity="error", timeout=10)
        if self.host.built is not None:
            self.update_subtitle()

    def engine_switched(self) -> None:
        from lucedesk.tui.screens.models import ModelsScreen

        self.update_subtitle()
        self.store.set_setting(MODEL_SETTING, self.host.model_name)
        if isinstance(self.screen, ModelsScreen):  # picked there: back to the chats
            self.pop_screen()
        self.notify(
            f"Engine running {self.host.built.loaded.name} with profile {self.host.profile.name}."
        )

    def update_subtitle(self) -> None:
        host = self.host
        built = host.built
        kernels = f"{built.kernels} kernels" + (
            f", {built.weights} weights" if built.weights != "dtype" else ""
        )
        parts = [built.loaded.name, f"profile {host.profile.name}", kernels]
        parts.append(f"{host.url}/v1" if host.url else "HTTP off")
        self.sub_title = " · ".join(parts)

    def startup_failed(self, message: str) -> None:
        self.exit(return_code=2, message=f"lucedesk: error: {message}")

    def get_system_commands(self, screen: Screen):
        yield from super().get_system_commands(screen)
        from lucedesk.tui.screens.main import MainScreen

        if not isinstance(screen, MainScreen):
            return
        for binding in screen.BINDINGS:
            yield SystemCommand(
                binding.description,
                f"key: {binding.key}",
                lambda action=binding.action: screen.run_action(action),
            )

    async def start_mcp(self) -> None:
        """MCP servers from the config file add their tools to every agent session."""
        if self.mcp_config is None:
            return
        from lucedesk.agent.mcp import McpHub, load_mcp_config
        from lucedesk.errors import ConfigError

        try:
            servers = load_mcp_config(self.mcp_config)
        except ConfigError as exc:
            self.notify(f"MCP servers are off: {exc}", severity="error", timeout=10)
            return
        if not servers:
            return
        self.mcp = McpHub()
        await self.mcp.start(servers)
        self.agents.extra_tools.extend(self.mcp.tools)
        for name, error in self.mcp.errors.items():
            self.notify(f"MCP server {name} is off: {error}", severity="warning", timeout=10)
        if self.mcp.tools:
            self.notify(f"{len(self.mcp.tools)} tools from MCP servers.")

    async def on_unmount(self) -> None:
        from lucedesk.tui.screens.main import MainScreen

        main = next((s for s in self.screen_stack if isinstance(s, MainScreen)), None)
        if main is not None:
            for pane in main.panes:
                self.forget_if_unused(pane.session)
        if self.mcp is not None:
            await self.mcp.stop()
        self.host.stop()
        self.store.close()
        self.kept_log.remove()
