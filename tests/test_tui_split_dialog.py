"""The /fanout split dialog's editor: Textual can draw a TextArea once more after it was
removed (a refresh that began before the removal); one never drawn before has no cached
styles left then, and raises a KeyError that stops the app. The dialog composes its editor
once and shows or hides it, never mounting or removing one."""

from __future__ import annotations

from textual.app import App
from textual.widgets import Static, TextArea

from lucedesk.tui.screens.dialogs import SplitDialog

SUBTASKS = [{"title": "one", "task": "fruit"}, {"title": "two", "task": "tools"}]


async def test_the_split_dialog_edits_in_place_without_mounting_or_removing():
    app = App()
    async with app.run_test(size=(100, 40)) as pilot:
        answers = []
        app.push_screen(SplitDialog("chat", [dict(t) for t in SUBTASKS]), answers.append)
        await pilot.pause()
        dialog = app.screen
        editor = dialog.query_one(TextArea)
        assert dialog.editing is None and not editor.display
        await pilot.press("e")
        await pilot.pause()
        assert dialog.editing is editor and editor.has_focus
        assert editor.text == "## one\nfruit\n\n## two\ntools"
        # Text that holds no subtask is refused, and the editing goes on.
        editor.text = "no headings here"
        await pilot.press("escape")
        await pilot.pause()
        assert dialog.editing is editor and dialog.subtasks == SUBTASKS
        editor.text = "## first\nbirds\n\n## second\nboats\n\n## third\ncars"
        await pilot.press("escape")
        await pilot.pause()
        assert dialog.editing is None and editor.is_attached  # hidden, never removed
        assert [t["title"] for t in dialog.subtasks] == ["first", "second", "third"]
        assert "## third" in str(dialog.query_one("#shown", Static).render())
        assert "3 subagents" in str(dialog.query_one("Label").render())
        await pilot.press("e")  # editing again starts from the edited split
        await pilot.pause()
        assert editor.text.startswith("## first\nbirds")
        editor.text = "## only\nthis"
        await pilot.press("escape")
        await pilot.press("enter")
        await pilot.pause()
        assert answers == [[{"title": "only", "task": "this"}]]
