"""`lily serve` driven by the official `openai` Python client, on the tiny fixture checkpoint (CPU).

Run after `cargo build`: `python -m pytest tests/python -q` (LILY_BIN overrides target/debug/lily;
LILY_SERVE_ARGS adds server options, e.g. `--device cuda`).
The fixture model has random weights (its text is gibberish), so the free-form reasoning and
tool-call paths use the server's test-only LILY_TEST_SCRIPTS hook: a request whose last message
contains a trigger generates a fixed text through the real model, sampler, stop strings and
parsers. The constrained cases (tool_choice required/named, json_schema) run without it: the mask
alone must make the random model's output parse and match the schema.

The checkpoint carries the real Qwen3.5 chat template (XML tool calls), the copy built into lily
(assets/).
"""

import concurrent.futures as cf
import http.client
import json
import os
import pathlib
import shutil
import socket
import subprocess
import time
import urllib.request

import jsonschema
import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("LILY_BIN", str(ROOT / "target" / "debug" / "lily"))
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-hf"
REAL_TEMPLATE = ROOT / "assets" / "qwen3.5-chat_template.jinja"
KEY = "test-key"

SCRIPTS = {
    "SCRIPT_THINK": "The user greets me.\n</think>\n\nHello there!",
    "SCRIPT_TOOL": "Weather needed.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "SCRIPT_AFTER_TOOL": "Done.\n</think>\n\nIt is 22C in Paris.",
    "SCRIPT_BADTOOL": "Hmm.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>",
    "SCRIPT_STOP": "alpha beta STOP gamma delta",
    "SCRIPT_LONG": "word " * 400,
    "SCRIPT_TWO_TOOLS": "Two.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo, \"the <north>\"\nline two\n</parameter>\n</function>\n</tool_call>",
    "SCRIPT_JSON_TOOL": 'Old style.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "parameters": {
                "type": "object",
                "properties": {
                    "when": {
                        "type": "object",
                        "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}, "late": {"type": "boolean"}},
                        "required": ["day", "late"],
                        "additionalProperties": False,
                    },
                    "guests": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
                },
                "required": ["when", "guests"],
            },
        },
    },
]


def model_dir(tmp: pathlib.Path, template=None) -> pathlib.Path:
    """The tiny checkpoint with the real Qwen3.5 chat template (or `template`)."""
    template = template or REAL_TEMPLATE
    assert template.exists(), f"the chat template is missing at {template}"
    d = tmp / "tiny-hf-tools"
    d.mkdir()
    for f in FIXTURE.iterdir():
        if f.name != "chat_template.jinja":
            (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").symlink_to(template)
    return d


class Server:
    def __init__(self, model, *args, env=None):
        e = dict(os.environ)
        e["LILY_TEST_SCRIPTS"] = json.dumps(SCRIPTS)
        e.update(env or {})
        # LILY_SERVE_ARGS adds options to every server, e.g. `--device cuda` on a GPU machine.
        extra = os.environ.get("LILY_SERVE_ARGS", "").split()
        cmd = [BIN, "serve", "--model", str(model), "--bind", "127.0.0.1:0", "--threads", "2", *extra, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.url = line.strip().split("listening on ")[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def client(self, key=KEY, retries=0):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=retries, timeout=120)

    def raw(self, method, path, body=None, headers=None):
        """(status, headers, body bytes) without any client-side validation."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        h.update(headers or {})
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, dict(r.getheaders()), data

    def alive(self):
        return self.proc.poll() is None and self.raw("GET", "/health")[0] == 200

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(model_dir(tmp_path_factory.mktemp("m")), "--api-key", KEY, "--max-seq", "4096", "--max-body-bytes", "65536")
    yield s
    assert s.alive(), "the server died during the tests"
    s.stop()


def user(text):
    return [{"role": "user", "content": text}]


def stream_text(stream):
    """Reassembles a chat stream; tool calls as (name, arguments) from their deltas by index."""
    content, reasoning, calls, finish, usage = "", "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                # The first delta of a call carries its id, type and name.
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.id is None and not tc.function.name, tc
            calls[tc.index][1] += tc.function.arguments or ""
        if ch.finish_reason:
            finish = ch.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish, usage


def test_models_health_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-hf-tools"]
    st, _, body = server.raw("GET", "/health", headers={"Authorization": ""})
    assert st == 200 and json.loads(body)["status"] == "ok"
    st, h, body = server.raw("GET", "/metrics")
    assert st == 200 and "text/plain" in h["content-type"]
    text = body.decode()
    for name in [
        "lily_requests_total",
        "lily_prompt_tokens_total",
        "lily_completion_tokens_total",
        "lily_prefill_tokens_per_second",
        "lily_decode_tokens_per_second",
        "lily_time_to_first_token_seconds_bucket",
        "lily_queue_depth",
        "lily_prefix_cache_hits_total",
    ]:
        assert f"\n{name}" in text or text.startswith(name), name


def test_streaming_equals_non_streaming(server):
    c = server.client()
    for kwargs in [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=11)]:
        full = c.chat.completions.create(model="m", messages=user("hello there"), max_tokens=12, **kwargs)
        msg = full.choices[0].message
        stream = c.chat.completions.create(
            model="m", messages=user("hello there"), max_tokens=12, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        content, reasoning, calls, finish, usage = stream_text(stream)
        assert content == (msg.content or "")
        assert reasoning == (getattr(msg, "reasoning_content", None) or "")
        assert finish == full.choices[0].finish_reason
        assert usage.completion_tokens == full.usage.completion_tokens
        assert usage.prompt_tokens == full.usage.prompt_tokens
    comp = c.completions.create(model="m", prompt="The sky is", max_tokens=10, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="m", prompt="The sky is", max_tokens=10, temperature=0, stream=True) if ch.choices)
    assert streamed == comp.choices[0].text
    assert comp.usage.completion_tokens >= 1


def test_seeded_sampling_is_repeatable(server):
    c = server.client()
    args = dict(model="m", messages=user("tell me a story"), max_tokens=16, temperature=1.0, seed=1234)
    a = c.chat.completions.create(**args).choices[0].message
    b = c.chat.completions.create(**args).choices[0].message
    assert (a.content, getattr(a, "reasoning_content", None)) == (b.content, getattr(b, "reasoning_content", None))
    ta = c.completions.create(model="m", prompt="once upon", max_tokens=16, temperature=1.0, seed=5).choices[0].text
    tb = c.completions.create(model="m", prompt="once upon", max_tokens=16, temperature=1.0, seed=5).choices[0].text
    assert ta == tb


def test_stop_strings(server):
    c = server.client()
    msgs = user("SCRIPT_STOP please")
    r = c.chat.completions.create(
        model="m", messages=msgs, max_tokens=50, temperature=0, stop=["STOP", "never"], extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.choices[0].message.content == "alpha beta "
    assert r.choices[0].finish_reason == "stop"
    content, _, _, finish, _ = stream_text(
        c.chat.completions.create(
            model="m", messages=msgs, max_tokens=50, temperature=0, stop="STOP", stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
    )
    assert content == "alpha beta " and finish == "stop"
    # Without the stop string the whole script comes out.
    r = c.chat.completions.create(model="m", messages=msgs, max_tokens=50, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "alpha beta STOP gamma delta"
    # On random-model text: a stop string taken from the greedy output truncates right before it.
    base = c.completions.create(model="m", prompt="abc", max_tokens=12, temperature=0).choices[0].text
    if len(base) >= 6:
        stop = base[3:5]
        cut = c.completions.create(model="m", prompt="abc", max_tokens=12, temperature=0, stop=[stop]).choices[0]
        assert cut.text == base[: base.index(stop)] and cut.finish_reason == "stop"


def test_thinking_split(server):
    c = server.client()
    r = c.chat.completions.create(model="m", messages=user("SCRIPT_THINK hi"), max_tokens=50, temperature=0)
    m = r.choices[0].message
    assert m.reasoning_content == "The user greets me.\n"
    assert m.content == "Hello there!"
    content, reasoning, _, finish, _ = stream_text(
        c.chat.completions.create(model="m", messages=user("SCRIPT_THINK hi"), max_tokens=50, temperature=0, stream=True)
    )
    assert (reasoning, content, finish) == ("The user greets me.\n", "Hello there!", "stop")
    # Thinking disabled: the template closes the think block in the prompt, so all text is content.
    r = c.chat.completions.create(
        model="m", messages=user("SCRIPT_STOP x"), max_tokens=50, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_tool_call_round_trip(server):
    c = server.client()
    msgs = user("SCRIPT_TOOL What's the weather in Paris?")
    r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=200, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    assert ch.message.reasoning_content == "Weather needed.\n"
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    # `days` is an integer in the schema, so the XML text "3" becomes 3.
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    _, reasoning, calls, finish, _ = stream_text(
        c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=200, temperature=0, stream=True)
    )
    assert finish == "tool_calls" and calls == [("get_weather", call.function.arguments)]
    # Send the result back: the assistant tool call (with its reasoning) and the tool message go
    # through the template.
    msgs2 = msgs + [
        ch.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls", "reasoning_content"}),
        {"role": "tool", "tool_call_id": call.id, "content": "SCRIPT_AFTER_TOOL 22C"},
    ]
    r2 = c.chat.completions.create(model="m", messages=msgs2, tools=TOOLS, max_tokens=200, temperature=0)
    assert r2.choices[0].message.content == "It is 22C in Paris."
    assert r2.choices[0].finish_reason == "stop"
    # The conversation prefix (system tools block, user turn) came from the prefix cache.
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    # tool_choice "none": tools are not offered, tags are plain text.
    r3 = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=200, temperature=0)
    assert r3.choices[0].message.tool_calls is None and "<tool_call>" in r3.choices[0].message.content


def test_parallel_tool_calls(server):
    c = server.client()
    msgs = user("SCRIPT_TWO_TOOLS")
    r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, temperature=0)
    cities = [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls]
    assert cities == ["Paris", 'Oslo, "the <north>"\nline two'] and r.choices[0].finish_reason == "tool_calls"
    assert len({t.id for t in r.choices[0].message.tool_calls}) == 2
    _, _, calls, _, _ = stream_text(c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, temperature=0, stream=True))
    # The streamed deltas, joined, are the non-streamed arguments.
    assert calls == [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    one = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, temperature=0, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    _, _, calls, _, _ = stream_text(
        c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, temperature=0, stream=True, parallel_tool_calls=False)
    )
    assert len(calls) == 1


def test_malformed_tool_call_falls_back_to_content(server):
    c = server.client()
    r = c.chat.completions.create(model="m", messages=user("SCRIPT_BADTOOL"), tools=TOOLS, max_tokens=200, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and not ch.message.tool_calls
    assert ch.message.content == "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>"
    content, _, calls, finish, _ = stream_text(
        c.chat.completions.create(model="m", messages=user("SCRIPT_BADTOOL"), tools=TOOLS, max_tokens=200, temperature=0, stream=True)
    )
    assert (content, calls, finish) == (ch.message.content, [], "stop")


NO_THINK = {"reasoning_effort": "none"}


def test_agent_loop_with_every_message_shape(server):
    """User, tool call, several tool results, answer; earlier reasoning, text parts and
    arguments as JSON strings, all through the real template."""
    c = server.client()
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris "}, {"type": "text", "text": "and Oslo?"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "SCRIPT_AFTER_TOOL 9C"}]},
    ]
    r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=60, temperature=0)
    assert r.choices[0].message.content == "It is 22C in Paris."
    assert r.choices[0].message.reasoning_content == "Done.\n"
    # (What the template renders from these shapes is checked in tests/tokenizer.rs.)


def test_template_errors_are_400s_quoting_the_template(server):
    chat = "/v1/chat/completions"
    err, _ = expect_error(server, 400, chat, json.dumps({"messages": [{"role": "system", "content": "only a system turn"}]}))
    assert "No user query found in messages." in err["message"], err
    bad_order = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    err, _ = expect_error(server, 400, chat, json.dumps({"messages": bad_order}))
    assert "System message must be at the beginning." in err["message"], err
    assert server.alive()


def test_tool_choice_required_and_named_without_the_hook(server):
    c = server.client()
    for seed in range(6):
        for choice in ["required", {"type": "function", "function": {"name": "book_table"}}]:
            kw = dict(model="m", messages=user("plan something"), tools=TOOLS, tool_choice=choice, max_tokens=200,
                      temperature=1.0, seed=seed, extra_body=NO_THINK)
            r = c.chat.completions.create(**kw)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls", (seed, choice, ch)
            assert ch.message.tool_calls and not ch.message.content, ch.message
            if isinstance(choice, dict):
                assert [t.function.name for t in ch.message.tool_calls] == ["book_table"]
            for t in ch.message.tool_calls:
                schema = next(x["function"]["parameters"] for x in TOOLS if x["function"]["name"] == t.function.name)
                jsonschema.validate(json.loads(t.function.arguments), schema)
            # The same seed streamed gives the same calls.
            _, _, calls, finish, _ = stream_text(c.chat.completions.create(stream=True, **kw))
            assert finish == "tool_calls"
            assert calls == [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]


def test_json_schema_output_without_the_hook(server):
    c = server.client()
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
        },
        "required": ["title", "rating", "meta"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "review", "schema": schema, "strict": True}}
    for seed in range(10):
        r = c.chat.completions.create(model="m", messages=user("review it"), response_format=fmt, max_tokens=150,
                                      temperature=1.0, seed=seed, extra_body=NO_THINK)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # json_object: any JSON object (greedy, so the random model's choice is repeatable).
    r = c.chat.completions.create(model="m", messages=user("json please"), response_format={"type": "json_object"},
                                  max_tokens=150, temperature=0, extra_body=NO_THINK)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # ran out of tokens inside an unbounded object: still a valid prefix of one
        assert r.choices[0].message.content.startswith("{")
    chat = "/v1/chat/completions"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}
    err, _ = expect_error(server, 400, chat, json.dumps({"messages": user("x"), "response_format": bad}), "response_format")
    expect_error(server, 400, chat, json.dumps({"messages": user("x"), "tools": TOOLS,
                 "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice")
    expect_error(server, 400, chat, json.dumps({"messages": user("x"), "tools": [5]}), "tools[0]")


def test_json_tool_format_for_templates_that_ask_for_it(tmp_path):
    """A template that asks for JSON inside <tool_call> still gets JSON parsed, and a forced call
    in that format."""
    s = Server(model_dir(tmp_path, pathlib.Path(__file__).with_name("chat_template_tools.jinja")), "--api-key", KEY)
    try:
        c = s.client()
        r = c.chat.completions.create(model="m", messages=user("SCRIPT_JSON_TOOL"), tools=TOOLS, max_tokens=200, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        r = c.chat.completions.create(model="m", messages=user("go"), tools=TOOLS, tool_choice="required", max_tokens=200,
                                      temperature=1.0, seed=3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        for t in r.choices[0].message.tool_calls:
            schema = next(x["function"]["parameters"] for x in TOOLS if x["function"]["name"] == t.function.name)
            jsonschema.validate(json.loads(t.function.arguments), schema)
    finally:
        s.stop()


def test_logprobs(server):
    c = server.client()
    r = c.chat.completions.create(model="m", messages=user("hi"), max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for e in lp:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5
    comp = c.completions.create(model="m", prompt="hi", max_tokens=4, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens


def test_penalties_are_applied(server):
    c = server.client()
    args = dict(model="m", prompt="a a a a", max_tokens=24, temperature=0)
    plain = c.completions.create(**args).choices[0].text
    pen = c.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **args).choices[0].text
    assert plain != pen


def test_prefix_cache_reuse_gives_identical_tokens(server, tmp_path):
    c = server.client()
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "first question here"}]
    a1 = c.chat.completions.create(model="m", messages=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [
        {"role": "assistant", "content": a1.choices[0].message.content or "ok"},
        {"role": "user", "content": "and a follow-up"},
    ]
    # A second server with the prefix cache disabled computes the same requests from scratch.
    d = tmp_path / "m"
    d.mkdir()
    cold = Server(model_dir(d), "--api-key", KEY, "--prefix-cache-mb", "0")
    try:
        cc = cold.client()
        for kwargs in [dict(temperature=0), dict(temperature=1.0, seed=99)]:
            warm = c.chat.completions.create(model="m", messages=turn2, max_tokens=12, **kwargs)
            ref = cc.chat.completions.create(model="m", messages=turn2, max_tokens=12, **kwargs)
            assert ref.usage.prompt_tokens_details.cached_tokens == 0
            assert warm.usage.prompt_tokens_details.cached_tokens > 0
            assert warm.choices[0].message == ref.choices[0].message
            assert warm.usage.completion_tokens == ref.usage.completion_tokens
    finally:
        cold.stop()
    # An exact repeat reuses the whole prompt (the logits after it are cached too).
    args = dict(model="m", prompt="repeat me exactly", max_tokens=8, temperature=0)
    first, again = c.completions.create(**args), c.completions.create(**args)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text
    st, _, body = server.raw("GET", "/metrics")
    hits = [l for l in body.decode().splitlines() if l.startswith("lily_prefix_cache_hits_total")]
    assert int(hits[0].split()[1]) > 0


def expect_error(server, status, path, body, param=None, headers=None):
    st, h, data = server.raw("POST", path, body=body, headers=headers)
    assert st == status, (st, data)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err, h


def test_error_paths(server):
    chat = "/v1/chat/completions"
    ok_msgs = user("hi")
    expect_error(server, 400, chat, b'{"messages": [', None)
    expect_error(server, 400, chat, b"[1, 2]")
    expect_error(server, 400, chat, json.dumps({"messages": "hi"}), "messages")
    expect_error(server, 400, chat, json.dumps({"messages": ok_msgs, "temperature": "hot"}), "temperature")
    expect_error(server, 400, chat, json.dumps({"messages": ok_msgs, "max_tokens": -3}), "max_tokens")
    expect_error(server, 400, chat, json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role")
    expect_error(server, 400, chat, json.dumps({"messages": ok_msgs, "n": 3}), "n")
    expect_error(server, 400, chat, json.dumps({"messages": ok_msgs, "frobnicate": True}), "frobnicate")
    expect_error(server, 400, chat, json.dumps({"messages": ok_msgs, "tool_choice": "required"}), "tool_choice")
    expect_error(server, 400, "/v1/completions", json.dumps({"prompt": [1, 99999]}), "prompt")
    # Context overflow (the server runs with --max-seq 4096): a clear 400.
    err, _ = expect_error(server, 400, chat, json.dumps({"messages": user("word " * 5000)}))
    assert err["code"] == "context_length_exceeded" and "4096" in err["message"]
    err, _ = expect_error(server, 400, chat, json.dumps({"messages": ok_msgs, "max_tokens": 100000}), "max_tokens")
    assert err["code"] == "context_length_exceeded"
    # Oversized body (--max-body-bytes 65536): 413.
    expect_error(server, 413, chat, json.dumps({"messages": user("x" * 70000)}))
    # Authentication.
    expect_error(server, 401, chat, json.dumps({"messages": ok_msgs}), headers={"Authorization": "Bearer wrong"})
    expect_error(server, 401, chat, json.dumps({"messages": ok_msgs}), headers={"Authorization": ""})
    expect_error(server, 404, "/v1/nothing", b"{}")
    # The same through the client: typed exceptions with the right status.
    c = server.client()
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        server.client(key="nope").chat.completions.create(model="m", messages=ok_msgs)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="m", messages=user("w " * 6000))
    assert server.alive()


def test_client_disconnect_cancels_generation(server):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"messages": user("SCRIPT_LONG"), "max_tokens": 900, "temperature": 0, "stream": True})
    c.request("POST", "/v1/chat/completions", body=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    r.fp.readline()  # the first event arrives: generation has started
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    deadline = time.time() + 20
    while time.time() < deadline:
        text = server.raw("GET", "/metrics")[2].decode()
        line = [l for l in text.splitlines() if l.startswith("lily_requests_cancelled_total")][0]
        if int(line.split()[1]) >= 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the generation was not cancelled")
    assert server.alive()


def test_load_48_concurrent_clients(tmp_path):
    s = Server(model_dir(tmp_path), "--queue-size", "8")
    try:
        c = s.client(key="x")
        health = []

        def one(i):
            try:
                if i % 2:
                    r = c.chat.completions.create(model="m", messages=user(f"client {i}"), max_tokens=8, temperature=0.7, seed=i)
                    return "ok" if r.choices[0].finish_reason in ("stop", "length") else "bad"
                text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                    model="m", messages=user(f"client {i}"), max_tokens=8, stream=True) if ch.choices)
                return "ok"
            except openai.APIStatusError as e:
                return 503 if e.status_code == 503 else f"status {e.status_code}"
            except Exception as e:  # noqa: BLE001
                return f"error {e!r}"

        with cf.ThreadPoolExecutor(64) as ex:
            futs = [ex.submit(one, i) for i in range(96)]
            # Health answers while generating.
            for _ in range(5):
                t0 = time.time()
                health.append((s.raw("GET", "/health")[0], time.time() - t0))
            results = [f.result() for f in futs]
        bad = [r for r in results if r not in ("ok", 503)]
        assert not bad, bad
        assert results.count("ok") >= 9  # at least the queue's worth got through
        assert all(st == 200 and dt < 5 for st, dt in health), health
        assert s.alive()
        r = c.chat.completions.create(model="m", messages=user("after the storm"), max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        text = s.raw("GET", "/metrics")[2].decode()
        assert "lily_queue_depth 0" in text
    finally:
        s.stop()


def test_fuzzed_requests_never_crash(server):
    """Seeded random mutations of valid requests: every answer is 200 or an OpenAI error object."""
    import random

    rng = random.Random(2024)
    weird = [None, -1, 0, 1, 2.5, 1e308, -1e308, "", "x", "\ud800", [], {}, [1, "a"], [[]], True, False, {"a": {"b": [None]}}, "0" * 300]
    fields = [
        "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "tools", "tool_choice", "n", "stream",
        "stream_options", "chat_template_kwargs", "response_format", "logit_bias", "user", "model", "bogus",
    ]
    msg_fields = ["role", "content", "tool_calls", "name", "tool_call_id"]
    statuses = {}
    for i in range(300):
        body = {"messages": [{"role": "user", "content": f"fuzz {i}"}], "max_tokens": 3}
        for _ in range(rng.randint(1, 3)):
            msgs = body.get("messages")
            if rng.random() < 0.3 and isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
                m = dict(msgs[0])
                m[rng.choice(msg_fields)] = rng.choice(weird)
                body["messages"] = [m]
            else:
                body[rng.choice(fields)] = rng.choice(weird)
        if body.get("max_completion_tokens") not in weird[:3] + [None]:
            body["max_completion_tokens"] = 3
        raw = json.dumps(body)
        if rng.random() < 0.1:  # truncated or corrupted JSON
            cut = rng.randint(0, len(raw))
            raw = raw[:cut] + rng.choice(["", "\x00", "}", "ÿ"])
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        st, _, data = server.raw("POST", path, body=raw.encode("utf-8", "surrogatepass"))
        statuses[st] = statuses.get(st, 0) + 1
        assert st in (200, 400), (st, raw, data)
        if st == 400:
            assert set(json.loads(data)["error"]) == {"message", "type", "param", "code"}
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 0, statuses
    assert server.alive()
