"""A session near the end of its model's context goes on: before each model turn the prompt
is measured, and when it would pass the policy's share of the context (compaction.py) the
older messages are summarized by the same model, in requests of their own, and a
`compaction` message is stored: its text the summary, its fields which messages the model
still sees whole. The store and the screen keep every message; only the model's view
(Session.model_view) reads the summary in their place.

A summary is written in rounds when what it covers is larger than one request holds (the
summary so far, then the next piece); a round that fails leaves the summary as it stood and
says what was left out, so compaction is never the reason a session stops."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from lucedesk.agent.compaction import MIN_REPLY, Policy, cut_text, pieces, plan
from lucedesk.agent.events import MessageAdded
from lucedesk.chat import ChatMessage, Sampling, ToolChoice, TurnRequest
from lucedesk.errors import RequestError
from lucedesk.store import StoredMessage

if TYPE_CHECKING:
    from lucedesk.agent.backend import Backend
    from lucedesk.agent.live import LiveSession

log = logging.getLogger(__name__)

SUMMARIZER = """\
You write the working notes that let a conversation go on after its older messages are \
removed. Keep what the rest of the work needs: the user's goals and requests, decisions \
made, facts found (file paths, names, numbers, commands, errors), what was done and what \
remains. Plain notes, no preamble."""

ROUND = """\
{so_far}The conversation continues:

{piece}

Write the updated notes{focus}, at most about {words} words."""

SHORTEN = """\
A subagent answered the task below with a report too long for the agent that asked for it. \
Shorten it to at most about {words} words, keeping every finding, path, name and number the \
task needs.

Task: {task}

Report:
{report}"""

MESSAGE_OVERHEAD = 8  # the template's tokens around one message (role, markers)


def message_text(m: StoredMessage) -> str:
    """A message as its tokens are counted and as a summary reads it."""
    calls = "".join(f"\n{c.name}({c.arguments})" for c in m.tool_calls)
    return f"{m.prompt or m.content}{calls}"


def transcript(messages: list[StoredMessage], counts: list[int], tool_budget: int) -> str:
    """The messages as the summarizer reads them, tool results cut to `tool_budget`."""
    lines = []
    for m, n in zip(messages, counts):
        text = message_text(m)
        if m.role == "tool":
            text = cut_text(text, n, tool_budget)
            lines.append(f"[tool result of {m.name}]\n{text}")
        else:
            lines.append(f"[{m.role}]\n{text}")
    return "\n\n".join(lines)


async def fit_request(session: LiveSession, req: TurnRequest, policy: Policy) -> TurnRequest:
    """`req`, the session's next turn, as it will be sent: the conversation compacted first
    when its prompt passes the policy's share of the context, and tool results larger than
    the policy allows cut with a note. Unchanged when the backend cannot say its context."""
    backend = session.runtime.backend
    limit = await backend.context_limit()
    if limit is None or req.raw is not None:
        return req
    try:
        tokens: int | None = backend.prompt_tokens(req)
        if policy.over(tokens, limit) and await compact(session, policy, limit):
            req, tokens = replace(req, messages=session.model_messages()), None
        if any(m.role == "tool" for m in req.messages):
            req = cut_tool_results(backend, req, lambda total, n: policy.tool_budget(limit))
            tokens = None
        # measured again only when the prompt changed (a plain chat's turn: once)
        over = (tokens or backend.prompt_tokens(req)) + MIN_REPLY - limit
        if over > 0:  # still no room for a reply: the tool results share what is left
            req = cut_tool_results(backend, req, lambda total, n: (total - over) // n)
        return req
    except RequestError:  # no model runs now, or it cannot take the chat: the turn says so
        return req


def cut_tool_results(
    backend: Backend, req: TurnRequest, budget: Callable[[int, int], int]
) -> TurnRequest:
    """`req` with each tool result cut to `budget(their total tokens, their number)`."""
    tools = [i for i, m in enumerate(req.messages) if m.role == "tool"]
    if not tools:
        return req
    counts = backend.count([req.messages[i].content for i in tools])
    each = max(32, budget(sum(counts), len(counts)))
    messages = list(req.messages)
    for i, n in zip(tools, counts):
        if n > each:
            messages[i] = replace(messages[i], content=cut_text(messages[i].content, n, each))
    return replace(req, messages=messages)


async def compact(
    session: LiveSession, policy: Policy, limit: int, focus: str = "", by_hand: bool = False
) -> StoredMessage | None:
    """Summarizes the older messages of the session's model view and stores the compaction
    marker; None when nothing is worth a summary (`by_hand`: when nothing can be cut)."""
    backend = session.runtime.backend
    summary_so_far, messages = session.record.model_view()
    counts = [n + MESSAGE_OVERHEAD for n in backend.count(map(message_text, messages))]
    cut = plan([m.role for m in messages], counts, limit, policy, 0 if by_hand else None)
    if cut is None:
        return None
    session.set_phase("compacting")
    older = [
        (m, n) for i, (m, n) in enumerate(zip(messages[: cut.keep], counts)) if i != cut.pinned
    ]
    text = transcript([m for m, _ in older], [n for _, n in older], policy.tool_budget(limit))
    summary = await summarize(session, summary_so_far, text, policy, limit, focus)
    marker = StoredMessage(
        "compaction",
        summary,
        keep_from=messages[cut.keep].id,
        pinned=messages[cut.pinned].id if cut.pinned is not None else 0,
        compacted=len(older),
        tokens=backend.count([summary])[0],
    )
    marker = session.store.add_message(session.record, marker)
    session.runtime.emit(MessageAdded(session, marker))
    log.info("session %s: %d messages compacted", session.id, len(older))
    return marker


async def summarize(
    session: LiveSession, so_far: str, text: str, policy: Policy, limit: int, focus: str = ""
) -> str:
    """The notes `so_far` brought up to date with `text`, in as many rounds as its size asks
    (each round's prompt: the instructions, the notes so far, a piece)."""
    backend = session.runtime.backend
    budget = policy.summary_budget(limit)
    room = max(64, limit - 2 * budget - backend.count([SUMMARIZER])[0] - 96)
    [total] = backend.count([text])
    focused = f", with attention to: {focus}" if focus else ""
    summary, left_out = so_far, 0
    for piece in pieces(text, total, room):
        head = f"Notes so far:\n{summary}\n\n" if summary else ""
        prompt = ROUND.format(so_far=head, piece=piece, focus=focused, words=budget * 2 // 3)
        written = await one_shot(session, prompt, budget)
        if written is None:
            left_out += 1
        else:
            summary = written
    if left_out:
        summary += (
            f"\n(Part of the earlier conversation could not be summarized: {left_out} pieces.)"
        )
    return summary.strip() or "(nothing to summarize)"


async def one_shot(session: LiveSession, prompt: str, max_tokens: int) -> str | None:
    """One request of the session's model outside its conversation (under its slot owner);
    None when it failed."""
    req = TurnRequest(
        messages=[ChatMessage("system", SUMMARIZER), ChatMessage("user", prompt)],
        tool_choice=ToolChoice(),
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
    )
    result = await session.runtime.backend.turn(req, session.owner, _ignore, _ignore)
    if result.finish == "error":
        log.warning("session %s: a summary request failed: %s", session.id, result.error)
        return None
    return result.text.strip() or None


async def shorten_report(session: LiveSession, task: str, report: str, policy: Policy) -> str:
    """A child's final message as its parent reads it: shortened by the child's model, in one
    request, when it is larger than a tool result may be (its beginning when that fails)."""
    backend = session.runtime.backend
    limit = await backend.context_limit()
    if limit is None:
        return report
    budget = policy.tool_budget(limit)
    [tokens] = backend.count([report])
    if tokens <= budget:
        return report
    room = max(64, limit - budget - 256)
    head = cut_text(report, tokens, room)
    prompt = SHORTEN.format(words=budget * 2 // 3, task=task, report=head)
    written = await one_shot(session, prompt, budget)
    return written if written is not None else cut_text(report, tokens, budget)


def _ignore(_: str) -> None:
    pass


def marker_line(m: StoredMessage) -> str:
    """How a compaction shows in a transcript and an export."""
    return f"compacted: {m.compacted:,} messages → summary, {m.tokens:,} tokens"
