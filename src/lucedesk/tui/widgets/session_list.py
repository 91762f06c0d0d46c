"""The sessions sidebar: chats at the top level, each agent's subagents as a tree beneath it,
every node with its live phase while it runs."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.binding import Binding
from textual.widgets import Tree

from lucedesk.store import Session
from lucedesk.tui.messages import SessionChosen, SessionDeleteAsked, SessionRenameAsked

MARKS = {
    "running": "●",
    "done": "✓",
    "cancelled": "⊘",
    "error": "✗",
    "interrupted": "!",
    "step_limit": "…",
}
MEANINGS = {
    "running": "running, with its phase",
    "done": "done",
    "cancelled": "stopped",
    "error": "failed",
    "interrupted": "interrupted (lucedesk was closed mid-reply)",
    "step_limit": "stopped at the step limit",
}
LEGEND = " · ".join(f"{MARKS[k]} {MEANINGS[k].split(',')[0].split(' (')[0]}" for k in MARKS)


class SessionList(Tree[int]):
    DEFAULT_CSS = """
    SessionList { width: 30; border: round $panel; }
    """
    BINDINGS = [
        Binding("r", "rename", "Rename"),
        Binding("delete", "delete", "Delete"),
    ]

    def __init__(self, phase: Callable[[int], str | None], **kwargs) -> None:
        super().__init__("sessions", **kwargs)
        self.border_title = "sessions"
        self.border_subtitle = "r rename · Del delete"
        self.tooltip = LEGEND
        self.show_root = False
        self.guide_depth = 2
        self._phase = phase  # a running session's phase, by id (None when it is not running)
        self._shape: list[tuple[int, int | None]] = []
        self._clicked = False

    def label(self, s: Session) -> Text:
        phase = self._phase(s.id)
        mark = MARKS.get("running" if phase else s.status, "")
        text = f"{mark} {s.title}" if mark else s.title
        return Text(f"{text} · {phase}" if phase else text)  # plain: titles may hold brackets

    def show(self, sessions: list[Session]) -> None:
        """Lists `sessions` (chats and their subagents); rebuilt only when the tree's shape
        changed, otherwise the labels are updated in place."""
        by_parent: dict[int | None, list[Session]] = {}
        known = {s.id for s in sessions}
        for s in sessions:
            parent = s.parent_id if s.parent_id in known else None
            by_parent.setdefault(parent, []).append(s)
        shape = [(s.id, s.parent_id) for s in sessions]
        if shape == self._shape:
            labels = {s.id: self.label(s) for s in sessions}
            for node in self.all_nodes():
                if node.data in labels and node.label.plain != labels[node.data].plain:
                    node.set_label(labels[node.data])
            return
        self._shape = shape
        self.clear()

        def add(node, parent_id: int | None) -> None:
            for s in by_parent.get(parent_id, []):
                children = by_parent.get(s.id, [])
                if children:
                    child = node.add(self.label(s), data=s.id, expand=True)
                    add(child, s.id)
                else:
                    node.add_leaf(self.label(s), data=s.id)

        add(self.root, None)

    def relabel(self, session: Session) -> None:
        node = self.node_of(session.id)
        if node is not None:
            node.set_label(self.label(session))

    def all_nodes(self):
        stack = list(self.root.children)
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)

    def node_of(self, session_id: int):
        return next((n for n in self.all_nodes() if n.data == session_id), None)

    def action_rename(self) -> None:
        node = self.cursor_node
        if node is not None and node.data is not None:
            self.post_message(SessionRenameAsked(node.data))

    def action_delete(self) -> None:
        node = self.cursor_node
        if node is not None and node.data is not None:
            self.post_message(SessionDeleteAsked(node.data))

    def on_click(self, event) -> None:
        self._clicked = True  # the node this click selects is chosen by the mouse

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        event.stop()
        clicked, self._clicked = self._clicked, False
        if event.node.data is not None:
            self.post_message(SessionChosen(event.node.data, clicked))
