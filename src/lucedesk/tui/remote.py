"""What the slot monitor shows of another server a session talks to (a bigger model on a
vLLM or llama.cpp server elsewhere; the agent's OpenAIBackend runs its turns there)."""

from __future__ import annotations

import httpx


async def remote_slots(url: str) -> str:
    """One line on what a remote server reports about its slots, if it reports anything."""
    base = url.rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            r = await http.get(base + "/slots")
            if r.status_code == 200:
                data = r.json()
                slots = data.get("slots", data if isinstance(data, list) else [])
                busy = sum(1 for s in slots if s.get("request_id") or s.get("is_processing"))
                return f"{base}: {busy}/{len(slots)} slots busy"
            r = await http.get(base + "/metrics")
            if r.status_code == 200:
                return f"{base}: /metrics available ({len(r.text.splitlines())} lines)"
    except (httpx.HTTPError, ValueError):
        return f"{base}: unreachable"
    return f"{base}: reports no slots"
