"""load_tokenizer: the same tokenizer as AutoTokenizer, without importing torch
(the router loads it at start and never needs torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "naïve café — 東京 🚀",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n\treturn x ** 2\n",
    "",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_it_agrees_with_auto_tokenizer(demo_model_dir, demo_tokenizer):
    ours = load_tokenizer(str(demo_model_dir))
    assert ours.eos_token_id == demo_tokenizer.eos_token_id
    assert ours.all_special_ids == demo_tokenizer.all_special_ids
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == demo_tokenizer.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                got = ours.decode(ids, skip_special_tokens=skip)
                assert got == demo_tokenizer.decode(ids, skip_special_tokens=skip)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": "Thanks"},
    ]
    for tools in (None, TOOLS):
        for prompt in (True, False):
            kwargs = dict(tools=tools, add_generation_prompt=prompt, tokenize=False)
            assert ours.apply_chat_template(chat, **kwargs) == (
                demo_tokenizer.apply_chat_template(chat, **kwargs)
            )


def test_loading_it_does_not_import_torch(demo_model_dir):
    code = (
        "import json, sys\n"
        "from engine.tokenizer import load_tokenizer\n"
        f"load_tokenizer({str(demo_model_dir)!r})\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["transformers"]


def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))
