/*
 * test_oom.c — allocation-failure injection over load, evaluation, forks,
 * session and cache files, page growth, pins and grammars, as SQLite tests
 * its allocator.
 *
 * The engine's calls to malloc, calloc, realloc, posix_memalign,
 * aligned_alloc, strdup, free, mmap, munmap, fopen, fdopen and fclose go
 * through the wrappers below (the test links with -Wl,--wrap=...: only the
 * engine's and this file's references are redirected, not libc's own).
 * Each scenario runs once to count its allocations N, then again for
 * k = 1..N with allocation k failing, and again with every allocation
 * from k on failing. Every API call is one step; a step that fails must
 *   - have had an allocation fail (no failure from anywhere else),
 *   - return an error status with a message, and NULL for what it opens,
 *   - leave every session and cache it touches as before the call
 *     (position, tokens, reused count, cache stats), and every cache
 *     consistent (page lists, counts and references match the sessions);
 * the step is then retried with injection off and the scenario goes on.
 * At the end of every run nothing the run allocated is still live (memory,
 * mappings, FILEs and file descriptors), no temporary file is left, and
 * what the scenario produced (logits, token ids, stats, pages added)
 * equals the run without failure. An allocation whose failure the engine
 * absorbs (the step succeeds: a word cache not grown, a page left unsealed
 * or without its token node) must still give the same logits, ids and text
 * and leave every cache consistent; its stats and page counts are then not
 * compared (an unsealed page is not shared, a page without its node is not
 * saved).
 *
 * ctest runs every third k (KV_OOM_STRIDE, default 3); KV_OOM_FULL=1 runs
 * every k. KV_OOM_VERBOSE=1 prints each absorbed failure.
 *
 * Findings (fixed):
 *   1. kv_cache_restore: slots unref'ed before they were set (crash).
 *   2. kv file streams: the cipher buffer leaked when the plain one failed.
 *   3. kv_session_eval, kv_prefill_batch: a failed call kept the reuse
 *      counters (hits, misses, reused tokens) it had raised.
 *   4. kv_vocab_load: out of memory finding the newline token gave a model
 *      with another nl instead of an error.
 *   5. kv_cache_pin: out of memory midway left the pages before it pinned.
 *   6. kv_grammar_mask: a limit (out of memory) met in the walk gave, and
 *      cached, a mask missing allowed tokens, with KV_OK.
 */
#define _GNU_SOURCE
#include "gguf_writer.h"
#include "grammar.h"
#include "kvlua.h"
#include "model_internal.h"
#include "quant.h"
#include "types.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

/* ==== the wrapped allocator ================================================== */

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t k);
void *__real_realloc(void *p, size_t n);
int __real_posix_memalign(void **p, size_t a, size_t n);
void *__real_aligned_alloc(size_t a, size_t n);
char *__real_strdup(const char *s);
void __real_free(void *p);
void *__real_mmap(void *a, size_t n, int prot, int flags, int fd, off_t off);
int __real_munmap(void *a, size_t n);
FILE *__real_fopen(const char *path, const char *mode);
FILE *__real_fdopen(int fd, const char *mode);
int __real_fclose(FILE *f);

enum { OOM_OFF, OOM_ONE, OOM_FROM };

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static bool g_track;      /* counting and tracking (inside a run) */
static int g_mode;        /* OOM_* */
static long g_count;      /* allocations counted this run */
static long g_fail_at;    /* the allocation that fails (OOM_ONE) or the first (OOM_FROM) */
static long g_injected;   /* failures given this run */
static void *g_inj_from;  /* the caller of the last one (KV_OOM_VERBOSE) */

/* Live allocations of the run: open addressing over the pointer values. */
#define LIVE_CAP (1 << 16)
static uintptr_t live_keys[LIVE_CAP]; /* 0: empty, 1: tombstone */
static int live_kind[LIVE_CAP];       /* 0 memory, 1 mapping, 2 FILE */
static void *live_from[LIVE_CAP];     /* the caller (KV_OOM_VERBOSE prints them) */
static void *g_from;                  /* the caller of the wrapper being run */
static long live_n;

static size_t live_slot(uintptr_t k) { return (size_t)((k >> 4) * 0x9E3779B97F4A7C15ull >> 48) & (LIVE_CAP - 1); }

static void live_add(const void *p, int kind) {
    if (!p) return;
    uintptr_t k = (uintptr_t)p;
    size_t j = live_slot(k);
    while (live_keys[j] > 1) j = (j + 1) & (LIVE_CAP - 1);
    live_keys[j] = k;
    live_kind[j] = kind;
    live_from[j] = g_from;
    live_n++;
}

static void live_del(const void *p) {
    if (!p) return;
    uintptr_t k = (uintptr_t)p;
    for (size_t j = live_slot(k), i = 0; live_keys[j] && i < LIVE_CAP; j = (j + 1) & (LIVE_CAP - 1), i++)
        if (live_keys[j] == k) {
            live_keys[j] = 1;
            live_n--;
            return;
        }
}

static void live_clear(void) {
    memset(live_keys, 0, sizeof live_keys);
    live_n = 0;
}

/* Counts one allocation; true when it is to fail. */
static bool inject(void) {
    if (!g_track) return false;
    long n = ++g_count;
    bool f = (g_mode == OOM_ONE && n == g_fail_at) || (g_mode == OOM_FROM && n >= g_fail_at);
    if (f) g_injected++, g_inj_from = g_from;
    return f;
}

#define LOCKED(x)                         \
    do {                                  \
        pthread_mutex_lock(&g_mu);        \
        x;                                \
        pthread_mutex_unlock(&g_mu);      \
    } while (0)

void *__wrap_malloc(size_t n) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = __real_malloc(n);
    LOCKED(g_from = __builtin_return_address(0); if (g_track) live_add(p, 0));
    return p;
}

void *__wrap_calloc(size_t n, size_t k) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = __real_calloc(n, k);
    LOCKED(g_from = __builtin_return_address(0); if (g_track) live_add(p, 0));
    return p;
}

void *__wrap_realloc(void *old, size_t n) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = __real_realloc(old, n);
    if (p || n == 0)
        LOCKED(g_from = __builtin_return_address(0); if (g_track) {
            bool was = false;
            uintptr_t k = (uintptr_t)old;
            for (size_t j = live_slot(k), i = 0; old && live_keys[j] && i < LIVE_CAP; j = (j + 1) & (LIVE_CAP - 1), i++)
                if (live_keys[j] == k) was = true;
            live_del(old);
            /* a block from before the run keeps being the caller's: not counted as new */
            if (was || !old) live_add(p, 0);
        });
    return p;
}

int __wrap_posix_memalign(void **out, size_t a, size_t n) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) return ENOMEM;
    int r = __real_posix_memalign(out, a, n);
    LOCKED(g_from = __builtin_return_address(0); if (g_track && r == 0) live_add(*out, 0));
    return r;
}

void *__wrap_aligned_alloc(size_t a, size_t n) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = __real_aligned_alloc(a, n);
    LOCKED(g_from = __builtin_return_address(0); if (g_track) live_add(p, 0));
    return p;
}

char *__wrap_strdup(const char *s) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return NULL;
    }
    size_t n = strlen(s) + 1;
    char *p = __real_malloc(n);
    if (p) memcpy(p, s, n);
    LOCKED(g_from = __builtin_return_address(0); if (g_track) live_add(p, 0));
    return p;
}

void __wrap_free(void *p) {
    LOCKED(if (g_track) live_del(p));
    __real_free(p);
}

void *__wrap_mmap(void *a, size_t n, int prot, int flags, int fd, off_t off) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return MAP_FAILED;
    }
    void *p = __real_mmap(a, n, prot, flags, fd, off);
    LOCKED(g_from = __builtin_return_address(0); if (g_track && p != MAP_FAILED) live_add(p, 1));
    return p;
}

int __wrap_munmap(void *a, size_t n) {
    LOCKED(if (g_track) live_del(a));
    return __real_munmap(a, n);
}

FILE *__wrap_fopen(const char *path, const char *mode) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return NULL;
    }
    FILE *p = __real_fopen(path, mode);
    LOCKED(g_from = __builtin_return_address(0); if (g_track) live_add(p, 2));
    return p;
}

FILE *__wrap_fdopen(int fd, const char *mode) {
    bool f;
    LOCKED(g_from = __builtin_return_address(0); f = inject());
    if (f) {
        errno = ENOMEM;
        return NULL;
    }
    FILE *p = __real_fdopen(fd, mode);
    LOCKED(g_from = __builtin_return_address(0); if (g_track) live_add(p, 2));
    return p;
}

int __wrap_fclose(FILE *f) {
    LOCKED(if (g_track) live_del(f));
    return __real_fclose(f);
}

static int open_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

/* ==== tiny models ============================================================ */

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

static float frand(void) { /* uniform [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static char tmpdir[256];

static void add_f32(gw *w, const char *name, int64_t cols, int64_t rows, float scale, float offset) {
    int64_t nr = rows ? rows : 1;
    float *f = malloc(sizeof(float) * (size_t)(cols * nr));
    for (int64_t i = 0; i < cols * nr; i++) f[i] = offset + scale * frand();
    int64_t ne[2] = {cols, nr};
    gw_tensor(w, name, rows ? 2 : 1, ne, KV_TYPE_F32, f);
    free(f);
}

enum { N_VOCAB = 64 };

/* A gpt2-style vocabulary of N_VOCAB tokens: a..z, space and newline, a few
 * merges toward "hello" and " world", fillers, and an end token. */
static void add_vocab(gw *w) {
    static const char *const merged[] = {"he", "ll", "hell", "hello", "\xc4\xa0w", "or", "\xc4\xa0wor", "ld",
                                         "\xc4\xa0world"};
    static const char *const merges[] = {"h e", "l l", "he ll", "hell o", "\xc4\xa0 w", "o r", "\xc4\xa0w or",
                                         "l d", "\xc4\xa0wor ld"};
    char store[N_VOCAB][16];
    const char *toks[N_VOCAB];
    int32_t types[N_VOCAB];
    int n = 0;
    for (char ch = 'a'; ch <= 'z'; ch++) snprintf(store[n], 16, "%c", ch), toks[n] = store[n], n++;
    toks[n++] = "\xc4\xa0";
    toks[n++] = "\xc4\x8a"; /* "\n": the vocabulary's newline token */
    for (size_t i = 0; i < sizeof merged / sizeof *merged; i++) toks[n++] = merged[i];
    while (n < N_VOCAB - 1) snprintf(store[n], 16, "%d", n), toks[n] = store[n], n++;
    toks[n++] = "<|endoftext|>";
    for (int i = 0; i < N_VOCAB; i++) types[i] = i == N_VOCAB - 1 ? 3 : 1;
    gw_kv_str(w, "tokenizer.ggml.model", "gpt2");
    gw_kv_str(w, "tokenizer.ggml.pre", "gpt-2");
    gw_kv_arr_str(w, "tokenizer.ggml.tokens", toks, N_VOCAB);
    gw_kv_arr(w, "tokenizer.ggml.token_type", KV_GGUF_I32, types, N_VOCAB);
    gw_kv_arr_str(w, "tokenizer.ggml.merges", merges, sizeof merges / sizeof *merges);
    gw_kv_u32(w, "tokenizer.ggml.eos_token_id", N_VOCAB - 1);
}

/* llama (2 layers, GQA 4:2, with the vocabulary) or gemma3 (3 layers, two
 * of them with a window of 5: two layer groups). */
static const char *write_model(const char *arch, const char *fname) {
    static char paths[2][512];
    char *path = paths[strcmp(arch, "llama") != 0];
    snprintf(path, 512, "%s/%s.gguf", tmpdir, fname);
    const bool gemma = strcmp(arch, "gemma3") == 0;
    const int L = gemma ? 3 : 2, E = 64, H = 4, KH = gemma ? 1 : 2, hd = gemma ? 32 : 16, F = 96;
    gw *w = gw_new(3);
    char k[128], nm[96];
#define AK(s) (snprintf(k, sizeof k, "%s.%s", arch, s), k)
    gw_kv_str(w, "general.architecture", arch);
    gw_kv_u32(w, AK("block_count"), (uint32_t)L);
    gw_kv_u32(w, AK("context_length"), 4096);
    gw_kv_u32(w, AK("embedding_length"), E);
    gw_kv_u32(w, AK("feed_forward_length"), F);
    gw_kv_u32(w, AK("attention.head_count"), H);
    gw_kv_u32(w, AK("attention.head_count_kv"), (uint32_t)KH);
    if (hd != E / H) {
        gw_kv_u32(w, AK("attention.key_length"), (uint32_t)hd);
        gw_kv_u32(w, AK("attention.value_length"), (uint32_t)hd);
    }
    gw_kv_f32(w, AK("attention.layer_norm_rms_epsilon"), 1e-5f);
    gw_kv_f32(w, AK("rope.freq_base"), 10000.0f);
    if (gemma) {
        gw_kv_u32(w, AK("attention.sliding_window"), 5);
        gw_kv_u32(w, AK("attention.sliding_window_pattern"), 3);
    } else {
        add_vocab(w);
    }
#undef AK
    const float ws = 1.0f / sqrtf((float)E);
    add_f32(w, "token_embd.weight", E, N_VOCAB, gemma ? 0.1f : 1.0f, 0);
    add_f32(w, "output_norm.weight", E, 0, 0.1f, 1.0f);
    if (!gemma) add_f32(w, "output.weight", E, N_VOCAB, ws, 0);
#define LN(s) (snprintf(nm, sizeof nm, "blk.%d.%s", il, s), nm)
    for (int il = 0; il < L; il++) {
        add_f32(w, LN("attn_norm.weight"), E, 0, 0.1f, 1.0f);
        add_f32(w, LN("attn_q.weight"), E, H * hd, ws, 0);
        add_f32(w, LN("attn_k.weight"), E, KH * hd, ws, 0);
        add_f32(w, LN("attn_v.weight"), E, KH * hd, ws, 0);
        add_f32(w, LN("attn_output.weight"), H * hd, E, 1.0f / sqrtf((float)(H * hd)), 0);
        if (gemma) {
            add_f32(w, LN("attn_q_norm.weight"), hd, 0, 0.1f, 1.0f);
            add_f32(w, LN("attn_k_norm.weight"), hd, 0, 0.1f, 1.0f);
            add_f32(w, LN("post_attention_norm.weight"), E, 0, 0.1f, 1.0f);
            add_f32(w, LN("post_ffw_norm.weight"), E, 0, 0.1f, 1.0f);
        }
        add_f32(w, LN("ffn_norm.weight"), E, 0, 0.1f, 1.0f);
        add_f32(w, LN("ffn_gate.weight"), E, F, ws, 0);
        add_f32(w, LN("ffn_up.weight"), E, F, ws, 0);
        add_f32(w, LN("ffn_down.weight"), F, E, 1.0f / sqrtf((float)F), 0);
    }
#undef LN
    uint8_t *buf;
    size_t len;
    int rc = gw_finish(w, &buf, &len);
    gw_free(w);
    if (rc != 0) return NULL;
    rc = gw_write_file(path, buf, len);
    free(buf);
    return rc == 0 ? path : NULL;
}

/* ==== runs, steps and checks ================================================= */

/* What a run produced, compared with the run without failure. */
typedef struct {
    uint8_t bytes[1 << 16]; /* logits, token ids, text: always the same */
    size_t n;
    uint8_t stats[4096];    /* stats and page counts: the same unless a failure was absorbed */
    size_t n_stats;
    int absorbed; /* steps that succeeded although an allocation failed in them */
} result;

static void keep_to(uint8_t *buf, size_t cap, size_t *n, const void *p, size_t k) {
    if (*n + k > cap) {
        report(false, "result buffer", "too small for %zu more bytes", k);
        return;
    }
    memcpy(buf + *n, p, k);
    *n += k;
}

static void keep(result *r, const void *p, size_t n) { keep_to(r->bytes, sizeof r->bytes, &r->n, p, n); }
static void keep_count(result *r, const void *p, size_t n) { keep_to(r->stats, sizeof r->stats, &r->n_stats, p, n); }

/* The state of what a step may touch. */
#define MAX_WATCH 6
typedef struct {
    kv_session **sess[MAX_WATCH];
    kv_cache **caches[MAX_WATCH];
    int n_sess, n_caches;
} watch;

typedef struct {
    int pos;
    uint64_t reused, tok_hash;
    kv_cache_stats st;
} sess_snap;

typedef struct {
    sess_snap s[MAX_WATCH];
    kv_cache_stats c[MAX_WATCH];
} snap;

static uint64_t hash_ids(const int32_t *ids, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)ids[i]) * 1099511628211ull;
    return h;
}

static void snap_take(const watch *w, snap *s) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < w->n_sess; i++) {
        kv_session *x = *w->sess[i];
        if (!x) continue;
        s->s[i].pos = kv_session_pos(x);
        s->s[i].reused = kv_session_reused_tokens(x);
        s->s[i].tok_hash = hash_ids(kv_session_tokens(x), s->s[i].pos);
        kv_cache_get_stats(kv_session_cache(x), &s->s[i].st);
    }
    for (int i = 0; i < w->n_caches; i++)
        if (*w->caches[i]) kv_cache_get_stats(*w->caches[i], &s->c[i]);
}

/* Stats that must not move under a failed step. A private pool's storage
 * (pages, free) may have grown by a slab before the failure: capacity, not
 * content. */
static bool stats_same(const kv_cache_stats *a, const kv_cache_stats *b, char *why, size_t cap) {
    const bool priv = a->capacity_bytes == 0;
#define F(x)                                                                                               \
    if (a->x != b->x) {                                                                                    \
        snprintf(why, cap, "%s %lld -> %lld", #x, (long long)a->x, (long long)b->x);                       \
        return false;                                                                                      \
    }
    F(used) F(cached) F(pinned) F(hits) F(misses) F(reused_tokens) F(evictions) F(bytes) F(capacity_bytes)
    if (!priv) {
        F(pages) F(free)
    }
#undef F
    return true;
}

static bool snap_same(const watch *w, const snap *a, const snap *b, char *why, size_t cap) {
    for (int i = 0; i < w->n_sess; i++) {
        if (!*w->sess[i]) continue;
        const sess_snap *x = &a->s[i], *y = &b->s[i];
        if (x->pos != y->pos || x->tok_hash != y->tok_hash || x->reused != y->reused) {
            snprintf(why, cap, "session %d: pos %d -> %d, reused %llu -> %llu%s", i, x->pos, y->pos,
                     (unsigned long long)x->reused, (unsigned long long)y->reused,
                     x->tok_hash != y->tok_hash ? ", tokens differ" : "");
            return false;
        }
        char sub[200];
        if (!stats_same(&x->st, &y->st, sub, sizeof sub)) {
            snprintf(why, cap, "session %d's cache: %s", i, sub);
            return false;
        }
    }
    for (int i = 0; i < w->n_caches; i++) {
        char sub[200];
        if (*w->caches[i] && !stats_same(&a->c[i], &b->c[i], sub, sizeof sub)) {
            snprintf(why, cap, "cache %d: %s", i, sub);
            return false;
        }
    }
    return true;
}

/* A cache's bookkeeping agrees with itself and with the page tables of the
 * watched sessions that use it (they must be all its sessions). */
static bool cache_consistent(const watch *w, const kv_cache *c, char *why, size_t cap) {
    for (int g = 0; g < c->n_groups; g++) {
        const kv_group *G = &c->groups[g];
        int n_free = 0, n_cached = 0, n_used = 0, n_sealed = 0;
        for (int32_t id = G->free_head; id >= 0 && n_free <= G->n_pages; id = G->pages[id].lru_next) n_free++;
        for (int32_t id = G->lru_head; id >= 0 && n_cached <= G->n_pages; id = G->pages[id].lru_next) n_cached++;
        for (int32_t id = 0; id < G->n_pages; id++) {
            const kv_page *p = &G->pages[id];
            n_used += p->ref > 0;
            if (p->state == KV_PAGE_SEALED) {
                n_sealed++;
                if (kv_pool_find(c, g, &p->hash) != id) {
                    snprintf(why, cap, "group %d: sealed page %d not in the index", g, (int)id);
                    return false;
                }
            }
            if (p->state == KV_PAGE_FREE && p->ref != 0) {
                snprintf(why, cap, "group %d: free page %d referenced", g, (int)id);
                return false;
            }
            int refs = 0;
            for (int i = 0; i < w->n_sess; i++) {
                const kv_session *s = *w->sess[i];
                if (!s || s->kv->pool != c) continue;
                for (int lp = 0; lp < s->kv->n_lp; lp++) refs += s->kv->tab[g][lp] == id;
            }
            if (refs != p->ref) {
                snprintf(why, cap, "group %d: page %d has %d references, the sessions hold %d", g, (int)id,
                         (int)p->ref, refs);
                return false;
            }
        }
        if (n_free != G->n_free || n_cached != G->n_cached || n_used != G->n_used ||
            n_free + n_cached + n_used != G->n_pages || (size_t)n_sealed != G->index.n) {
            snprintf(why, cap, "group %d: lists free %d/%d cached %d/%d used %d/%d of %d, %d sealed, index %zu", g,
                     n_free, (int)G->n_free, n_cached, (int)G->n_cached, n_used, (int)G->n_used, (int)G->n_pages,
                     n_sealed, G->index.n);
            return false;
        }
    }
    return true;
}

static bool all_consistent(const watch *w, char *why, size_t cap) {
    for (int i = 0; i < w->n_sess; i++)
        if (*w->sess[i] && !cache_consistent(w, kv_session_cache(*w->sess[i]), why, cap)) return false;
    for (int i = 0; i < w->n_caches; i++)
        if (*w->caches[i] && !cache_consistent(w, *w->caches[i], why, cap)) return false;
    return true;
}

/* The run in progress. */
static char g_label[128];   /* "scenario, k = 5 (one)" */
static bool g_run_ok;       /* no check failed this run */
static bool g_verbose;
static result *g_res;

static void run_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void run_fail(const char *fmt, ...) {
    char msg[700];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (g_run_ok) report(false, g_label, "%s", msg); /* the first failure of a run */
    g_run_ok = false;
}

static kv_error E;

/* After a step: st its status, inj0 the injections before it, out what it
 * opens (or NULL). On failure: the checks above, then the step is retried
 * with injection off (the caller does that). */
static bool step_after(kv_status st, long inj0, void *out, const watch *w, const snap *before, const char *what,
                       int line) {
    long inj;
    LOCKED(inj = g_injected);
    char why[300];
    if (st == KV_OK) {
        if (inj > inj0) {
            g_res->absorbed++;
            if (g_verbose) printf("  absorbed: %s: line %d: %s (allocation from %p)\n", g_label, line, what, g_inj_from);
            if (!all_consistent(w, why, sizeof why)) run_fail("line %d: %s absorbed a failure: %s", line, what, why);
        }
        return true;
    }
    if (inj == inj0) run_fail("line %d: %s failed without an injected failure: %s", line, what, E.msg);
    else if (!E.msg[0]) run_fail("line %d: %s failed with no message", line, what);
    if (out) run_fail("line %d: %s failed but gave an object", line, what);
    snap now;
    snap_take(w, &now);
    if (!snap_same(w, before, &now, why, sizeof why))
        run_fail("line %d: %s failed (%s) and changed state: %s", line, what, E.msg, why);
    if (!all_consistent(w, why, sizeof why)) run_fail("line %d: %s failed (%s): %s", line, what, E.msg, why);
    LOCKED(g_mode = OOM_OFF);
    return false;
}

/* One API call as a step; `out` is what it opens (a kv_session * or
 * kv_cache * variable set to NULL first), or none. */
#define STEP_OUT(out, call)                                                                        \
    do {                                                                                           \
        snap b_;                                                                                   \
        snap_take(W, &b_);                                                                         \
        memset(&E, 0, sizeof E);                                                                   \
        long i_;                                                                                   \
        LOCKED(i_ = g_injected);                                                                   \
        kv_status s_ = (call);                                                                     \
        if (!step_after(s_, i_, (out), W, &b_, #call, __LINE__)) {                                 \
            memset(&E, 0, sizeof E);                                                               \
            s_ = (call);                                                                           \
            if (s_ != KV_OK) {                                                                     \
                run_fail("line %d: %s failed again with injection off: %s", __LINE__, #call, E.msg); \
                return;                                                                            \
            }                                                                                      \
        }                                                                                          \
    } while (0)
#define STEP(call) STEP_OUT(NULL, call)

/* ==== scenarios ================================================================ */

static const char *g_llama, *g_gemma; /* model files */
static kv_model *g_ml, *g_mg;        /* opened once, outside the runs */
static char g_path1[600], g_path2[600], g_vocab[600];
static const uint8_t KEY[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
static float g_lg[64 * N_VOCAB];

static void ids_of(int32_t *ids, int n, int seed) {
    for (int i = 0; i < n; i++) ids[i] = (int32_t)((i * 7 + seed * 13 + i * i) % (N_VOCAB - 1));
}

static void keep_stats(kv_cache *c) {
    kv_cache_stats st;
    kv_cache_get_stats(c, &st);
    keep_count(g_res, &st, sizeof st);
}

/* What a load gives, field by field (a struct's padding is not compared). */
static void keep_model(const kv_model *m) {
    const kv_model_info *in = kv_model_info_get(m);
    const int64_t f[] = {in->n_layer, in->n_embd, in->n_head, in->n_head_kv, in->head_dim, in->head_dim_v,
                         in->n_ff, in->n_ctx_train, in->n_vocab, in->sliding_window, in->file_type,
                         (int64_t)in->n_params, (int64_t)in->size_bytes, in->has_weights, in->threads};
    keep(g_res, f, sizeof f);
    keep(g_res, in->arch, strlen(in->arch));
    const kv_vocab *v = kv_model_vocab(m);
    const kv_vocab_special *sp = v ? kv_vocab_specials(v) : NULL;
    if (!sp) return;
    const int32_t t[] = {kv_vocab_n(v), sp->bos, sp->eos, sp->eot, sp->eom, sp->unk, sp->pad, sp->sep, sp->nl,
                         sp->mask, sp->add_bos, sp->add_eos, sp->add_space_prefix};
    keep(g_res, t, sizeof t);
}

/* Model load (with a vocabulary and a thread pool), tokenize, detokenize. */
static void scen_load(void) {
    kv_model *m = NULL;
    watch w0 = {0}, *W = &w0;
    kv_model_params p = {.threads = 2};
    STEP_OUT(m, kv_model_open(g_llama, &p, &m, &E));
    keep_model(m);
    int32_t *ids = NULL;
    size_t n = 0;
    STEP(kv_tokenize(kv_model_vocab(m), "hello world hello", 17, true, false, &ids, &n, &E));
    keep(g_res, ids, n * sizeof *ids);
    char *text = NULL;
    size_t len = 0;
    STEP(kv_detokenize(kv_model_vocab(m), ids, n, false, false, &text, &len, &E));
    keep(g_res, text, len);
    free(ids);
    free(text);
    /* the first evaluation: the backend's tables (rope, attention) */
    kv_session *s = NULL;
    W->sess[0] = &s, W->n_sess = 1;
    int32_t t[24];
    ids_of(t, 24, 7);
    STEP_OUT(s, kv_session_open(m, 32, &s, &E));
    STEP(kv_session_eval(s, t, 23, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_session_eval(s, t + 23, 1, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    kv_session_close(s);
    kv_model_close(m);
}

/* A vocabulary-only file (no weights): the loader's other path. */
static void scen_load_vocab(void) {
    kv_model *m = NULL;
    watch w0 = {0}, *W = &w0;
    kv_model_params p = {.threads = 1};
    STEP_OUT(m, kv_model_open(g_vocab, &p, &m, &E));
    keep_model(m);
    kv_model_close(m);
}

/* A session with its private pool: prefill, decode, rewind, shift, fork
 * (copy-on-write pages: the pool grows by a slab). */
static void scen_session(void) {
    kv_session *s = NULL, *f = NULL;
    watch w0 = {.sess = {&s, &f}, .n_sess = 2}, *W = &w0;
    int32_t ids[40];
    ids_of(ids, 40, 1);
    STEP_OUT(s, kv_session_open(g_ml, 64, &s, &E));
    STEP(kv_session_eval(s, ids, 20, KV_LOGITS_ALL, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * 20 * N_VOCAB);
    for (int i = 20; i < 24; i++) {
        STEP(kv_session_eval(s, ids + i, 1, KV_LOGITS_LAST, g_lg, &E));
        keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    }
    kv_session_rewind(s, 3);
    STEP(kv_session_eval(s, ids + 21, 3, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP_OUT(f, kv_session_fork(s, &f, &E));
    STEP(kv_session_eval(f, ids + 30, 6, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_session_eval(s, ids + 24, 2, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_session_shift(s, 4, 8, &E));
    STEP(kv_session_eval(s, ids + 5, 1, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    keep_stats(kv_session_cache(s));
    kv_session_close(f);
    f = NULL;
    kv_session_close(s);
}

static kv_status evict_oldest(void *ud, const kv_evict_candidate *cands, int n, int need, int32_t *chosen,
                              int *n_chosen, kv_error *e) {
    (void)ud, (void)e;
    int k = 0;
    for (int i = 0; i < n && k < need; i++) chosen[k++] = cands[i].id;
    *n_chosen = k;
    return KV_OK;
}

/* A shared cache with prefix reuse and two layer groups: sessions, a fork,
 * reuse, lookup, pins, batches, eviction through a
 * policy once it is full. */
static void scen_shared(void) {
    kv_cache *c = NULL;
    kv_session *a = NULL, *f = NULL, *b = NULL;
    watch w0 = {.sess = {&a, &f, &b}, .n_sess = 3, .caches = {&c}, .n_caches = 1}, *W = &w0;
    int32_t ids[48], alt[48];
    ids_of(ids, 48, 2);
    ids_of(alt, 48, 5);
    kv_cache_params cp = {.pages = 24, .page_tokens = 4, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    STEP_OUT(c, kv_cache_open(g_mg, &cp, &c, &E));
    kv_session_params sp = {.n_ctx = 64, .cache = c};
    STEP_OUT(a, kv_session_open_p(g_mg, &sp, &a, &E));
    STEP(kv_session_eval(a, ids, 22, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP_OUT(f, kv_session_fork(a, &f, &E));
    STEP(kv_session_eval(f, alt, 3, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_cache_pin(c, ids, 8, true, &E));
    STEP_OUT(b, kv_session_open_p(g_mg, &sp, &b, &E));
    STEP(kv_session_eval(b, ids, 26, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    int64_t cached = -1;
    const char *why = NULL;
    STEP(kv_cache_lookup(c, ids, 30, &cached, &why, &E));
    keep_count(g_res, &cached, sizeof cached);
    {
        kv_session *ss[3] = {a, f, b};
        int32_t next[3] = {alt[10], alt[11], alt[12]};
        STEP(kv_decode_batch(ss, next, 3, g_lg, &E));
        keep(g_res, g_lg, sizeof(float) * 3 * N_VOCAB);
        const int32_t *pi[2] = {alt + 20, ids + 30};
        const size_t pn[2] = {5, 7};
        float *pl[2] = {g_lg, g_lg + N_VOCAB};
        kv_session *ps[2] = {a, b};
        STEP(kv_prefill_batch(ps, pi, pn, 2, KV_LOGITS_LAST, pl, &E));
        keep(g_res, g_lg, sizeof(float) * 2 * N_VOCAB);
    }
    STEP(kv_session_eval(b, ids + 37, 7, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    keep_stats(c);
    kv_session_close(f);
    f = NULL;
    kv_session_close(b);
    b = NULL;
    /* full: the next prefill evicts through the policy */
    kv_cache_set_policy(c, evict_oldest, NULL);
    STEP_OUT(b, kv_session_open_p(g_mg, &sp, &b, &E));
    STEP(kv_session_eval(b, alt, 40, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_cache_pin(c, ids, 8, false, &E));
    keep_stats(c);
    kv_session_close(b);
    b = NULL;
    kv_session_close(a);
    a = NULL;
    kv_cache_close(c);
}

/* Session files, plain and encrypted: save, restore into a private pool and
 * into a cache, evaluate on. */
static void scen_session_file(void) {
    kv_session *s = NULL, *r1 = NULL, *r2 = NULL;
    kv_cache *c = NULL;
    watch w0 = {.sess = {&s, &r1, &r2}, .n_sess = 3, .caches = {&c}, .n_caches = 1}, *W = &w0;
    int32_t ids[24];
    ids_of(ids, 24, 3);
    STEP_OUT(s, kv_session_open(g_mg, 48, &s, &E));
    STEP(kv_session_eval(s, ids, 21, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_session_save(s, g_path1, NULL, &E));
    STEP(kv_session_save(s, g_path2, KEY, &E));
    kv_session_close(s);
    s = NULL;
    STEP_OUT(r1, kv_session_restore(g_mg, g_path1, NULL, NULL, 0, &r1, &E));
    STEP(kv_session_eval(r1, ids + 21, 2, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    kv_cache_params cp = {.pages = 32, .page_tokens = 16, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    STEP_OUT(c, kv_cache_open(g_mg, &cp, &c, &E));
    STEP_OUT(r2, kv_session_restore(g_mg, g_path2, KEY, c, 0, &r2, &E));
    STEP(kv_session_eval(r2, ids + 21, 2, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    keep_stats(c);
    kv_session_close(r1);
    r1 = NULL;
    kv_session_close(r2);
    r2 = NULL;
    kv_cache_close(c);
}

/* Cache files: save every page (plain) and two prefixes (encrypted),
 * restore them into other caches, reuse the restored pages. */
static void scen_cache_file(void) {
    kv_cache *a = NULL, *b = NULL, *c = NULL;
    kv_session *s = NULL;
    watch w0 = {.sess = {&s}, .n_sess = 1, .caches = {&a, &b, &c}, .n_caches = 3}, *W = &w0;
    int32_t ids[41];
    ids_of(ids, 41, 4);
    kv_cache_params cp = {.pages = 40, .page_tokens = 4, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    STEP_OUT(a, kv_cache_open(g_mg, &cp, &a, &E));
    kv_session_params sp = {.n_ctx = 64, .cache = a};
    STEP_OUT(s, kv_session_open_p(g_mg, &sp, &s, &E));
    STEP(kv_session_eval(s, ids, 40, KV_LOGITS_NONE, NULL, &E));
    kv_session_close(s);
    s = NULL;
    int64_t n = -1;
    STEP(kv_cache_save(a, g_path1, NULL, NULL, NULL, 0, &n, &E));
    keep_count(g_res, &n, sizeof n);
    const int32_t *pre[2] = {ids, ids};
    const size_t lens[2] = {13, 30};
    STEP(kv_cache_save(a, g_path2, KEY, pre, lens, 2, &n, &E));
    keep_count(g_res, &n, sizeof n);
    STEP_OUT(b, kv_cache_open(g_mg, &cp, &b, &E));
    STEP(kv_cache_restore(b, g_path1, NULL, &n, &E));
    keep_count(g_res, &n, sizeof n);
    STEP_OUT(c, kv_cache_open(g_mg, &cp, &c, &E));
    STEP(kv_cache_restore(c, g_path2, KEY, &n, &E));
    keep_count(g_res, &n, sizeof n);
    keep_stats(b);
    keep_stats(c);
    sp.cache = b;
    STEP_OUT(s, kv_session_open_p(g_mg, &sp, &s, &E));
    STEP(kv_session_eval(s, ids, 41, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    uint64_t reused = kv_session_reused_tokens(s);
    keep_count(g_res, &reused, sizeof reused);
    kv_session_close(s);
    s = NULL;
    kv_cache_close(a);
    kv_cache_close(b);
    kv_cache_close(c);
}

/* A private pool that grows slab by slab: a long context, forks writing
 * into shared pages. */
static void scen_growth(void) {
    kv_session *s = NULL, *f1 = NULL, *f2 = NULL;
    watch w0 = {.sess = {&s, &f1, &f2}, .n_sess = 3}, *W = &w0;
    int32_t ids[200];
    ids_of(ids, 200, 6);
    STEP_OUT(s, kv_session_open(g_ml, 40, &s, &E));
    STEP(kv_session_eval(s, ids, 35, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP_OUT(f1, kv_session_fork(s, &f1, &E));
    STEP_OUT(f2, kv_session_fork(s, &f2, &E));
    kv_session_rewind(f1, 20);
    kv_session_rewind(f2, 12);
    STEP(kv_session_eval(f1, ids + 100, 20, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_session_eval(f2, ids + 150, 15, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    STEP(kv_session_eval(s, ids + 35, 5, KV_LOGITS_LAST, g_lg, &E));
    keep(g_res, g_lg, sizeof(float) * N_VOCAB);
    keep_stats(kv_session_cache(s));
    kv_session_close(f1);
    f1 = NULL;
    kv_session_close(f2);
    f2 = NULL;
    kv_session_close(s);
}

/* Pins over many pages (the pin table grows midway), unpinned again. */
static void scen_pins(void) {
    kv_cache *c = NULL;
    kv_session *s = NULL;
    watch w0 = {.sess = {&s}, .n_sess = 1, .caches = {&c}, .n_caches = 1}, *W = &w0;
    int32_t ids[60];
    ids_of(ids, 60, 8);
    kv_cache_params cp = {.pages = 80, .page_tokens = 1, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    STEP_OUT(c, kv_cache_open(g_ml, &cp, &c, &E));
    kv_session_params sp = {.n_ctx = 64, .cache = c};
    STEP_OUT(s, kv_session_open_p(g_ml, &sp, &s, &E));
    STEP(kv_session_eval(s, ids, 60, KV_LOGITS_NONE, NULL, &E));
    kv_session_close(s);
    s = NULL;
    STEP(kv_cache_pin(c, ids, 60, true, &E));
    keep_stats(c);
    STEP(kv_cache_pin(c, ids, 60, false, &E));
    keep_stats(c);
    kv_cache_close(c);
}

/* A grammar over the llama model's vocabulary: compile, the vocabulary's
 * trie, a matcher, masks and accepted tokens (the automaton's states are
 * made as they are reached). */
static void scen_grammar(void) {
    kv_grammar *g = NULL;
    kv_grammar_vocab *gv = NULL;
    kv_grammar_matcher *m = NULL;
    watch w0 = {0}, *W = &w0;
    static const char src[] = "root ::= greet (\" \" greet)*\ngreet ::= \"hello\" | \"world\" | [a-f]+ \"z\"\n";
    STEP_OUT(g, kv_grammar_compile(src, sizeof src - 1, NULL, &g, &E));
    STEP_OUT(gv, kv_grammar_vocab_build(kv_model_vocab(g_ml), &gv, &E));
    STEP_OUT(m, kv_grammar_matcher_new(g, gv, &m, &E));
    kv_grammar_state st;
    STEP(kv_grammar_start(m, &st, &E));
    const char *const text[] = {"hello", "\xc4\xa0w", "or", "ld", "\xc4\xa0", "a", "b", "z"};
    for (size_t i = 0; i <= sizeof text / sizeof *text; i++) {
        const uint32_t *bits = NULL;
        int32_t n = -1;
        STEP(kv_grammar_mask(m, &st, &bits, &n, &E));
        keep(g_res, &n, sizeof n);
        keep(g_res, bits, (N_VOCAB + 31) / 32 * sizeof *bits);
        if (i == sizeof text / sizeof *text) break;
        int32_t id = -1;
        for (int32_t t = 0; t < N_VOCAB && id < 0; t++) {
            size_t len = 0;
            const char *tt = kv_vocab_text(kv_model_vocab(g_ml), t, &len);
            if (len == strlen(text[i]) && memcmp(tt, text[i], len) == 0) id = t;
        }
        STEP(kv_grammar_accept_token(m, &st, id, &E));
    }
    const bool end = kv_grammar_can_end(m, &st);
    keep(g_res, &end, sizeof end);
    kv_grammar_matcher_free(m);
    kv_grammar_vocab_free(gv);
    kv_grammar_free(g);
}

/* ==== the driver ================================================================ */

static result g_base, g_cur;

/* One run of fn; mode/at: the injection. Returns the allocations counted. */
static long run_once(void (*fn)(void), int mode, long at, result *r) {
    memset(r, 0, sizeof *r);
    g_res = r;
    g_run_ok = true;
    unlink(g_path1);
    unlink(g_path2);
    int fds = open_fds();
    LOCKED(live_clear(); g_count = 0; g_injected = 0; g_mode = mode; g_fail_at = at; g_track = true);
    fn();
    long count, live;
    LOCKED(g_track = false; g_mode = OOM_OFF; count = g_count; live = live_n);
    if (live) {
        int kinds[3] = {0};
        for (size_t j = 0; j < LIVE_CAP; j++)
            if (live_keys[j] > 1) kinds[live_kind[j]]++;
        run_fail("%ld allocations left live (%d blocks, %d mappings, %d FILEs)", live, kinds[0], kinds[1], kinds[2]);
        for (size_t j = 0; g_verbose && j < LIVE_CAP; j++)
            if (live_keys[j] > 1) printf("  live: allocated from %p\n", live_from[j]);
    }
    if (open_fds() != fds) run_fail("%d file descriptors open before, %d after", fds, open_fds());
    /* no temporary file of a save left beside the targets */
    DIR *d = opendir(tmpdir);
    for (struct dirent *de; d && (de = readdir(d));)
        if (strstr(de->d_name, "kvlua-tmp")) run_fail("temporary file %s left behind", de->d_name);
    if (d) closedir(d);
    return count;
}

static void scenario(const char *name, void (*fn)(void), long stride) {
    snprintf(g_label, sizeof g_label, "%s: without failures", name);
    long n = run_once(fn, OOM_OFF, 0, &g_base);
    if (!g_run_ok) return;
    if (g_base.absorbed) report(false, g_label, "a step absorbed a failure with none injected");
    int bad = 0, absorbed = 0;
    for (int mode = OOM_ONE; mode <= OOM_FROM; mode++)
        for (long k = 1; k <= n; k = k < n && k + stride > n ? n : k + stride) { /* the last k always */
            snprintf(g_label, sizeof g_label, "%s: allocation %ld of %ld %s", name, k, n,
                     mode == OOM_ONE ? "fails" : "and all after it fail");
            run_once(fn, mode, k, &g_cur);
            if (g_run_ok && (g_cur.n != g_base.n || memcmp(g_cur.bytes, g_base.bytes, g_base.n) != 0))
                run_fail("the logits, ids or text differ from the run without failures");
            if (g_run_ok && !g_cur.absorbed &&
                (g_cur.n_stats != g_base.n_stats || memcmp(g_cur.stats, g_base.stats, g_base.n_stats) != 0))
                run_fail("the stats or page counts differ from the run without failures");
            absorbed += g_cur.absorbed > 0;
            bad += !g_run_ok;
            if (bad >= 8) {
                printf("  (%s: more failures not shown)\n", name);
                return;
            }
        }
    snprintf(g_label, sizeof g_label, "%s: %ld allocations, each failing alone and from it on (stride %ld), "
             "%d runs absorbed one", name, n, stride, absorbed);
    report(bad == 0, g_label, "%d runs failed", bad);
}

int main(void) {
    const char *td = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/kvlua_test_oom_XXXXXX", td && *td ? td : "/tmp");
    if (!mkdtemp(tmpdir)) {
        printf("cannot create a temporary directory\n0 passed, 1 failed\n");
        return 1;
    }
    g_verbose = getenv("KV_OOM_VERBOSE") && atoi(getenv("KV_OOM_VERBOSE"));
    const char *full = getenv("KV_OOM_FULL"), *sv = getenv("KV_OOM_STRIDE");
    long stride = full && atoi(full) ? 1 : sv && atol(sv) > 0 ? atol(sv) : 3;
    snprintf(g_path1, sizeof g_path1, "%s/one.kv", tmpdir);
    snprintf(g_path2, sizeof g_path2, "%s/two.kv", tmpdir);
    g_llama = write_model("llama", "llama");
    g_gemma = write_model("gemma3", "gemma");
    kv_error e = {{0}};
    kv_model_params p = {.threads = 1};
    if (!g_llama || !g_gemma || kv_model_open(g_llama, &p, &g_ml, &e) || kv_model_open(g_gemma, &p, &g_mg, &e)) {
        report(false, "tiny models", "%s", e.msg);
        return kvt_finish();
    }
    /* what a model computes once and keeps for its life, first: the
     * fingerprint, the backend's rope table and attention state (at their
     * largest: a full chunk, a long decode); scen_load fails those too */
    kv_model *ms[2] = {g_ml, g_mg};
    for (int i = 0; i < 2; i++) {
        kv_model_fingerprint(ms[i], NULL, NULL, &e);
        kv_session *s = NULL;
        int32_t ids[KV_CHUNK + 1];
        ids_of(ids, KV_CHUNK + 1, 9);
        if (kv_session_open(ms[i], KV_CHUNK + 1, &s, &e) || kv_session_eval(s, ids, KV_CHUNK, KV_LOGITS_NONE, NULL, &e) ||
            kv_session_eval(s, ids + KV_CHUNK, 1, KV_LOGITS_LAST, g_lg, &e))
            report(false, "warm-up", "%s", e.msg);
        kv_session_close(s);
    }

    scenario("model load", scen_load, stride);
    {
        gw *w = gw_new(3);
        gw_kv_str(w, "general.architecture", "llama");
        add_vocab(w);
        uint8_t *buf;
        size_t len;
        if (gw_finish(w, &buf, &len) == 0) {
            snprintf(g_vocab, sizeof g_vocab, "%s/vocab.gguf", tmpdir);
            if (gw_write_file(g_vocab, buf, len) == 0) scenario("vocabulary-only load", scen_load_vocab, stride);
            free(buf);
        }
        gw_free(w);
    }
    scenario("session: prefill, decode, rewind, fork, shift", scen_session, stride);
    scenario("shared cache: reuse, fork, pins, batches, eviction", scen_shared, stride);
    scenario("session files: save, restore", scen_session_file, stride);
    scenario("cache files: save, restore", scen_cache_file, stride);
    scenario("private pool growth", scen_growth, stride);
    scenario("pins over many pages", scen_pins, stride);
    scenario("grammar: compile, masks, accepted tokens", scen_grammar, stride);

    kv_model_close(g_ml);
    kv_model_close(g_mg);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", tmpdir);
    return kvt_finish();
}
