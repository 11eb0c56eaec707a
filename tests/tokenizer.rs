//! Tokenization against ids from an independent implementation (tiktoken on the same Qwen3.6
//! vocabulary, stored by scripts/gen_tokenizer_fixture.py) and chat-template rendering.

mod common;
use common::*;
use lily::tokenizer::{StreamDecoder, Tokenizer};
use serde_json::{json, Value};

fn qwen() -> Tokenizer {
    Tokenizer::load(&shared_tokenizer_dir(), None).expect("loading the shared Qwen3.6 tokenizer")
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
        r.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
        "{r}"
    );
    assert!(r.contains("<tool_response>\nsunny\n</tool_response>"));
}

#[test]
fn template_errors_are_reported() {
    let d = std::env::temp_dir().join(format!("lily-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(shared_tokenizer_dir().join("tokenizer.json"), d.join("tokenizer.json")).unwrap();
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
