-- Findings of an audit of session and cache files on disk, one describe per
-- finding, each written to fail before its fix:
--
--   1  version-1 files were refused as altered (the reader authenticated
--      every file as version 2), and a version field changed from 2 to 1
--      went unnoticed (f16 pages restored; quantized ones were refused for
--      their version)
--   2  a plain record of 1 MiB + 17 bytes was read into a 1 MiB buffer
--   3  a save over a FIFO replaced the FIFO with a regular file (as root, a
--      save to /dev/null replaced the device); over a directory it failed
--      only at the rename
--   4  a save through a symbolic link replaced the link with a regular file
--   5  a save killed midway (kill -9) left its temporary file for ever: the
--      temporary name was random, so no later save found it (and a name of
--      more than 244 bytes could not be saved to: the temporary name was
--      too long)
--   6  kvlua.restore on a FIFO waited for a writer for ever; on a directory
--      it said "bad magic"
--
-- And one check that held already: a save that runs out of disk space
-- leaves the old file as it was and no temporary file.
--
-- Everything runs on tiny random-weight models written to temporary files;
-- what could hang (a FIFO), corrupt the heap (2) or must be killed (a
-- save) runs in a child lua5.4. The /dev/null case runs last, and only once
-- the FIFO case has passed: a build that replaces FIFOs must never be let
-- near /dev/null.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local run_child = require "spec.support.child"
local files = require "spec.support.files"
local same = require("spec.support.ids").same
local some_ids = require("spec.support.ids").some
local child, quote = run_child.run, run_child.quote
local read, write = files.read, files.write

local KEY = ("k"):rep(32)

-- ==== helpers ================================================================

local function sh(cmd)
  return os.execute(cmd) == true
end

-- A new folder, removed after the test whatever its outcome.
local made = {}
local function tempdir()
  local p = assert(io.popen("mktemp -d"))
  local d = p:read("l")
  p:close()
  made[#made + 1] = d
  return d
end
after_each(function()
  for _, d in ipairs(made) do sh("rm -rf " .. quote(d)) end
  made = {}
end)

-- The names in folder dir (dot files too), sorted.
local function listing(dir)
  local p = assert(io.popen("ls -A " .. quote(dir)))
  local t = {}
  for name in p:lines() do t[#t + 1] = name end
  p:close()
  table.sort(t)
  return t
end

local function is_link(p) return sh("test -L " .. quote(p)) end
local function is_fifo(p) return sh("test -p " .. quote(p)) end
local function is_dir(p) return sh("test -d " .. quote(p) .. " && test ! -L " .. quote(p)) end

local path, m -- a tiny llama, 64 tokens of vocabulary
setup(function()
  path = tiny.llama { seed = 61, n_embd = 64, n_head = 2, n_head_kv = 1 }
  m = assert(kvlua.load(path, { threads = 1 }))
end)
teardown(function()
  m:close()
  tiny.cleanup()
end)

local function session(n, opts)
  opts = opts or {}
  opts.ctx = opts.ctx or 512
  local s = assert(m:session(opts))
  assert(s:prefill(some_ids(n, 64, n)))
  return s
end

-- The next logits after token 9: the same bits for a session and its restored copy.
local function same_next(a, b)
  return same(assert(a:fork():decode(9)), assert(b:fork():decode(9)))
end

local fifo_refused = false -- set once a save to a FIFO was refused (finding 3)

-- ==== 1 ======================================================================

describe("1: the version field is authenticated; version 1 is refused by its version", function()
  local function saved(opts, key)
    local s = session(40, opts)
    local p = os.tmpname()
    assert(s:save(p, { key = key }))
    local b = read(p)
    return s, p, b
  end

  it("a genuine version-1 file with f16 pages restores", function()
    local s, p, b = saved()
    write(p, files.as_version(b, 1))
    local r, err = kvlua.restore(m, p)
    os.remove(p)
    assert(r, err)
    assert.is_true(same_next(s, r))
  end)

  it("a genuine version-1 file with quantized pages: refused by its version", function()
    local _, p, b = saved { ktype = "q8_0", vtype = "q8_0" }
    write(p, files.as_version(b, 1))
    local r, err = kvlua.restore(m, p)
    os.remove(p)
    assert.is_nil(r)
    assert.matches("session file version 1: this kvlua reads version 2", err)
    assert.matches("save it again", err)
  end)

  it("a version-2 file whose version reads 1: altered (plain, f16 and q8_0 pages)", function()
    for _, opts in ipairs { {}, { ktype = "q8_0", vtype = "q8_0" } } do
      local _, p, b = saved(opts)
      write(p, b:sub(1, 8) .. string.pack("<I4", 1) .. b:sub(13))
      local r, err = kvlua.restore(m, p)
      os.remove(p)
      assert.is_nil(r, opts.ktype or "f16")
      assert.matches("checksum mismatch %(altered", err)
    end
  end)

  it("a version-2 file whose version reads 1: altered (encrypted)", function()
    for _, opts in ipairs { {}, { ktype = "q8_0", vtype = "q8_0" } } do
      local _, p, b = saved(opts, KEY)
      write(p, b:sub(1, 8) .. string.pack("<I4", 1) .. b:sub(13))
      local r, err = kvlua.restore(m, p, { key = KEY })
      os.remove(p)
      assert.is_nil(r, opts.ktype or "f16")
      assert.matches("the file was altered", err)
    end
  end)

  it("cache files: a genuine version 1 restores (f16) or is refused by its version (q8_0); an altered one", function()
    for _, t in ipairs { "f16", "q8_0" } do
      local c = assert(kvlua.cache(m, { pages = 16, ktype = t, vtype = t }))
      local s = assert(m:session { ctx = 512, cache = c })
      assert(s:prefill(some_ids(40, 64, 3), { logits = "none" }))
      s:close()
      local p = os.tmpname()
      assert(c:save(p))
      local b = read(p)
      write(p, files.as_version(b, 1))
      local c2 = assert(kvlua.cache(m, { pages = 16, ktype = t, vtype = t }))
      local got, added = kvlua.restore(m, p, { cache = c2 })
      if t == "f16" then
        assert.equals(c2, got, added)
        assert.equals(2, added)
      else
        assert.is_nil(got)
        assert.matches("cache file version 1: this kvlua reads version 2", added)
      end
      write(p, b:sub(1, 8) .. string.pack("<I4", 1) .. b:sub(13))
      local got2, err2 = kvlua.restore(m, p, { cache = c2 })
      os.remove(p)
      assert.is_nil(got2)
      assert.matches("checksum mismatch %(altered", err2)
    end
  end)
end)

-- ==== 2 ======================================================================

describe("2: a plain record larger than 1 MiB is refused before it is read", function()
  it("1 MiB + 17 bytes (the encrypted limit) in a plain file: nil, message (in a child: it corrupted the heap)", function()
    local p = os.tmpname()
    assert(session(20):save(p))
    local b = read(p)
    local n = (1 << 20) + 17
    write(p, b:sub(1, 16) .. string.pack("<I4", n) .. ("\0"):rep(n) .. string.pack("<I4", 0) .. ("\0"):rep(32))
    local out, rc = child(([[
      local kvlua = require "kvlua"
      local m = assert(kvlua.load(%q, { threads = 1 }))
      print("session:", select(2, kvlua.restore(m, %q)))
      local c = assert(kvlua.cache(m, { pages = 16 }))
      io.open(%q, "r+b"):write("KVLUAKC1"):close()
      print("cache:", select(2, kvlua.restore(m, %q, { cache = c })))
    ]]):format(path, p, p, p), 60)
    os.remove(p)
    assert.equals(0, rc, out)
    assert.matches("session:%s+kv file: record larger than allowed", out)
    assert.matches("cache:%s+kv file: record larger than allowed", out)
  end)
end)

-- ==== 3 ======================================================================

describe("3: a save over what is not a regular file is refused, nothing touched", function()
  it("a FIFO: nil, message; still a FIFO, nothing else in the folder", function()
    local dir = tempdir()
    local fifo = dir .. "/f.kv"
    assert.is_true(sh("mkfifo " .. quote(fifo)))
    local ok, err = session(20):save(fifo)
    local still = is_fifo(fifo)
    local names = listing(dir)
    sh("rm -rf " .. quote(dir))
    assert.is_nil(ok)
    assert.matches("not a regular file", err)
    assert.is_true(still, "the FIFO is still a FIFO")
    assert.same({ "f.kv" }, names)
    fifo_refused = true
  end)

  it("a directory (a cache file too): nil, message before anything is written", function()
    local dir = tempdir()
    local sub = dir .. "/d.kv"
    assert.is_true(sh("mkdir " .. quote(sub)))
    local ok, err = session(20):save(sub)
    assert.is_nil(ok)
    assert.matches("not a regular file", err)
    local c = assert(kvlua.cache(m, { pages = 16 }))
    local ok2, err2 = c:save(sub)
    assert.is_nil(ok2)
    assert.matches("not a regular file", err2)
    local still, names, inside = is_dir(sub), listing(dir), listing(sub)
    sh("rm -rf " .. quote(dir))
    assert.is_true(still)
    assert.same({ "d.kv" }, names)
    assert.same({}, inside)
  end)
end)

-- ==== 4 ======================================================================

describe("4: a save through a symbolic link replaces the link's target, the link stays", function()
  it("relative links, a chain of two, a link in another folder", function()
    local dir = tempdir()
    assert.is_true(sh(("mkdir %s/a %s/b"):format(quote(dir), quote(dir))))
    local target = dir .. "/a/t.kv"
    write(target, "an older file")
    -- b/l2 -> l1 (relative to b), b/l1 -> ../a/t.kv (relative to b, not to the working folder)
    assert.is_true(sh(("ln -s ../a/t.kv %s/b/l1 && ln -s l1 %s/b/l2"):format(quote(dir), quote(dir))))
    local s = session(30)
    assert.is_true(s:save(dir .. "/b/l2"))
    local links = is_link(dir .. "/b/l1") and is_link(dir .. "/b/l2")
    local a, b = listing(dir .. "/a"), listing(dir .. "/b")
    local r, err = kvlua.restore(m, target)
    sh("rm -rf " .. quote(dir))
    assert.is_true(links, "both links are still links")
    assert.same({ "t.kv" }, a) -- no temporary file left beside the target
    assert.same({ "l1", "l2" }, b)
    assert(r, err)
    assert.same(s:tokens(), r:tokens())
    assert.is_true(same_next(s, r))
  end)

  it("an absolute link; a cache file", function()
    local dir = tempdir()
    local target = dir .. "/t.kv"
    write(target, "an older file")
    assert.is_true(sh(("ln -s %s %s/l"):format(quote(target), quote(dir))))
    local c = assert(kvlua.cache(m, { pages = 16 }))
    local s = assert(m:session { ctx = 512, cache = c })
    assert(s:prefill(some_ids(40, 64, 3), { logits = "none" }))
    s:close()
    local ok, n = c:save(dir .. "/l")
    local link = is_link(dir .. "/l")
    local c2 = assert(kvlua.cache(m, { pages = 16 }))
    local _, added = kvlua.restore(m, target, { cache = c2 })
    local names = listing(dir)
    sh("rm -rf " .. quote(dir))
    assert.is_true(ok)
    assert.is_true(link)
    assert.equals(n, added)
    assert.equals(2, added)
    assert.same({ "l", "t.kv" }, names)
  end)

  it("a dangling link: its target is created, the link stays", function()
    local dir = tempdir()
    assert.is_true(sh(("ln -s new.kv %s/l"):format(quote(dir))))
    local s = session(20)
    assert.is_true(s:save(dir .. "/l"))
    local link = is_link(dir .. "/l")
    local names = listing(dir)
    local r = kvlua.restore(m, dir .. "/new.kv")
    sh("rm -rf " .. quote(dir))
    assert.is_true(link)
    assert.same({ "l", "new.kv" }, names)
    assert.is_true(r ~= nil and same_next(s, r))
  end)

  it("a link to a FIFO: refused, the FIFO and the link as they were", function()
    local dir = tempdir()
    assert.is_true(sh(("mkfifo %s/f && ln -s f %s/l"):format(quote(dir), quote(dir))))
    local ok, err = session(20):save(dir .. "/l")
    local fifo, link, names = is_fifo(dir .. "/f"), is_link(dir .. "/l"), listing(dir)
    sh("rm -rf " .. quote(dir))
    assert.is_nil(ok)
    assert.matches("not a regular file", err)
    assert.is_true(fifo and link)
    assert.same({ "f", "l" }, names)
  end)

  it("a loop of links: nil, message", function()
    local dir = tempdir()
    assert.is_true(sh(("ln -s b %s/a && ln -s a %s/b"):format(quote(dir), quote(dir))))
    local ok, err = session(20):save(dir .. "/a")
    local names = listing(dir)
    sh("rm -rf " .. quote(dir))
    assert.is_nil(ok)
    assert.matches("symbolic links", err)
    assert.same({ "a", "b" }, names)
  end)
end)

-- ==== 5 ======================================================================

describe("5: a save killed midway leaves no temporary file for ever", function()
  it("kill -9 during saves of a 4 MiB session; the next save leaves only the file", function()
    -- 4 layers x 128 f32 K and V values a token x 1024 tokens: 4 MiB a save;
    -- prefilled once here, restored by each child
    local big_path = tiny.llama { seed = 62, n_layer = 4, n_embd = 128, n_head = 2, n_head_kv = 2, n_ff = 32,
      n_ctx = 2048 }
    local seed = os.tmpname()
    do
      local big = assert(kvlua.load(big_path, { threads = 1 }))
      local s = assert(big:session { ctx = 2048, ktype = "f32", vtype = "f32" })
      assert(s:prefill(some_ids(1024, 64, 7), { logits = "none" }))
      assert(s:save(seed))
      big:close()
    end
    local build = os.getenv("KVLUA_BUILD") or "build"
    local killed_mid_save = 0
    for round = 1, 8 do
      local dir = tempdir()
      local target, ready = dir .. "/s.kv", dir .. "/ready"
      local code = ([[
        package.cpath = %q .. '/?.so;' .. package.cpath
        package.path = 'luamod/?.lua;' .. package.path
        local kvlua = require "kvlua"
        local m = assert(kvlua.load(%q, { threads = 1 }))
        local s = assert(kvlua.restore(m, %q))
        assert(s:save(%q))
        io.open(%q, "w"):close()
        local t0 = os.time()
        while os.time() < t0 + 60 do assert(s:save(%q)) end
      ]]):format(build, big_path, seed, target, ready, target)
      -- the child saves in a loop (for a minute at most); once it has saved
      -- once it is killed 0.02 s * round later (the loop is nearly all save)
      local cmd = ([[
        exec 2>/dev/null
        lua5.4 -e %s </dev/null >/dev/null 2>&1 & pid=$!
        while [ ! -e %s ] && kill -0 $pid 2>/dev/null; do sleep 0.05; done
        sleep %s; kill -9 $pid; wait $pid; test $? = 137
      ]]):format(quote(code), quote(ready), tostring(0.02 * round))
      assert.is_true(sh(cmd), "the child was killed by SIGKILL")
      os.remove(ready)
      local after_kill = listing(dir)
      if #after_kill > 1 then killed_mid_save = killed_mid_save + 1 end
      -- another save to the same path, from this process
      local s = session(20)
      assert.is_true(s:save(target))
      local names = listing(dir)
      local r = kvlua.restore(m, target)
      sh("rm -rf " .. quote(dir))
      assert.same({ "s.kv" }, names, "round " .. round .. ": left " .. table.concat(after_kill, " "))
      assert.is_true(r ~= nil and same_next(s, r))
      if killed_mid_save >= 2 then break end
    end
    os.remove(seed)
    assert.is_true(killed_mid_save >= 1, "no kill landed in the middle of a save")
  end)

  it("a name of 250 bytes (the temporary name would pass 255): saved, nothing left beside it", function()
    local dir = tempdir()
    local name = ("n"):rep(247) .. ".kv"
    local s = session(20)
    assert.is_true(s:save(dir .. "/" .. name)) -- twice: the second replaces the first
    assert.is_true(s:save(dir .. "/" .. name))
    local r = kvlua.restore(m, dir .. "/" .. name)
    assert.same({ name }, listing(dir))
    assert.is_true(r ~= nil and same_next(s, r))
  end)

  it("two saves to one path at once: the second is refused while the first holds the file", function()
    -- the first save is stood for by flock(1) holding the lock on the
    -- temporary file, as a live save does (-o: flock keeps the lock itself,
    -- so killing it lets the lock go)
    local dir = tempdir()
    local target, tmp, pidfile = dir .. "/s.kv", dir .. "/.s.kv.kvlua-tmp", os.tmpname()
    local s = session(20)
    assert.is_true(s:save(target))
    assert.is_true(sh(("touch %s && { flock -o -x %s sleep 30 </dev/null >/dev/null 2>&1 & echo $! > %s; } && "
      .. "i=0; while flock -n %s true && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; [ $i -lt 400 ]")
      :format(quote(tmp), quote(tmp), quote(pidfile), quote(tmp))), "flock holds the lock")
    local ok, err = session(30):save(target)
    local r = kvlua.restore(m, target)
    assert.is_true(sh(("kill -9 $(cat %s); i=0; while ! flock -n %s true && [ $i -lt 400 ]; do sleep 0.05; "
      .. "i=$((i+1)); done; [ $i -lt 400 ]"):format(quote(pidfile), quote(tmp))), "the lock is let go")
    os.remove(pidfile)
    local s2 = session(30)
    local ok2 = s2:save(target) -- the lock is gone: the stale file is taken over
    local names = listing(dir)
    local r2 = kvlua.restore(m, target)
    sh("rm -rf " .. quote(dir))
    assert.is_nil(ok)
    assert.matches("another save to .* is under way", err)
    assert.is_true(r ~= nil and same_next(s, r), "the file is the first save's")
    assert.is_true(ok2)
    assert.same({ "s.kv" }, names)
    assert.is_true(r2 ~= nil and same_next(s2, r2))
  end)
end)

-- ==== 6 ======================================================================

describe("6: restoring what is not a regular file is refused at once", function()
  it("a FIFO without a writer (in a child, under a timeout); into a cache too", function()
    local dir = tempdir()
    local fifo = dir .. "/f.kv"
    assert.is_true(sh("mkfifo " .. quote(fifo)))
    local out, rc = child(([[
      local kvlua = require "kvlua"
      local m = assert(kvlua.load(%q, { threads = 1 }))
      print("session:", select(2, kvlua.restore(m, %q)))
      local c = assert(kvlua.cache(m, { pages = 16 }))
      print("cache:", select(2, kvlua.restore(m, %q, { cache = c })))
    ]]):format(path, fifo, fifo), 20)
    sh("rm -rf " .. quote(dir))
    assert.equals(0, rc, out)
    assert.matches("session:%s+restore: [^\n]*not a regular file", out)
    assert.matches("cache:%s+restore: [^\n]*not a regular file", out)
  end)

  it("a directory", function()
    local dir = tempdir()
    local r, err = kvlua.restore(m, dir)
    sh("rm -rf " .. quote(dir))
    assert.is_nil(r)
    assert.matches("not a regular file", err)
  end)
end)

-- ==== a full disk (held already) ===============================================

describe("a save that runs out of disk space", function()
  it("nil, message; the old file as it was, no temporary file", function()
    local dir = tempdir()
    if not sh("mount -t tmpfs -o size=64k tmpfs " .. quote(dir) .. " 2>/dev/null") then
      sh("rmdir " .. quote(dir))
      return pending("cannot mount a small tmpfs here")
    end
    finally(function() sh("umount " .. quote(dir) .. " 2>/dev/null; rmdir " .. quote(dir)) end)
    local small = session(10)
    local ok0 = small:save(dir .. "/s.kv")
    local big = session(400)
    local ok, err = big:save(dir .. "/s.kv")
    local names = listing(dir)
    local r = kvlua.restore(m, dir .. "/s.kv")
    sh("umount " .. quote(dir))
    assert.is_true(ok0)
    assert.is_nil(ok)
    assert.matches("No space left", err)
    assert.same({ "s.kv" }, names)
    assert.is_true(r ~= nil and same_next(small, r))
  end)
end)

-- ==== 3 (last): a device =====================================================

describe("3 (a device): a save to /dev/null is refused, the device as it was", function()
  it("nil, message; /dev/null still a character device, nothing beside it", function()
    if not fifo_refused then
      return pending("runs only once a save over a FIFO is refused (it would replace /dev/null as root)")
    end
    local before = listing("/dev")
    local ok, err = session(20):save("/dev/null")
    assert.is_nil(ok)
    assert.matches("not a regular file", err)
    assert.is_true(sh("test -c /dev/null"))
    assert.same(before, listing("/dev"))
  end)
end)
