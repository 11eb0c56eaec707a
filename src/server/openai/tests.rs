//! Request parsing and validation (`super::parse_chat`, `super::parse_completion`).
use super::*;

fn err(v: Value) -> ApiError {
    parse_chat(&v).expect_err("should fail")
}

#[test]
fn accepts_a_full_request() {
    let r = parse_chat(&json!({
        "model": "x", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}],
        "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 7,
        "stop": ["x"], "presence_penalty": 0.5, "frequency_penalty": 0.1, "logprobs": true, "top_logprobs": 3,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": false}, "n": 1, "user": "u",
        "stream": true, "stream_options": {"include_usage": true}
    }))
    .unwrap();
    assert_eq!(r.messages[1]["content"], "ab");
    assert_eq!(r.messages[2]["tool_calls"][0]["function"]["arguments"]["a"], 1);
    assert_eq!(r.params.logprobs, Some(3));
    assert_eq!(r.params.max_tokens, Some(5));
    assert!(r.params.include_usage && r.tools.is_some());
    assert_eq!(r.constraint, None);
}

#[test]
fn repetition_penalty_is_vllms_range() {
    let m = json!([{"role": "user", "content": "hi"}]);
    let p = |v: Value| parse_chat(&json!({"messages": m, "repetition_penalty": v}));
    assert_eq!(p(json!(1.3)).unwrap().params.repetition_penalty, Some(1.3));
    assert_eq!(p(json!(1)).unwrap().params.repetition_penalty, None, "1 is off");
    for bad in [json!(0), json!(-1), json!(2.5), json!("x")] {
        let e = p(bad.clone()).expect_err(&format!("{bad} must be refused"));
        assert_eq!(e.param.as_deref(), Some("repetition_penalty"));
    }
}

#[test]
fn constraints_and_reasoning_fields() {
    let m = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a", "reasoning_content": "because"}, {"role": "user", "content": "b"}]);
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g"}}]);
    let r = parse_chat(&json!({"messages": m, "tools": tools, "tool_choice": "required"})).unwrap();
    assert_eq!(r.constraint, Some(OutputConstraint::ToolCalls { only: None, parallel: true }));
    assert_eq!(r.messages[1]["reasoning_content"], "because");
    let named = json!({"type": "function", "function": {"name": "g"}});
    let r = parse_chat(&json!({"messages": m, "tools": tools, "tool_choice": named})).unwrap();
    assert_eq!(r.constraint, Some(OutputConstraint::ToolCalls { only: Some("g".into()), parallel: false }));
    let r = parse_chat(&json!({"messages": m, "response_format": {"type": "json_object"}, "reasoning_effort": "none"}))
        .unwrap();
    assert_eq!(r.constraint, Some(OutputConstraint::Json(json!({"type": "object"}))));
    assert_eq!(r.template_kwargs["enable_thinking"], false);
    let schema = json!({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]});
    let r = parse_chat(&json!({"messages": m, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})).unwrap();
    assert_eq!(r.constraint, Some(OutputConstraint::Json(schema)));
    let r = parse_chat(&json!({"messages": m, "tools": tools, "tool_choice": "none"})).unwrap();
    assert!(r.tools.is_none() && r.constraint.is_none());
}

#[test]
fn errors_name_the_field() {
    let m = json!([{"role": "user", "content": "hi"}]);
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let cases = [
        (json!({"messages": m, "temperature": "hot"}), "temperature"),
        (json!({"messages": m, "temperature": 3}), "temperature"),
        (json!({"messages": m, "max_tokens": 0}), "max_tokens"),
        (json!({"messages": m, "max_tokens": 1.5}), "max_tokens"),
        (json!({"messages": m, "n": 2}), "n"),
        (json!({"messages": m, "top_logprobs": 2}), "top_logprobs"),
        (json!({"messages": m, "stop": [1]}), "stop[0]"),
        (json!({"messages": m, "stop": ""}), "stop"),
        (json!({"messages": m, "bogus": 1}), "bogus"),
        (json!({"messages": m, "tool_choice": "required"}), "tool_choice"),
        (
            json!({"messages": m, "tools": [tool.clone()], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (json!({"messages": m, "tools": ["f"]}), "tools[0]"),
        (
            json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5, "properties": "x"}}}]}),
            "tools[0].function.parameters.type",
        ),
        (
            json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": "x"}}}]}),
            "tools[0].function.parameters.properties",
        ),
        (
            json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}),
            "tools[0].function.parameters.properties.a.type",
        ),
        (
            json!({"messages": m, "tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (json!({"messages": m, "chat_template_kwargs": {"tools": "not-a-list"}}), "chat_template_kwargs.tools"),
        (
            json!({"messages": m, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}}),
            "response_format.json_schema.schema.type",
        ),
        (json!({"messages": m, "response_format": {"type": "yaml"}}), "response_format.type"),
        (json!({"messages": m, "reasoning_effort": "max"}), "reasoning_effort"),
        (
            json!({"messages": m, "tools": [tool.clone()], "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"messages": m, "stream_options": {"include_usage": true}}), "stream_options"),
        (json!({"messages": m, "logit_bias": {"1": 5}}), "logit_bias"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "messages[0].content[0]"),
        (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (
            json!({"messages": m, "chat_template_kwargs": {"enable_thinking": "yes"}}),
            "chat_template_kwargs.enable_thinking",
        ),
    ];
    for (body, param) in cases {
        let e = err(body.clone());
        assert_eq!(e.status, 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
    }
    assert_eq!(err(json!([1])).status, 400);
}

#[test]
fn completion_prompts() {
    assert!(matches!(parse_completion(&json!({"prompt": "hi"})).unwrap().prompt, Prompt::Text(_)));
    assert!(matches!(parse_completion(&json!({"prompt": [1, 2]})).unwrap().prompt, Prompt::Tokens(_)));
    assert_eq!(parse_completion(&json!({"prompt": ["a", "b"]})).unwrap_err().param.as_deref(), Some("prompt"));
    assert_eq!(parse_completion(&json!({"prompt": "a", "echo": true})).unwrap_err().param.as_deref(), Some("echo"));
    assert_eq!(parse_completion(&json!({"prompt": "a"})).unwrap().params.max_tokens, Some(16));
    assert_eq!(parse_completion(&json!({"prompt": "a", "logprobs": 2})).unwrap().params.logprobs, Some(2));
}
