"""MCP servers as agent tools, against real servers: a stdio server the test writes as a
script, and a streamable HTTP server run with uvicorn in a thread."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import mcp.types as mt
import pytest
import pytest_asyncio
import uvicorn
from mcp.server.mcpserver import MCPServer

from lucedesk.agent.approvals import ApprovalRequest, Approvals
from lucedesk.agent.mcp import (
    McpHub,
    McpServerConfig,
    default_mcp_config_path,
    load_mcp_config,
    result_text,
    unique,
)
from lucedesk.agent.tools.base import ToolContext, ToolError
from lucedesk.agent.workspace import Workspace
from lucedesk.errors import ConfigError

from .conftest import TEST_HOME, free_port

# The hub and its servers live on the module's event loop; so do the tests that use them.
in_module_loop = pytest.mark.asyncio(loop_scope="module")

SERVER_SCRIPT = '''
import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image

server = MCPServer("demo")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail() -> str:
    """Always fails."""
    raise ToolError("the disk is on fire")  # other exceptions reach clients without their text


@server.tool()
def picture() -> Image:
    return Image(data=b"\\x89PNG" + bytes(1230), format="png")


@server.tool(name="odd.name with spaces")
def odd() -> str:
    return "odd"


@server.tool()
async def nap(seconds: float) -> str:
    await anyio.sleep(seconds)
    return "rested"


@server.tool()
def crash() -> str:
    os._exit(3)


server.run()
'''


def stdio(path: Path, **extra) -> dict:
    return {"command": sys.executable, "args": [str(path)], **extra}


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mcp") / "demo_server.py"
    path.write_text(SERVER_SCRIPT)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hub(script, tmp_path_factory):
    """One hub for the module: servers start in parallel, the broken ones alongside."""
    config = tmp_path_factory.mktemp("cfg") / "mcp.json"
    servers = {
        "demo": stdio(script),
        "trusted": stdio(script, trust=True),
        "crashy": stdio(script, trust=True),
        "missing": {"command": str(config.parent / "no-such-mcp-server")},
        "quits": stdio(script, args=["-c", "import sys; print('bad token', file=sys.stderr)"]),
    }
    config.write_text(json.dumps({"mcpServers": servers}))
    hub = McpHub()
    await hub.start(load_mcp_config(config))
    yield hub
    await hub.stop()


def tool(hub: McpHub, name: str):
    return next(t for t in hub.tools if t.name == name)


def context(tmp_path: Path, approvals: Approvals) -> ToolContext:
    return ToolContext(Workspace(tmp_path), approvals, "mcp test")


@in_module_loop
async def test_stdio_tools_are_listed_with_their_schemas(hub):
    add = tool(hub, "mcp__demo__add")
    assert add.description == "Add two integers."
    assert add.access == "exec"
    assert add.parameters["type"] == "object"
    assert set(add.parameters["properties"]) == {"a", "b"}
    assert sorted(add.parameters["required"]) == ["a", "b"]
    assert tool(hub, "mcp__demo__fail").parameters["properties"] == {}
    assert tool(hub, "mcp__demo__odd_name_with_spaces")
    names = [t.name for t in hub.tools if t.name.startswith("mcp__trusted__")]
    assert names == [t.name.replace("demo", "trusted") for t in hub.tools if "__demo__" in t.name]


@in_module_loop
async def test_call_returns_the_tools_text(hub, tmp_path):
    add = tool(hub, "mcp__demo__add")
    assert (
        await add.handler(context(tmp_path, Approvals(allow_commands=True)), {"a": 2, "b": 3})
        == "5"
    )


@in_module_loop
async def test_a_failing_tool_raises_tool_error(hub, tmp_path):
    fail = tool(hub, "mcp__demo__fail")
    with pytest.raises(ToolError, match="the disk is on fire"):
        await fail.handler(context(tmp_path, Approvals(allow_commands=True)), {})


@in_module_loop
async def test_untrusted_server_asks_and_a_refusal_is_a_tool_error(hub, tmp_path):
    add = tool(hub, "mcp__demo__add")
    with pytest.raises(ToolError, match="declined"):
        await add.handler(context(tmp_path, Approvals()), {"a": 1, "b": 1})
    asked: list[ApprovalRequest] = []

    async def ask(request: ApprovalRequest) -> bool:
        asked.append(request)
        return True

    assert await add.handler(context(tmp_path, Approvals(ask=ask)), {"a": 1, "b": 1}) == "2"
    [request] = asked
    assert (request.kind, request.session_title, request.tool) == (
        "command",
        "mcp test",
        "mcp__demo__add",
    )
    assert request.summary == "MCP demo.add"
    assert json.loads(request.detail) == {"a": 1, "b": 1}


@in_module_loop
async def test_trusted_server_runs_without_asking(hub, tmp_path):
    add = tool(hub, "mcp__trusted__add")
    assert await add.handler(context(tmp_path, Approvals()), {"a": 40, "b": 2}) == "42"


@in_module_loop
async def test_image_content_becomes_a_note(hub, tmp_path):
    picture = tool(hub, "mcp__trusted__picture")
    assert await picture.handler(context(tmp_path, Approvals()), {}) == (
        "[image/png content, 1234 bytes]"
    )


@in_module_loop
async def test_a_slow_call_times_out_and_the_server_goes_on(hub, tmp_path):
    hub.call_timeout = 0.3
    try:
        with pytest.raises(ToolError, match="MCP trusted.nap: the call failed"):
            await tool(hub, "mcp__trusted__nap").handler(
                context(tmp_path, Approvals()), {"seconds": 5}
            )
    finally:
        hub.call_timeout = 60
    add = tool(hub, "mcp__trusted__add")
    assert await add.handler(context(tmp_path, Approvals()), {"a": 1, "b": 2}) == "3"


@in_module_loop
async def test_servers_that_fail_are_recorded_and_the_rest_work(hub):
    assert set(hub.errors) == {"missing", "quits"}
    assert "no-such-mcp-server" in hub.errors["missing"]
    assert "bad token" in hub.errors["quits"]  # the server's stderr comes with the error
    assert not [t for t in hub.tools if t.name.startswith(("mcp__missing", "mcp__quits"))]


@in_module_loop
async def test_a_server_that_dies_mid_call_gives_a_tool_error(hub, tmp_path):
    crash = tool(hub, "mcp__crashy__crash")
    with pytest.raises(ToolError, match="MCP crashy.crash: the call failed"):
        await crash.handler(context(tmp_path, Approvals()), {})
    with pytest.raises(ToolError, match="the call failed"):
        await tool(hub, "mcp__crashy__add").handler(context(tmp_path, Approvals()), {"a": 1})


@in_module_loop
async def test_a_server_that_never_answers_times_out(tmp_path):
    silent = ["-c", "import sys; sys.stdin.read()"]  # reads until stdin closes, says nothing
    hub = McpHub(start_timeout=0.5)
    began = time.monotonic()
    await hub.start([McpServerConfig("silent", sys.executable, silent)])
    assert time.monotonic() - began < 5
    assert hub.errors == {"silent": "did not start within 0.5 s"}
    assert hub.tools == []
    await hub.stop()


@pytest.fixture(scope="module")
def http_url():
    server = MCPServer("web")
    seen_headers: list[str] = []

    @server.tool()
    def echo(text: str) -> str:
        """Say it back."""
        return f"echo: {text}"

    app = server.streamable_http_app()

    async def recording(scope, receive, send):
        if scope["type"] == "http":
            seen_headers.append(dict(scope["headers"]).get(b"x-token", b"").decode())
        await app(scope, receive, send)

    port = free_port()
    config = uvicorn.Config(recording, host="127.0.0.1", port=port, log_level="warning")
    web = uvicorn.Server(config)
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not web.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/mcp", seen_headers
    web.should_exit = True
    thread.join(10)


@in_module_loop
async def test_streamable_http_server(http_url, tmp_path):
    url, seen_headers = http_url
    hub = McpHub()
    await hub.start([McpServerConfig("web", url=url, headers={"X-Token": "t"}, trust=True)])
    try:
        assert hub.errors == {}
        assert [t.name for t in hub.tools] == ["mcp__web__echo"]
        echo = hub.tools[0]
        assert await echo.handler(context(tmp_path, Approvals()), {"text": "hi"}) == "echo: hi"
        assert seen_headers and set(seen_headers) == {"t"}  # the configured header, every time
    finally:
        await hub.stop()
    assert hub.tools == []


@in_module_loop
async def test_an_http_server_that_is_not_there_is_recorded(tmp_path):
    hub = McpHub(start_timeout=5)
    await hub.start([McpServerConfig("gone", url=f"http://127.0.0.1:{free_port()}/mcp")])
    assert hub.errors == {"gone": "All connection attempts failed"} and hub.tools == []
    await hub.stop()


def test_config_is_parsed(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "fs": {
                        "type": "stdio",
                        "command": "npx",
                        "args": ["-y", "server-filesystem"],
                        "env": {"A": "1"},
                        "cwd": "sub",
                        "autoApprove": [],
                    },
                    "web": {"url": "https://example.com/mcp", "headers": {"X": "y"}, "trust": True},
                    "off": {"command": "x", "disabled": True},
                }
            }
        )
    )
    fs, web = load_mcp_config(path)
    assert fs == McpServerConfig(
        "fs", "npx", ["-y", "server-filesystem"], {"A": "1"}, str(tmp_path / "sub")
    )
    assert web == McpServerConfig(
        "web", url="https://example.com/mcp", headers={"X": "y"}, trust=True
    )
    assert load_mcp_config(tmp_path / "absent.json") == []


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ({"fs": {"command": "x", "args": "-y"}}, "mcpServers.fs.args must be a list of strings"),
        ({"fs": {"command": "x", "args": [1]}}, "mcpServers.fs.args must be a list of strings"),
        ({"fs": {"command": "x", "env": {"A": 1}}}, "mcpServers.fs.env must be an object of"),
        ({"fs": {"command": 3}}, "mcpServers.fs.command must be a string"),
        ({"fs": {"command": "x", "url": "http://h"}}, "mcpServers.fs must be an object with"),
        ({"fs": {}}, 'mcpServers.fs must be an object with either "command" or "url"'),
        ({"fs": {"url": "ftp://h"}}, "mcpServers.fs.url must be an http:// or https://"),
        ({"fs": {"url": "http://h", "trust": "yes"}}, "mcpServers.fs.trust must be true or"),
        ({"fs": {"url": "http://h", "type": "sse"}}, "mcpServers.fs.type must be stdio, http"),
        ({"fs": []}, "mcpServers.fs must be an object"),
        ([], "mcpServers must be an object"),
    ],
)
def test_config_errors_name_the_file_and_the_field(tmp_path, servers, message):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    with pytest.raises(ConfigError, match="mcp.json: ") as caught:
        load_mcp_config(path)
    assert str(path) in str(caught.value) and message in str(caught.value)


def test_bad_json_is_a_config_error(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {')
    with pytest.raises(ConfigError, match="mcp.json: not a readable JSON file"):
        load_mcp_config(path)


def test_default_config_path_is_in_the_users_config_folder():
    path = default_mcp_config_path()
    assert path.name == "mcp.json" and path.parent.name == "lucedesk"
    assert path.is_relative_to(TEST_HOME)  # conftest points XDG_CONFIG_HOME there


def test_tool_names_are_cut_to_64_characters_and_kept_unique():
    name = "mcp__" + "s" * 70
    assert unique(name, set()) == name[:64]
    assert unique(name, {name[:64]}) == name[:62] + "_2"
    assert len(unique(name, {name[:64], name[:62] + "_2"})) == 64


def test_other_content_becomes_short_notes():
    result = mt.CallToolResult(
        content=[
            mt.TextContent(text="hello"),
            mt.EmbeddedResource(
                resource=mt.TextResourceContents(uri="file:///a.txt", text="inside")
            ),
            mt.EmbeddedResource(
                resource=mt.BlobResourceContents(
                    uri="file:///b.bin", blob="AAAA", mime_type="application/zip"
                )
            ),
            mt.ResourceLink(uri="file:///c.txt", name="c"),
        ]
    )
    assert result_text(result) == (
        "hello\n[resource file:///a.txt]\ninside\n"
        "[application/zip resource file:///b.bin, 3 bytes]\n[resource link file:///c.txt]"
    )
    structured = mt.CallToolResult(content=[], structured_content={"n": 1})
    assert result_text(structured) == '{"n": 1}'
