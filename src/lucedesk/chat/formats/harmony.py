"""gpt-oss's harmony format: a reply is a run of messages, each a header and its content,

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>commentary<|message|>a preamble, shown...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}
    <|start|>assistant<|channel|>final<|message|>the answer

(the prompt ends in `<|start|>assistant`, so the first header follows it directly; <|call|>
and <|return|> end the reply and are never text). The recipient may also stand in the role:
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`.

The markers are special tokens the detokenizer keeps as text (`MARKERS`), so a reply can be
read as text: analysis is reasoning, final and commentary without a recipient the answer,
and a `functions.NAME` recipient a tool call whose content is the arguments.

Tool calls are held to one form by a grammar (llguidance names the markers as the tokens
they are): reasoning and preambles first if the model wants them, then one call.
"""

from __future__ import annotations

import json
import re

from lucedesk.chat.formats.base import CallFormat, json_rule, offered
from lucedesk.chat.messages import ChatMessage, Tool, ToolCall, ToolChoice
from lucedesk.chat.tool_parser import CallDelta, ReasoningDelta, TextDelta, merge
from lucedesk.engine import HARMONY_MARKERS as MARKERS
from lucedesk.engine import Grammar, is_harmony, overlap_with_start

START, END, MESSAGE, CHANNEL, CONSTRAIN = MARKERS
EFFORTS = ("low", "medium", "high")
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<|$)")


def effort_of(reasoning: str | None) -> str | None:
    """A request's reasoning level as the template's `reasoning_effort` (gpt-oss cannot
    stop reasoning: "none" is its lowest)."""
    if reasoning is None:
        return None
    if reasoning in EFFORTS:
        return reasoning
    return "high" if reasoning in ("xhigh", "max") else "low"


def render_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the harmony template takes them: one call per assistant message (the
    template renders only the first), reasoning as `thinking`, which the template takes
    instead of content on a call."""
    out: list[dict] = []
    for m in messages:
        if m.role != "assistant" or len(m.tool_calls) < 2:
            out.append(_thinking(m.for_template()))
            continue
        first = ChatMessage("assistant", m.content, m.tool_calls[:1], m.reasoning)
        out.append(_thinking(first.for_template()))
        out += [ChatMessage("assistant", tool_calls=[c]).for_template() for c in m.tool_calls[1:]]
    return out


def _thinking(m: dict) -> dict:
    reasoning = m.pop("reasoning_content", None)
    if reasoning:
        m["thinking"] = reasoning
        if m.get("tool_calls"):
            m["content"] = ""
    return m


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def grammar(
    tools: list[Tool],
    choice: ToolChoice,
    text_schema: dict | bool | None = None,
) -> Grammar:
    """A reply for `choice`: analysis and preambles, then (auto) an answer or one call,
    (required, a function) one call. `text_schema` holds the answer to a JSON schema."""
    calls = offered(tools, choice)
    answer = json_rule(text_schema) if text_schema is not None else "TEXT"
    rules = [
        'preface: (<|channel|> ("analysis" | "commentary") <|message|> TEXT <|end|>'
        ' <|start|> "assistant")',
        f'final: <|channel|> "final" <|message|> {answer}',
        r"TEXT: /(?s:.*)/",
    ]
    if calls:
        rules.append(
            'call: <|channel|> "commentary to=functions." ('
            + " | ".join(f"fn_{i}" for i in range(len(calls)))
            + ")"
        )
        for i, tool in enumerate(calls):  # the tool's schema whole: its own refs hold
            rules.append(
                f'fn_{i}: {json.dumps(tool.name)} " " <|constrain|> "json" <|message|> '
                + json_rule(tool.parameters)
            )
    forced = choice.mode in ("required", "function")
    if forced:
        start = "start: preface* call"
    elif calls and choice.mode != "none":
        start = "start: preface* (final | call)"
    else:
        start = "start: preface* final"
    field = (
        "tool_choice" if choice.mode == "function" else ("tools" if calls else "response_format")
    )
    return Grammar.lark("%llguidance {}\n" + "\n".join([start, *rules]), field)


class HarmonyParser:
    """A reply in harmony format as text, reasoning, and tool-call events; fed text in any
    cut it gives the same events (joined) as for the whole text. `tool_names`: the offered
    tools (a call to another one is its text); None: no tools, every message is text."""

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        self.tool_names = tool_names
        self.calls: list[ToolCall] = []
        self.incomplete = False
        self._buffer = ""
        self._state = "header"  # the prompt opened the first message: its header comes next
        self._route = "text"  # where the current message's content goes: reasoning, text, call
        self._call: ToolCall | None = None
        self._texts = 0  # messages of answer text given out: a new one starts on a new line
        self._fresh = False  # the current message has given out nothing yet

    def feed(self, text: str) -> list:
        self._buffer += text
        events: list = []
        while self._step(events):
            pass
        return merge(events)

    def finish(self, cut: bool = False) -> list:
        """`cut` (max_tokens ended the reply) changes nothing: harmony's markers are single
        tokens, never held back half-written."""
        events: list = []
        if self._state == "content":
            self._emit(self._buffer, events)
            if self._call is not None:  # a call ends with <|call|>, which ends the reply
                self.incomplete = not _is_json(self._call.arguments)
                self._close()
        elif self._state in ("header", "between") and self._buffer:
            events.append(TextDelta(self._buffer))  # text that never got a header
        self._buffer, self._call, self._state = "", None, "done"
        return merge(events)

    # -- the state machine ---------------------------------------------------------------

    def _step(self, events: list) -> bool:
        buf = self._buffer
        if self._state == "between":  # after <|end|>: the next message's <|start|>role
            if not buf.startswith(START):
                if START.startswith(buf):
                    return False
                self._state = "header"  # a stray: read on as a header
                return True
            self._buffer, self._state = buf[len(START) :], "header"
            return True
        if self._state == "header":
            at = buf.find(MESSAGE)
            if at < 0:
                return False
            self._open(buf[:at], events)
            self._buffer, self._state = buf[at + len(MESSAGE) :], "content"
            return True
        if self._state == "content":
            at = buf.find(END)
            if at < 0:
                ready = buf[: len(buf) - overlap_with_start(buf, END)]
                self._emit(ready, events)
                self._buffer = buf[len(ready) :]
                return False
            self._emit(buf[:at], events)
            self._close()
            self._buffer, self._state = buf[at + len(END) :], "between"
            return True
        return False  # done

    def _open(self, header: str, events: list) -> None:
        """A message's header: its channel and recipient say where its content goes."""
        channel = ""
        if CHANNEL in header:
            channel = re.split(r"[\s<]", header.split(CHANNEL, 1)[1], maxsplit=1)[0]
        found = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        recipient = found.group(1) if found else None
        name = recipient.removeprefix("functions.") if recipient else None
        if (
            recipient is not None
            and recipient.startswith("functions.")
            and self.tool_names is not None
            and name in self.tool_names
        ):
            self._call = ToolCall(ToolCall.new_id(), name, "")
            events.append(CallDelta(len(self.calls), self._call.id, name))
            self._route = "call"
        elif channel == "analysis":
            self._route = "reasoning"
        else:
            self._route = "text"
        self._fresh = True

    def _emit(self, text: str, events: list) -> None:
        if not text:
            return
        if self._route == "call" and self._call is not None:
            self._call.arguments += text
            events.append(CallDelta(len(self.calls), arguments=text))
        elif self._route == "reasoning":
            events.append(ReasoningDelta(text))
        else:  # a preamble and the final answer are two paragraphs of the answer
            if self._fresh:
                self._texts += 1
                if self._texts > 1:
                    text = "\n\n" + text
            events.append(TextDelta(text))
        self._fresh = False

    def _close(self) -> None:
        if self._call is not None:
            self.calls.append(self._call)
            self._call = None


class Harmony(CallFormat):
    name = "harmony"
    wraps_answer = True

    def detects(self, template: str) -> bool:
        return is_harmony(template)

    def render_messages(
        self, messages: list[ChatMessage], tools: list[Tool]
    ) -> tuple[list[dict], list]:
        return render_messages(messages), [t.openai() for t in tools]

    def grammar(
        self,
        tools: list[Tool],
        choice: ToolChoice,
        parallel: bool = True,
        text_schema: dict | bool | None = None,
        single_tokens: frozenset[str] = frozenset(),
    ) -> Grammar:
        return grammar(tools, choice, text_schema)

    def parser(self, tool_names: frozenset[str] | None = None) -> HarmonyParser:
        return HarmonyParser(tool_names)

    def reasoning(self, template: str) -> str | None:
        return "harmony"

    def template_vars(self, reasoning: str | None, level: str | None) -> dict:
        return {} if level is None else {"reasoning_effort": effort_of(level)}

    def reply_parser(
        self, tool_names: frozenset[str] | None, reasoning: str | None, inside: bool
    ) -> HarmonyParser:
        """Every harmony reply is channels: read whether or not tools were offered."""
        return HarmonyParser(tool_names)


FORMAT = Harmony()
