"""Stop strings over a reply's free text (the text a turn's parser leaves outside its calls
and reasoning), where the engine's own stop check cannot look: it sees the whole reply."""

from __future__ import annotations

from lucedesk.engine import overlap_with_start


class FreeTextStops:
    """Stop strings over a reply's free text, fed piece by piece: a tail that could grow
    into a stop string is held back until the next piece says."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """(the text safe to hand out, the stop string found or None)."""
        text, self.held = self.held + text, ""
        hits = [(i, stop) for stop in self.stops if (i := text.find(stop)) >= 0]
        if hits:
            at, stop = min(hits)
            return text[:at], stop
        if not final:
            keep = max(overlap_with_start(text, stop) for stop in self.stops)
            text, self.held = text[: len(text) - keep], text[len(text) - keep :]
        return text, None
