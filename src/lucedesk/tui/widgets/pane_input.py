"""What a pane does with what is typed: a slash command runs (those for the next turn while a
reply streams too); a message that can never fit the context is refused with its count and
left in the input; one typed while the pane answers is queued (shown, Esc takes it back) and
sent when the reply ends. And how full the context is, shown in the header as it changes:
the next turn's prompt, plus the draft's tokens. Mixed into ChatPane."""

from __future__ import annotations

from textual.widgets import Label

from lucedesk.errors import RequestError
from lucedesk.tui.messages import PromptSubmitted
from lucedesk.tui.widgets.chat_input import ChatInput

DRAFT_PAUSE_S = 0.3  # the draft is counted once typing pauses this long


def short(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


class PaneInput:
    queued: list[str]
    context: tuple[int, int] | None  # the next turn's prompt tokens and the context
    draft_tokens: int
    draft_refusal: str | None  # why the draft cannot be sent (None: it can)

    def setup_input(self) -> None:
        self.queued, self.context, self.draft_tokens, self.draft_refusal = [], None, 0, None
        self._draft_timer = None

    # -- typed ------------------------------------------------------------------------------

    async def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        message.stop()
        text = message.text.strip()
        box = self.query_one(ChatInput)
        if not text:
            self.app.notify("Type a message first.", severity="warning")
            return
        if text.startswith("/"):  # those for the next turn run while one is answered too
            if await self.run_command(self, text):
                box.clear()
            else:
                box.select_all()  # left to fix; whatever is typed next replaces it
            return
        if (refusal := await self.agent.refusal(text)) is not None:
            self.app.notify(f"Not sent: {refusal}. It stays here to shorten.", severity="error")
            return
        box.clear()
        self.draft_tokens, self.draft_refusal = 0, None
        if self.busy:
            self.queued.append(text)
            self.show_queue()
            return
        await self.send(text)

    def show_queue(self) -> None:
        for label in self.query("#queued").results(Label):
            if not self.queued:
                label.set_class(False, "shown")
                continue
            first = " ".join(self.queued[0].split())
            more = f" ({len(self.queued)})" if len(self.queued) > 1 else ""
            label.update(f"queued{more}: {first[:200]} · Esc edits")
            label.set_class(True, "shown")

    def unqueue(self) -> bool:
        """Esc with a message queued: the last one back in the input (before what is typed
        there), out of the queue. False when none is queued."""
        if not self.queued:
            return False
        box = self.query_one(ChatInput)
        text = self.queued.pop()
        box.text = f"{text}\n{box.whole_text}" if box.text.strip() else text
        box.pastes.clear()
        box.move_cursor(box.document.end)
        self.show_queue()
        return True

    async def after_run(self, status: str) -> None:
        """A run ended: the next queued message goes, after a reply that ended as replies do;
        after a stop or an error every queued message waits in the input instead."""
        if not self.queued or self.gone:
            return
        if status in ("done", "step_limit"):
            text = self.queued.pop(0)
            self.show_queue()
            await self.send(text)
            return
        box = self.query_one(ChatInput)
        box.text = "\n\n".join([*self.queued, box.whole_text]).strip()
        box.pastes.clear()
        self.queued.clear()
        self.show_queue()

    # -- the context ------------------------------------------------------------------------

    def context_text(self) -> str:
        """`ctx 3.2k/8.2k` (the prompt and the draft against the context), with a warning
        when the draft cannot be sent."""
        if self.context is None:
            return ""
        used, limit = self.context
        text = f"ctx {short(used + self.draft_tokens)}/{short(limit)}"
        return f"{text} too long · " if self.draft_refusal else f"{text} · "

    def measure_context(self) -> None:
        """The context use measured again, off the next keystroke (a worker)."""
        if not self.gone:
            self.run_worker(self._measure, group="context", exclusive=True)

    async def _measure(self) -> None:
        if self.gone:
            return
        self.context = await self.agent.context_use()
        self.refresh_header()

    def on_text_area_changed(self, event: ChatInput.Changed) -> None:
        if self._draft_timer is not None:
            self._draft_timer.stop()
        self._draft_timer = self.set_timer(DRAFT_PAUSE_S, self._count_draft)

    async def _count_draft(self) -> None:
        if self.gone:
            return
        text = self.query_one(ChatInput).whole_text
        counted = self.count_text(text) if text.strip() else 0
        self.draft_tokens = counted or 0
        self.draft_refusal = await self.agent.refusal(text) if counted else None
        self.refresh_header()

    def count_text(self, text: str) -> int | None:
        """`text`'s tokens for this session's model (None while no model runs)."""
        try:
            return self.agent.runtime.backend.count([text])[0]
        except RequestError:
            return None
