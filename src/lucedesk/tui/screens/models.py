"""The model picker (F7, /model): every model on this machine with what fits marked, and any
Hugging Face repository by name, pulled with its progress shown, then loaded in place of the
running one (as a profile switch: the old engine stays where the new one cannot load)."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Label

from lucedesk.catalog.listing import ListedModel, list_models
from lucedesk.catalog.quants import human_size
from lucedesk.catalog.resolve import hub_name
from lucedesk.engine import fit_now, resolve_device

HINT = (
    "▶ running · ✓ fits · Enter loads the model · type to filter, or a Hugging Face "
    "repository (ORG/REPO[:QUANT]) and Enter to pull it"
)


class ModelsScreen(Screen):
    CSS_PATH = "models.tcss"
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self) -> None:
        super().__init__()
        self.models: list[ListedModel] = []

    def compose(self) -> ComposeResult:
        yield Header()
        yield Input(placeholder="filter, or ORG/REPO[:QUANT] to pull", id="name")
        yield DataTable(cursor_type="row", id="models")
        yield Label("reading the model stores…", id="progress")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("", "name", "source", "family", "params", "quant", "size", "context")
        self.query_one("#name", Input).focus()
        self.read_models()

    @work(thread=True, exclusive=True, group="models", exit_on_error=False)
    def read_models(self) -> None:
        """The listing off the event loop: a store's headers are read the first time."""
        host = self.app.host
        device = resolve_device(host.config.device)
        fit = fit_now(host.config, host.given_back(device))
        listed = list_models(fit.why_not)
        self.app.call_from_thread(self.show_models, listed)

    def show_models(self, listed: list[ListedModel]) -> None:
        self.models = listed
        self.query_one("#progress", Label).update(HINT)
        self.fill(self.query_one("#name", Input).value)

    def fill(self, text: str) -> None:
        table = self.query_one(DataTable)
        table.clear()
        running = self.app.host.model_name
        wanted = text.strip().lower()
        for m in self.models:
            if wanted and wanted not in m.name.lower():
                continue
            s = m.summary
            mark = ("▶" if m.name == running or str(m.path) == running else " ") + (
                "✓" if m.fits else "✗" if m.fits is False else "?"
            )
            table.add_row(
                mark,
                m.name,
                m.source,
                s.architecture if s else "?",
                f"{s.params / 1e9:.2f}B" if s else "?",
                s.quant if s else "?",
                human_size(s.size_bytes) if s else "?",
                str(s.context) if s else "?",
                key=m.name,
            )

    def on_input_changed(self, event: Input.Changed) -> None:
        self.fill(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the box: the one row the filter left, else a repository to pull."""
        event.stop()
        text = event.value.strip()
        table = self.query_one(DataTable)
        if table.row_count == 1 or (table.row_count and text == ""):
            self.load(str(table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value))
        elif text and hub_name(text) is not None:
            self.load(text)
        elif text:
            self.notify(
                f"{text!r} is no model here nor a Hugging Face repository (ORG/REPO[:QUANT])",
                severity="warning",
            )

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.load(str(event.row_key.value))

    def load(self, name: str) -> None:
        """A model that cannot run here is said so and not loaded; any other, and any
        repository, is loaded in place of the running one."""
        listed = next((m for m in self.models if m.name == name), None)
        if listed is not None and listed.fits is False:
            self.notify(f"{name}: {listed.problem}", severity="error", timeout=10)
            return
        self.query_one("#progress", Label).update(f"loading {name}…")
        self.app.switch_model(name, say=self.progress_line)

    def progress_line(self, text: str) -> None:
        """A switch's progress (from its worker thread) on the picker's line while the picker
        is shown, else on the app's (App.show_progress)."""
        self.app.call_from_thread(self._show, text)

    def _show(self, text: str) -> None:
        if self.is_attached:
            self.query_one("#progress", Label).update(text)
        else:
            self.app.show_progress(text)
