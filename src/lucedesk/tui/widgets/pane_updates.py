"""How a pane shows what the agent of its session did: a message added (mounted), text and
reasoning streamed into its view, a message or tool call done (its final form and how it
ended), the phase in the header, the context use measured again. Mixed into ChatPane, whose
views, `view_for`, transcript and `follow` it uses."""

from __future__ import annotations

from lucedesk.agent import (
    AgentEvent,
    MessageAdded,
    MessageDone,
    PhaseChanged,
    ReasoningStreamed,
    TextStreamed,
    split_progress,
)
from lucedesk.store import StoredMessage
from lucedesk.tui.widgets.message_view import MessageView
from lucedesk.tui.widgets.tool_call_view import ToolCallView


def shown_text(message: StoredMessage) -> str:
    """What a message's view shows of its text: a /fanout split's JSON as its progress."""
    progress = split_progress(message)
    return message.content if progress is None else progress


class PaneUpdates:
    async def show_update(self, event: AgentEvent) -> None:
        if isinstance(event, PhaseChanged):
            self.refresh_header()
        elif isinstance(event, MessageAdded):
            await self.message_added(event.message)
            if event.message.role == "compaction":
                self.measure_context()
        elif isinstance(event, TextStreamed):
            view = self.views.get(event.message.id)
            if isinstance(view, MessageView):
                await self.text_streamed(view, event.message)
        elif isinstance(event, ReasoningStreamed):
            view = self.views.get(event.message.id)
            if isinstance(view, MessageView):
                await view.show_reasoning(event.message.reasoning)
        elif isinstance(event, MessageDone):
            view = self.views.get(event.message.id)
            if isinstance(view, ToolCallView):
                view.update_call(event.message)
            elif isinstance(view, MessageView):
                await self.message_done(view, event.message)
            self.measure_context()

    async def message_added(self, message: StoredMessage) -> None:
        if message.id in self.views:
            return  # shown already: the pane opened after the message was added
        view = self.view_for(message)
        if view is not None:
            await self.log_view.query("#welcome").remove()
            if self.is_attached:
                await self.log_view.mount(view)
                self.follow()

    async def text_streamed(self, view: MessageView, message: StoredMessage) -> None:
        content = message.content
        if split_progress(message) is not None:
            if (progress := shown_text(message)) != view.content:
                await view.replace(progress)
            return
        if view.title != view.role:  # written on (/continue): no longer cut short
            view.retitle(None)
        if not content.startswith(view.content):
            # written on from its text trimmed (/continue): shown whole once
            await view.replace(content)
            self.follow()
        # Only what the view lacks: one opened mid-reply showed the text so far.
        elif (missing := content[len(view.content) :]) and await view.append(missing):
            self.follow()

    async def message_done(self, view: MessageView, message: StoredMessage) -> None:
        await view.finish(" · ".join(message.notes()) or None)
        if not self.is_attached:
            return
        text = shown_text(message)
        if text and view.content != text:
            await view.replace(text)
        self.follow()
        if message.reasoning:
            await view.show_reasoning(message.reasoning)
        if not view.content and not message.reasoning and message.tool_calls:
            await view.remove()  # the calls follow, each in its own block
