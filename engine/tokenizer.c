/*
 * tokenizer.c — the vocabulary: GGUF tokenizer metadata in, token ids out,
 * and back. It implements the "vocabulary" section of kvlua.h.
 *
 * The goal is bit-identical ids with llama.cpp (src/llama-vocab.cpp) for the
 * two tokenizer families kvlua runs:
 *
 *   "llama" (SPM)  SentencePiece-style: spaces become U+2581 "▁", an
 *                  optional space prefix, then bigram merges by token score
 *                  over the whole fragment, byte-fallback <0xNN> tokens for
 *                  what no token covers.
 *   "gpt2"  (BPE)  byte-level BPE: a regex pre-tokenizer (pretok.h) splits
 *                  the text into words, each byte becomes a printable
 *                  codepoint (the GPT-2 byte-to-unicode table), then merges
 *                  by rank from tokenizer.ggml.merges.
 *
 * Before either, special tokens (control, user-defined, unknown) are cut
 * out of the text exactly as the reference's tokenizer_st_partition does:
 * longest token text first, leftmost non-overlapping occurrences. That pass
 * runs on a trie (to learn which special texts occur at all) plus memmem
 * per occurring text, so its cost grows with the text, not with the number
 * of special tokens times the text.
 *
 * Memory: one arena holds every token text (NUL-terminated), one open
 * addressing table maps text -> id, one maps a merge pair (left id, right
 * id) -> (rank, merged id). Merges are resolved to ids at load time, so the
 * BPE inner loop compares integers; the SPM loop hashes byte ranges of the
 * escaped text in place (no string copies).
 */
#define _GNU_SOURCE /* memmem, qsort_r */
#include "kvlua.h"
#include "pretok.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== attributes and limits ============================================== */

/* Internal attribute bits beyond the public KV_TOKEN_* ones (kvlua.h). */
enum {
    ATTR_PUBLIC = 0x3f,
    ATTR_LSTRIP = 1 << 7,
    ATTR_RSTRIP = 1 << 8,
};

enum { VT_SPM = 1, VT_BPE = 2 };

#define MAX_TOKENS 0x7fffffff
#define MAX_TEXT_LEN 0x3fffffffu /* a token text of a GiB is hostile */

/* ==== growable buffers ==================================================== */

typedef struct {
    int32_t *p;
    size_t n, cap;
} ivec;

static bool ivec_reserve(ivec *v, size_t extra) {
    if (extra <= v->cap - v->n) return true;
    if (extra > SIZE_MAX / 8 - v->n) return false;
    size_t cap = v->cap ? v->cap : 64;
    while (cap < v->n + extra) cap *= 2;
    int32_t *p = realloc(v->p, cap * sizeof *p);
    if (!p) return false;
    v->p = p;
    v->cap = cap;
    return true;
}

static bool ivec_push(ivec *v, int32_t x) {
    if (v->n == v->cap && !ivec_reserve(v, 1)) return false;
    v->p[v->n++] = x;
    return true;
}

typedef struct {
    char *p;
    size_t n, cap;
} sbuf;

static bool sbuf_reserve(sbuf *b, size_t extra) {
    if (extra <= b->cap - b->n) return true;
    if (extra > SIZE_MAX / 4 - b->n) return false;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return false;
    b->p = p;
    b->cap = cap;
    return true;
}

static bool sbuf_put(sbuf *b, const void *s, size_t n) {
    if (!sbuf_reserve(b, n)) return false;
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    return true;
}

/* ==== hashing ============================================================ */

static inline uint64_t rd64(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
}

static inline uint64_t mix64(uint64_t h) {
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ull;
    h ^= h >> 32;
    return h;
}

static uint64_t hash_bytes(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        h = (h ^ rd64(p)) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    if (n) {
        uint64_t t = 0;
        memcpy(&t, p, n);
        h = (h ^ t) * 0x94d049bb133111ebull;
    }
    return mix64(h);
}

/* ==== the vocabulary ===================================================== */

typedef struct {
    uint32_t tag; /* low 32 bits of the text hash */
    int32_t id;   /* -1: empty */
} tslot;

struct kv_vocab {
    int type;                 /* VT_SPM, VT_BPE */
    char model_name[16];      /* "llama", "gpt2" */
    char pre_name[64];        /* tokenizer.ggml.pre, or "default" */
    int pretok_kind;          /* BPE: kv_pretok_kind(pre_name) */
    int32_t n;                /* tokens */

    char *arena;              /* every token text, NUL-terminated */
    uint32_t *off, *len;      /* (n) text of token i: arena + off[i], len[i] bytes */
    float *score;             /* (n) */
    uint16_t *attr;           /* (n) KV_TOKEN_* | ATTR_LSTRIP | ATTR_RSTRIP */
    uint8_t *eog;             /* (n) 1 for end-of-generation tokens */

    uint32_t tmask;           /* text -> id table: (tmask + 1) slots */
    tslot *ttab;

    uint32_t mmask;           /* (left id, right id) -> merge: (mmask + 1) slots */
    uint64_t *mkey;           /* ((left << 32) | right) + 1; 0 = empty */
    int32_t *mrank, *mres;    /* rank, id of the merged text (-1: not a token) */

    kv_vocab_special sp;
    int32_t fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep;
    bool ignore_merges, clean_spaces, add_sep;

    uint8_t spm_nosplit[256]; /* SPM: 1 when some token holds that byte then "▁" */
    int32_t byte_tok[256];    /* SPM: <0xNN> (or the 1-byte text); BPE: the encoded byte; -1 */
    char benc[256][2];        /* BPE: GPT-2 byte -> codepoint, as UTF-8 */
    uint8_t benc_len[256];
    int16_t bdec[324];        /* codepoint -> byte, -1 when not a byte symbol */

    int32_t *spec;            /* special tokens, longest text first (ties: lower id) */
    size_t n_spec;
    uint8_t spec_first[256];  /* 1 when some special text starts with that byte */
    uint32_t trie_nodes;      /* trie over special texts; node 0 is the root */
    int32_t *trie_rank;       /* (trie_nodes) index into spec, or -1 */
    uint32_t emask;           /* edges: ((node << 8) | byte) + 1 -> child */
    uint32_t *ekey, *eval;
};

/* ---- text lookups ---- */

static int32_t lookup(const kv_vocab *v, const char *s, size_t n) {
    uint64_t h = hash_bytes(s, n);
    uint32_t tag = (uint32_t)h;
    for (uint32_t i = (uint32_t)(h >> 32) & v->tmask;; i = (i + 1) & v->tmask) {
        tslot t = v->ttab[i];
        if (t.id < 0) return -1;
        if (t.tag == tag && v->len[t.id] == n && memcmp(v->arena + v->off[t.id], s, n) == 0) return t.id;
    }
}

static int32_t lookup_cstr(const kv_vocab *v, const char *s) { return lookup(v, s, strlen(s)); }

static inline const char *tok_text(const kv_vocab *v, int32_t id) { return v->arena + v->off[id]; }

/* ---- merges ---- */

static inline uint32_t pair_slot(uint64_t key) { return (uint32_t)mix64(key * 0x9e3779b97f4a7c15ull); }

static int32_t merge_find(const kv_vocab *v, int32_t left, int32_t right, int32_t *res) {
    if (!v->mkey || left < 0 || right < 0) return -1;
    uint64_t key = (((uint64_t)(uint32_t)left << 32) | (uint32_t)right) + 1;
    for (uint32_t i = pair_slot(key) & v->mmask;; i = (i + 1) & v->mmask) {
        if (v->mkey[i] == 0) return -1;
        if (v->mkey[i] == key) {
            *res = v->mres[i];
            return v->mrank[i];
        }
    }
}

/* ==== UTF-8 as the reference reads it ===================================== */

/* Length announced by a lead byte; 1 for continuation and invalid bytes. */
static inline size_t u8len(unsigned char c) {
    static const uint8_t lut[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lut[c >> 4];
}

/* One codepoint at s[0..n); invalid -> U+FFFD consuming 1 byte. Overlong
 * forms and surrogates decode arithmetically (as the reference does). */
static uint32_t u8dec(const unsigned char *s, size_t n, size_t *adv) {
    unsigned char c = s[0];
    *adv = 1;
    if (!(c & 0x80)) return c;
    if (!(c & 0x40)) return 0xfffd;
    if (!(c & 0x20)) {
        if (n < 2 || (s[1] & 0xc0) != 0x80) return 0xfffd;
        *adv = 2;
        return ((uint32_t)(c & 0x1f) << 6) | (s[1] & 0x3f);
    }
    if (!(c & 0x10)) {
        if (n < 3 || (s[1] & 0xc0) != 0x80 || (s[2] & 0xc0) != 0x80) return 0xfffd;
        *adv = 3;
        return ((uint32_t)(c & 0x0f) << 12) | ((uint32_t)(s[1] & 0x3f) << 6) | (s[2] & 0x3f);
    }
    if (!(c & 0x08)) {
        if (n < 4 || (s[1] & 0xc0) != 0x80 || (s[2] & 0xc0) != 0x80 || (s[3] & 0xc0) != 0x80) return 0xfffd;
        *adv = 4;
        return ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[1] & 0x3f) << 12) |
               ((uint32_t)(s[2] & 0x3f) << 6) | (s[3] & 0x3f);
    }
    return 0xfffd;
}

/* Encodes cp (cp > 0x10FFFF, which the reference cannot encode, becomes
 * U+FFFD here instead of an exception). */
static size_t u8enc(uint32_t cp, char *o) {
    if (cp <= 0x7f) { o[0] = (char)cp; return 1; }
    if (cp <= 0x7ff) { o[0] = (char)(0xc0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp <= 0xffff) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    if (cp <= 0x10ffff) {
        o[0] = (char)(0xf0 | (cp >> 18));
        o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[3] = (char)(0x80 | (cp & 0x3f));
        return 4;
    }
    return u8enc(0xfffd, o);
}

size_t kv_utf8_complete_prefix(const char *buf, size_t n) {
    if (!buf) return 0;
    const unsigned char *s = (const unsigned char *)buf;
    /* find the last lead byte among the last 4 bytes */
    size_t back = n < 4 ? n : 4;
    for (size_t k = 1; k <= back; k++) {
        unsigned char c = s[n - k];
        if ((c & 0xc0) == 0x80) continue; /* continuation: keep looking */
        if (c < 0x80) return n;           /* ASCII: complete */
        size_t need = u8len(c);
        if (c >= 0xf8) return n;          /* never a lead byte */
        return k < need ? n - k : n;
    }
    return n; /* only continuation bytes: nothing will complete them */
}

/* ==== GPT-2 byte <-> unicode ============================================== */

static void init_byte_tables(kv_vocab *v) {
    int n = 0;
    for (int i = 0; i < 324; i++) v->bdec[i] = -1;
    for (int b = 0; b < 256; b++) {
        uint32_t cp;
        if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) cp = (uint32_t)b;
        else cp = 256 + (uint32_t)n++;
        v->benc_len[b] = (uint8_t)u8enc(cp, v->benc[b]);
        v->bdec[cp] = (int16_t)b;
    }
}

/* ==== binary heap of merge candidates ===================================== */

/* Ordered by key ascending. BPE: key = (rank << 32) | left, so the lowest
 * rank wins and ties go to the leftmost pair. SPM: key = (~score_bits << 32)
 * | left, so the highest score wins, ties leftmost (the reference's
 * comparators). */
typedef struct {
    uint64_t key;
    int32_t right;
    uint32_t size;
} cand;

typedef struct {
    cand *p;
    size_t n, cap;
} heap;

static bool heap_push(heap *h, cand c) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 256;
        cand *p = realloc(h->p, cap * sizeof *p);
        if (!p) return false;
        h->p = p;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (h->p[parent].key <= c.key) break;
        h->p[i] = h->p[parent];
        i = parent;
    }
    h->p[i] = c;
    return true;
}

static cand heap_pop(heap *h) {
    cand top = h->p[0];
    cand last = h->p[--h->n];
    size_t i = 0, n = h->n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t m = (l + 1 < n && h->p[l + 1].key < h->p[l].key) ? l + 1 : l;
        if (last.key <= h->p[m].key) break;
        h->p[i] = h->p[m];
        i = m;
    }
    if (n) h->p[i] = last;
    return top;
}

/* Score -> a 32-bit key whose ascending order is descending score. */
static inline uint32_t score_key(float f) {
    uint32_t u;
    if (f == 0.0f) f = 0.0f; /* -0 == +0, as the reference's float compare */
    memcpy(&u, &f, 4);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending with f */
    return ~u;
}

/* Symbols of one merge sequence: a doubly linked list over byte ranges. */
typedef struct {
    int32_t prev, next;
    uint32_t off, n; /* bytes text[off .. off+n); n == 0 once merged away */
    int32_t id;      /* BPE: token id of the text, -1 if none */
} sym;

typedef struct {
    sym *p;
    size_t n, cap;
} symvec;

static bool symvec_reserve(symvec *s, size_t n) {
    if (n <= s->cap) return true;
    if (n > SIZE_MAX / sizeof(sym) / 2) return false;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    sym *p = realloc(s->p, cap * sizeof *p);
    if (!p) return false;
    s->p = p;
    s->cap = cap;
    return true;
}

/* Word cache of one kv_tokenize call: word text -> its ids. Tokenizing a
 * word is a pure function of its bytes, and natural text repeats words. */
typedef struct {
    uint64_t h;
    uint32_t koff, klen; /* key bytes in keys; klen == 0: empty slot */
    uint32_t ioff, nids; /* ids in ids */
} centry;

typedef struct {
    centry *t;
    uint32_t mask, n;
    sbuf keys;
    ivec ids;
} wcache;

#define WC_MAX_KEY 128         /* longer words are not cached */
#define WC_MAX_ENTRIES (1u << 16)

/* Scratch shared by the fragments of one kv_tokenize call. */
typedef struct {
    symvec syms;
    heap hp;
    sbuf text; /* escaped (SPM) or byte-encoded (BPE) text */
    wcache wc;
} scratch;

static void scratch_free(scratch *s) {
    free(s->syms.p);
    free(s->hp.p);
    free(s->text.p);
    free(s->wc.t);
    free(s->wc.keys.p);
    free(s->wc.ids.p);
}

typedef bool (*word_fn)(const kv_vocab *v, scratch *w, const char *s, size_t n, ivec *out);

static bool wc_grow(wcache *c) {
    uint32_t cap = c->t ? 2 * (c->mask + 1) : 4096;
    centry *t = calloc(cap, sizeof *t);
    if (!t) return false;
    for (uint32_t i = 0; c->t && i <= c->mask; i++) {
        if (!c->t[i].klen) continue;
        uint32_t k = (uint32_t)(c->t[i].h >> 32) & (cap - 1);
        while (t[k].klen) k = (k + 1) & (cap - 1);
        t[k] = c->t[i];
    }
    free(c->t);
    c->t = t;
    c->mask = cap - 1;
    return true;
}

/* Appends the ids of word s[0..n), from the cache or computed by fn. */
static bool cached_word(const kv_vocab *v, scratch *w, const char *s, size_t n, ivec *out, word_fn fn) {
    if (n == 0) return true;
    wcache *c = &w->wc;
    if (n > WC_MAX_KEY || (!c->t && !wc_grow(c))) return fn(v, w, s, n, out);
    uint64_t h = hash_bytes(s, n);
    uint32_t i = (uint32_t)(h >> 32) & c->mask;
    for (; c->t[i].klen; i = (i + 1) & c->mask) {
        const centry *e = &c->t[i];
        if (e->h == h && e->klen == n && memcmp(c->keys.p + e->koff, s, n) == 0) {
            if (!e->nids) return true;
            if (!ivec_reserve(out, e->nids)) return false;
            memcpy(out->p + out->n, c->ids.p + e->ioff, e->nids * sizeof *out->p);
            out->n += e->nids;
            return true;
        }
    }
    size_t before = out->n;
    if (!fn(v, w, s, n, out)) return false;
    size_t nids = out->n - before;
    if (c->n >= WC_MAX_ENTRIES || c->keys.n > 0x7fffffff || c->ids.n > 0x7fffffff) return true;
    if (2 * (c->n + 1) > c->mask + 1) {
        if (!wc_grow(c)) return true; /* no cache, still correct */
        i = (uint32_t)(h >> 32) & c->mask;
        while (c->t[i].klen) i = (i + 1) & c->mask;
    }
    if (!sbuf_reserve(&c->keys, n) || !ivec_reserve(&c->ids, nids)) return true;
    c->t[i] = (centry){h, (uint32_t)c->keys.n, (uint32_t)n, (uint32_t)c->ids.n, (uint32_t)nids};
    memcpy(c->keys.p + c->keys.n, s, n);
    c->keys.n += n;
    if (nids) memcpy(c->ids.p + c->ids.n, out->p + before, nids * sizeof *out->p);
    c->ids.n += nids;
    c->n++;
    return true;
}

/* ==== SPM ================================================================== */

static bool spm_try_bigram(const kv_vocab *v, scratch *w, const char *base, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return true;
    const sym *l = &w->syms.p[left], *r = &w->syms.p[right];
    size_t n = (size_t)l->n + r->n;
    int32_t id = lookup(v, base + l->off, n);
    if (id < 0) return true;
    cand c = {((uint64_t)score_key(v->score[id]) << 32) | (uint32_t)left, right, (uint32_t)n};
    return heap_push(&w->hp, c);
}

/* Appends the byte-fallback ids of bytes s[0..n). The reference throws when
 * a byte has no token; here such a byte gives unk, or nothing. */
static bool spm_bytes(const kv_vocab *v, const char *s, size_t n, ivec *out) {
    for (size_t j = 0; j < n; j++) {
        int32_t id = v->byte_tok[(unsigned char)s[j]];
        if (id < 0) id = v->sp.unk;
        if (id >= 0 && !ivec_push(out, id)) return false;
    }
    return true;
}

/* llm_tokenizer_spm_session::tokenize on escaped text t[0..n) that starts
 * and ends on symbol boundaries: UTF-8 characters (by lead byte, no
 * validation), merged by the best-scoring bigram first (ties: leftmost). */
static bool spm_merge(const kv_vocab *v, scratch *w, const char *t, size_t n, ivec *out) {
    symvec *S = &w->syms;
    S->n = 0;
    if (!symvec_reserve(S, n)) return false;
    for (size_t off = 0; off < n;) {
        size_t cl = u8len((unsigned char)t[off]);
        if (cl > n - off) cl = n - off;
        sym s = {(int32_t)S->n - 1, 0, (uint32_t)off, (uint32_t)cl, -1};
        off += cl;
        s.next = off == n ? -1 : (int32_t)S->n + 1;
        S->p[S->n++] = s;
    }

    heap *hp = &w->hp;
    hp->n = 0;
    for (size_t i = 1; i < S->n; i++)
        if (!spm_try_bigram(v, w, t, (int32_t)i - 1, (int32_t)i)) return false;

    while (hp->n) {
        cand c = heap_pop(hp);
        int32_t li = (int32_t)(uint32_t)c.key;
        sym *l = &S->p[li], *r = &S->p[c.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != c.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) S->p[r->next].prev = li;
        if (!spm_try_bigram(v, w, t, l->prev, li) || !spm_try_bigram(v, w, t, li, l->next)) return false;
    }

    /* resegment: a merged symbol is always a token; single characters that
     * are not fall back to bytes */
    for (int32_t i = 0; i != -1; i = S->p[i].next) {
        const sym *s = &S->p[i];
        int32_t id = lookup(v, t + s->off, s->n);
        if (id >= 0) {
            if (!ivec_push(out, id)) return false;
        } else if (!spm_bytes(v, t + s->off, s->n, out)) {
            return false;
        }
    }
    return true;
}

/* One SPM raw fragment: optional space prefix, spaces escaped to "▁", then
 * merges. The merge runs per piece: the text is cut before a "▁" symbol
 * whose left neighbour can never be merged with it (no token holds that
 * byte followed by "▁", see spm_nosplit), so no bigram crosses a cut and
 * the pieces merge independently, each one cached by its text. */
static bool spm_fragment(const kv_vocab *v, scratch *w, const char *frag, size_t len, bool prefix,
                         ivec *out) {
    sbuf *t = &w->text;
    t->n = 0;
    if (len > (SIZE_MAX - 3) / 3 || !sbuf_reserve(t, 3 * len + 3)) return false;
    if (prefix) { memcpy(t->p, "\xe2\x96\x81", 3); t->n = 3; }
    for (size_t i = 0; i < len; i++) {
        if (frag[i] == ' ') { memcpy(t->p + t->n, "\xe2\x96\x81", 3); t->n += 3; }
        else t->p[t->n++] = frag[i];
    }
    if (t->n == 0) return true;
    if (t->n > 0x7fffffff) return false;

    const unsigned char *u = (const unsigned char *)t->p;
    size_t start = 0;
    bool prev_space = false;
    for (size_t off = 0; off < t->n;) {
        size_t cl = u8len(u[off]);
        if (cl > t->n - off) cl = t->n - off;
        bool space = cl == 3 && u[off] == 0xe2 && u[off + 1] == 0x96 && u[off + 2] == 0x81;
        if (space && off > start && !prev_space && !v->spm_nosplit[u[off - 1]]) {
            if (!cached_word(v, w, t->p + start, off - start, out, spm_merge)) return false;
            start = off;
        }
        prev_space = space;
        off += cl;
    }
    return cached_word(v, w, t->p + start, t->n - start, out, spm_merge);
}

/* ==== BPE ================================================================== */

static bool bpe_try_pair(const kv_vocab *v, scratch *w, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return true;
    const sym *l = &w->syms.p[left], *r = &w->syms.p[right];
    int32_t res;
    int32_t rank = merge_find(v, l->id, r->id, &res);
    if (rank < 0) return true;
    cand c = {((uint64_t)(uint32_t)rank << 32) | (uint32_t)left, right, l->n + r->n};
    return heap_push(&w->hp, c);
}

/* Merges one byte-encoded word t->p[0..t->n) and appends its ids. */
static bool bpe_word(const kv_vocab *v, scratch *w, ivec *out) {
    sbuf *t = &w->text;
    if (t->n == 0) return true;
    if (t->n > 0x7fffffff) return false;
    if (v->ignore_merges) {
        int32_t id = lookup(v, t->p, t->n);
        if (id >= 0) return ivec_push(out, id);
    }
    symvec *S = &w->syms;
    S->n = 0;
    if (!symvec_reserve(S, t->n)) return false;
    for (size_t off = 0; off < t->n;) {
        size_t cl = u8len((unsigned char)t->p[off]);
        if (cl > t->n - off) cl = t->n - off;
        sym s = {(int32_t)S->n - 1, 0, (uint32_t)off, (uint32_t)cl, lookup(v, t->p + off, cl)};
        off += cl;
        s.next = off == t->n ? -1 : (int32_t)S->n + 1;
        S->p[S->n++] = s;
    }
    heap *hp = &w->hp;
    hp->n = 0;
    for (size_t i = 1; i < S->n; i++)
        if (!bpe_try_pair(v, w, (int32_t)i - 1, (int32_t)i)) return false;

    while (hp->n) {
        cand c = heap_pop(hp);
        int32_t li = (int32_t)(uint32_t)c.key;
        sym *l = &S->p[li], *r = &S->p[c.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != c.size) continue;
        int32_t res = -1;
        merge_find(v, l->id, r->id, &res);
        l->n += r->n;
        l->id = res;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) S->p[r->next].prev = li;
        if (!bpe_try_pair(v, w, l->prev, li) || !bpe_try_pair(v, w, li, l->next)) return false;
    }

    for (int32_t i = 0; i != -1; i = S->p[i].next) {
        const sym *s = &S->p[i];
        if (s->id >= 0) {
            if (!ivec_push(out, s->id)) return false;
            continue;
        }
        /* the reference looks up each raw byte of the encoded text */
        for (uint32_t j = 0; j < s->n; j++) {
            int32_t id = lookup(v, t->p + s->off + j, 1);
            if (id >= 0 && !ivec_push(out, id)) return false;
        }
    }
    return true;
}

/* Byte-encodes the reference's word text of text[0..len): each codepoint
 * (invalid bytes -> U+FFFD) re-encoded, each byte of that -> its GPT-2
 * symbol. */
static bool bpe_encode_word(const kv_vocab *v, scratch *w, const char *s, size_t len) {
    sbuf *t = &w->text;
    t->n = 0;
    if (len > SIZE_MAX / 8 || !sbuf_reserve(t, 6 * len)) return false;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        char tmp[4];
        size_t adv, k;
        if (u[i] < 0x80) {
            tmp[0] = (char)u[i];
            k = 1;
            adv = 1;
        } else {
            uint32_t cp = u8dec(u + i, len - i, &adv);
            k = u8enc(cp, tmp);
        }
        for (size_t j = 0; j < k; j++) {
            unsigned char b = (unsigned char)tmp[j];
            memcpy(t->p + t->n, v->benc[b], v->benc_len[b]);
            t->n += v->benc_len[b];
        }
        i += adv;
    }
    return true;
}

/* One pre-tokenizer word, raw bytes in: encode, then merge. */
static bool bpe_span(const kv_vocab *v, scratch *w, const char *s, size_t n, ivec *out) {
    return bpe_encode_word(v, w, s, n) && bpe_word(v, w, out);
}

/* A 4-byte sequence that decodes above U+10FFFF: the reference throws on
 * it (and aborts the process); here its lead byte is read as invalid. */
static bool above_unicode(const unsigned char *u, size_t len, size_t i) {
    return u[i] >= 0xf4 && u[i] <= 0xf7 && i + 3 < len && (u[i + 1] & 0xc0) == 0x80 && (u[i + 2] & 0xc0) == 0x80 &&
           (u[i + 3] & 0xc0) == 0x80 && (u[i] > 0xf4 || u[i + 1] >= 0x90);
}

static kv_status bpe_fragment(const kv_vocab *v, scratch *w, const char *frag, size_t len, ivec *out,
                              kv_error *e) {
    kv_span *spans = NULL;
    size_t n = 0;
    char *copy = NULL;
    const unsigned char *u = (const unsigned char *)frag;
    for (size_t i = 0; i < len; i++) {
        if (u[i] < 0xf4 || !above_unicode(u, len, i)) continue;
        if (!copy) {
            if (!(copy = malloc(len))) return kv_fail(e, KV_ERR_NOMEM, "tokenize: out of memory");
            memcpy(copy, frag, len);
        }
        copy[i] = (char)0xff;
    }
    if (copy) frag = copy;
    kv_status st = kv_pretokenize(v->pretok_kind, frag, len, &spans, &n, e);
    if (st != KV_OK) {
        free(copy);
        return st;
    }
    for (size_t i = 0; i < n; i++) {
        if (spans[i].off > len || spans[i].len > len - spans[i].off) {
            free(spans);
            free(copy);
            return kv_fail(e, KV_ERR_ARG, "tokenize: pre-tokenizer span out of range");
        }
        if (!cached_word(v, w, frag + spans[i].off, spans[i].len, out, bpe_span)) {
            free(spans);
            free(copy);
            return kv_fail(e, KV_ERR_NOMEM, "tokenize: out of memory");
        }
    }
    free(spans);
    free(copy);
    return KV_OK;
}

/* ==== special-token partition ============================================== */

/* One piece of the partitioned input: raw text or a special token. */
typedef struct {
    size_t off, len;
    int32_t id; /* -1: raw text [off, off+len) */
} frag;

static inline bool is_space_c(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

static int frag_cmp(const void *a, const void *b) {
    size_t x = ((const frag *)a)->off, y = ((const frag *)b)->off;
    return x < y ? -1 : x > y;
}

static uint32_t trie_child(const kv_vocab *v, uint32_t node, unsigned char b) {
    uint32_t key = ((node << 8) | b) + 1;
    for (uint32_t i = (uint32_t)mix64(key) & v->emask;; i = (i + 1) & v->emask) {
        if (v->ekey[i] == 0) return 0;
        if (v->ekey[i] == key) return v->eval[i];
    }
}

/* tokenizer_st_partition: special tokens in priority order (longest
 * first), each at its leftmost occurrences that lie wholly in raw text.
 * covered[i] != 0 marks bytes taken by a token or dropped by lstrip/rstrip;
 * an occurrence overlapping covered bytes is skipped, which is what the
 * reference's per-fragment search amounts to. */
static kv_status partition(const kv_vocab *v, const char *text, size_t len, bool parse_special,
                           const uint8_t *literal, frag **out, size_t *n_out, kv_error *e) {
    *out = NULL;
    *n_out = 0;
    uint8_t *present = NULL, *covered = NULL;
    frag *fr = NULL;
    size_t n_fr = 0, cap_fr = 0;
    bool any = false;

    if (v->n_spec && len) {
        present = calloc(v->n_spec, 1);
        if (!present) goto nomem;
        const unsigned char *u = (const unsigned char *)text;
        for (size_t p = 0; p < len; p++) {
            if (!v->spec_first[u[p]]) continue;
            uint32_t node = 0;
            for (size_t k = p; k < len; k++) {
                node = trie_child(v, node, u[k]);
                if (!node) break;
                int32_t r = v->trie_rank[node];
                if (r >= 0 && !present[r]) {
                    int32_t id = v->spec[r];
                    if (parse_special || !(v->attr[id] & (KV_TOKEN_CONTROL | KV_TOKEN_UNKNOWN))) {
                        present[r] = 1;
                        any = true;
                    }
                }
            }
        }
    }

    if (any) {
        covered = calloc(len, 1);
        if (!covered) goto nomem;
        for (size_t r = 0; r < v->n_spec; r++) {
            if (!present[r]) continue;
            int32_t id = v->spec[r];
            const char *tt = tok_text(v, id);
            size_t tl = v->len[id];
            size_t q = 0;
            while (q + tl <= len) {
                const char *hit = memmem(text + q, len - q, tt, tl);
                if (!hit) break;
                size_t p = (size_t)(hit - text);
                /* last covered byte inside the occurrence, if any */
                size_t c = p + tl;
                while (c > p && !covered[c - 1]) c--;
                if (c > p) {
                    const void *z = memchr(covered + c, 0, len - c);
                    if (!z) break;
                    q = (size_t)((const uint8_t *)z - covered);
                    continue;
                }
                /* literal bytes are read as without parse_special: a control (or unknown)
                 * token touching them is text; go on past the last one */
                if (literal && (v->attr[id] & (KV_TOKEN_CONTROL | KV_TOKEN_UNKNOWN))) {
                    c = p + tl;
                    while (c > p && !literal[c - 1]) c--;
                    if (c > p) {
                        q = c;
                        continue;
                    }
                }
                memset(covered + p, 2, tl);
                if (n_fr == cap_fr) {
                    size_t nc = cap_fr ? cap_fr * 2 : 16;
                    frag *nf = realloc(fr, nc * sizeof *nf);
                    if (!nf) goto nomem;
                    fr = nf;
                    cap_fr = nc;
                }
                fr[n_fr++] = (frag){p, tl, id};
                if (v->attr[id] & ATTR_LSTRIP) {
                    size_t b = p;
                    while (b > 0 && !covered[b - 1] && is_space_c((unsigned char)text[b - 1])) covered[--b] = 1;
                }
                size_t end = p + tl;
                if (v->attr[id] & ATTR_RSTRIP) {
                    while (end < len && !covered[end] && is_space_c((unsigned char)text[end])) covered[end++] = 1;
                }
                q = end;
            }
        }
    }

    /* assemble: tokens sorted by position, raw runs between them */
    frag *res = NULL;
    size_t n_res = 0;
    if (!any) {
        if (len) {
            res = malloc(sizeof *res);
            if (!res) goto nomem;
            res[0] = (frag){0, len, -1};
            n_res = 1;
        }
    } else {
        res = malloc((2 * n_fr + 1) * sizeof *res);
        if (!res) goto nomem;
        if (n_fr) qsort(fr, n_fr, sizeof *fr, frag_cmp); /* none when every occurrence was literal */
        size_t k = 0, p = 0;
        while (p < len) {
            if (k < n_fr && fr[k].off == p) {
                res[n_res++] = fr[k];
                p += fr[k].len;
                k++;
            } else if (covered[p]) {
                p++; /* dropped by lstrip / rstrip */
            } else {
                size_t s = p;
                while (p < len && !covered[p]) p++;
                res[n_res++] = (frag){s, p - s, -1};
            }
        }
    }
    free(fr);
    free(present);
    free(covered);
    *out = res;
    *n_out = n_res;
    return KV_OK;

nomem:
    free(fr);
    free(present);
    free(covered);
    return kv_fail(e, KV_ERR_NOMEM, "tokenize: out of memory");
}
/* ==== tokenize ============================================================= */

kv_status kv_tokenize(const kv_vocab *v, const char *text, size_t len, bool add_special, bool parse_special,
                      int32_t **ids, size_t *n, kv_error *e) {
    return kv_tokenize_literal(v, text, len, add_special, parse_special, NULL, ids, n, e);
}

kv_status kv_tokenize_literal(const kv_vocab *v, const char *text, size_t len, bool add_special,
                              bool parse_special, const uint8_t *literal, int32_t **ids, size_t *n, kv_error *e) {
    if (!ids || !n) return kv_fail(e, KV_ERR_ARG, "tokenize: ids and n must not be NULL");
    *ids = NULL;
    *n = 0;
    if (!v) return kv_fail(e, KV_ERR_ARG, "tokenize: no vocabulary");
    if (!text && len) return kv_fail(e, KV_ERR_ARG, "tokenize: text is NULL");
    if (len > 0x7fffffff) return kv_fail(e, KV_ERR_ARG, "tokenize: text of %zu bytes is too long", len);

    frag *fr = NULL;
    size_t n_fr = 0;
    kv_status st = partition(v, text, len, parse_special, literal, &fr, &n_fr, e);
    if (st != KV_OK) return st;

    ivec out = {0};
    scratch w = {0};
    bool ok = ivec_reserve(&out, len / 3 + 8);
    if (ok && add_special && v->sp.add_bos) ok = ivec_push(&out, v->sp.bos);

    bool prev_special = true; /* SPM: prefix a space to the first text */
    for (size_t i = 0; ok && i < n_fr; i++) {
        if (fr[i].id >= 0) {
            ok = ivec_push(&out, fr[i].id);
            prev_special = true;
            continue;
        }
        if (v->type == VT_SPM) {
            ok = spm_fragment(v, &w, text + fr[i].off, fr[i].len, v->sp.add_space_prefix && prev_special, &out);
        } else {
            st = bpe_fragment(v, &w, text + fr[i].off, fr[i].len, &out, e);
            if (st != KV_OK) break;
        }
        prev_special = false;
    }
    if (ok && st == KV_OK && add_special && v->sp.add_eos) ok = ivec_push(&out, v->sp.eos);

    free(fr);
    scratch_free(&w);
    if (st == KV_OK && !ok) st = kv_fail(e, KV_ERR_NOMEM, "tokenize: out of memory");
    if (st != KV_OK) {
        free(out.p);
        return st;
    }
    *ids = out.p;
    *n = out.n;
    return KV_OK;
}

/* ==== pieces and detokenize =============================================== */

/* Bounded writer: counts every byte, stores what fits, and drops up to
 * `skip` leading spaces of what is written (the reference's lstrip). */
typedef struct {
    char *dst;
    size_t cap, n;
    int skip;
} wr;

static void wr_put(wr *w, const char *s, size_t n) {
    if (w->skip > 0) {
        while (w->skip > 0 && n > 0 && *s == ' ') { s++; n--; w->skip--; }
        if (n > 0) w->skip = 0;
    }
    if (w->n < w->cap) {
        size_t k = w->cap - w->n < n ? w->cap - w->n : n;
        memcpy(w->dst + w->n, s, k);
    }
    w->n += n;
}

static inline int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : 0;
}

/* llama_token_to_piece: the bytes of one token, after skipping up to
 * lstrip leading spaces. Returns the full length (may exceed cap). */
static size_t piece(const kv_vocab *v, int32_t id, bool special, int lstrip, char *dst, size_t cap) {
    if (!v || id < 0 || id >= v->n) return 0;
    int attr = v->attr[id];
    if (!special && (attr & (KV_TOKEN_UNKNOWN | KV_TOKEN_CONTROL))) return 0;
    const char *s = tok_text(v, id);
    size_t n = v->len[id];
    wr w = {dst, cap, 0, lstrip};

    if (attr & (KV_TOKEN_UNKNOWN | KV_TOKEN_CONTROL | KV_TOKEN_USER_DEFINED)) {
        wr_put(&w, s, n);
    } else if (attr & KV_TOKEN_NORMAL) {
        if (v->type == VT_SPM) { /* "▁" -> " " */
            size_t i = 0;
            while (i < n) {
                const char *m = n - i >= 3 ? memmem(s + i, n - i, "\xe2\x96\x81", 3) : NULL;
                size_t j = m ? (size_t)(m - s) : n;
                wr_put(&w, s + i, j - i);
                if (!m) break;
                wr_put(&w, " ", 1);
                i = j + 3;
            }
        } else { /* byte-level BPE: each codepoint maps back to one byte */
            const unsigned char *u = (const unsigned char *)s;
            for (size_t i = 0; i < n;) {
                size_t adv;
                uint32_t cp = u8dec(u + i, n - i, &adv);
                if (cp < 324 && v->bdec[cp] >= 0) {
                    char b = (char)v->bdec[cp];
                    wr_put(&w, &b, 1);
                } else {
                    char enc[4], hex[3];
                    size_t k = u8enc(cp, enc);
                    wr_put(&w, "[UNK_BYTE_0x", 12);
                    for (size_t j = 0; j < k; j++) {
                        snprintf(hex, sizeof hex, "%02x", (unsigned char)enc[j]);
                        wr_put(&w, hex, 2);
                    }
                    wr_put(&w, s, n);
                    wr_put(&w, "]", 1);
                }
                i += adv;
            }
        }
    } else if (attr & KV_TOKEN_BYTE) { /* "<0xNN>" -> the byte */
        char b = n >= 5 ? (char)(hexval(s[3]) * 16 + hexval(s[4])) : 0;
        wr_put(&w, &b, 1);
    }
    return w.n;
}

size_t kv_token_piece(const kv_vocab *v, int32_t id, bool special, char *buf, size_t cap) {
    if (!buf) cap = 0;
    return piece(v, id, special, 0, buf, cap);
}

/* clean_up_tokenization_spaces, three passes in place as the reference. */
static size_t clean_spaces(char *t, size_t total) {
    size_t t1 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < t1; i++) {
        char x = t[i];
        if (t[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) total--;
        t[total++] = x;
    }
    size_t t2 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < t2; i++) {
        char x = t[i];
        if (x == '\'' && i + 1 < t2 && t[i - 1] == ' ' && t[i + 1] == ' ') {
            total--;
            t[++i] = '\0';
        }
        t[total++] = x;
    }
    size_t t3 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < t3; i++) {
        char x = t[i];
        if (t[i - 1] == ' ' && x == '\'' && i + 1 < t3) {
            char x1 = t[i + 1];
            if (x1 == 's' || x1 == 'm') total--;
            else if (x1 != 't' && x1 != 'd' && i + 2 < t3) {
                char x2 = t[i + 2];
                if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) total--;
            }
        }
        t[total++] = x;
    }
    return total;
}

kv_status kv_detokenize(const kv_vocab *v, const int32_t *ids, size_t n, bool remove_special, bool unparse_special,
                        char **out, size_t *len, kv_error *e) {
    if (!out || !len) return kv_fail(e, KV_ERR_ARG, "detokenize: out and len must not be NULL");
    *out = NULL;
    *len = 0;
    if (!v) return kv_fail(e, KV_ERR_ARG, "detokenize: no vocabulary");
    if (!ids && n) return kv_fail(e, KV_ERR_ARG, "detokenize: ids is NULL");
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= v->n)
            return kv_fail(e, KV_ERR_ARG, "detokenize: token id %d out of range [0, %d)", (int)ids[i], (int)v->n);

    bool remove_space = v->sp.add_space_prefix;
    if (remove_special && v->sp.add_bos && n > 0 && ids[0] == v->sp.bos) {
        remove_space = false;
        ids++;
        n--;
    }
    if (remove_special && v->sp.add_eos && n > 0 && ids[n - 1] == v->sp.eos) n--;

    sbuf b = {0};
    if (!sbuf_reserve(&b, 4 * n + 16)) return kv_fail(e, KV_ERR_NOMEM, "detokenize: out of memory");
    for (size_t i = 0; i < n; i++) {
        int lstrip = remove_space ? 1 : 0;
        size_t k = piece(v, ids[i], unparse_special, lstrip, b.p + b.n, b.cap - b.n);
        if (k > b.cap - b.n) {
            if (!sbuf_reserve(&b, k)) {
                free(b.p);
                return kv_fail(e, KV_ERR_NOMEM, "detokenize: out of memory");
            }
            piece(v, ids[i], unparse_special, lstrip, b.p + b.n, b.cap - b.n);
        }
        b.n += k;
        remove_space = false;
    }
    if (v->clean_spaces) b.n = clean_spaces(b.p, b.n);
    if (!sbuf_reserve(&b, 1)) {
        free(b.p);
        return kv_fail(e, KV_ERR_NOMEM, "detokenize: out of memory");
    }
    b.p[b.n] = '\0';
    *out = b.p;
    *len = b.n;
    return KV_OK;
}

/* ==== loading ============================================================== */

void kv_vocab_free(kv_vocab *v) {
    if (!v) return;
    free(v->arena);
    free(v->off);
    free(v->len);
    free(v->score);
    free(v->attr);
    free(v->eog);
    free(v->ttab);
    free(v->mkey);
    free(v->mrank);
    free(v->mres);
    free(v->spec);
    free(v->trie_rank);
    free(v->ekey);
    free(v->eval);
    free(v);
}

static uint32_t pow2_at_least(uint64_t n) {
    uint64_t c = 16;
    while (c < n) c <<= 1;
    return c > 0x80000000ull ? 0 : (uint32_t)c;
}

/* Flags that llama.cpp attaches to a BPE pre-tokenizer name. */
static void pre_flags(kv_vocab *v, const char *pre) {
    static const char *const ignore_bos[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                             "midm-2.0", "lfm2", "jina-v5-nano", NULL};
    static const char *const no_clean[] = {
        "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu", "command-r", "qwen2",
        "deepseek-r1-qwen", "kormo", "f2llmv2", "qwen35", "poro-chat", "viking", "tekken", "smollm", "chameleon",
        "gpt-4o", "llama4", "kanana2", "talkie", "granite-embed-multi-97m", "tiny_aya", "cohere2moe", "superbpe",
        "trillion", "granite-docling", "bailingmoe", "bailingmoe2", "llada-moe", "seed-coder", "hunyuan",
        "hunyuan-dense", "hy_v4", "joyai-llm", "kimi-k2", "ufakzeka", "grok-2", "afmoe", "laguna", "minimax-m2",
        "solar-open", "sarvam-moe", NULL};
    for (int i = 0; ignore_bos[i]; i++)
        if (!strcmp(pre, ignore_bos[i])) { v->ignore_merges = true; v->sp.add_bos = true; }
    for (int i = 0; no_clean[i]; i++)
        if (!strcmp(pre, no_clean[i])) v->clean_spaces = false;
    if (!strcmp(pre, "minicpm5") || !strcmp(pre, "youtu") || !strcmp(pre, "tekken") ||
        !strcmp(pre, "granite-embed-multi-97m"))
        v->ignore_merges = true;
    if (!strcmp(pre, "tekken") || !strcmp(pre, "chameleon")) v->sp.add_bos = true;
    if (!strcmp(pre, "glm4") || !strcmp(pre, "chatglm-bpe")) v->sp.bos = -1;
    if (!strcmp(pre, "jina-v1-en") || !strcmp(pre, "jina-v2-code") || !strcmp(pre, "roberta-bpe")) v->add_sep = true;
}

/* Copies a GGUF string into a NUL-terminated buffer (truncating). */
static void str_copy(char *dst, size_t cap, kv_gguf_str s) {
    size_t n = s.len < cap - 1 ? (size_t)s.len : cap - 1;
    if (n) memcpy(dst, s.ptr, n);
    dst[n] = '\0';
}

/* The lowest id among tokens with one of the given texts, -1 if none. */
static int32_t find_first(const kv_vocab *v, const char *const *texts) {
    int32_t best = -1;
    for (int i = 0; texts[i]; i++) {
        int32_t id = lookup_cstr(v, texts[i]);
        if (id >= 0 && (best < 0 || id < best)) best = id;
    }
    return best;
}

/* Text-based detection of a special id left unset by the metadata; the
 * token found is forced to CONTROL as the reference does. (With several
 * candidates the reference takes the first in its hash-map order; here the
 * lowest id.) */
static void autodetect(kv_vocab *v, int32_t *id, const char *const *texts) {
    if (*id >= 0) return;
    int32_t t = find_first(v, texts);
    if (t < 0) return;
    *id = t;
    v->attr[t] |= KV_TOKEN_CONTROL;
}

static int spec_cmp_len_desc(const void *a, const void *b, void *ctx) {
    const kv_vocab *v = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (v->len[x] != v->len[y]) return v->len[x] > v->len[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

static kv_status build_specials(kv_vocab *v, kv_error *e) {
    size_t n = 0, total = 1;
    for (int32_t i = 0; i < v->n; i++)
        if (v->attr[i] & (KV_TOKEN_CONTROL | KV_TOKEN_USER_DEFINED | KV_TOKEN_UNKNOWN)) {
            n++;
            total += v->len[i];
        }
    v->n_spec = n;
    if (!n) return KV_OK;
    v->spec = malloc(n * sizeof *v->spec);
    uint32_t ecap = pow2_at_least(2 * (uint64_t)total);
    if (!v->spec || !ecap || total > 0xffffff) return kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory (special tokens)");
    n = 0;
    for (int32_t i = 0; i < v->n; i++)
        if (v->attr[i] & (KV_TOKEN_CONTROL | KV_TOKEN_USER_DEFINED | KV_TOKEN_UNKNOWN)) v->spec[n++] = i;
    qsort_r(v->spec, n, sizeof *v->spec, spec_cmp_len_desc, v);

    v->trie_rank = malloc(total * sizeof *v->trie_rank);
    v->ekey = calloc(ecap, sizeof *v->ekey);
    v->eval = malloc(ecap * sizeof *v->eval);
    if (!v->trie_rank || !v->ekey || !v->eval) return kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory (special tokens)");
    v->emask = ecap - 1;
    v->trie_nodes = 1;
    v->trie_rank[0] = -1;
    for (size_t r = 0; r < n; r++) {
        int32_t id = v->spec[r];
        const unsigned char *s = (const unsigned char *)tok_text(v, id);
        uint32_t node = 0;
        v->spec_first[s[0]] = 1;
        for (uint32_t k = 0; k < v->len[id]; k++) {
            uint32_t key = ((node << 8) | s[k]) + 1;
            uint32_t i = (uint32_t)mix64(key) & v->emask;
            while (v->ekey[i] && v->ekey[i] != key) i = (i + 1) & v->emask;
            if (!v->ekey[i]) {
                v->ekey[i] = key;
                v->eval[i] = v->trie_nodes;
                v->trie_rank[v->trie_nodes++] = -1;
            }
            node = v->eval[i];
        }
        v->trie_rank[node] = (int32_t)r;
    }
    return KV_OK;
}

static kv_status read_special(const kv_gguf *g, const kv_vocab *v, const char *key, int32_t *id, kv_error *e) {
    uint32_t x;
    if (!kv_gguf_get(g, key)) return KV_OK;
    kv_status st = kv_gguf_get_u32(g, key, &x, true, e);
    if (st != KV_OK) return st;
    if (x >= (uint32_t)v->n)
        return kv_fail(e, KV_ERR_FORMAT, "vocab: %s = %u is out of range (%d tokens)", key, x, (int)v->n);
    *id = (int32_t)x;
    return KV_OK;
}

static const char *const EOT_TEXTS[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                                        "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
                                        "<end_of_utterance>", NULL};
static const char *const EOM_TEXTS[] = {"<|eom_id|>", NULL};
static const char *const FIM_PRE_TEXTS[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                            "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>", "<PRE>",
                                            "\xe2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>", NULL};
static const char *const FIM_SUF_TEXTS[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                            "<\xef\xbd\x9c" "fim\xe2\x96\x81hole\xef\xbd\x9c>", "<SUF>",
                                            "\xe2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>", NULL};
static const char *const FIM_MID_TEXTS[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                            "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>", "<MID>",
                                            "\xe2\x96\x81<MID>", "<|code_middle|>", "<|middle|>", NULL};
static const char *const FIM_PAD_TEXTS[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL};
static const char *const FIM_REP_TEXTS[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", NULL};
static const char *const FIM_SEP_TEXTS[] = {"<|file_sep|>", NULL};
static const char *const EOG_TEXTS[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
                                        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
                                        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
                                        "<turn|>", "<|tool_response>",
                                        "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "[e~[",
                                        NULL};

/* End-of-generation set, special-id detection and attribute fix-ups, in
 * the reference's order. */
static void finish_specials(kv_vocab *v) {
    autodetect(v, &v->sp.eot, EOT_TEXTS);
    autodetect(v, &v->sp.eom, EOM_TEXTS);
    autodetect(v, &v->fim_pre, FIM_PRE_TEXTS);
    autodetect(v, &v->fim_suf, FIM_SUF_TEXTS);
    autodetect(v, &v->fim_mid, FIM_MID_TEXTS);
    autodetect(v, &v->fim_pad, FIM_PAD_TEXTS);
    autodetect(v, &v->fim_rep, FIM_REP_TEXTS);
    autodetect(v, &v->fim_sep, FIM_SEP_TEXTS);

    /* control tokens named "unused" are unused */
    for (int32_t i = 0; i < v->n; i++)
        if ((v->attr[i] & KV_TOKEN_CONTROL) && strstr(tok_text(v, i), "unused")) v->attr[i] |= KV_TOKEN_UNUSED;

    if (v->fim_pad >= 0) v->eog[v->fim_pad] = 1;
    if (v->fim_rep >= 0) v->eog[v->fim_rep] = 1;
    if (v->fim_sep >= 0) v->eog[v->fim_sep] = 1;
    for (int i = 0; EOG_TEXTS[i]; i++) {
        int32_t id = lookup_cstr(v, EOG_TEXTS[i]);
        if (id < 0) continue;
        v->eog[id] = 1;
        v->attr[id] |= KV_TOKEN_CONTROL;
    }
    static const char *const gpt_oss[] = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", NULL};
    for (int i = 0; gpt_oss[i]; i++) {
        int32_t id = lookup_cstr(v, gpt_oss[i]);
        if (id >= 0) v->attr[id] = KV_TOKEN_USER_DEFINED;
    }
    if (v->sp.eos >= 0) v->eog[v->sp.eos] = 1;
    if (v->sp.eot >= 0) v->eog[v->sp.eot] = 1;
    if (v->sp.eom >= 0) v->eog[v->sp.eom] = 1;

    /* o200k_harmony / solar-open: "<|end|>" is not EOG when
     * "<|return|>" and "<|call|>" (or "<|calls|>" and "<|flush|>") are */
    int32_t ret = lookup_cstr(v, "<|return|>"), call = lookup_cstr(v, "<|call|>"),
            calls = lookup_cstr(v, "<|calls|>"), flush = lookup_cstr(v, "<|flush|>"),
            end = lookup_cstr(v, "<|end|>");
    bool has_call = (call >= 0 && v->eog[call]) || (calls >= 0 && v->eog[calls]);
    bool has_ret = ret >= 0 && v->eog[ret], has_flush = flush >= 0 && v->eog[flush];
    if (end >= 0 && v->eog[end] && ((has_ret && has_call) || (has_call && has_flush))) {
        v->eog[end] = 0;
        v->attr[end] = KV_TOKEN_USER_DEFINED;
    }
    /* gemma4 / paddleocr: "</s>" is not EOG when "<|tool_response>" is */
    int32_t tr = lookup_cstr(v, "<|tool_response>"), s_end = lookup_cstr(v, "</s>");
    if (tr >= 0 && v->eog[tr] && s_end >= 0 && v->eog[s_end]) {
        v->eog[s_end] = 0;
        v->attr[s_end] = KV_TOKEN_NORMAL;
    }
}

/* Per-model attributes the reference sets by name after building its
 * special-token cache (Phi-3: special tokens strip spaces on their right). */
static void name_attrs(kv_vocab *v, const kv_gguf *g) {
    kv_gguf_str name = {0};
    if (kv_gguf_get_str(g, "general.name", &name, false, NULL) != KV_OK || !name.ptr) return;
    char low[256];
    str_copy(low, sizeof low, name);
    for (char *p = low; *p; p++)
        if (*p >= 'A' && *p <= 'Z') *p = (char)(*p - 'A' + 'a');
    if (!strstr(low, "phi-3") && !strstr(low, "phi3")) return;
    for (size_t r = 0; r < v->n_spec; r++) v->attr[v->spec[r]] |= ATTR_RSTRIP;
    int32_t id = lookup_cstr(v, "</s>");
    if (id >= 0) v->attr[id] |= ATTR_RSTRIP;
    static const char *const off[] = {"<unk>", "<s>", "<|endoftext|>", NULL};
    for (int i = 0; off[i]; i++)
        if ((id = lookup_cstr(v, off[i])) >= 0) v->attr[id] &= (uint16_t)~ATTR_RSTRIP;
}

static kv_status load_tokens(kv_vocab *v, const kv_gguf *g, kv_error *e) {
    const kv_gguf_value *toks = NULL, *scores = NULL, *types = NULL;
    kv_status st = kv_gguf_get_arr(g, "tokenizer.ggml.tokens", KV_GGUF_STRING, &toks, true, e);
    if (st != KV_OK) return st;
    uint64_t n = toks->v.arr.n;
    if (n == 0) return kv_fail(e, KV_ERR_FORMAT, "vocab: tokenizer.ggml.tokens is empty");
    if (n > MAX_TOKENS / 2) return kv_fail(e, KV_ERR_FORMAT, "vocab: %llu tokens is too many", (unsigned long long)n);
    v->n = (int32_t)n;

    if ((st = kv_gguf_get_arr(g, "tokenizer.ggml.scores", KV_GGUF_NTYPES, &scores, false, e)) != KV_OK) return st;
    if (scores) {
        if (scores->v.arr.type != KV_GGUF_F32 && scores->v.arr.type != KV_GGUF_I32)
            return kv_fail(e, KV_ERR_FORMAT, "vocab: tokenizer.ggml.scores is an array of %s, expected f32",
                           kv_gguf_vtype_name(scores->v.arr.type));
        if (scores->v.arr.n != n)
            return kv_fail(e, KV_ERR_FORMAT, "vocab: %llu scores for %llu tokens",
                           (unsigned long long)scores->v.arr.n, (unsigned long long)n);
    }
    if ((st = kv_gguf_get_arr(g, "tokenizer.ggml.token_type", KV_GGUF_NTYPES, &types, false, e)) != KV_OK) return st;
    if (types) {
        if (types->v.arr.type != KV_GGUF_I32)
            return kv_fail(e, KV_ERR_FORMAT, "vocab: tokenizer.ggml.token_type is an array of %s, expected i32",
                           kv_gguf_vtype_name(types->v.arr.type));
        if (types->v.arr.n != n)
            return kv_fail(e, KV_ERR_FORMAT, "vocab: %llu token types for %llu tokens",
                           (unsigned long long)types->v.arr.n, (unsigned long long)n);
    }

    /* arena size: texts + NULs (+ "[EMPTY_i]" for empty ones) */
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t l = toks->v.arr.strs[i].len;
        if (l > MAX_TEXT_LEN) return kv_fail(e, KV_ERR_FORMAT, "vocab: token %llu is %llu bytes long",
                                             (unsigned long long)i, (unsigned long long)l);
        total += (l ? l : 24) + 1;
    }
    if (total > 0xffffffffull) return kv_fail(e, KV_ERR_FORMAT, "vocab: token texts total %llu bytes",
                                              (unsigned long long)total);
    uint32_t tcap = pow2_at_least(2 * n);
    v->arena = malloc((size_t)total);
    v->off = malloc(n * sizeof *v->off);
    v->len = malloc(n * sizeof *v->len);
    v->score = malloc(n * sizeof *v->score);
    v->attr = malloc(n * sizeof *v->attr);
    v->eog = calloc(n, 1);
    v->ttab = tcap ? malloc((size_t)tcap * sizeof *v->ttab) : NULL;
    if (!v->arena || !v->off || !v->len || !v->score || !v->attr || !v->eog || !v->ttab)
        return kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory (%llu tokens)", (unsigned long long)n);
    memset(v->ttab, 0xff, (size_t)tcap * sizeof *v->ttab);
    v->tmask = tcap - 1;

    uint64_t *hs = malloc(n * sizeof *hs); /* (n) text hashes */
    if (!hs) return kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory (%llu tokens)", (unsigned long long)n);
    const uint8_t *sraw = scores ? scores->v.arr.raw : NULL;
    const uint8_t *traw = types ? types->v.arr.raw : NULL;
    uint32_t pos = 0;
    for (uint32_t i = 0; i < (uint32_t)n; i++) {
        kv_gguf_str s = toks->v.arr.strs[i];
        char *dst = v->arena + pos;
        uint32_t l;
        if (s.len) {
            memcpy(dst, s.ptr, (size_t)s.len);
            l = (uint32_t)s.len;
        } else {
            l = (uint32_t)snprintf(dst, 24, "[EMPTY_%u]", i);
        }
        dst[l] = '\0';
        v->off[i] = pos;
        v->len[i] = l;
        pos += l + 1;

        float f = 0.0f;
        if (sraw) {
            if (scores->v.arr.type == KV_GGUF_F32) memcpy(&f, sraw + 4 * (size_t)i, 4);
            else { int32_t x; memcpy(&x, sraw + 4 * (size_t)i, 4); f = (float)x; }
        }
        v->score[i] = f;

        int32_t t = 1;
        if (traw) memcpy(&t, traw + 4 * (size_t)i, 4);
        static const uint16_t map[7] = {0, KV_TOKEN_NORMAL, KV_TOKEN_UNKNOWN, KV_TOKEN_CONTROL,
                                        KV_TOKEN_USER_DEFINED, KV_TOKEN_UNUSED, KV_TOKEN_BYTE};
        v->attr[i] = (t >= 0 && t <= 6) ? map[t] : 0;

        hs[i] = hash_bytes(dst, l);
    }

    /* insert, prefetching the slot a few tokens ahead: the table is larger
     * than the caches and each first probe would otherwise be a miss */
    for (uint32_t i = 0; i < (uint32_t)n; i++) {
        if (i + 16 < (uint32_t)n) __builtin_prefetch(&v->ttab[(uint32_t)(hs[i + 16] >> 32) & v->tmask], 1);
        uint64_t h = hs[i];
        uint32_t tag = (uint32_t)h, l = v->len[i];
        const char *dst = v->arena + v->off[i];
        uint32_t k = (uint32_t)(h >> 32) & v->tmask;
        for (;; k = (k + 1) & v->tmask) {
            tslot t = v->ttab[k];
            if (t.id < 0) break;
            if (t.tag == tag && v->len[t.id] == l && memcmp(v->arena + v->off[t.id], dst, l) == 0) {
                free(hs);
                return kv_fail(e, KV_ERR_FORMAT, "vocab: duplicate token '%.*s' has ids %d and %u",
                               (int)(l > 64 ? 64 : l), dst, (int)t.id, i);
            }
        }
        v->ttab[k] = (tslot){tag, (int32_t)i};
    }
    free(hs);
    return KV_OK;
}

static kv_status load_merges(kv_vocab *v, const kv_gguf *g, kv_error *e) {
    const kv_gguf_value *m = NULL;
    kv_status st = kv_gguf_get_arr(g, "tokenizer.ggml.merges", KV_GGUF_STRING, &m, false, e);
    if (st != KV_OK) return st;
    if (!m) return kv_fail(e, KV_ERR_FORMAT, "vocab: BPE vocabulary without tokenizer.ggml.merges");
    uint64_t n = m->v.arr.n;
    if (n > 0x7fffffff) return kv_fail(e, KV_ERR_FORMAT, "vocab: %llu merges is too many", (unsigned long long)n);
    uint32_t cap = pow2_at_least(2 * n + 16);
    v->mkey = cap ? calloc(cap, sizeof *v->mkey) : NULL;
    v->mrank = cap ? malloc(cap * sizeof *v->mrank) : NULL;
    v->mres = cap ? malloc(cap * sizeof *v->mres) : NULL;
    if (!v->mkey || !v->mrank || !v->mres) return kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory (merges)");
    v->mmask = cap - 1;
    sbuf cat = {0};
    for (uint64_t r = 0; r < n; r++) {
        kv_gguf_str s = m->v.arr.strs[r];
        const char *sp = s.len > 1 ? memchr(s.ptr + 1, ' ', (size_t)s.len - 1) : NULL;
        if (!sp) {
            free(cat.p);
            return kv_fail(e, KV_ERR_FORMAT, "vocab: merge %llu ('%.*s') is not two tokens separated by a space",
                           (unsigned long long)r, (int)(s.len > 64 ? 64 : s.len), s.ptr);
        }
        size_t ll = (size_t)(sp - s.ptr), rl = (size_t)s.len - ll - 1;
        int32_t a = lookup(v, s.ptr, ll), b = lookup(v, sp + 1, rl);
        if (a < 0 || b < 0) {
            free(cat.p);
            const char *bad = a < 0 ? s.ptr : sp + 1;
            size_t bl = a < 0 ? ll : rl;
            return kv_fail(e, KV_ERR_FORMAT, "vocab: merge %llu names unknown token '%.*s'", (unsigned long long)r,
                           (int)(bl > 64 ? 64 : bl), bad);
        }
        cat.n = 0;
        if (!sbuf_put(&cat, s.ptr, ll) || !sbuf_put(&cat, sp + 1, rl)) {
            free(cat.p);
            return kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory (merges)");
        }
        uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
        uint32_t i = pair_slot(key) & v->mmask;
        while (v->mkey[i] && v->mkey[i] != key) i = (i + 1) & v->mmask;
        if (v->mkey[i]) continue; /* duplicate pair: the first rank stays */
        v->mkey[i] = key;
        v->mrank[i] = (int32_t)r;
        v->mres[i] = lookup(v, cat.p, cat.n);
    }
    free(cat.p);
    return KV_OK;
}

kv_status kv_vocab_load(const kv_gguf *g, kv_vocab **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "vocab: out must not be NULL");
    *out = NULL;
    if (!g) return kv_fail(e, KV_ERR_ARG, "vocab: no GGUF");

    kv_gguf_str model = {0}, pre = {0};
    kv_status st = kv_gguf_get_str(g, "tokenizer.ggml.model", &model, false, e);
    if (st != KV_OK) return st;
    if (!model.ptr || kv_gguf_str_eq(model, "no") || kv_gguf_str_eq(model, "none") ||
        kv_gguf_str_eq(model, "no_vocab"))
        return KV_OK; /* no tokenizer */
    if ((st = kv_gguf_get_str(g, "tokenizer.ggml.pre", &pre, false, e)) != KV_OK) return st;

    kv_vocab *v = calloc(1, sizeof *v);
    if (!v) return kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory");
    v->sp = (kv_vocab_special){-1, -1, -1, -1, -1, -1, -1, -1, -1, false, false, false};
    v->fim_pre = v->fim_suf = v->fim_mid = v->fim_pad = v->fim_rep = v->fim_sep = -1;
    init_byte_tables(v);

    if (kv_gguf_str_eq(model, "llama")) {
        v->type = VT_SPM;
        strcpy(v->model_name, "llama");
        v->sp.bos = 1;
        v->sp.eos = 2;
        v->sp.unk = 0;
        v->sp.add_space_prefix = true;
        v->sp.add_bos = true;
        v->clean_spaces = false;
        if (pre.ptr && pre.len) str_copy(v->pre_name, sizeof v->pre_name, pre);
        else strcpy(v->pre_name, "default");
    } else if (kv_gguf_str_eq(model, "gpt2")) {
        v->type = VT_BPE;
        strcpy(v->model_name, "gpt2");
        v->sp.bos = 11;
        v->sp.eos = 11;
        v->clean_spaces = true;
        if (pre.ptr && pre.len) {
            if (pre.len >= sizeof v->pre_name) {
                kv_vocab_free(v);
                return kv_fail(e, KV_ERR_UNSUPPORTED, "vocab: pre-tokenizer '%.*s' is not supported", 64, pre.ptr);
            }
            str_copy(v->pre_name, sizeof v->pre_name, pre);
        } else {
            strcpy(v->pre_name, "default");
        }
        v->pretok_kind = kv_pretok_kind(v->pre_name);
        if (v->pretok_kind < 0) {
            st = kv_fail(e, KV_ERR_UNSUPPORTED, "vocab: pre-tokenizer '%s' is not supported", v->pre_name);
            kv_vocab_free(v);
            return st;
        }
        pre_flags(v, v->pre_name);
    } else {
        kv_vocab_free(v);
        return kv_fail(e, KV_ERR_UNSUPPORTED, "vocab: tokenizer model '%.*s' is not supported (only llama and gpt2)",
                       (int)(model.len > 64 ? 64 : model.len), model.ptr);
    }
    bool b;
    if ((st = kv_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b, false, e)) != KV_OK) goto fail;
    if (kv_gguf_get(g, "tokenizer.ggml.add_space_prefix")) v->sp.add_space_prefix = b;

    if ((st = load_tokens(v, g, e)) != KV_OK) goto fail;
    if (v->type == VT_BPE && (st = load_merges(v, g, e)) != KV_OK) goto fail;

    /* byte fallback ids */
    for (int c = 0; c < 256; c++) {
        char buf[8];
        if (v->type == VT_SPM) {
            static const char hex[] = "0123456789ABCDEF";
            memcpy(buf, "<0x", 3);
            buf[3] = hex[c >> 4];
            buf[4] = hex[c & 15];
            buf[5] = '>';
            buf[6] = '\0';
            int32_t id = lookup_cstr(v, buf);
            if (id < 0) { buf[0] = (char)c; id = lookup(v, buf, 1); }
            v->byte_tok[c] = id;
        } else {
            v->byte_tok[c] = lookup(v, v->benc[c], v->benc_len[c]);
        }
    }

    /* SPM pieces: bytes that some token has right before a "▁" */
    if (v->type == VT_SPM) {
        for (int32_t i = 0; i < v->n; i++) {
            const unsigned char *t = (const unsigned char *)tok_text(v, i);
            for (uint32_t k = 1; k + 3 <= v->len[i]; k++)
                if (t[k] == 0xe2 && t[k + 1] == 0x96 && t[k + 2] == 0x81) v->spm_nosplit[t[k - 1]] = 1;
        }
    }

    /* defaults out of range are disabled; explicit ids out of range are errors */
    int32_t *defaults[] = {&v->sp.bos, &v->sp.eos, &v->sp.unk};
    for (int i = 0; i < 3; i++)
        if (*defaults[i] >= v->n) *defaults[i] = -1;
    static const struct { const char *key; size_t off; } keys[] = {
        {"tokenizer.ggml.bos_token_id", offsetof(kv_vocab, sp.bos)},
        {"tokenizer.ggml.eos_token_id", offsetof(kv_vocab, sp.eos)},
        {"tokenizer.ggml.eot_token_id", offsetof(kv_vocab, sp.eot)},
        {"tokenizer.ggml.eom_token_id", offsetof(kv_vocab, sp.eom)},
        {"tokenizer.ggml.unknown_token_id", offsetof(kv_vocab, sp.unk)},
        {"tokenizer.ggml.seperator_token_id", offsetof(kv_vocab, sp.sep)},
        {"tokenizer.ggml.padding_token_id", offsetof(kv_vocab, sp.pad)},
        {"tokenizer.ggml.mask_token_id", offsetof(kv_vocab, sp.mask)},
        {"tokenizer.ggml.fim_pre_token_id", offsetof(kv_vocab, fim_pre)},
        {"tokenizer.ggml.fim_suf_token_id", offsetof(kv_vocab, fim_suf)},
        {"tokenizer.ggml.fim_mid_token_id", offsetof(kv_vocab, fim_mid)},
        {"tokenizer.ggml.fim_pad_token_id", offsetof(kv_vocab, fim_pad)},
        {"tokenizer.ggml.fim_rep_token_id", offsetof(kv_vocab, fim_rep)},
        {"tokenizer.ggml.fim_sep_token_id", offsetof(kv_vocab, fim_sep)},
        {"tokenizer.ggml.prefix_token_id", offsetof(kv_vocab, fim_pre)},
        {"tokenizer.ggml.suffix_token_id", offsetof(kv_vocab, fim_suf)},
        {"tokenizer.ggml.middle_token_id", offsetof(kv_vocab, fim_mid)},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if ((st = read_special(g, v, keys[i].key, (int32_t *)((char *)v + keys[i].off), e)) != KV_OK) goto fail;

    static const struct { const char *key; int which; } flags[] = {
        {"tokenizer.ggml.add_bos_token", 0}, {"tokenizer.ggml.add_eos_token", 1}, {"tokenizer.ggml.add_sep_token", 2}};
    for (int i = 0; i < 3; i++) {
        if (!kv_gguf_get(g, flags[i].key)) continue;
        if ((st = kv_gguf_get_bool(g, flags[i].key, &b, true, e)) != KV_OK) goto fail;
        if (flags[i].which == 0) v->sp.add_bos = b;
        else if (flags[i].which == 1) v->sp.add_eos = b;
        else v->add_sep = b;
    }
    if (v->sp.add_bos && v->sp.bos < 0) {
        st = kv_fail(e, KV_ERR_FORMAT, "vocab: tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set");
        goto fail;
    }
    if (v->sp.add_eos && v->sp.eos < 0) {
        st = kv_fail(e, KV_ERR_FORMAT, "vocab: tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set");
        goto fail;
    }

    finish_specials(v);
    if ((st = build_specials(v, e)) != KV_OK) goto fail;
    name_attrs(v, g);

    /* newline token: SPM byte token for '\n' (else pad); BPE: first id of "\n" */
    if (v->type == VT_SPM) {
        v->sp.nl = v->byte_tok['\n'] >= 0 ? v->byte_tok['\n'] : v->sp.pad;
    } else {
        scratch w = {0};
        ivec ids = {0};
        kv_error e2;
        kv_status s2 = bpe_fragment(v, &w, "\n", 1, &ids, &e2);
        if (s2 == KV_OK && ids.n) v->sp.nl = ids.p[0];
        else v->sp.nl = v->sp.pad;
        scratch_free(&w);
        free(ids.p);
        if (s2 == KV_ERR_NOMEM) { /* not "no newline token": a vocabulary unlike the file's */
            st = kv_fail(e, KV_ERR_NOMEM, "vocab: out of memory finding the newline token");
            goto fail;
        }
    }
    *out = v;
    return KV_OK;

fail:
    kv_vocab_free(v);
    return st;
}

/* ==== accessors ============================================================ */

int32_t kv_vocab_n(const kv_vocab *v) { return v ? v->n : 0; }

const kv_vocab_special *kv_vocab_specials(const kv_vocab *v) { return v ? &v->sp : NULL; }

const char *kv_vocab_model_name(const kv_vocab *v) { return v ? v->model_name : NULL; }

const char *kv_vocab_pre_name(const kv_vocab *v) { return v ? v->pre_name : NULL; }

const char *kv_vocab_text(const kv_vocab *v, int32_t id, size_t *len) {
    if (!v || id < 0 || id >= v->n) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = v->len[id];
    return tok_text(v, id);
}

int kv_vocab_attr(const kv_vocab *v, int32_t id) {
    if (!v || id < 0 || id >= v->n) return 0;
    return v->attr[id] & ATTR_PUBLIC;
}

bool kv_vocab_is_eog(const kv_vocab *v, int32_t id) {
    return v && id >= 0 && id < v->n && v->eog[id];
}
