"""The engine settings a command's arguments ask for: the profile and its overrides."""

from __future__ import annotations

import argparse


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """The command line's `--set` overrides, `--no-prefix-cache` included."""
    overrides = list(getattr(args, "set", []) or [])
    if getattr(args, "no_prefix_cache", False):
        overrides.append("prefix_cache=false")
    return overrides


def engine_config(args: argparse.Namespace):
    """The resolved profile and its EngineConfig with the command line's overrides."""
    from lucedesk import profile

    return profile.resolve(getattr(args, "profile", None), engine_overrides(args))
