//! Tokenization against ids from an independent implementation (tiktoken on the same Qwen3.6
//! vocabulary, stored by scripts/gen_tokenizer_fixture.py) and chat-template rendering.

mod common;
use common::*;
use lily::tokenizer::{StreamDecoder, Tokenizer};
use serde_json::{json, Value};

/// The built-in Qwen3.6 tokenizer and the real Qwen3.5 chat template (assets/).
fn qwen() -> Tokenizer {
    Tokenizer::builtin().expect("loading the built-in Qwen3.6 tokenizer")
}

#[test]
fn ids_match_tiktoken_on_the_real_vocabulary() {
    let tok = qwen();
    let path = fixtures().join("tokenizer/qwen36_ids.json");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).expect("tokenizer fixture")).unwrap();
    assert!(cases.len() >= 20, "fixture has too few cases");
    for c in &cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, want, "text {text:?}");
        // Decoding gives the NFC-normalised text back, which encodes to the same ids.
        let back = tok.decode(&got).unwrap();
        assert_eq!(tok.encode(&back).unwrap(), want, "round trip of {text:?}");
    }
}

#[test]
fn special_tokens_and_eos() {
    let tok = qwen();
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(tok.encode("<|im_start|>").unwrap(), vec![im_start]);
    assert!(tok.eos_ids.contains(&im_end), "eos_token from tokenizer_config.json");
}

#[test]
fn chat_template_follows_hf_conventions() {
    let tok = qwen();
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there> & \"you\""}]);
    let mut kw = serde_json::Map::new();
    let think = tok.apply_chat_template(&msgs, None, true, &kw).unwrap();
    assert_eq!(think, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <there> & \"you\"<|im_end|>\n<|im_start|>assistant\n<think>\n");
    kw.insert("enable_thinking".into(), Value::Bool(false));
    let no_think = tok.apply_chat_template(&msgs, None, true, &kw).unwrap();
    assert!(no_think.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    // Tools go through tojson with Python's separators and no HTML escaping.
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather <now>", "parameters": {"type": "object"}}}]);
    let with_tools = tok.apply_chat_template(&msgs, Some(&tools), true, &kw).unwrap();
    assert!(
        with_tools.contains(r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather <now>", "parameters": {"type": "object"}}}"#),
        "{with_tools}"
    );
    // Assistant tool calls with dict arguments are serialised by the template.
    let conv = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}
    ]);
    let r = tok.apply_chat_template(&conv, Some(&tools), true, &kw).unwrap();
    assert!(
        r.contains(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
        ),
        "{r}"
    );
    assert!(r.contains("<tool_response>\nsunny\n</tool_response>"));
}

/// The real tokenizer with the real Qwen3.5 template, as a checkpoint directory would hold them.
fn qwen_real_template() -> Tokenizer {
    let d = std::env::temp_dir().join(format!("lily-real-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let _ = std::fs::remove_file(d.join("tokenizer.json"));
    std::fs::write(d.join("tokenizer.json"), lily::tokenizer::builtin_json().unwrap()).unwrap();
    std::fs::write(d.join("tokenizer_config.json"), r#"{"eos_token": "<|im_end|>", "bos_token": null}"#).unwrap();
    std::fs::copy(real_template(), d.join("chat_template.jinja")).unwrap();
    Tokenizer::load(&d, None).unwrap()
}

/// What OpenAI clients send, normalised by the server's request parser, rendered by the real
/// template: arguments as a JSON string become the mapping it iterates, earlier reasoning is
/// kept after the last user query, consecutive tool results share one user turn, text parts join.
#[test]
fn real_template_renders_every_client_message_shape() {
    let tok = qwen_real_template();
    assert_eq!(tok.tool_format(), lily::constrain::ToolFormat::Xml);
    let body = json!({
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris "}, {"type": "text", "text": "and Oslo?"}]},
            {"role": "assistant", "content": null, "reasoning_content": "Two cities, two calls.",
             "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2, \"opts\": {\"unit\": \"C\"}}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "9C"}]}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    });
    let req = lily::server::openai::parse_chat(&body).unwrap();
    let msgs = Value::Array(req.messages.clone());
    let out = tok.apply_chat_template(&msgs, req.tools.as_ref(), true, &req.template_kwargs).unwrap();
    assert!(out.starts_with("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{\"type\": \"function\""), "{out}");
    assert!(out.contains("</IMPORTANT>\n\nBe brief.<|im_end|>\n"), "{out}");
    let tail = "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n\
        <|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n\
        <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n\
        <parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n</function>\n</tool_call>\n\
        <tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>\n\
        <|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n9C\n</tool_response><|im_end|>\n\
        <|im_start|>assistant\n<think>\n";
    assert!(out.ends_with(tail), "{out}");
    // Reasoning of turns before the last user query is dropped, as the template says.
    let body = json!({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "c"}], "reasoning_effort": "none"});
    let req = lily::server::openai::parse_chat(&body).unwrap();
    let out = tok.apply_chat_template(&Value::Array(req.messages), None, true, &req.template_kwargs).unwrap();
    assert_eq!(out, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    // The template's own errors come back with its message.
    for (msgs, want) in [
        (json!([{"role": "system", "content": "x"}]), "No user query found in messages."),
        (
            json!([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]),
            "System message must be at the beginning.",
        ),
    ] {
        let e = tok.apply_chat_template(&msgs, None, true, &Default::default()).unwrap_err();
        assert!(format!("{e:#}").contains(want), "{e:#}");
    }
}

#[test]
fn template_errors_are_reported() {
    let d = std::env::temp_dir().join(format!("lily-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("tokenizer.json"), lily::tokenizer::builtin_json().unwrap()).unwrap();
    std::fs::write(
        d.join("chat_template.jinja"),
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok",
    )
    .unwrap();
    let tok = Tokenizer::load(&d, None).unwrap();
    let e = tok
        .apply_chat_template(&json!([{"role": "system", "content": "x"}]), None, true, &Default::default())
        .unwrap_err();
    assert!(format!("{e:#}").contains("first message must be from the user"), "{e:#}");
    assert_eq!(
        tok.apply_chat_template(&json!([{"role": "user", "content": "x"}]), None, true, &Default::default()).unwrap(),
        "ok"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn stream_decoder_holds_back_partial_utf8() {
    let tok = qwen();
    let text = "日本語のテキスト 🌸 and ascii";
    let ids = tok.encode(text).unwrap();
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(&tok, id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "emitted a partial character");
        out.push_str(&piece);
    }
    out.push_str(&dec.flush(&tok).unwrap());
    assert_eq!(out, text);
}
