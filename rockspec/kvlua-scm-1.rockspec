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
GGUF files on the CPU (OpenCL next), and exposes sessions, logits and the KV
cache as Lua objects. Sampling, chat templates and cache policy are Lua.
]],
  license = "MIT",
}
dependencies = {
  "lua >= 5.4",
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
  },
}
