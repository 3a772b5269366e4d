#!/usr/bin/env python3
"""Reference chat-template renderings for spec/chat_spec.lua.

Renders each chat template with Python jinja2, configured the way Hugging
Face transformers does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols,
raise_exception), on a fixed set of conversations, and writes one Lua
fixture per template:

    tests/fixtures/chat_<name>.lua
      return { name=, source=, model=(fetch name or nil), template=,
               bos_token=, eos_token=,
               cases = { {messages=, add_generation_prompt=, expected=}
                         | {messages=, add_generation_prompt=, error=}, ... } }

Templates:
  smollm2   tokenizer.chat_template of the SmolLM2 GGUF (scripts/fetch-models.sh)
  gemma3    Gemma 3 instruct template (tokenizer_config.json of the
            google/gemma-3-*-it models; the 270m GGUF carries none)
  llama3    Meta-Llama-3-8B-Instruct tokenizer_config.json
  mistral   Mistral-7B-Instruct-v0.1/v0.2 tokenizer_config.json
  qwen2     Qwen2-7B-Instruct tokenizer_config.json
  phi3      tokenizer.chat_template of the Phi-3 vocab GGUF in the tokenizer
            conformance set (tests/data/vocab)
  phi3_small Phi-3-small-8k-instruct tokenizer_config.json

bos/eos strings come from the GGUF token tables where a GGUF is used, else
from the model's tokenizer_config.json.

    python3 scripts/ref/gen-chat-fixtures.py        (from the repo root)
"""
import os
import subprocess
import sys

import gguf
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures")
CONFORMANCE = os.path.join(ROOT, "tests", "data", "vocab")

# ---------------------------------------------------------------------------
# Canonical templates (tokenizer_config.json "chat_template" values, decoded)
# ---------------------------------------------------------------------------

GEMMA3 = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PHI3_SMALL = (
    "{{ bos_token }}{% for message in messages %}"
    "{{'<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# ---------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------

SYS = {"role": "system", "content": "You are a terse assistant."}
U1 = {"role": "user", "content": "Hello!"}
A1 = {"role": "assistant", "content": "Hi. How can I help?"}
U2 = {"role": "user", "content": "What is 2+2?"}
A2 = {"role": "assistant", "content": "4"}

CONVERSATIONS = [
    ([U1], True),
    ([U1], False),
    ([SYS, U1], True),
    ([U1, A1, U2], True),
    ([SYS, U1, A1, U2, A2], False),
    ([SYS, U1, A1, U2], True),
    ([{"role": "system", "content": "Réponds en français.\nSois bref ☺"},
      {"role": "user", "content": "Line one\nLine two\n\n  indented — 日本語 🌍"},
      {"role": "assistant", "content": "  Bien reçu.  \n"},
      {"role": "user", "content": "\tEncore une fois ?\n"}], True),
    ([{"role": "user", "content": "  padded with spaces  "}], True),
    ([{"role": "user", "content": "say \"hi\" and 'bye' \\ {{ not a tag }} {% raw %}"}], False),
    ([U1, A1], False),
    ([{"role": "user", "content": "多行\n文本 ✓"},
      {"role": "assistant", "content": " spaced answer "},
      {"role": "user", "content": "ok"}], True),
    ([U1, U2], True),  # not alternating: some templates reject it
]

# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env


def render(template, bos, eos, messages, agp):
    tmpl = make_env().from_string(template)
    try:
        return {"expected": tmpl.render(messages=messages, add_generation_prompt=agp,
                                        bos_token=bos, eos_token=eos)}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def gguf_template(path):
    r = gguf.GGUFReader(path)

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.parts[f.data[0]]

    tmpl = field("tokenizer.chat_template")
    tokens = r.fields["tokenizer.ggml.tokens"]

    def token(key):
        idx = field(key)
        if idx is None:
            return ""
        return bytes(tokens.parts[tokens.data[int(idx[0])]]).decode("utf-8")

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    return (bytes(tmpl).decode("utf-8") if tmpl is not None else None), bos, eos


def fetch_model(name):
    return subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-models.sh"), name],
                                   cwd=ROOT).decode().strip()

# ---------------------------------------------------------------------------
# Lua output
# ---------------------------------------------------------------------------


def lua_str(s):
    out = ['"']
    for b in s.encode("utf-8"):
        c = chr(b)
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif 32 <= b < 127:
            out.append(c)
        else:
            out.append("\\%03d" % b)
    out.append('"')
    return "".join(out)


def lua_val(v, indent=""):
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return lua_str(v)
    if isinstance(v, list):
        inner = indent + "  "
        return "{\n" + "".join(inner + lua_val(x, inner) + ",\n" for x in v) + indent + "}"
    if isinstance(v, dict):
        inner = indent + "  "
        return "{\n" + "".join("%s%s = %s,\n" % (inner, k, lua_val(x, inner)) for k, x in v.items()) + indent + "}"
    raise TypeError(type(v))


def write_fixture(name, source, model, template, bos, eos):
    cases = []
    for messages, agp in CONVERSATIONS:
        case = {"messages": messages, "add_generation_prompt": agp}
        case.update(render(template, bos, eos, messages, agp))
        cases.append(case)
    data = {"name": name, "source": source, "model": model, "template": template,
            "bos_token": bos, "eos_token": eos, "cases": cases}
    path = os.path.join(OUT, "chat_%s.lua" % name)
    with open(path, "w", encoding="utf-8") as f:
        f.write("-- Generated by scripts/ref/gen-chat-fixtures.py (jinja2 %s); do not edit.\n" % jinja2.__version__)
        f.write("return " + lua_val(data) + "\n")
    n_err = sum(1 for c in cases if "error" in c)
    print("%-28s %2d cases (%d template errors)" % (os.path.relpath(path, ROOT), len(cases), n_err))


def main():
    os.makedirs(OUT, exist_ok=True)

    t, bos, eos = gguf_template(fetch_model("smollm2"))
    write_fixture("smollm2", "SmolLM2-135M-Instruct GGUF tokenizer.chat_template", "smollm2", t, bos, eos)

    _, bos, eos = gguf_template(fetch_model("gemma3"))
    write_fixture("gemma3", "google/gemma-3-*-it tokenizer_config.json (the 270m GGUF has no template)",
                  "gemma3", GEMMA3, bos, eos)

    write_fixture("llama3", "meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json", None,
                  LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
    write_fixture("mistral", "mistralai/Mistral-7B-Instruct-v0.2 tokenizer_config.json", None,
                  MISTRAL, "<s>", "</s>")
    write_fixture("qwen2", "Qwen/Qwen2-7B-Instruct tokenizer_config.json", None,
                  QWEN2, "", "<|im_end|>")

    t, bos, eos = gguf_template(os.path.join(CONFORMANCE, "ggml-vocab-phi-3.gguf"))
    if t is None:
        sys.exit("ggml-vocab-phi-3.gguf has no tokenizer.chat_template")
    write_fixture("phi3", "Phi-3-mini (ggml-vocab-phi-3.gguf tokenizer.chat_template)", None, t, bos, eos)
    write_fixture("phi3_small", "microsoft/Phi-3-small-8k-instruct tokenizer_config.json", None,
                  PHI3_SMALL, "<|endoftext|>", "<|endoftext|>")


if __name__ == "__main__":
    main()
