"""What every protocol adapter shares: the current engine, the names the model answers to,
and who sent a request (for the slot monitor)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from lucedesk.chat import Turn, TurnRequest, TurnResult, start_turn
from lucedesk.engine import Engine
from lucedesk.server.errors import APIError, generation_failed

CLIENT_HEADER = "x-lucedesk-client"
PRIORITY_HEADER = "x-lucedesk-priority"  # interactive | background (the default)
DEFAULT_NAME = "default"


@dataclass(slots=True, frozen=True)
class Served:
    """`engine()` is the engine serving now (a host may rebuild it, as the TUI's /model
    does); the model answers to its own id, to `default`, and to each alias."""

    engine: Callable[[], Engine]
    aliases: tuple[str, ...] = ()

    @property
    def model_id(self) -> str:
        """The name clients are shown: the first alias, else the loaded model's own."""
        return self.aliases[0] if self.aliases else self.engine().model_name

    def names(self) -> list[str]:
        return list(
            dict.fromkeys([self.model_id, self.engine().model_name, DEFAULT_NAME, *self.aliases])
        )

    def check_model(self, name: str | None, field: str = "model") -> None:
        """A 404 (in the caller's protocol's shape) for a model this server does not serve;
        no name at all means the served one."""
        if name is None or name == "" or name in self.names():
            return
        if name.removesuffix(":latest") in self.names():  # Ollama's default tag
            return
        raise APIError(
            404,
            f"model {name!r} not found; this server serves {self.model_id!r} "
            f"(also as {', '.join(repr(n) for n in self.names()[1:])})",
            field,
            kind="not_found_error",
        )


def owner_label(request: Request) -> str:
    """Who sent it, for the slot monitor: an explicit header, else the User-Agent's product."""
    return label_of(request.headers.get(CLIENT_HEADER), request.headers.get("user-agent"))


def label_of(client: str | None, user_agent: str | None) -> str:
    label = client or user_agent or "client"
    label = label.split()[0] if label.split() else "client"
    return "http:" + "".join(c for c in label if c.isprintable())[:32]


async def start_client_turn(engine: Engine, req: TurnRequest, request: Request) -> Turn:
    """start_turn for an HTTP client: its slot owned by its label, and interactive (decoding
    every step beside background work) when it asks with X-Lucedesk-Priority."""
    priority = request.headers.get(PRIORITY_HEADER, "background").strip().lower()
    if priority not in ("interactive", "background"):
        raise APIError(
            400,
            f"X-Lucedesk-Priority must be interactive or background, not {priority!r}",
            "X-Lucedesk-Priority",
        )
    req.interactive = priority == "interactive"
    turn = await start_turn(engine, req, owner_label(request))
    access = getattr(request.state, "access", None)
    if access is not None:  # its tokens and first token's time go in the access line
        access.turn = turn
    return turn


async def complete(turn: Turn, request: Request) -> TurnResult:
    """The whole reply of a turn that is not streamed (cancelled if the client leaves);
    raises the 500 every protocol answers when generation failed."""
    done = await turn.complete(request.is_disconnected)
    if done.finish == "error":
        raise generation_failed(done.error)
    return done
