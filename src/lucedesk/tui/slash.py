"""Slash commands typed in a pane's input: one table (what the key overlay and /help list)
and a handler for each. A handler raises ValueError with what was wrong; the pane says it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lucedesk.agent import SWITCHES
from lucedesk.chat import ToolChoice
from lucedesk.tui.messages import SessionsChanged

if TYPE_CHECKING:
    from lucedesk.tui.widgets.chat_pane import ChatPane


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    usage: str  # what follows the name
    help: str
    run: Callable[[ChatPane, str], Awaitable[None]]


def number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


async def fanout(pane: ChatPane, rest: str) -> None:
    count, _, task = rest.partition(" ")
    pane.start_fanout(number(int, count), task.strip())


async def tools(pane: ChatPane, rest: str) -> None:
    modes = SWITCHES
    if rest not in modes:
        raise ValueError("/tools on (every tool), read (read-only) or off")
    s = pane.session
    s.agent_type = modes[rest]
    s.workspace = s.workspace or str(pane.app.workspace)
    where = f" in {s.workspace}." if rest != "off" else "."
    pane.app.notify(f"Tools {rest} for this session{where}")
    pane.warn_without_tool_format()


async def tool_choice(pane: ChatPane, rest: str) -> None:
    """auto, required, none, or a tool's name: what the model's next turns must do."""
    if not rest:
        raise ValueError("/tool-choice auto|required|none|<tool name>")
    if rest in ("auto", "required", "none"):
        choice = ToolChoice(rest)
    else:
        names = [t.name for t in pane.agent.tools()]
        if rest not in names:
            known = ", ".join(names) or "none: tools are off (/tools on)"
            raise ValueError(f"no tool {rest!r} in this session; its tools: {known}")
        choice = ToolChoice("function", rest)
    # the first turn takes the choice, the turns after it are free again (a forced call
    # held for every turn would never let the model answer)
    pane.next_choices = [choice, ToolChoice()] if choice.mode != "auto" else [choice]
    pane.app.notify(f"Tool choice for the next message: {rest}.")


async def system(pane: ChatPane, rest: str) -> None:
    pane.session.system_prompt = rest
    pane.app.notify("System prompt set." if rest else "System prompt cleared.")


async def temp(pane: ChatPane, rest: str) -> None:
    value = number(float, rest)
    if not 0.0 <= value <= 2.0:
        raise ValueError("the temperature must be between 0 and 2")
    pane.session.temperature = value


async def max_tokens(pane: ChatPane, rest: str) -> None:
    value = number(int, rest)
    if value < 1:
        raise ValueError("max tokens must be at least 1")
    pane.session.max_tokens = value


async def title(pane: ChatPane, rest: str) -> None:
    if not rest:
        raise ValueError("give the session a name: /title <name>")
    pane.session.title = rest[:60]
    pane.post_message(SessionsChanged())


async def backend(pane: ChatPane, rest: str) -> None:
    s = pane.session
    if rest in ("", "local"):
        s.backend_url = ""
    elif rest.startswith(("http://", "https://")):
        s.backend_url = rest.rstrip("/")
    else:
        raise ValueError("give an http(s) URL of an OpenAI-compatible server, or local")
    pane.app.notify(f"This session now talks to {s.backend_url or 'the local engine'}.")


async def model(pane: ChatPane, rest: str) -> None:
    if not rest:
        await pane.screen.run_action("models")  # the picker, as F7
        return
    pane.app.switch_model(rest)


async def compact(pane: ChatPane, rest: str) -> None:
    pane.start_compact(rest)


async def continue_(pane: ChatPane, rest: str) -> None:
    pane.continue_reply()


async def undo(pane: ChatPane, rest: str) -> None:
    await pane.undo_regenerate()


async def export(pane: ChatPane, rest: str) -> None:
    pane.app.notify(f"Exported to {pane.export()}")


async def help_(pane: ChatPane, rest: str) -> None:
    await pane.screen.run_action("keys")  # what F1 does


COMMANDS = [
    Command("fanout", "N <task>", "split a task among N subagents, then sum up", fanout),
    Command("tools", "on|read|off", "this session's tools: all, read-only, none", tools),
    Command(
        "tool-choice",
        "auto|required|none|NAME",
        "what the next turn must do: call a tool, a named one, or answer",
        tool_choice,
    ),
    Command("system", "<prompt>", "set (or, empty, clear) the system prompt", system),
    Command("temp", "<0-2>", "sampling temperature", temp),
    Command("max", "<tokens>", "the most tokens a reply may have", max_tokens),
    Command("title", "<name>", "rename this session", title),
    Command("continue", "", "write on from a reply cut short (Esc, max tokens)", continue_),
    Command(
        "compact",
        "[focus]",
        "summarize the conversation but its last exchange now (the model reads the summary "
        "from then on; the screen and the store keep every message)",
        compact,
    ),
    Command("undo", "", "bring back the reply Ctrl+R replaced", undo),
    Command("export", "", "write this session to Markdown", export),
    Command("backend", "<url|local>", "send this session to another server", backend),
    Command(
        "model",
        "[name]",
        "load another model: a file, a name `lucedesk models` lists, ORG/REPO[:QUANT] "
        "(conversations stay); alone: the picker",
        model,
    ),
    Command("help", "", "every key and command", help_),
]
BY_NAME = {c.name: c for c in COMMANDS}
HELP = "Commands: " + " · ".join(f"/{c.name} {c.usage}".rstrip() for c in COMMANDS)


async def run_command(pane: ChatPane, line: str) -> bool:
    """A slash command; False (and a notice) when it is not understood or failed."""
    name, _, rest = line[1:].partition(" ")
    command = BY_NAME.get(name)
    if command is None:
        pane.app.notify(f"Unknown command /{name}. {HELP}", severity="error", timeout=6)
        return False
    try:
        await command.run(pane, rest.strip())
    except ValueError as exc:
        pane.app.notify(f"/{name}: {exc}", severity="error")
        return False
    pane.app.store.update_session(pane.session)
    pane.refresh_header()
    return True
