"""Serialize Python values as Lua table constructors (for tests/fixtures/*.lua).

bytes/str -> Lua string literal: printable ASCII kept, everything else as \\xNN,
so arbitrary bytes (invalid UTF-8 included) survive. float -> "%.9g" (enough
to round-trip a float32), or a higher precision with the `digits` argument.
Dicts keep insertion order; keys that are Lua identifiers are written bare.
"""

import math
import re

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LUA_KEYWORDS = {
    "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if",
    "in", "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while",
}


def lua_string(b):
    if isinstance(b, str):
        b = b.encode("utf-8")
    out = ['"']
    for c in b:
        if c == 0x22:
            out.append('\\"')
        elif c == 0x5C:
            out.append("\\\\")
        elif c == 0x0A:
            out.append("\\n")
        elif c == 0x09:
            out.append("\\t")
        elif c == 0x0D:
            out.append("\\r")
        elif 0x20 <= c < 0x7F:
            out.append(chr(c))
        else:
            out.append("\\x%02X" % c)
    out.append('"')
    return "".join(out)


def lua_number(x, digits=9):
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    x = float(x)
    if math.isnan(x):
        return "(0/0)"
    if math.isinf(x):
        return "math.huge" if x > 0 else "-math.huge"
    s = "%.*g" % (digits, x)
    if "e" not in s and "." not in s and "n" not in s:
        s += ".0"
    return s


class Raw(str):
    """A pre-serialized Lua expression."""


def to_lua(v, indent="", digits=9, inline_width=100):
    if v is None:
        return "nil"
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (bytes, bytearray, str)):
        return lua_string(bytes(v) if not isinstance(v, str) else v)
    if isinstance(v, (int, float)) or hasattr(v, "dtype"):
        if hasattr(v, "dtype"):
            v = v.item()
        return lua_number(v, digits)
    inner = indent + "  "
    if isinstance(v, dict):
        parts = []
        for k, val in v.items():
            if isinstance(k, str) and _IDENT.match(k) and k not in _LUA_KEYWORDS:
                key = k
            else:
                key = "[" + to_lua(k, digits=digits) + "]"
            parts.append(key + " = " + to_lua(val, inner, digits, inline_width))
    else:
        parts = [to_lua(x, inner, digits, inline_width) for x in v]
    flat = "{ " + ", ".join(parts) + " }" if parts else "{}"
    if len(flat) + len(indent) <= inline_width and "\n" not in flat:
        return flat
    all_scalar = all(not isinstance(x, (list, tuple, dict)) for x in (v.values() if isinstance(v, dict) else v))
    if all_scalar and not isinstance(v, dict):
        # wrap long scalar arrays at ~inline_width columns
        lines, cur = [], ""
        for p in parts:
            if cur and len(cur) + len(p) + 2 + len(inner) > inline_width:
                lines.append(cur.rstrip())
                cur = ""
            cur += p + ", "
        if cur:
            lines.append(cur.rstrip())
        return "{\n" + "".join(inner + l + "\n" for l in lines) + indent + "}"
    return "{\n" + "".join(inner + p + ",\n" for p in parts) + indent + "}"


def write_fixture(path, header_lines, value, digits=9):
    with open(path, "w", encoding="ascii") as f:
        for h in header_lines:
            f.write("-- " + h + "\n")
        f.write("return " + to_lua(value, "", digits) + "\n")
