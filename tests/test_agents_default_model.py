"""Agents against a real `lucedesk serve` process on the default model: the openai client's
tool calls and JSON schema output, and pydantic-ai's agent loop run to its final answer; and
`lucedesk agent -p` headless on the default model, with its argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.default_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve + "/v1", api_key="unused", max_retries=0)


def model_id(client) -> str:
    return client.models.list().data[0].id


def test_required_tool_call_then_the_result_is_answered(client):
    kwargs = dict(
        model=model_id(client),
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert "paris" in args["city"].lower()

    streamed = {"name": None, "arguments": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed["name"] = streamed["name"] or tc.function.name
            streamed["arguments"] += tc.function.arguments or ""
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}

    answer = client.chat.completions.create(
        model=model_id(client),
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees Celsius."},
        ],
        tools=[WEATHER],
        max_tokens=60,
        temperature=0,
    )
    text = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop" and text
    assert "24" in text or "sunny" in text.lower()


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "country": {"type": "string", "maxLength": 30},
            "capital": {"type": "string", "maxLength": 30},
        },
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model_id(client),
        messages=[{"role": "user", "content": "What is the capital of France? Reply in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        max_tokens=60,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    data = json.loads(r.choices[0].message.content)
    jsonschema.validate(data, schema)
    assert data["capital"] == "Paris"


def test_pydantic_ai_agent_runs_its_tool_loop(serve, client):
    """pydantic-ai's own loop: its structured output makes every turn a forced tool call
    (the weather tool or its `final_result` tool); the weather tool offers itself once, so
    the run goes call -> result -> final answer built from that result."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    class Weather(BaseModel):
        city: str
        summary: str

    model = OpenAIChatModel(
        model_id(client), provider=OpenAIProvider(base_url=serve + "/v1", api_key="unused")
    )
    agent = Agent(model, output_type=Weather, model_settings={"temperature": 0, "max_tokens": 100})
    looked_up: list[str] = []

    async def until_used(ctx, tool_def):
        return None if looked_up else tool_def

    @agent.tool_plain(prepare=until_used)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        looked_up.append(city)
        return "Sunny, 24 degrees Celsius."

    result = agent.run_sync(
        "What is the weather in Paris? Look it up.", usage_limits=UsageLimits(request_limit=4)
    )
    assert looked_up and "paris" in looked_up[0].lower()
    assert result.output.city == "Paris"
    assert "24" in result.output.summary or "sunny" in result.output.summary.lower()
    texts = [p.content for m in result.all_messages() for p in m.parts if p.part_kind == "text"]
    assert not any("<tool_call>" in t for t in texts), texts


# -- the headless CLI ------------------------------------------------------------------------


def lucedesk_agent(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LUCEDESK_DATA_DIR": str(tmp_path / "data")}
    return subprocess.run(
        [sys.executable, "-m", "lucedesk", "agent", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_headless_agent_reads_a_file_and_answers_from_it(default_model, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("The launch code is 7431.\n")
    done = lucedesk_agent(
        tmp_path,
        "-p",
        "Use list_dir and read_file to find the launch code in notes.txt, then answer with "
        "the launch code.",
        "--workspace",
        str(ws),
        "--tool-choice",
        "list_dir,read_file,none",
        "--no-mcp",
        "--model",
        str(default_model),
        "--profile",
        "cpu",
        "--max-tokens",
        "256",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    tools = {m["meta"]["name"]: m for m in out["session"]["messages"] if m["role"] == "tool"}
    assert set(tools) == {"list_dir", "read_file"}, out
    assert tools["list_dir"]["meta"]["error"] is False
    assert tools["read_file"]["meta"]["error"] is False
    assert "7431" in tools["read_file"]["content"]
    assert out["status"] == "done" and "7431" in out["final"], out["final"]
    assert (tmp_path / "data" / "sessions.db").exists()


@pytest.mark.parametrize(
    "args, option",
    [
        (["-p", "hi", "--workspace", "/nonexistent"], "--workspace"),
        (["-p", "hi", "--tool-choice", "a b"], "--tool-choice"),
        (["-p", "hi", "--max-steps", "0"], "--max-steps"),
        (["-p", "  "], "--prompt"),
    ],
)
def test_headless_bad_arguments_are_clean_errors(tmp_path, args, option):
    done = lucedesk_agent(tmp_path, *args, "--base-url", "http://127.0.0.1:9", "--no-mcp")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("lucedesk: error: ") and option in done.stderr
    assert "Traceback" not in done.stderr


def test_headless_arguments_are_checked_before_a_model_loads(tmp_path):
    """A model path that does not exist is never looked at: the bad option is named first."""
    done = lucedesk_agent(
        tmp_path, "-p", "hi", "--workspace", "/nonexistent", "--model", str(tmp_path / "none")
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "lucedesk: error: --workspace: workspace /nonexistent: not a folder"
    ]


def test_any_prompt_goes_to_another_server(serve, tmp_path):
    """The prompt names the session, and the session's name went into a header: a prompt
    with non-ASCII text, or whose first 16 characters end in a space, failed the request."""
    ws = tmp_path / "ws"
    ws.mkdir()
    for prompt in ("Résumé: list the files", "Please list all the files"):
        done = lucedesk_agent(
            tmp_path,
            "-p",
            prompt,
            "--workspace",
            str(ws),
            "--base-url",
            serve,
            "--tool-choice",
            "none",
            "--max-tokens",
            "8",
            "--no-mcp",
        )
        assert done.returncode == 0, done.stderr
        assert "codec" not in done.stderr and "Illegal header" not in done.stderr
