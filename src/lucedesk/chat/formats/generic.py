"""Templates with no tool support of their own (the default SmolLM2 model): the tools are
described in the system message, results come back in <tool_response> blocks of a user
turn, and calls use the hermes envelope, which the grammar enforces. Matches any template,
so it is the registry's last."""

from __future__ import annotations

import json

from lucedesk.chat.formats.hermes import Hermes, block
from lucedesk.chat.messages import ChatMessage, Tool

INSTRUCTIONS = """\
You can call tools. The tools, with their arguments as JSON Schema:
{tools}

To call a tool, write
<tool_call>
{{"name": "<tool name>", "arguments": {{<the arguments as JSON>}}}}
</tool_call>
one block per call, and nothing after the blocks. Results come back in <tool_response> blocks.
When no tool is needed, answer in plain text."""


class Generic(Hermes):
    name = "generic"

    def detects(self, template: str) -> bool:
        return True

    def render_messages(
        self, messages: list[ChatMessage], tools: list[Tool]
    ) -> tuple[list[dict], list]:
        out: list[dict] = []
        results: dict | None = None  # the user turn collecting consecutive tool results
        for m in messages:
            if m.role == "tool":
                response = f"<tool_response>\n{m.content}\n</tool_response>"
                if results is None:
                    results = {"role": "user", "content": response}
                    out.append(results)
                else:
                    results["content"] += "\n" + response
                continue
            results = None
            if m.role == "assistant" and m.tool_calls:
                blocks = [block(c) for c in m.tool_calls]
                text = "\n".join(([m.content] if m.content else []) + blocks)
                out.append(ChatMessage("assistant", text, reasoning=m.reasoning).for_template())
            else:
                out.append(m.for_template())
        if tools:
            listing = "\n".join(
                json.dumps(
                    {"name": t.name, "description": t.description, "parameters": t.parameters},
                    ensure_ascii=False,
                )
                for t in tools
            )
            note = INSTRUCTIONS.format(tools=listing)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out, []


FORMAT = Generic()
