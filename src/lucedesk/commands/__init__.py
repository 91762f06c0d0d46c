"""The CLI's commands, each a function of the parsed arguments returning an exit code (those
about models in models.py)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from lucedesk.chat import ChatEncoder, ChatMessage, schema_grammar
from lucedesk.commands.models import resolve_model_arg
from lucedesk.commands.settings import agent_limits, engine_config, engine_overrides
from lucedesk.engine import BuiltEngine


def say(message: str) -> None:
    print(message, file=sys.stderr)


def build_from_args(args: argparse.Namespace, stage=None) -> BuiltEngine:
    """The engine `args` ask for; `stage` (Startup.stage) is told each step of the start."""
    from lucedesk.catalog.settings import chat_template
    from lucedesk.engine import kernel_build_notice, launch_engine

    stage = stage or (lambda text: say(f"lucedesk: {text}"))
    chosen, config, why = engine_config(args)
    say(f"lucedesk: {why}")
    model = resolve_model_arg(args, config)
    template = chat_template(model.name or str(model.path), getattr(args, "chat_template", None))
    notice = kernel_build_notice(config)
    name = model.name or model.path.name
    stage(f"loading {name}" + (f"; {notice}" if notice else ""))
    built = launch_engine(model.path, config, name=model.name, chat_template=template)
    say(f"lucedesk: weights held as {built.held} on {built.device}, {built.kernels} kernels")
    settle()
    return built


def settle() -> None:
    """A start is done: where collection was off for it (cli.main turns it off), what the
    start made (modules, the model's Python side) is frozen out of the collector's way and
    collection is on again. A full collection over those objects took ~0.1 s, a pause in
    whatever ran then."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def sampling_from_args(args: argparse.Namespace):
    from lucedesk.engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    ).validate()


def run_prompt(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    # One request: a single slot and a pool of one full context keep start-up short.
    args.set = [*args.set, "max_slots=1"] + (
        [] if any(s.startswith("kv_pool_tokens") for s in args.set) else ["kv_pool_tokens=8192"]
    )
    built = build_from_args(args)
    engine = built.engine
    try:
        if args.raw:
            prompt_ids = engine.tokenizer.encode(args.prompt)
        else:
            messages = [ChatMessage("system", args.system)] if args.system else []
            messages.append(ChatMessage("user", args.prompt))
            prompt_ids = ChatEncoder.of(engine).encode(messages).token_ids
        completion = None
        for out in engine.submit(prompt_ids, params, owner="cli"):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                completion = out
        sys.stdout.write("\n")
        if completion is not None and completion.error:
            say(f"lucedesk: error: {completion.error}")
            return 1
        return 0
    finally:
        engine.shutdown()


def bench(args: argparse.Namespace) -> int:
    if not args.offline:
        from lucedesk.bench.online import main as online_main

        return online_main(args)
    from lucedesk.bench.offline import markdown_table, run_offline
    from lucedesk.bench.online import length_range

    try:
        levels = [int(c) for c in str(args.concurrency or "1,2,4,8,16").split(",") if c.strip()]
    except ValueError:
        from lucedesk.errors import ConfigError

        raise ConfigError(
            f"--concurrency {args.concurrency!r}: expected numbers like 1,2,4"
        ) from None
    from lucedesk.bench.online import response_format
    from lucedesk.engine import SamplingParams

    input_len, output_len = length_range(args.input_len), length_range(args.output_len)
    fmt = response_format(args.response_format)
    grammar = None
    if fmt is not None:
        schema = fmt["json_schema"]["schema"] if "json_schema" in fmt else {"type": "object"}
        grammar = schema_grammar(schema)
    built = build_from_args(args)
    engine = built.engine
    try:
        say(
            f"offline bench: {args.num_requests} requests per level, prompt {args.input_len}, "
            f"output {args.output_len}, ignore_eos, closed loop"
            + (f", response format {args.response_format}" if grammar else "")
        )
        results = run_offline(
            engine,
            levels,
            args.num_requests,
            input_len,
            output_len,
            args.seed,
            log=say,
            params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, grammar=grammar),
        )
    finally:
        engine.shutdown()
    print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": built.loaded.name,
                    "dtype": str(built.dtype),
                    "device": str(built.device),
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                    "levels": [{"concurrency": c, **s.as_dict()} for c, s in results],
                },
                f,
                indent=2,
            )
    return 0


def show_profiles(args: argparse.Namespace) -> int:
    from lucedesk import profile
    from lucedesk.catalog.fit import kv_bytes_per_token, pool_basis
    from lucedesk.catalog.summary import summarize_path
    from lucedesk.config import field_names
    from lucedesk.engine import (
        check_device,
        dtype_name,
        fit_now,
        memory_basis,
        read_model_config,
        resolve_device,
        resolve_dtype,
    )
    from lucedesk.errors import ConfigError

    profiles = profile.all_profiles()
    device = profile.probe_device()
    detected, why = profile.detect(profiles, device)
    print("profiles:")
    for name, p in profiles.items():
        mark = "*" if name == detected.name else " "
        where = "built-in" if p.builtin else str(p.path)
        print(f" {mark} {name:<12} {p.description}  [{where}]")
    print(f"\n{why}")
    chosen, config, _ = engine_config(args)
    model_path = resolve_model_arg(args, config, need_device=False).path
    model_config = read_model_config(model_path)
    dtype = dtype_name(resolve_dtype(config.dtype, resolve_device(config.device)))
    max_len = min(
        config.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
    )
    per_token = kv_bytes_per_token(model_config, dtype, config.kv_dtype)
    print(f"\nresolved settings of {chosen.name!r} for {model_config.name}:")
    for key in sorted(field_names()):
        print(f"  {key:<24} {getattr(config, key)}")

    try:
        check_device(config)
        free, memory = memory_basis(resolve_device(config.device), config.unified_memory)
        pool, basis = pool_basis(config, model_config, dtype, free, max_len)
    except ConfigError as exc:  # a profile for a device this machine lacks: what it would take
        pool = (config.kv_pool_tokens or config.max_slots * max_len) // config.block_size
        pool *= config.block_size
        most = (
            "kv_pool_tokens" if config.kv_pool_tokens else f"{config.max_slots} slots x {max_len}"
        )
        basis = f"{most} tokens at most, the free memory measured on the device ({exc})"
        memory = f"not on this machine ({exc})"
        if config.device_memory_gb:
            memory = f"{config.device_memory_gb:g} GiB, the profile's device's; {memory}"
    print(f"\n  memory                   {memory}")
    try:
        held = held_line(fit_now(config), summarize_path(model_path))
    except ConfigError as exc:  # a GPU this machine lacks and the profile says nothing of
        held = str(exc)
    print(f"  held weights             {held}")
    kv_type = "int8 + scales" if config.kv_dtype == "int8" else dtype
    print(f"  KV bytes per token       {per_token} ({kv_type})")
    print(f"  KV pool                  {pool} tokens ({pool * per_token / 2**20:.0f} MiB): {basis}")
    if resolve_device(config.device).type == "cpu":
        print("                           reserved, not written: resident as blocks are used")
    print(f"  context limit            {max_len} tokens")
    print(f"  full-length contexts     {pool // max_len} at once (of {config.max_slots} slots)")
    print(f"  prefix cache on disk     {disk_cache_line(config)}")
    print(f"  held weights on disk     {weight_cache_line(config)}")
    return 0


def held_line(fit, summary) -> str:
    """The form the model's weights take under the profile, and what they and the rest need
    (catalog/held_formats.py, as the loader holds them)."""
    from lucedesk.catalog.fit import expected_weights
    from lucedesk.errors import ConfigError

    try:
        held = expected_weights(summary, fit.config, fit.device, fit.dtype)
    except ConfigError as exc:
        return str(exc)
    form = f"{held.name} ({held.description})" if held else f"dtype ({fit.dtype})"
    return f"{form}; the model needs {fit.describe(summary)}"


def weight_cache_line(config) -> str:
    """What the held weights kept on disk take and may take, or that none are kept."""
    from lucedesk.engine import weight_cache_root

    if not config.weight_cache_gb:
        return "off"
    root = weight_cache_root()
    used = sum(p.stat().st_size for p in root.glob("*.weights.pt")) if root.is_dir() else 0
    return f"{used / 1e9:.2f} of {config.weight_cache_gb:g} GB in {root}"


def disk_cache_line(config) -> str:
    """What the prefix cache on disk holds and may hold, or that there is none."""
    from lucedesk.engine import disk_cache_root

    if not (config.disk_cache_gb and config.prefix_cache):
        return "off"
    root = disk_cache_root()
    used = sum(p.stat().st_size for p in root.glob("*/*.kv")) if root.is_dir() else 0
    return (
        f"{used / 1e9:.2f} of {config.disk_cache_gb:g} GB in {root} "
        f"(prompts of {config.disk_cache_min_tokens}+ tokens)"
    )


def serve(args: argparse.Namespace) -> int:

    from lucedesk.engine import EngineNotReady
    from lucedesk.server import allowed_hosts_for, check_host, create_app, start_server
    from lucedesk.server.access import print_access
    from lucedesk.server.startup import Startup

    print_access(args.log_format)
    api_key = args.api_key or os.environ.get("LUCEDESK_API_KEY") or None
    check_host(args.host, api_key)
    startup = Startup(lambda text: say(f"lucedesk: {text}"))
    serving: list[BuiltEngine] = []

    def engine():
        if not serving:  # /health answers 503 "starting" with what is under way
            raise EngineNotReady(f"starting: {startup.describe()}")
        return serving[0].engine

    app = create_app(
        engine,
        model_name=args.served_model_name,
        api_key=api_key,
        allowed_hosts=allowed_hosts_for(args.host, args.allow_host),
        allowed_origins=args.allow_origin,
    )
    # Listening first: a client sees the server start (503 until the model serves).
    running = start_server(app, args.host, args.port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        serving.append(build_from_args(args, startup.stage))
        startup.done()
        say(f"lucedesk: serving {serving[0].loaded.name} at http://{host}:{running.port}/v1")
        wait_for_a_signal()
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: a stop asked for
        pass
    finally:
        startup.done()
        running.stop()
        if serving:
            serving[0].engine.shutdown()
    return 0


def wait_for_a_signal() -> None:
    """Until Ctrl+C or SIGTERM (both end `serve` the same way)."""
    import signal
    import threading

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    forever = threading.Event()
    while not forever.wait(3600):
        pass


def tui(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lucedesk.store import Store, data_dir
    from lucedesk.tui.app import MODEL_SETTING, LucedeskApp
    from lucedesk.tui.engine_host import EngineHost

    overrides = engine_overrides(args)
    store = Store(data_dir() / "sessions.db")
    host = EngineHost(
        args.model,
        args.profile,
        overrides,
        http=not args.no_http,
        host=args.host,
        port=args.port,
        allowed_hosts=args.allow_host,
        allowed_origins=args.allow_origin,
        chat_template_file=args.chat_template,
        remembered=store.setting(MODEL_SETTING, None),
    )
    if not args.no_http:
        from lucedesk.server import check_host

        check_host(args.host, None)
    from lucedesk.agent import SWITCHES, Approvals
    from lucedesk.agent.mcp import default_mcp_config_path

    workspace = Path(args.workspace).expanduser()
    if not workspace.is_dir():
        from lucedesk.errors import ConfigError

        raise ConfigError(f"--workspace {args.workspace}: not a folder")
    app = LucedeskApp(
        host,
        store,
        workspace=workspace,
        agent_type=SWITCHES[args.tools],
        approvals=Approvals(args.allow_edits, args.allow_commands),
        mcp_config=None if args.no_mcp else Path(args.mcp_config or default_mcp_config_path()),
        limits=agent_limits(args),
    )
    settle()  # (the engine loads in the app, which collects from here on)
    app.run()
    # Everything is closed by now (generation stopped, the server and the store closed):
    # the interpreter's own teardown of torch and the model, a second more of a blank
    # terminal, is skipped.
    from lucedesk.engine import wait_for_writers

    wait_for_writers(lambda text: say(f"lucedesk: {text}"))  # os._exit skips the cli's wait
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(app.return_code or 0)
