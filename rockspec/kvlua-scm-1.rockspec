-- The development rockspec: `luarocks make rockspec/kvlua-scm-1.rockspec`
-- (or `luarocks build` with no argument) builds and installs the checkout it
-- is run in. Its source URL only names the checkout; a source rock that
-- installs on another machine comes from rockspec/pack.sh, which writes a
-- versioned copy of this file whose source is a tarball of the checkout and
-- packs both (see README, "Install with LuaRocks").
rockspec_format = "3.0"
package = "kvlua"
version = "scm-1"
source = {
  url = "git+file://.",
}
description = {
  summary = "Run GGUF language models from Lua, with a KV cache you can script",
  detailed = [[
kvlua is a Lua 5.4 module written in C that runs large language models from
GGUF files on the CPU or through OpenCL, and exposes sessions, logits and the
KV cache as Lua objects. Sampling, chat templates and cache policy are Lua.
The rock installs the module and the kvlua-* commands (kvlua-generate,
kvlua-chat, kvlua-batch-generate, ...).
]],
  license = "MIT",
}
dependencies = {
  "lua >= 5.4",
  "argparse >= 0.7",
}
-- libsodium (hashes, encrypted session files) and the OpenCL ICD loader.
-- In a prefix outside the usual ones: luarocks install ... SODIUM_DIR=/opt/x
-- (or SODIUM_INCDIR=... SODIUM_LIBDIR=...), the same with OPENCL_.
external_dependencies = {
  SODIUM = { header = "sodium.h", library = "sodium" },
  OPENCL = { header = "CL/cl.h", library = "OpenCL" },
}
build = {
  type = "cmake",
  variables = {
    CMAKE_BUILD_TYPE = "Release",
    KV_TESTS = "OFF",
    LUA_INCDIR = "$(LUA_INCDIR)",
    LUA_LIBDIR = "$(LIBDIR)",
    LUA_LUADIR = "$(LUADIR)",
    CMAKE_INSTALL_PREFIX = "$(PREFIX)",
    KV_SODIUM_INCDIR = "$(SODIUM_INCDIR)",
    KV_SODIUM_LIBDIR = "$(SODIUM_LIBDIR)",
    KV_OPENCL_INCDIR = "$(OPENCL_INCDIR)",
    KV_OPENCL_LIBDIR = "$(OPENCL_LIBDIR)",
  },
  -- the user-facing scripts as commands (luarocks wraps each one so that it
  -- finds the tree's modules); the dev tools (references, benchmark
  -- comparisons, table generators) stay in the checkout
  install = {
    bin = {
      ["kvlua-generate"] = "scripts/generate.lua",
      ["kvlua-chat"] = "scripts/chat.lua",
      ["kvlua-batch-generate"] = "scripts/batch-generate.lua",
      ["kvlua-mc-eval"] = "scripts/mc-eval.lua",
      ["kvlua-bench"] = "scripts/bench.lua",
      ["kvlua-bench-batch"] = "scripts/bench-batch.lua",
      ["kvlua-chat-bench"] = "scripts/chat-bench.lua",
      ["kvlua-agent"] = "scripts/agent.lua",
      ["kvlua-perplexity"] = "scripts/perplexity.lua",
      ["kvlua-prompt-cache"] = "scripts/prompt-cache.lua",
      ["kvlua-kv-demo"] = "scripts/kv-demo.lua",
      ["kvlua-fetch-models"] = "scripts/fetch-models.sh",
    },
  },
}
