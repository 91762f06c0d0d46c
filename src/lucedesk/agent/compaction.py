"""The compaction policy, on token counts alone: when a session's next prompt is too full,
which messages are summarized and which are kept whole, how large a summary and a tool
result may be, and how a text too large to summarize at once is cut into pieces.

A turn's prompt is the system prompt and the tool definitions (always kept), then the
conversation. When it would pass `compact_at` of the context, the older messages are
replaced, in the model's view only, by a summary the same model writes (compactor.py):

- the last turns are kept whole, as many as fit in `recent` of the context, counted back
  from the newest (a turn: a user message and what answered it);
- when the newest turn alone is larger than that (an agent working through many tool calls
  on one request), it is cut between two steps, never between a call and its result, and
  the user message that started it stays in front of what is kept;
- a tool result larger than `tool_result` of the context is kept as its beginning and a note
  of how much was cut, in the kept part as in what is summarized;
- the summary is written in at most `summary_tokens` (an eighth of a small context).
"""

from __future__ import annotations

from dataclasses import dataclass

# The reply's room when deciding whether a message can be sent at all: the summary of the
# rest and an answer must fit beside it.
MIN_REPLY = 64


@dataclass(frozen=True, slots=True)
class Policy:
    compact_at: float = 0.8  # compact when a turn's prompt would pass this share of the context
    recent: float = 0.3  # the share of the context the turns kept whole may take
    tool_result: float = 0.2  # a tool result larger than this share is cut, with a note
    summary_tokens: int = 1024  # the most a summary is written in

    def summary_budget(self, limit: int) -> int:
        return max(32, min(self.summary_tokens, limit // 8))

    def tool_budget(self, limit: int) -> int:
        return max(32, int(limit * self.tool_result))

    def over(self, prompt_tokens: int, limit: int) -> bool:
        return prompt_tokens > self.compact_at * limit

    def message_room(self, fixed: int, limit: int) -> int:
        """The largest user message a session with `fixed` tokens of system prompt and tools
        can take: the rest summarized, a summary and a short reply beside it."""
        return limit - fixed - self.summary_budget(limit) - MIN_REPLY


@dataclass(frozen=True, slots=True)
class Cut:
    """Messages [0, keep) are summarized (but `pinned`, a user message kept in front of the
    rest when the cut falls inside its turn); [keep, end) are kept whole."""

    keep: int
    pinned: int | None = None


def plan(
    roles: list[str], counts: list[int], limit: int, policy: Policy, least: int | None = None
) -> Cut | None:
    """Where to cut a conversation of messages with these roles and token counts, so that
    what is kept takes at most `policy.recent` of `limit`; None when no cut is worth a
    summary: what it would summarize is no more than `least` tokens (default: a summary's
    size; a single message, one call and its results summarize nothing). The newest
    message is always kept."""
    cut = _cut(roles, counts, limit, policy)
    if cut is None:
        return None
    summarized = sum(counts[: cut.keep]) - (counts[cut.pinned] if cut.pinned is not None else 0)
    return cut if summarized > (policy.summary_budget(limit) if least is None else least) else None


def _cut(roles: list[str], counts: list[int], limit: int, policy: Policy) -> Cut | None:
    budget = policy.recent * limit
    kept = [0] * (len(counts) + 1)  # kept[i]: the tokens of messages [i, end)
    for i in range(len(counts) - 1, -1, -1):  # a tool result counted as it will be cut
        cap = policy.tool_budget(limit) if roles[i] == "tool" else counts[i]
        kept[i] = kept[i + 1] + min(counts[i], cap)
    # A cut may fall before any message but a tool result (which stays with its call).
    cuts = [i for i in range(1, len(roles)) if roles[i] != "tool"]
    if not cuts:
        return None
    for i in cuts:  # the earliest turn start whose turns fit: the most kept whole
        if roles[i] == "user" and kept[i] <= budget:
            return Cut(i)
    for i in cuts:  # inside the newest turn: its user message kept in front
        if roles[i] == "user":
            continue
        pinned = last_user_before(roles, i)
        if kept[i] + (counts[pinned] if pinned is not None else 0) <= budget:
            return Cut(i, pinned)
    last = cuts[-1]
    return Cut(last, None if roles[last] == "user" else last_user_before(roles, last))


def last_user_before(roles: list[str], index: int) -> int | None:
    return next((i for i in range(index - 1, -1, -1) if roles[i] == "user"), None)


def pieces(text: str, tokens: int, budget: int) -> list[str]:
    """`text` (`tokens` long) in consecutive pieces of about `budget` tokens each, cut at a
    line end where one is near (within the last fifth of a piece)."""
    if tokens <= budget:
        return [text]
    size = max(1, int(len(text) * budget / tokens))
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            newline = text.rfind("\n", start + size * 4 // 5, end)
            end = newline + 1 if newline > start else end
        out.append(text[start:end])
        start = end
    return out


def cut_text(text: str, tokens: int, budget: int) -> str:
    """A tool result of `tokens` tokens kept to about `budget`: its beginning and a note of
    what was cut (the model can ask for the rest: read a file by lines, grep)."""
    if tokens <= budget:
        return text
    head = pieces(text, tokens, max(1, budget - 24))[0]
    return (
        f"{head.rstrip()}\n[… cut to fit the context: this result had {tokens:,} tokens, "
        f"the first {budget - 24:,} are shown]"
    )
