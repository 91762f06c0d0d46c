"""How a pane shows what the agent of its session did: a message added (mounted), text and
reasoning streamed into its view, a message or tool call done (its final form and how it
ended), the phase in the header."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lucedesk.agent import (
    AgentEvent,
    MessageAdded,
    MessageDone,
    PhaseChanged,
    ReasoningStreamed,
    TextStreamed,
    split_progress,
)
from lucedesk.store import message_notes
from lucedesk.tui.widgets.message_view import MessageView
from lucedesk.tui.widgets.tool_call_view import ToolCallView

if TYPE_CHECKING:
    from lucedesk.tui.widgets.chat_pane import ChatPane


async def show_update(pane: ChatPane, event: AgentEvent) -> None:
    if isinstance(event, PhaseChanged):
        pane.refresh_header()
    elif isinstance(event, MessageAdded):
        await message_added(pane, event.message)
    elif isinstance(event, TextStreamed):
        view = pane.views.get(event.message["id"])
        if isinstance(view, MessageView):
            await text_streamed(pane, view, event.message)
    elif isinstance(event, ReasoningStreamed):
        view = pane.views.get(event.message["id"])
        if isinstance(view, MessageView):
            await view.show_reasoning(event.message["meta"].get("reasoning", ""))
    elif isinstance(event, MessageDone):
        view = pane.views.get(event.message["id"])
        if isinstance(view, ToolCallView):
            view.update_call(event.message)
        elif isinstance(view, MessageView):
            await message_done(pane, view, event.message)


async def message_added(pane: ChatPane, message: dict) -> None:
    if message["id"] in pane.views:
        return  # shown already: the pane opened after the message was added
    view = pane.view_for(message)
    if view is not None:
        await pane.log_view.query("#welcome").remove()
        if pane.is_attached:
            await pane.log_view.mount(view)
            pane.follow()


def shown_text(message: dict) -> str:
    """What a message's view shows of its text: a /fanout split's JSON as its progress."""
    content = message["content"]
    progress = split_progress(message.get("meta") or {}, content)
    return content if progress is None else progress


async def text_streamed(pane: ChatPane, view: MessageView, message: dict) -> None:
    content = message["content"]
    if split_progress(message.get("meta") or {}, content) is not None:
        if (progress := shown_text(message)) != view.content:
            await view.replace(progress)
        return
    if view.title != view.role:  # written on (/continue): no longer cut short
        view.retitle(None)
    if not content.startswith(view.content):
        # written on from its text trimmed (/continue): shown whole once
        await view.replace(content)
        pane.follow()
    # Only what the view lacks: one opened mid-reply showed the text so far.
    elif (missing := content[len(view.content) :]) and await view.append(missing):
        pane.follow()


async def message_done(pane: ChatPane, view: MessageView, message: dict) -> None:
    meta = message.get("meta") or {}
    await view.finish(" · ".join(message_notes(message)) or None)
    if not pane.is_attached:
        return
    text = shown_text(message)
    if text and view.content != text:
        await view.replace(text)
    pane.follow()
    if meta.get("reasoning"):
        await view.show_reasoning(meta["reasoning"])
    if not view.content and not meta.get("reasoning") and meta.get("tool_calls"):
        await view.remove()  # the calls follow, each in its own block
