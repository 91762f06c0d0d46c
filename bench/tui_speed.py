"""One stream's decode speed headless, in a TUI pane, and in a TUI pane with the slot monitor
open (Ctrl+G), on the same model and settings, alternating A B C C B A so drift in the
machine's speed falls on all three alike.

    .venv/bin/python bench/tui_speed.py [--model PATH] [--tokens 256] [--rounds 2]

The TUI runs under Textual's headless driver (every widget renders; nothing is written to a
terminal). Speed is decode steps per second as the client sees them: text deltas after the
first over the time from the first to the last, counted alike headless and in the TUI.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from lucedesk import profile
from lucedesk.agent import AgentSession, MessageDone, TextStreamed
from lucedesk.catalog.resolve import resolve
from lucedesk.chat import Sampling, TurnRequest, submit_turn
from lucedesk.engine import launch_engine
from lucedesk.store import Store

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def forced_length(tokens: int):
    """Every agent turn runs `tokens` long (ignore_eos), greedy."""
    original = AgentSession.turn_request

    def turn_request(self, *args):
        req = original(self, *args)
        s = req.sampling
        s.ignore_eos, s.max_tokens, s.temperature = True, tokens, 0.0
        return req

    AgentSession.turn_request = turn_request


async def headless(engine, tokens: int) -> float:
    req = TurnRequest(
        messages=[{"role": "user", "content": PROMPT}],
        sampling=Sampling(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )
    stamps: list[float] = []
    turn = submit_turn(engine, req, owner="bench")
    await turn.collect(lambda _text: stamps.append(time.perf_counter()))
    return rate(stamps)


def rate(stamps: list[float]) -> float:
    """Text deltas per second after the first: one per engine step for one stream (a token
    whose text is held back, part of a longer character, comes with the next)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def in_tui(model: Path, overrides: list[str], tokens: int, monitor: bool) -> float:
    from lucedesk.tui.app import LucedeskApp
    from lucedesk.tui.engine_host import EngineHost
    from lucedesk.tui.screens.main import MainScreen
    from lucedesk.tui.widgets.chat_input import ChatInput

    with tempfile.TemporaryDirectory() as tmp:
        host = EngineHost(str(model), "cpu", overrides, http=False)
        app = LucedeskApp(host, Store(Path(tmp) / "s.db"), Path(tmp), "chat")
        stamps: list[float] = []
        done = asyncio.Event()
        observe = app.agents.observe

        def timed(event) -> None:
            if isinstance(event, TextStreamed):
                stamps.append(time.perf_counter())
            elif isinstance(event, MessageDone) and event.message.role == "assistant":
                done.set()
            observe(event)

        app.agents.observe = timed
        async with app.run_test(size=(160, 48)) as pilot:
            while not isinstance(app.screen, MainScreen) or not app.screen.panes:
                await pilot.pause(0.1)
            if monitor:
                await pilot.press("ctrl+g")
            pane = app.screen.panes[0]
            box = pane.query_one(ChatInput)
            for _ in range(2):  # a warm-up reply first (as headless gets one), then a new chat
                await app.screen.action_new_session()
                stamps.clear()
                done.clear()
                box.focus()
                box.text = PROMPT
                await pilot.press("enter")
                await asyncio.wait_for(done.wait(), 600)
                while pane.busy:
                    await pilot.pause(0.05)
    return rate(stamps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    forced_length(args.tokens)
    model = resolve(args.model, print).path
    overrides = ["max_slots=4", "kv_pool_tokens=8192"]
    _, config, why = profile.resolve("cpu", overrides)
    print(why)
    results: dict[str, list[float]] = {"headless": [], "tui": [], "tui + monitor": []}
    order = ["headless", "tui", "tui + monitor"]
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            if name == "headless":
                built = launch_engine(model, config)
                try:
                    asyncio.run(headless(built.engine, args.tokens))  # warm-up
                    value = asyncio.run(headless(built.engine, args.tokens))
                finally:
                    built.engine.shutdown()
            else:
                value = asyncio.run(in_tui(model, overrides, args.tokens, name != "tui"))
            results[name].append(value)
            print(f"{name:14} {value:6.1f} tok/s", flush=True)
    base = statistics.median(results["headless"])
    print("\n| | runs (tok/s) | median | vs headless |\n|---|---|---:|---:|")
    for name, values in results.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {runs} | {med:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
