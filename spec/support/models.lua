-- Paths of the real models the specs run against. They are fetched (once,
-- then cached) by scripts/fetch-models.sh; KVLUA_NO_MODELS=1 skips them.
local M = {}

local cache = {}

-- Returns the path of a real model ("smollm2" or "gemma3"), or nil and a
-- reason when models are disabled or cannot be fetched.
function M.path(name)
  if os.getenv("KVLUA_NO_MODELS") == "1" then return nil, "KVLUA_NO_MODELS=1" end
  if cache[name] == nil then
    local p = io.popen("scripts/fetch-models.sh " .. name .. " 2>/dev/null")
    local out = p:read("l")
    p:close()
    cache[name] = (out and out ~= "") and out or false
  end
  return cache[name] or nil, "could not fetch model " .. name
end

-- llama.cpp's tokenizer vocabularies and test vectors (tests/data/vocab).
M.vocab_dir = "tests/data/vocab"

return M
