/*
 * fuzz_kvfile.c — libFuzzer entry point for the session-file reader
 * (kv_session_restore_fp) and the cache-file reader (kv_cache_restore_fp),
 * engine/kvfile.c.
 *
 * At start-up it writes a tiny random-weight llama model (1 layer) to a
 * temporary file and opens it; if KVFILE_SEEDS names a folder, it saves a
 * few sessions of that model there (plain and encrypted) as seeds, so the
 * mutations start from files whose fingerprint matches. Each input is
 * restored from memory (with the fixed key when it says it is encrypted);
 * a restored session must hold what the engine promises (pos <= ctx, ids in
 * range) and must then evaluate one more token without trouble. Each
 * input is also restored into a small cache that already holds a few
 * pages (cache files are seeds too: all pages, some prefixes, plain and
 * encrypted): a refused file must leave the cache's stats exactly as they
 * were; an accepted one must have added as many cached pages as it says,
 * and a session on the cache must then evaluate. Run it with
 * tests/run-fuzz.sh SECONDS.
 */
#include "gguf_writer.h"
#include "kvlua.h"
#include "types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define REQUIRE(c) do { if (!(c)) __builtin_trap(); } while (0)

static kv_model *g_model;
static const uint8_t g_key[32] = "fuzzing key, 32 bytes long here";

static void add(gw *w, const char *name, int64_t cols, int64_t rows, uint32_t *seed) {
    int64_t n = cols * (rows ? rows : 1);
    float *f = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        f[i] = ((float)(*seed >> 8) / 16777216.0f - 0.5f) * (rows ? 0.5f : 0.1f) + (rows ? 0.0f : 1.0f);
    }
    int64_t ne[2] = {cols, rows ? rows : 1};
    gw_tensor(w, name, rows ? 2 : 1, ne, KV_TYPE_F32, f);
    free(f);
}

static char *write_model(void) {
    static char path[] = "/tmp/kvlua-fuzz-model-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return NULL;
    gw *w = gw_new(3);
    uint32_t seed = 7;
    gw_kv_str(w, "general.architecture", "llama");
    gw_kv_u32(w, "llama.block_count", 1);
    gw_kv_u32(w, "llama.context_length", 4096);
    gw_kv_u32(w, "llama.embedding_length", 32);
    gw_kv_u32(w, "llama.feed_forward_length", 32);
    gw_kv_u32(w, "llama.attention.head_count", 2);
    gw_kv_u32(w, "llama.attention.head_count_kv", 1);
    gw_kv_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    add(w, "token_embd.weight", 32, 40, &seed);
    add(w, "output_norm.weight", 32, 0, &seed);
    add(w, "blk.0.attn_norm.weight", 32, 0, &seed);
    add(w, "blk.0.attn_q.weight", 32, 32, &seed);
    add(w, "blk.0.attn_k.weight", 32, 16, &seed);
    add(w, "blk.0.attn_v.weight", 32, 16, &seed);
    add(w, "blk.0.attn_output.weight", 32, 32, &seed);
    add(w, "blk.0.ffn_norm.weight", 32, 0, &seed);
    add(w, "blk.0.ffn_gate.weight", 32, 32, &seed);
    add(w, "blk.0.ffn_up.weight", 32, 32, &seed);
    add(w, "blk.0.ffn_down.weight", 32, 32, &seed);
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = gw_finish(w, &buf, &len);
    gw_free(w);
    if (rc != 0 || write(fd, buf, len) != (ssize_t)len) path[0] = 0;
    free(buf);
    close(fd);
    return path[0] ? path : NULL;
}

/* A cache of `pages` pages holding the pages of a prefill of n ids (seed k). */
static kv_cache *filled_cache(int pages, int n, int k) {
    kv_cache_params p = {.pages = pages, .page_tokens = 4, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    kv_cache *c = NULL;
    kv_error e;
    if (kv_cache_open(g_model, &p, &c, &e) != KV_OK) abort();
    kv_session_params sp = {.n_ctx = 64, .cache = c};
    kv_session *s = NULL;
    if (kv_session_open_p(g_model, &sp, &s, &e) != KV_OK) abort();
    int32_t ids[64];
    for (int i = 0; i < n && i < 64; i++) ids[i] = (i * 5 + k) % 40;
    if (n > 0 && kv_session_eval(s, ids, (size_t)n, KV_LOGITS_NONE, NULL, &e) != KV_OK) abort();
    kv_session_close(s);
    return c;
}

static void cache_seeds(const char *dir) {
    for (int i = 0; i < 4; i++) {
        kv_cache *c = filled_cache(32, 10 + 7 * i, i);
        kv_error e;
        int32_t pre[20];
        for (int k = 0; k < 20; k++) pre[k] = (k * 5 + i) % 40;
        const int32_t *prefixes[2] = {pre, pre};
        const size_t lens[2] = {9, 20};
        char path[512];
        snprintf(path, sizeof path, "%s/cache-%d.kvc", dir, i);
        kv_cache_save(c, path, i & 1 ? g_key : NULL, i & 2 ? prefixes : NULL, lens, 2, NULL, &e);
        kv_cache_close(c);
    }
}

static void seeds(const char *dir) {
    cache_seeds(dir);
    const int lengths[3] = {5, 17, 40};
    for (int i = 0; i < 6; i++) {
        kv_session *s = NULL;
        kv_error e;
        if (kv_session_open(g_model, 64, &s, &e) != KV_OK) return;
        int32_t ids[40];
        for (int k = 0; k < 40; k++) ids[k] = (k * 7 + i) % 40;
        kv_session_eval(s, ids, (size_t)lengths[i % 3], KV_LOGITS_NONE, NULL, &e);
        char path[512];
        snprintf(path, sizeof path, "%s/session-%d.kv", dir, i);
        kv_session_save(s, path, i >= 3 ? g_key : NULL, &e);
        kv_session_close(s);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *path = write_model();
    kv_error e;
    kv_model_params p = {.threads = 1};
    if (!path || kv_model_open(path, &p, &g_model, &e) != KV_OK) abort();
    unlink(path); /* mapped: the file can go */
    const char *dir = getenv("KVFILE_SEEDS");
    if (dir) seeds(dir);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FILE *f = fmemopen((void *)data, size, "rb");
    if (!f) return 0;
    const bool enc = size >= 16 && data[12] == 1;
    kv_session *s = NULL;
    kv_error e;
    kv_status st = kv_session_restore_fp(g_model, f, enc ? g_key : NULL, NULL, 0, &s, &e);
    fclose(f);
    if (st == KV_OK) {
        REQUIRE(s && kv_session_pos(s) <= kv_session_ctx(s));
        const int32_t *toks = kv_session_tokens(s);
        for (int i = 0; i < kv_session_pos(s); i++) REQUIRE(toks[i] >= 0 && toks[i] < 40);
        float logits[40];
        int32_t next = 3;
        if (kv_session_pos(s) < kv_session_ctx(s)) kv_session_eval(s, &next, 1, KV_LOGITS_LAST, logits, &e);
        kv_session_close(s);
    } else {
        REQUIRE(!s && e.msg[0]);
    }
    /* the same bytes as a cache file, into a cache that holds pages already */
    f = fmemopen((void *)data, size, "rb");
    if (!f) return 0;
    kv_cache *c = filled_cache(12, 9, 1);
    kv_cache_stats before, after;
    kv_cache_get_stats(c, &before);
    int64_t added = -1;
    st = kv_cache_restore_fp(c, f, enc ? g_key : NULL, &added, &e);
    fclose(f);
    kv_cache_get_stats(c, &after);
    if (st == KV_OK) {
        REQUIRE(added >= 0 && after.cached == before.cached + added && after.used == 0);
        kv_session_params sp = {.n_ctx = 64, .cache = c};
        if (kv_session_open_p(g_model, &sp, &s, &e) == KV_OK) {
            int32_t ids[24];
            for (int i = 0; i < 24; i++) ids[i] = (i * 5) % 40;
            kv_session_eval(s, ids, 24, KV_LOGITS_NONE, NULL, &e);
            kv_session_close(s);
        }
    } else {
        REQUIRE(e.msg[0] && added == 0 && memcmp(&before, &after, sizeof before) == 0);
    }
    kv_cache_close(c);
    return 0;
}
