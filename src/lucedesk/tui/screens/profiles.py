"""Hardware profiles: which exist, which matches this machine, and switching at run time."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Label

from lucedesk import profile as profiles
from lucedesk.errors import LucedeskError


class ProfilesScreen(Screen):
    CSS_PATH = "profiles.tcss"
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("enter", "switch", "Switch to profile"),
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Label("", id="why")
        yield DataTable(cursor_type="row", id="profiles")
        yield Label("", id="details")
        yield Footer()

    def on_mount(self) -> None:
        self.profiles = profiles.all_profiles()
        detected, why = profiles.detect(self.profiles, profiles.probe_device())
        current = self.app.host.profile.name if self.app.host.profile else ""
        self.query_one("#why", Label).update(f"{why}; running: {current}")
        table = self.query_one(DataTable)
        table.add_columns("", "profile", "description", "slots", "KV pool", "kernels", "source")
        for name, p in self.profiles.items():
            mark = ("▶" if name == current else " ") + ("*" if name == detected.name else " ")
            pool = str(p.engine.kv_pool_tokens or "derived")
            table.add_row(
                mark,
                name,
                p.description,
                str(p.engine.max_slots),
                pool,
                p.engine.kernels,
                "built-in" if p.builtin else str(p.path),
                key=name,
            )
        self.query_one("#details", Label).update(
            "▶ running  * detected · Enter switches (conversations are kept)"
        )

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a row: confirm, then switch."""
        from lucedesk.tui.screens.dialogs import ConfirmDialog

        event.stop()
        name = event.row_key.value
        question = (
            f"Switch the engine to profile {name!r}? The model is loaded again; conversations stay."
        )
        choices = [("finish", "Finish running replies first"), ("stop", "Cancel them")]

        def answered(choice: str | None) -> None:
            if choice is not None:
                self.do_switch(name, drain=choice == "finish")

        self.app.push_screen(ConfirmDialog(question, choices), answered)

    @work(thread=True, exclusive=True, exit_on_error=False)
    def do_switch(self, name: str, drain: bool) -> None:
        def say(text: str) -> None:
            self.app.call_from_thread(self.app.notify, text)

        try:
            self.app.host.switch(name, drain, say)
        except Exception as exc:  # said, never a silent worker failure
            text = str(exc) if isinstance(exc, LucedeskError) else f"{type(exc).__name__}: {exc}"
            self.app.call_from_thread(
                self.app.notify, f"Switch to {name} failed: {text}", severity="error", timeout=10
            )
            return
        self.app.call_from_thread(self.app.engine_switched)
