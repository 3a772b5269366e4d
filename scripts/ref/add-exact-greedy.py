#!/usr/bin/env python3
"""Add the float64 pass's greedy-step margins to the logits fixtures.

    python3 scripts/ref/add-exact-greedy.py [--models smollm2,gemma3]     (from the repo root)

For each prompt of tests/fixtures/ref_logits_<m>.lua, runs the float64 numpy
forward pass (np_llama.py) teacher-forced over ids + greedy (llama.cpp's
recorded tokens) and adds, per greedy step i, what it gives before greedy[i]:

  exact_greedy_top[i]     its top-1 id
  exact_greedy_margin[i]  its top1 - top2 logit

llama.cpp's greedy_margin alone is not a reliable "clear choice" signal: its
activations are quantized to 8 bits, and on Gemma 3 it gives 0.653 at french
step 27 where the float64 pass puts the runner-up first. The other values of
the fixture (llama.cpp's) are kept byte for byte: the new fields are inserted
as text at the end of each prompt's table, and the header gains a note. A rerun
replaces the fields. scripts/ref/gen-fixtures.py writes the same fields when it
regenerates a fixture.
"""

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import np_llama  # noqa: E402
from luaser import to_lua  # noqa: E402

HEADER = [
    "exact_greedy_top/exact_greedy_margin: the float64 pass teacher-forced over ids + greedy: its",
    "top-1 id and top1 - top2 logit before greedy[i] (added by scripts/ref/add-exact-greedy.py).",
    "A greedy step is a clear choice only if both margins are large and both top-1s agree.",
]

# prints, per prompt, "ids..." and "greedy..." lines
DUMP = r"""
local f = dofile(arg[1])
print(f.model)
for _, p in ipairs(f.prompts) do
  print(table.concat(p.ids, " "))
  print(table.concat(p.greedy, " "))
end
"""


def model_path(name):
    out = subprocess.run([os.path.join(ROOT, "scripts", "fetch-models.sh"), name],
                         check=True, capture_output=True, text=True).stdout.strip()
    return out.splitlines()[-1]


def read_fixture(path):
    out = subprocess.run(["lua5.4", "-", path], input=DUMP, check=True, capture_output=True,
                         text=True).stdout.splitlines()
    model, rows = out[0], out[1:]
    return model, [([int(x) for x in rows[k].split()], [int(x) for x in rows[k + 1].split()])
                   for k in range(0, len(rows), 2)]


def add(path, mpath):
    model, prompts = read_fixture(path)
    assert model == os.path.basename(mpath), (model, mpath)
    exact = np_llama.load(mpath)
    fields = []
    for n, (ids, greedy) in enumerate(prompts):
        top, margin = np_llama.greedy_margins(exact, ids, greedy)
        fields.append((top, margin))
        print("%s prompt %d: %d steps, min float64 margin %.3f" % (model, n + 1, len(greedy), min(margin)))
    with open(path, encoding="ascii") as f:
        text = f.read()
    # drop the fields and header lines of an earlier run
    text = re.sub(r"\n      exact_greedy_(top|margin) = (\{[^}]*\}|[^\n]*),", "", text)
    for h in HEADER:
        text = text.replace("-- " + h + "\n", "")
    head, body = text.split("\nreturn {\n", 1)
    head += "".join("\n-- " + h for h in HEADER)
    # each prompt's table ends with a line "    }," (four spaces: inside prompts = { ... })
    parts = body.split("\n    },\n")
    assert len(parts) == len(prompts) + 1, (len(parts), len(prompts))
    out = []
    for (top, margin), part in zip(fields, parts):
        out.append(part + "\n      exact_greedy_top = " + to_lua(top, "      ") + ","
                   + "\n      exact_greedy_margin = " + to_lua(margin, "      ") + ",")
    out.append(parts[-1])
    with open(path, "w", encoding="ascii") as f:
        f.write(head + "\nreturn {\n" + "\n    },\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    a = ap.parse_args()
    for m in a.models.split(","):
        add(os.path.join(ROOT, "tests", "fixtures", "ref_logits_%s.lua" % m), model_path(m))


if __name__ == "__main__":
    main()
