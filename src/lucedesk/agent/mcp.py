"""MCP servers as tool sources. `mcp.json` names the servers (a command over stdio, or a
streamable HTTP url); `McpHub` connects to them, lists their tools and turns each into a
ToolSpec named `mcp__<server>__<tool>` whose handler asks the user first (unless the server is
trusted) and calls the tool.

The mcp package's transports are anyio context managers that must be exited in the task that
entered them, so each server lives in one long-lived task of its own: it connects, reports
ready, waits for `stop()` and closes its session there. One task per server also means that
servers start in parallel and that one that dies takes no other down with it."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import tempfile
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx2
import mcp.types as mt
import platformdirs
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from lucedesk.agent.approvals import ApprovalRequest
from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, capped
from lucedesk.errors import ConfigError

START_TIMEOUT_S = 20.0  # per server: spawn (or connect), initialize, list tools
CALL_TIMEOUT_S = 60.0
EMPTY_SCHEMA = {"type": "object", "properties": {}}

log = logging.getLogger(__name__)


@dataclass(slots=True)
class McpServerConfig:
    name: str
    command: str | None = None  # stdio: the program to run ...
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # over HOME, PATH, SHELL, TERM, USER
    cwd: str | None = None
    url: str | None = None  # ... or streamable HTTP: the endpoint
    headers: dict[str, str] = field(default_factory=dict)
    trust: bool = False  # its tools run without asking


def default_mcp_config_path() -> Path:
    return Path(platformdirs.user_config_dir("lucedesk")) / "mcp.json"


def load_mcp_config(path: Path) -> list[McpServerConfig]:
    """The servers in `path` (`{"mcpServers": {name: {...}}}`); none if the file is missing.
    Keys other clients add ("autoApprove", "timeout", ...) are ignored; `"disabled": true` skips
    a server, and a "type" other than stdio or streamable HTTP is an error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be an object")
    servers = data.get("mcpServers", {})
    if not isinstance(servers, dict):
        raise ConfigError(f"{path}: mcpServers must be an object of servers by name")
    found = (parse_server(path, name, entry) for name, entry in servers.items())
    return [server for server in found if server is not None]


def parse_server(path: Path, name: str, entry: object) -> McpServerConfig | None:
    where = f"mcpServers.{name}"

    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{path}: {where}{key} must be {what}")

    if not isinstance(entry, dict):
        raise bad("", "an object")

    def get(key: str, kind: type, what: str, default: object = None):
        value = entry.get(key, default)
        items = value.values() if isinstance(value, dict) else value
        items = items if isinstance(value, list | dict) else ()
        valid = isinstance(value, kind) and all(isinstance(item, str) for item in items)
        if value is not default and not valid:
            raise bad(f".{key}", what)
        return value

    if get("disabled", bool, "true or false", False):
        return None
    kind = get("type", str, "a string")
    if kind not in (None, "stdio", "http", "streamable-http", "streamableHttp"):
        raise bad(".type", "stdio, http or streamable-http (SSE servers are not supported)")
    command = get("command", str, "a string")
    url = get("url", str, "a string")
    if (command is None) == (url is None) or command == "":
        raise bad("", 'an object with either "command" or "url"')
    if url is not None and not url.startswith(("http://", "https://")):
        raise bad(".url", "an http:// or https:// address")
    cwd = get("cwd", str, "a string")
    return McpServerConfig(
        name,
        command,
        list(get("args", list, "a list of strings", [])),
        dict(get("env", dict, "an object of strings", {})),
        None if cwd is None else str(path.parent / Path(cwd).expanduser()),
        url,
        dict(get("headers", dict, "an object of strings", {})),
        get("trust", bool, "true or false", False),
    )


class McpHub:
    def __init__(
        self, start_timeout: float = START_TIMEOUT_S, call_timeout: float = CALL_TIMEOUT_S
    ) -> None:
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.tools: list[ToolSpec] = []
        self.errors: dict[str, str] = {}  # server name -> why it is not connected
        self._listed: dict[str, tuple[ClientSession, list[mt.Tool]]] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = asyncio.Event()

    async def start(self, servers: list[McpServerConfig]) -> None:
        """Connects to every server at once; returns when each is connected or has failed
        (its reason in `errors`). Never raises for a server's sake."""
        readies = []
        for server in servers:
            ready = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._serve(server, ready)))
            readies.append(ready.wait())
        await asyncio.gather(*readies)
        for server in servers:
            session, tools = self._listed.get(server.name, (None, []))
            for tool in tools:
                self.tools.append(self._tool_spec(server, session, tool))

    async def stop(self) -> None:
        """Closes every session (and stops every stdio server) from the task that opened it."""
        self._stopping.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._listed.clear()
        self.tools = []
        self._stopping = asyncio.Event()

    async def _serve(self, server: McpServerConfig, ready: asyncio.Event) -> None:
        # The deadline covers connecting only; once the tools are listed it is lifted, and the
        # scope stays open around the session, as anyio requires scopes to nest.
        reason = None
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
            try:
                with anyio.CancelScope(deadline=anyio.current_time() + self.start_timeout) as scope:
                    async with AsyncExitStack() as stack:
                        session = await self._connect(stack, server, errlog)
                        self._listed[server.name] = (session, await list_tools(session))
                        scope.deadline = math.inf
                        ready.set()
                        await self._stopping.wait()
                if scope.cancelled_caught and not ready.is_set():
                    reason = f"did not start within {self.start_timeout:g} s"
            except Exception as exc:
                if not ready.is_set():
                    reason = describe(exc)
                else:  # it was serving; calls to its tools now fail with a ToolError
                    log.warning("MCP server %s stopped: %s", server.name, describe(exc))
            finally:
                if reason is not None:
                    errlog.seek(0)
                    stderr = errlog.read()[-600:].strip()  # what the server said, if anything
                    self.errors[server.name] = reason + (f"\n{stderr}" if stderr else "")
                ready.set()

    async def _connect(self, stack: AsyncExitStack, server: McpServerConfig, errlog):
        if server.command is not None:
            params = StdioServerParameters(
                command=server.command, args=server.args, env=server.env, cwd=server.cwd
            )
            read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
        else:
            http = httpx2.AsyncClient(headers=server.headers, timeout=httpx2.Timeout(30, read=300))
            await stack.enter_async_context(http)
            transport = streamable_http_client(server.url, http_client=http)
            read, write = await stack.enter_async_context(transport)
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        return session

    def _tool_spec(self, server: McpServerConfig, session: ClientSession, tool: mt.Tool):
        taken = {t.name for t in self.tools}
        name = unique(re.sub(r"[^a-zA-Z0-9_-]", "_", f"mcp__{server.name}__{tool.name}"), taken)
        where = f"MCP {server.name}.{tool.name}"

        async def call(ctx: ToolContext, args: dict) -> str:
            if not server.trust:
                detail = json.dumps(args, indent=1)
                request = ApprovalRequest("command", ctx.title, name, where, detail)
                if not await ctx.approve(request):
                    raise ToolError(f"the user declined to run {where}")
            try:
                result = await session.call_tool(tool.name, args, self.call_timeout)
            except Exception as exc:  # the connection, a timeout, a protocol error
                raise ToolError(f"{where}: the call failed ({describe(exc)})") from None
            text = result_text(result)
            if result.is_error:
                raise ToolError(capped(text or f"{where} failed"))
            return capped(text)

        schema = dict(tool.input_schema or EMPTY_SCHEMA)
        if schema.get("type") == "object":
            schema.setdefault("properties", {})
        description = tool.description or tool.title or f"The {tool.name} tool of {server.name}."
        return ToolSpec(name, description, schema, call, "exec")


async def list_tools(session: ClientSession) -> list[mt.Tool]:
    init = session.initialize_result
    if init is not None and init.capabilities.tools is None:
        return []  # a server of prompts or resources only
    tools: list[mt.Tool] = []
    cursor = None
    while True:
        params = mt.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools += page.tools
        if not (cursor := page.next_cursor):
            return tools


def unique(name: str, taken: set[str], limit: int = 64) -> str:
    found, n = name[:limit], 1
    while found in taken:
        n += 1
        found = name[: limit - len(f"_{n}")] + f"_{n}"
    return found


def result_text(result: mt.CallToolResult) -> str:
    """Text blocks as they are; binary content as a note of its type and size."""
    parts = []
    for block in result.content:
        if isinstance(block, mt.TextContent):
            parts.append(block.text)
        elif isinstance(block, mt.ImageContent | mt.AudioContent):
            parts.append(f"[{block.mime_type} content, {b64_size(block.data)} bytes]")
        elif isinstance(block, mt.EmbeddedResource):
            res = block.resource
            if isinstance(res, mt.TextResourceContents):
                parts.append(f"[resource {res.uri}]\n{res.text}")
            else:
                parts.append(
                    f"[{res.mime_type or 'binary'} resource {res.uri}, {b64_size(res.blob)} bytes]"
                )
        elif isinstance(block, mt.ResourceLink):
            parts.append(f"[resource link {block.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def b64_size(data: str) -> int:
    return len(data) * 3 // 4 - data[-2:].count("=")


def describe(exc: BaseException) -> str:
    """The message of the first real error inside anyio's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return str(exc).strip() or type(exc).__name__
