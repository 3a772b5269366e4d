#!/usr/bin/env python3
"""Reference renderings of real chat templates, for spec/jinja_spec.lua.

Renders every tests/fixtures/templates/*.jinja (llama.cpp's corpus of chat
templates, MIT, see tests/fixtures/templates/NOTICE) with Python jinja2,
configured as Hugging Face transformers configures it for chat templates
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
raise_exception, strftime_now, and transformers' tojson: json.dumps with
ensure_ascii=False), on a fixed set of conversations, and writes

    tests/fixtures/templates/expected.lua
      return { now = <epoch seconds strftime_now formats>,
               conversations = { <name> = <vars>, ... },   (D{} dicts keep key order)
               data = <vars>, snippets = { { src =, expected = } | { src =, error =, raised = } },
               templates = { { file =, cases = { { conv =, expected = } |
                                                 { conv =, error =, raised = } } }, ... } }

A template that jinja2 refuses to compile gets { file =, compile_error = }.
Conversations that set enable_thinking are rendered only for templates
that read it.

    python3 scripts/ref/gen-jinja-fixtures.py        (from the repo root)
"""
import datetime
import json
import os
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from luaser import lua_string  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIR = os.path.join(ROOT, "tests", "fixtures", "templates")

NOW = datetime.datetime(2024, 7, 26, 12, 0, 0, tzinfo=datetime.timezone.utc)


class Raised(Exception):
    pass


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override (utils/chat_template_utils.py): json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return NOW.strftime(fmt)


class AssistantTracker(jinja2.ext.Extension):
    # transformers' {% generation %} tag, without the mask bookkeeping
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def env():
    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    e.filters["tojson"] = tojson
    e.globals["raise_exception"] = raise_exception
    e.globals["strftime_now"] = strftime_now
    return e


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER1 = {"role": "user", "content": "Hello! Can you say \"hi\" in French?  "}
ASSIST1 = {"role": "assistant", "content": "Bonjour ! That's \"hi\" in French."}
USER2 = {"role": "user", "content": "Thanks.\nAnd in Spanish?"}
TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}},
    }],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
               "content": "{\"temperature\": 22, \"sky\": \"clear\"}"}
ANSWER = {"role": "assistant", "content": "It is 22 °C and clear in Paris."}

BASE = {"bos_token": "<s>", "eos_token": "</s>"}

CONVERSATIONS = [
    ("user", {"messages": [USER1], "add_generation_prompt": True}),
    ("multi", {"messages": [SYSTEM, USER1, ASSIST1, USER2], "add_generation_prompt": True}),
    ("multi_nogp", {"messages": [SYSTEM, USER1, ASSIST1, USER2], "add_generation_prompt": False}),
    ("no_system", {"messages": [USER1, ASSIST1], "add_generation_prompt": False}),
    ("tools", {"messages": [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"},
                            TOOL_CALL, TOOL_RESULT],
               "tools": [WEATHER, SEARCH], "add_generation_prompt": True}),
    ("tools_done", {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                                 TOOL_CALL, TOOL_RESULT, ANSWER],
                    "tools": [WEATHER], "add_generation_prompt": False}),
    ("think_on", {"messages": [SYSTEM, USER1, ASSIST1, USER2], "add_generation_prompt": True,
                  "enable_thinking": True}),
    ("think_off", {"messages": [SYSTEM, USER1, ASSIST1, USER2], "add_generation_prompt": True,
                   "enable_thinking": False}),
    ("bad_roles", {"messages": [USER1, USER2], "add_generation_prompt": True}),
]


# Small templates, one language point each (rendered with DATA as variables).
DATA = {"s": "  Hello, World  ", "u": "h\u00e9llo w\u00f6rld \U0001F600", "n": 3, "f": 2.5, "z": 0,
        "items": ["b", "a", "C"], "empty": [], "d": {"zeta": 1, "alpha": [1, 2], "mid": None},
        "msgs": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                 {"role": "user", "content": "z"}]}
SNIPPETS = [
    # whitespace control, trim_blocks, lstrip_blocks, trailing newline
    "a\n  {% if true %}\n  b\n  {% endif %}\nc\n",
    "a  {%- if true -%}  b  {%- endif -%}  c",
    "x {{- ' y ' -}} z",
    "  {%+ if true %}k{% endif %}\n  {# note #}\nend",
    "{% for i in [1, 2] %}\n  {{ i }}\n{% endfor %}\n\n",
    "{% raw %}{{ not a tag }}{% endraw %}",
    # values as str() prints them
    "{{ none }} {{ true }} {{ false }} {{ 1.0 }} {{ 1e20 }} {{ 0.0001 }} {{ 1e-5 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ -7 % 3 }}",
    "{{ [1, 'a', none, [true]] }} {{ {'k': 'v', 'n': 1} }} {{ ('t', 1) }} {{ \"it's\" }}",
    "{{ 2 ** 10 }} {{ 3 * 'ab' }} {{ [1] + [2] }} {{ 'a' ~ 1 ~ none }} {{ -n }} {{ f * 2 }}",
    # truthiness, tests, comparisons
    "{% for v in ['', 'x', [], [0], {}, 0, 0.0, none, undefined_name] %}{{ 'T' if v else 'F' }}{% endfor %}",
    "{{ s is string }} {{ n is number }} {{ f is float }} {{ n is integer }} {{ d is mapping }} {{ items is sequence }}"
    " {{ nope is defined }} {{ d.mid is none }} {{ true is boolean }} {{ n is odd }} {{ 9 is divisibleby 3 }}",
    "{{ 'a' in 'cat' }} {{ 'b' in items }} {{ 'zeta' in d }} {{ 'q' not in items }} {{ 1 < n <= 3 }} {{ [1, 2] == [1, 2] }}",
    "{{ n is eq 3 }} {{ n is gt 1 }} {{ s is lower }} {{ 'AB' is upper }} {{ x is undefined }} {{ d is iterable }}",
    # slices and subscripts
    "{{ items[1:] }} {{ items[::-1] }} {{ items[-1] }} {{ items[:-1] }} {{ s[2:7] }} {{ u[1:4] }} {{ u[::-1] }}",
    "{{ msgs[0].role }} {{ msgs[-1]['content'] }} {{ d['alpha'][1] }} {{ d.zeta }} {{ items.0 }}",
    # string methods
    "[{{ s.strip() }}] [{{ s.lstrip() }}] [{{ s.rstrip() }}] [{{ 'xxhixx'.strip('x') }}] {{ s.split(',') }}"
    " {{ 'a b  c'.split() }} {{ 'a,b,c'.split(',', 1) }}",
    "{{ s.upper() }} {{ s.lower() }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }} {{ s.replace('l', 'L') }}"
    " {{ s.startswith('  H') }} {{ s.endswith(('x', 'd  ')) }} {{ s.find('W') }} {{ '-'.join(items) }}",
    "{{ '{} and {}'.format('a', 1) }} {{ '{x}!'.format(x='y') }} {{ 'a\\nb\\n'.splitlines() }} {{ 'abcabc'.count('b') }}",
    # dict methods and iteration order
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %} {{ d.keys() | list }} {{ d.get('nope', 'dflt') }} {{ d.get('nope') }}",
    "{% for k in d %}{{ k }},{% endfor %} {{ d | dictsort }} {{ d.values() | list }}",
    # filters
    "{{ s | trim }}|{{ items | length }}|{{ d | length }}|{{ s | upper }}|{{ items | join(', ') }}|{{ items | first }}|{{ items | last }}",
    "{{ nope | default('dflt') }}|{{ '' | default('e', true) }}|{{ none | d('n') }}|{{ items | list }}|{{ 'ab' | list }}",
    "{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | join }}"
    "|{{ msgs | rejectattr('role', 'eq', 'user') | list | length }}|{{ [0, 1, 2] | select('odd') | list }}"
    "|{{ [0, 1, '', 'x'] | select | list }}|{{ [1, 2] | reject('even') | list }}|{{ items | map('upper') | list }}",
    "{{ items | sort }}|{{ items | sort(reverse=true) }}|{{ items | sort(case_sensitive=true) }}|{{ ['a', 'A', 'b'] | unique | list }}"
    "|{{ items | reverse | list }}|{{ msgs | map(attribute='role') | unique | list }}",
    "{{ '3' | int + 1 }}|{{ 'x' | int }}|{{ 2.7 | int }}|{{ '2.5' | float }}|{{ n | string }}|{{ -3 | abs }}|{{ 2.567 | round(2) }}"
    "|{{ [1, 2, 3] | sum }}|{{ [3, 1, 2] | min }}|{{ [3, 1, 2] | max }}",
    "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'one two, three' | wordcount }}"
    "|{{ 'hello world' | title }}|{{ 'hello' | capitalize }}|{{ 'a-b-c' | replace('-', '+', 1) }}|{{ '<a & \"b\">' | e }}",
    "{{ d | items | list }}|{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(sort_keys=true) }}",
    "{{ u | tojson }}|{{ u | tojson(ensure_ascii=true) }}|{{ 'q\"\\\\\\n\\t\\u0001' | tojson }}|{{ [1.5, 1e100, -0.0, none, true] | tojson }}"
    "|{{ {'a': [1, {'b': []}]} | tojson(indent=4) }}|{{ d | tojson(separators=(',', ':')) }}",
    "{{ ('x' | safe) + '<\"y\">' }}|{{ '<' + ('&' | safe) }}|{{ ('a' | safe) ~ '<' }}",
    # loops
    "{% for m in msgs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}"
    "{{ loop.length }}{{ loop.previtem.role if loop.previtem is defined }}{{ loop.cycle('o', 'e') }};{% endfor %}",
    "{% for m in msgs if m.role == 'user' %}{{ loop.index }}/{{ loop.length }}:{{ m.content }} {% endfor %}",
    "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{% for i in empty %}x{% else %}empty{% endfor %} {% for a, b in [[1, 2], [3, 4]] %}{{ a + b }},{% endfor %}",
    "{% for c in 'ab' %}{{ c }}.{% endfor %} {{ range(2, 9, 3) | list }} {{ range(3, 0, -1) | list }}",
    # scoping and namespaces
    "{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}",
    "{% set ns = namespace(total=0, seen=false) %}{% for i in [1, 2, 3] %}{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }}",
    "{% if true %}{% set y = 5 %}{% endif %}{{ y }} {% set a, b = [1, 2] %}{{ a }}{{ b }}",
    "{% set block_var %}  inner {{ n }}  {% endset %}[{{ block_var }}] {% set t | upper %}up{% endset %}{{ t }}",
    # macros, call, filter blocks
    "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', '?') }} {{ greet(name='c', punct='.') }}",
    "{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}body {{ n }}{% endcall %}",
    "{% filter upper %}shout {{ s | trim }}{% endfilter %}",
    "{{ 'yes' if n > 2 else 'no' }} {{ 'only' if false }}|{{ n and 'and' }} {{ z or 'or' }} {{ not z }}",
    "{{ strftime_now('%Y-%m-%d %H:%M %b %A') }}",
    "{{ dict(a=1, b=2) | tojson }} {{ {'a': 1}.get('a') }}",
    "{% generation %}gen {{ n }}{% endgeneration %}",
    # (round 2) lexer corners, comparisons, macro varargs, filters with Python's own rules
    "a\n{% if true %}\nb\n{% endif %}\nc\n",
    "  {{ 1 }}\n  {% if true %}x{% endif %}  \n  y",
    "{% if true -%}\n  a\n{% endif -%}\n  b",
    "x   {#- comment -#}   y\nx\n  {# comment #}\ny",
    "line1\n{%- for i in [1,2] %}\n  item{{ i }}\n{%- endfor %}\nend",
    "\t{% if true %}tab{% endif %}\ntext{% if true %}\n{% endif %}more",
    "{% if true +%}\na{% endif %}|  {%+ if true %}b{% endif %}",
    "A{% raw -%}   B  {%- endraw %}C",
    "{%- macro f(x) %}\n  {{ x }}\n{% endmacro -%}\n{{ f(1) }}{{ f(2) }}",
    "{{ 1 == 1.0 }} {{ true == 1 }} {{ [1, 2] < [1, 3] }} {{ [1] < [1, 0] }} {{ (1, 2) + (3,) }} {{ (1,) }}",
    "{% macro m(a, b=2) %}{{ a }}{{ b }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1) }}{{ m(1, 2, 3, z=4) }}",
    "{{ 'hello wORLD'.title() }} {{ \"they're\".title() }} {{ \"they're bill's-x (y\" | title }}",
    "{{ 2.5 | round }} {{ 3.5 | round }} {{ -2.5 | round }} {{ 2.45 | round(1) }} {{ 7 | round }} {{ 2.5 | round(0, 'floor') }}",
    "{{ items | batch(2) | list }} {{ items | batch(2, 'x') | list }} [{{ 'x' | center(6) }}] [{{ 'ab' | center(5) }}]",
    # (round 3) loop.changed, }} inside dict literals, case mapping beyond ASCII
    "{% for i in [1, 1, 2, 1] %}{{ loop.changed(i) }},{% endfor %}",
    "{{ {'a': {'b': {'c': 1}}}.a.b.c }} {{ {'k': [1, {'x': 2}]}['k'][1].x }}",
    "{{ 'ÉCOLE Ωμέγα Привет' | lower }} {{ 'çava straße' | upper }} {{ 'éa ÀB'.title() }} {{ 'émile'.capitalize() }}"
    " {{ ['b', 'É', 'a', 'é'] | sort }} {{ 'é' is lower }}",
    "{{ [1, 2, 3] | join(', ', attribute=none) }} {{ msgs | map(attribute='role') | join(' ') }}",
    # (round 4) printf-style formatting: the % operator and the format filter
    "{{ '%s' | format(1) }} {{ '%s-%d' | format('a', 3) }} {{ '%(x)s!' | format(x='y') }} {{ '%s' % 1 }}"
    " {{ '%s and %s' % ('a', 'b') }}",
    "{{ '%5.2f|%-4d|%04d|%x|%X|%o|%e|%g|%c' % (3.14159, 7, 42, 255, 255, 8, 12345.678, 0.0001, 65) }}"
    " {{ '%r %s' % ('a', none) }} {{ '%(a)s %(b)d' % {'a': 'x', 'b': 2} }} {{ '100%%' % () }} {{ '%s' % [1, 2] }}",
    "{{ '%.2s|%5s|%-5s|' % ('abc', 'ab', 'ab') }} {{ '%+d % d' % (5, 5) }} {{ '%d' % 3.9 }} {{ '%d' % true }}",
    "{{ '%s %s' % ('a',) }}",
    "{{ 'a' + 1 }}",
    "{{ nope.attr }}",
    "{{ raise_exception('custom failure') }}",
    "{{ items.append('x') }}",
    "{{ d | length + n | string }}",
    "{{ undefined_thing | length }} {{ undefined_thing | trim }}| {{ undefined_thing | items | list }}",
]


def conv_vars(v):
    out = dict(BASE)
    out.update(v)
    return out


def to_lua(v, indent=""):
    """Lua constructor: D{ {k, v}, ... } for dicts (order kept), A{ ... } for lists."""
    inner = indent + "  "
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return lua_string(v)
    if isinstance(v, dict):
        if not v:
            return "D{}"
        parts = ["{ %s, %s }" % (lua_string(k), to_lua(x, inner)) for k, x in v.items()]
        return "D{\n" + "".join(inner + p + ",\n" for p in parts) + indent + "}"
    if isinstance(v, (list, tuple)):
        if not v:
            return "A{}"
        return "A{\n" + "".join(inner + to_lua(x, inner) + ",\n" for x in v) + indent + "}"
    raise TypeError(type(v))


def main():
    e = env()
    files = sorted(f for f in os.listdir(DIR) if f.endswith(".jinja"))
    lines = [
        "-- Generated by scripts/ref/gen-jinja-fixtures.py: Python jinja2 %s renderings of" % jinja2.__version__,
        "-- tests/fixtures/templates/*.jinja (configured as transformers does) for the conversations below.",
        "-- D{ {k, v}, ... } is an ordered dict, A{ ... } a list, NULL None: the spec defines them.",
        "local D, A, NULL = ...",
        "return {",
        "  now = %d," % int(NOW.timestamp()),
        "  conversations = {",
    ]
    for name, v in CONVERSATIONS:
        lines.append("    %s = %s," % (name, to_lua(conv_vars(v), "    ")))
    lines.append("  },")
    lines.append("  data = %s," % to_lua(DATA, "  "))
    lines.append("  snippets = {")
    for src in SNIPPETS:
        try:
            out = e.from_string(src).render(**DATA)
            lines.append("    { src = %s, expected = %s }," % (lua_string(src), lua_string(out)))
        except jinja2.exceptions.TemplateError as ex:
            raised = type(ex) is jinja2.exceptions.TemplateError
            lines.append("    { src = %s, error = %s, raised = %s }," % (
                lua_string(src), lua_string(str(ex)), "true" if raised else "false"))
        except Exception as ex:  # noqa: BLE001
            lines.append("    { src = %s, error = %s, raised = false }," % (
                lua_string(src), lua_string("%s: %s" % (type(ex).__name__, ex))))
    lines.append("  },")
    lines.append("  templates = {")
    counts = {"ok": 0, "raised": 0, "error": 0}
    for f in files:
        with open(os.path.join(DIR, f), encoding="utf-8") as fh:
            src = fh.read()
        lines.append("    {")
        lines.append("      file = %s," % lua_string(f))
        try:
            t = e.from_string(src)
        except Exception as ex:  # noqa: BLE001
            lines.append("      compile_error = %s," % lua_string("%s: %s" % (type(ex).__name__, ex)))
            lines.append("    },")
            counts["error"] += 1
            continue
        lines.append("      cases = {")
        for name, v in CONVERSATIONS:
            if "enable_thinking" in v and "enable_thinking" not in src:
                continue
            try:
                out = t.render(**conv_vars(v))
                lines.append("        { conv = %s, expected = %s }," % (lua_string(name), lua_string(out)))
                counts["ok"] += 1
            except jinja2.exceptions.TemplateError as ex:
                raised = type(ex) is jinja2.exceptions.TemplateError
                lines.append("        { conv = %s, error = %s, raised = %s }," % (
                    lua_string(name), lua_string(str(ex)), "true" if raised else "false"))
                counts["raised" if raised else "error"] += 1
            except Exception as ex:  # noqa: BLE001
                lines.append("        { conv = %s, error = %s, raised = false }," % (
                    lua_string(name), lua_string("%s: %s" % (type(ex).__name__, ex))))
                counts["error"] += 1
        lines.append("      },")
        lines.append("    },")
    lines.append("  },")
    lines.append("}")
    with open(os.path.join(DIR, "expected.lua"), "w", encoding="ascii") as fh:
        fh.write("\n".join(lines) + "\n")
    print("%d templates: %d renderings, %d raise_exception, %d other errors" % (
        len(files), counts["ok"], counts["raised"], counts["error"]))


if __name__ == "__main__":
    main()
