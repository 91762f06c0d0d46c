"""The settings a command's arguments ask for: the profile and its overrides, the agents'
limits."""

from __future__ import annotations

import argparse


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """The command line's `--set` overrides, `--no-prefix-cache` and `--no-disk-cache`
    included."""
    overrides = list(getattr(args, "set", []) or [])
    if getattr(args, "no_prefix_cache", False):
        overrides.append("prefix_cache=false")
    if getattr(args, "no_disk_cache", False):
        overrides.append("disk_cache_gb=0")
    return overrides


def engine_config(args: argparse.Namespace):
    """The resolved profile and its EngineConfig with the command line's overrides."""
    from lucedesk import profile

    return profile.resolve(getattr(args, "profile", None), engine_overrides(args))


def agent_limits(args: argparse.Namespace):
    """The agents' limits: --max-steps, --max-depth (lucedesk agent) and --compact-at."""
    from lucedesk.agent import Limits, Policy
    from lucedesk.errors import ConfigError

    share = args.compact_at
    if not 0.3 <= share <= 0.95:
        raise ConfigError(f"--compact-at {share:g}: give a share of the context from 0.3 to 0.95")
    limits = Limits(compaction=Policy(compact_at=share))
    limits.max_steps = getattr(args, "max_steps", limits.max_steps)
    limits.max_depth = getattr(args, "max_depth", limits.max_depth)
    return limits
