"""A session as Markdown, and where exports go."""

from __future__ import annotations

import os
from pathlib import Path

from lucedesk.store import Session, data_dir


def export_dir() -> Path:
    """Where Markdown exports go: beside the sessions when LUCEDESK_DATA_DIR names a folder,
    else the platform's documents folder."""
    import platformdirs

    if os.environ.get("LUCEDESK_DATA_DIR"):
        return data_dir() / "exports"
    return Path(platformdirs.user_documents_dir()) / "lucedesk"


def slug(title: str, limit: int = 60) -> str:
    """A title as a file name: lower-case words joined by dashes, accents off, nothing else
    ("Name three planets?" -> "name-three-planets")."""
    import re
    import unicodedata

    ascii_text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    words = re.findall(r"[a-z0-9]+", ascii_text.lower())
    text = "-".join(words)[:limit].strip("-")
    return text or "session"


def export_markdown(session: Session) -> str:
    """The conversation as Markdown: replies with their reasoning folded, every tool call
    with its arguments and result."""
    lines = [f"# {session.title}", ""]
    if session.system_prompt:
        lines += [f"> system: {session.system_prompt}", ""]
    for m in session.messages:
        if m.role == "tool":
            state = " · error" if m.error else ""
            state = " · interrupted" if m.status == "interrupted" else state
            lines += [
                f"### tool call · {m.name or '?'}{state}",
                "",
                fenced(m.arguments, "json"),
                "",
                fenced(m.content, "text"),
                "",
            ]
            continue
        if m.role == "compaction":  # what the model read in place of the messages above
            marker = f"{m.compacted:,} messages compacted into a summary ({m.tokens:,} tokens)"
            lines += [f"> {marker}", "", "<details><summary>summary</summary>", "", m.content]
            lines += ["", "</details>", ""]
            continue
        lines += [f"## {' · '.join([m.role, *m.notes()])}", ""]
        if m.reasoning:
            lines += [
                "<details><summary>thinking</summary>",
                "",
                m.reasoning,
                "",
                "</details>",
                "",
            ]
        if m.content:
            lines += [m.content, ""]
        lines += [line for call in m.tool_calls for line in (f"- calls `{call.name}`", "")]
    return "\n".join(lines)


def fenced(text: str, language: str) -> str:
    """`text` in a code fence longer than any run of backticks inside it."""
    run, best = 0, 0
    for c in text:
        run = run + 1 if c == "`" else 0
        best = max(best, run)
    ticks = "`" * max(3, best + 1)
    return f"{ticks}{language}\n{text}\n{ticks}"
