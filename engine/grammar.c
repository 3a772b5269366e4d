/*
 * grammar.c — GBNF grammars for constrained generation: the compiler, the
 * pushdown runtime and the token masks (see grammar.h for the contract).
 *
 * Compiled form (as llama.cpp's): one array of elements, code[]. Rule r is
 * its alternatives back to back from rule_start[r], each a sequence of
 * elements ended by ALT (another alternative follows) or END (the last).
 * An element is a character class (CHAR, an index into classes[]) or a
 * reference to a rule (REF). Repetitions are expanded into helper rules,
 * right-recursive (R ::= S R | ""), so nothing recurses on the left.
 *
 * Runtime: a stack is a list of positions in code[], the top being the
 * character class to match next and each one below the place to continue
 * once the rule above it completes; the empty stack has matched a whole
 * sentence. Stacks are hash-consed into nodes (position, parent), so a
 * stack is one node id and a push or pop costs a table lookup. A state of
 * the parse is a set of stacks (sorted node ids, interned: one set id)
 * plus the pending bytes of a code point split across tokens; those pairs
 * are interned too ("automaton states"), and the successor of a state on
 * one byte is memoized in a row of 256 entries: the automaton is built
 * lazily, as generation visits it. A token mask is one walk of the
 * vocabulary's trie (preorder, with skip pointers) in which each node
 * costs one row lookup and a dead state skips its subtree; the mask of a
 * state is cached, so a state seen again (inside a string, a list, a
 * number) costs a copy.
 *
 * Bounds: every table has a limit (grammar.h); the memo rows and the mask
 * cache are caches and are dropped when they grow past theirs. Nothing
 * here recurses on input: expansion runs on a work list, the checks on an
 * explicit stack.
 */
#include "grammar.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvlua.h"

/* ==== small helpers ======================================================= */

typedef struct {
    uint32_t *v;
    size_t n, cap;
} u32vec;

static bool u32_push(u32vec *a, uint32_t x) {
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        uint32_t *nv = realloc(a->v, nc * sizeof *nv);
        if (!nv) return false;
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = x;
    return true;
}

/* Grows *p (an array of *cap elements of size sz) to hold at least need. */
static bool grow(void **p, size_t *cap, size_t need, size_t sz) {
    if (need <= *cap) return true;
    size_t nc = *cap ? *cap : 16;
    while (nc < need) nc *= 2;
    void *np = realloc(*p, nc * sz);
    if (!np) return false;
    *p = np;
    *cap = nc;
    return true;
}

static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* Open addressing map: nonzero uint64 keys -> uint32 values. */
typedef struct {
    uint64_t *keys;
    uint32_t *vals;
    size_t cap, n; /* cap: power of two */
} u64map;

static uint32_t *map_find(u64map *m, uint64_t key) {
    if (!m->cap) return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
        if (m->keys[i] == key) return &m->vals[i];
        if (m->keys[i] == 0) return NULL;
    }
}

static bool map_put(u64map *m, uint64_t key, uint32_t val) {
    if (2 * (m->n + 1) > m->cap) {
        size_t nc = m->cap ? m->cap * 2 : 64;
        uint64_t *nk = calloc(nc, sizeof *nk);
        uint32_t *nv = malloc(nc * sizeof *nv);
        if (!nk || !nv) {
            free(nk);
            free(nv);
            return false;
        }
        for (size_t i = 0; i < m->cap; i++) {
            if (!m->keys[i]) continue;
            size_t j = mix64(m->keys[i]) & (nc - 1);
            while (nk[j]) j = (j + 1) & (nc - 1);
            nk[j] = m->keys[i];
            nv[j] = m->vals[i];
        }
        free(m->keys);
        free(m->vals);
        m->keys = nk;
        m->vals = nv;
        m->cap = nc;
    }
    size_t mask = m->cap - 1;
    size_t i = mix64(key) & mask;
    while (m->keys[i] && m->keys[i] != key) i = (i + 1) & mask;
    if (!m->keys[i]) m->n++;
    m->keys[i] = key;
    m->vals[i] = val;
    return true;
}

static void map_free(u64map *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

/* ==== compiled grammar ==================================================== */

enum { E_END = 0, E_ALT = 1, E_REF = 2, E_CHAR = 3 };
#define EL(t, v) (((uint32_t)(t) << 30) | (uint32_t)(v))
#define EL_T(x) ((x) >> 30)
#define EL_V(x) ((x)&0x3fffffffu)
#define IS_END(x) (EL_T(x) <= E_ALT)

#define CP_MAX 0x10FFFFu

typedef struct {
    uint32_t lo, hi;
} g_range;

typedef struct {
    uint32_t r0, nr; /* ranges[r0 .. r0 + nr): sorted, merged */
    bool neg;
    uint32_t ascii[4]; /* matches of code points 0..127, negation applied */
} g_class;

struct kv_grammar {
    int refs;
    uint32_t *code; /* elements of every rule */
    size_t n_code;
    int n_rules;
    uint32_t *rule_start;          /* first element of rule r */
    uint32_t *alt0, *alts;         /* alternatives of rule r: alts[alt0[r] .. alt0[r + 1]) (positions) */
    g_class *classes;
    size_t n_classes;
    g_range *ranges;
    size_t n_ranges;
    char **names; /* rule names (helper rules: parent-N) */
    uint32_t root;
};

static bool class_match(const kv_grammar *g, uint32_t ci, uint32_t cp) {
    const g_class *c = &g->classes[ci];
    if (cp < 128) return (c->ascii[cp >> 5] >> (cp & 31)) & 1;
    const g_range *r = g->ranges + c->r0;
    size_t lo = 0, hi = c->nr;
    bool in = false;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < r[mid].lo) hi = mid;
        else if (cp > r[mid].hi) lo = mid + 1;
        else { in = true; break; }
    }
    return in != c->neg;
}

/* Whether the class matches some code point in [lo, hi]. */
static bool class_meets(const kv_grammar *g, uint32_t ci, uint32_t lo, uint32_t hi) {
    const g_class *c = &g->classes[ci];
    const g_range *r = g->ranges + c->r0;
    if (!c->neg) {
        for (uint32_t i = 0; i < c->nr; i++)
            if (r[i].lo <= hi && r[i].hi >= lo) return true;
        return false;
    }
    for (uint32_t i = 0; i < c->nr; i++) /* negated: unless one merged range covers [lo, hi] */
        if (r[i].lo <= lo && r[i].hi >= hi) return false;
    return true;
}

static bool class_empty(const kv_grammar *g, uint32_t ci) {
    return !class_meets(g, ci, 0, CP_MAX);
}

void kv_grammar_free(kv_grammar *g) {
    if (!g || --g->refs > 0) return;
    free(g->code);
    free(g->rule_start);
    free(g->alt0);
    free(g->alts);
    free(g->classes);
    free(g->ranges);
    if (g->names)
        for (int i = 0; i < g->n_rules; i++) free(g->names[i]);
    free(g->names);
    free(g);
}

int kv_grammar_n_rules(const kv_grammar *g) { return g->n_rules; }

/* ==== parser ============================================================== */

#define NO_POS SIZE_MAX

typedef struct {
    const char *src;
    size_t len, pos;
    kv_error *e;
    kv_status st; /* first failure */
    /* rules being built */
    u32vec *rules;
    char **names;
    size_t *def_at, *ref_at; /* where defined (NO_POS: not yet) / first referenced */
    uint32_t n_rules;
    size_t cap_rules;
    uint32_t cur;     /* the rule being defined (helper rules are named after it) */
    uint32_t helpers; /* helper rules made so far */
    u64map names_ht;  /* name hash -> rule id + 1 chain (hash collisions resolved by strcmp) */
    g_class *classes;
    size_t n_classes, cap_classes;
    g_range *ranges;
    size_t n_ranges, cap_ranges;
    size_t n_elements;
    int depth;
} g_parser;

static void line_col(const char *src, size_t at, int *line, int *col) {
    int l = 1, c = 1;
    for (size_t i = 0; i < at; i++) {
        if (src[i] == '\n') {
            l++;
            c = 1;
        } else if (((unsigned char)src[i] & 0xC0) != 0x80) {
            c++;
        }
    }
    *line = l;
    *col = c;
}

static bool __attribute__((format(printf, 3, 4))) perr(g_parser *p, size_t at, const char *fmt, ...) {
    if (p->st != KV_OK) return false;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int l, c;
    line_col(p->src, at > p->len ? p->len : at, &l, &c);
    kv_fail(p->e, KV_ERR_FORMAT, "line %d, column %d: %s", l, c, msg);
    p->st = KV_ERR_FORMAT;
    return false;
}

static bool pnomem(g_parser *p) {
    if (p->st == KV_OK) {
        kv_fail(p->e, KV_ERR_NOMEM, "grammar: out of memory");
        p->st = KV_ERR_NOMEM;
    }
    return false;
}

static uint64_t name_hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h | 1;
}

/* A new rule (name: n bytes of s), or UINT32_MAX on failure. */
static uint32_t new_rule(g_parser *p, const char *s, size_t n, size_t at) {
    if (p->n_rules >= KV_GRAMMAR_MAX_RULES) {
        perr(p, at, "more than %d rules (repetitions and groups count)", KV_GRAMMAR_MAX_RULES);
        return UINT32_MAX;
    }
    if (p->n_rules == p->cap_rules) {
        size_t nc = p->cap_rules ? p->cap_rules * 2 : 32;
        u32vec *nr = realloc(p->rules, nc * sizeof *nr);
        if (nr) p->rules = nr;
        char **nn = realloc(p->names, nc * sizeof *nn);
        if (nn) p->names = nn;
        size_t *nd = realloc(p->def_at, nc * sizeof *nd);
        if (nd) p->def_at = nd;
        size_t *nf = realloc(p->ref_at, nc * sizeof *nf);
        if (nf) p->ref_at = nf;
        if (!nr || !nn || !nd || !nf) {
            pnomem(p);
            return UINT32_MAX;
        }
        p->cap_rules = nc;
    }
    uint32_t id = p->n_rules;
    char *name = malloc(n + 1);
    if (!name) {
        pnomem(p);
        return UINT32_MAX;
    }
    memcpy(name, s, n);
    name[n] = '\0';
    memset(&p->rules[id], 0, sizeof p->rules[id]);
    p->names[id] = name;
    p->def_at[id] = NO_POS;
    p->ref_at[id] = NO_POS;
    p->n_rules++;
    return id;
}

/* The rule named s (created, undefined, when new). */
static uint32_t named_rule(g_parser *p, const char *s, size_t n, size_t at) {
    uint64_t h = name_hash(s, n);
    for (uint64_t k = h;; k = mix64(k) | 1) { /* chain through rehashed keys on a collision */
        uint32_t *v = map_find(&p->names_ht, k);
        if (!v) {
            uint32_t id = new_rule(p, s, n, at);
            if (id == UINT32_MAX) return id;
            if (!map_put(&p->names_ht, k, id)) {
                pnomem(p);
                return UINT32_MAX;
            }
            return id;
        }
        if (strlen(p->names[*v]) == n && memcmp(p->names[*v], s, n) == 0) return *v;
    }
}

static uint32_t helper_rule(g_parser *p, size_t at) {
    char buf[300];
    int k = snprintf(buf, sizeof buf, "%.200s-%u", p->names[p->cur], ++p->helpers);
    uint32_t id = new_rule(p, buf, (size_t)k, at);
    if (id != UINT32_MAX) p->def_at[id] = at;
    return id;
}

static bool add_el(g_parser *p, u32vec *seq, uint32_t el) {
    if (++p->n_elements > KV_GRAMMAR_MAX_ELEMENTS)
        return perr(p, p->pos, "grammar too large: more than %d elements once repetitions are expanded",
                    KV_GRAMMAR_MAX_ELEMENTS);
    return u32_push(seq, el) || pnomem(p);
}

static bool is_word(int c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

static void skip_space(g_parser *p, bool newline_ok) {
    while (p->pos < p->len) {
        char c = p->src[p->pos];
        if (c == '#') {
            while (p->pos < p->len && p->src[p->pos] != '\n' && p->src[p->pos] != '\r') p->pos++;
        } else if (c == ' ' || c == '\t' || (newline_ok && (c == '\n' || c == '\r'))) {
            p->pos++;
        } else {
            break;
        }
    }
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One character of a literal or class (an escape or a UTF-8 sequence). */
static bool parse_char(g_parser *p, uint32_t *cp) {
    const unsigned char *s = (const unsigned char *)p->src;
    size_t at = p->pos;
    if (s[at] == '\\') {
        if (at + 1 >= p->len) return perr(p, at, "unfinished escape at the end of the text");
        char c = (char)s[at + 1];
        int nhex = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
        if (nhex) {
            uint32_t v = 0;
            for (int i = 0; i < nhex; i++) {
                int h = at + 2 + (size_t)i < p->len ? hexval(p->src[at + 2 + i]) : -1;
                if (h < 0) return perr(p, at, "escape \\%c needs %d hexadecimal digits", c, nhex);
                v = v << 4 | (uint32_t)h;
            }
            if (v > CP_MAX) return perr(p, at, "escape names U+%X, beyond U+10FFFF", v);
            *cp = v;
            p->pos = at + 2 + (size_t)nhex;
            return true;
        }
        switch (c) {
        case 'n': *cp = '\n'; break;
        case 'r': *cp = '\r'; break;
        case 't': *cp = '\t'; break;
        case '\\': case '"': case '[': case ']': case '-': case '^': case '/': case '\'': case '.':
        case '(': case ')': case '{': case '}': case '*': case '+': case '?': case '|':
            *cp = (uint32_t)c;
            break;
        default:
            return perr(p, at, "unknown escape '\\%c'", c);
        }
        p->pos = at + 2;
        return true;
    }
    unsigned char b = s[at];
    int n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (!n || at + (size_t)n > p->len) return perr(p, at, "invalid UTF-8 in the grammar text");
    uint32_t v = n == 1 ? b : n == 2 ? b & 0x1fu : n == 3 ? b & 0x0fu : b & 0x07u;
    for (int i = 1; i < n; i++) {
        if ((s[at + i] & 0xC0) != 0x80) return perr(p, at, "invalid UTF-8 in the grammar text");
        v = v << 6 | (s[at + i] & 0x3fu);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[n] || v > CP_MAX || (v >= 0xD800 && v <= 0xDFFF))
        return perr(p, at, "invalid UTF-8 in the grammar text");
    *cp = v;
    p->pos = at + (size_t)n;
    return true;
}

static int range_cmp(const void *a, const void *b) {
    const g_range *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : 0;
}

/* A class of the ranges ranges[r0 ..] (sorted and merged here). */
static uint32_t add_class(g_parser *p, size_t r0, bool neg) {
    g_range *r = p->ranges + r0;
    size_t n = p->n_ranges - r0;
    qsort(r, n, sizeof *r, range_cmp);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (k && r[i].lo <= r[k - 1].hi + 1) {
            if (r[i].hi > r[k - 1].hi) r[k - 1].hi = r[i].hi;
        } else {
            r[k++] = r[i];
        }
    }
    p->n_ranges = r0 + k;
    if (!grow((void **)&p->classes, &p->cap_classes, p->n_classes + 1, sizeof *p->classes)) {
        pnomem(p);
        return UINT32_MAX;
    }
    g_class *c = &p->classes[p->n_classes];
    memset(c, 0, sizeof *c);
    c->r0 = (uint32_t)r0;
    c->nr = (uint32_t)k;
    c->neg = neg;
    for (uint32_t cp = 0; cp < 128; cp++) {
        bool in = false;
        for (size_t i = 0; i < k; i++)
            if (cp >= r[i].lo && cp <= r[i].hi) in = true;
        if (in != neg) c->ascii[cp >> 5] |= 1u << (cp & 31);
    }
    return (uint32_t)p->n_classes++;
}

static bool add_range(g_parser *p, uint32_t lo, uint32_t hi) {
    if (!grow((void **)&p->ranges, &p->cap_ranges, p->n_ranges + 1, sizeof *p->ranges)) return pnomem(p);
    p->ranges[p->n_ranges++] = (g_range){lo, hi};
    return true;
}

static bool parse_alternates(g_parser *p, uint32_t rule, bool nested);

/* x{m,n} etc. on the elements seq[last ..): m copies, then n - m nested
 * optional copies (unbounded: one right-recursive rule). */
static bool repeat(g_parser *p, u32vec *seq, size_t last, uint32_t m, uint32_t n, size_t at) {
    size_t k = seq->n - last;
    uint32_t *prev = malloc(k * sizeof *prev);
    if (!prev) return pnomem(p);
    memcpy(prev, seq->v + last, k * sizeof *prev);
    seq->n = last;
    p->n_elements -= k;
    bool ok = true;
    for (uint32_t i = 0; i < m && ok; i++)
        for (size_t j = 0; j < k && ok; j++) ok = add_el(p, seq, prev[j]);
    if (ok && n == UINT32_MAX) {
        uint32_t r = helper_rule(p, at);
        ok = r != UINT32_MAX;
        for (size_t j = 0; j < k && ok; j++) ok = add_el(p, &p->rules[r], prev[j]);
        ok = ok && add_el(p, &p->rules[r], EL(E_REF, r)) && add_el(p, &p->rules[r], EL(E_ALT, 0)) &&
             add_el(p, &p->rules[r], EL(E_END, 0)) && add_el(p, seq, EL(E_REF, r));
    } else if (ok && n > m) {
        uint32_t last_r = UINT32_MAX;
        for (uint32_t i = 0; i < n - m && ok; i++) {
            uint32_t r = helper_rule(p, at);
            ok = r != UINT32_MAX;
            for (size_t j = 0; j < k && ok; j++) ok = add_el(p, &p->rules[r], prev[j]);
            if (ok && i > 0) ok = add_el(p, &p->rules[r], EL(E_REF, last_r));
            ok = ok && add_el(p, &p->rules[r], EL(E_ALT, 0)) && add_el(p, &p->rules[r], EL(E_END, 0));
            last_r = r;
        }
        ok = ok && add_el(p, seq, EL(E_REF, last_r));
    }
    free(prev);
    return ok;
}

static bool parse_count(g_parser *p, uint32_t *out) {
    size_t at = p->pos;
    uint64_t v = 0;
    if (p->pos >= p->len || p->src[p->pos] < '0' || p->src[p->pos] > '9')
        return perr(p, at, "expected a number in the repetition");
    while (p->pos < p->len && p->src[p->pos] >= '0' && p->src[p->pos] <= '9') {
        if (v < 1000000000u) v = v * 10 + (uint64_t)(p->src[p->pos] - '0');
        p->pos++;
    }
    if (v > KV_GRAMMAR_MAX_REPEAT)
        return perr(p, at, "repetition count %llu is above the limit %d", (unsigned long long)v,
                    KV_GRAMMAR_MAX_REPEAT);
    *out = (uint32_t)v;
    return true;
}

static bool parse_sequence(g_parser *p, u32vec *seq, bool nested) {
    size_t last = seq->n; /* start of the last symbol (what a repetition repeats) */
    bool have_last = false;
    while (p->pos < p->len && p->st == KV_OK) {
        size_t at = p->pos;
        char c = p->src[at];
        if (c == '"') {
            p->pos++;
            last = seq->n;
            have_last = true;
            while (p->pos < p->len && p->src[p->pos] != '"') {
                uint32_t cp;
                if (!parse_char(p, &cp)) return false;
                size_t r0 = p->n_ranges;
                if (!add_range(p, cp, cp)) return false;
                uint32_t ci = add_class(p, r0, false);
                if (ci == UINT32_MAX || !add_el(p, seq, EL(E_CHAR, ci))) return false;
            }
            if (p->pos >= p->len) return perr(p, at, "unterminated string literal");
            p->pos++;
        } else if (c == '[') {
            p->pos++;
            bool neg = p->pos < p->len && p->src[p->pos] == '^';
            if (neg) p->pos++;
            size_t r0 = p->n_ranges;
            while (p->pos < p->len && p->src[p->pos] != ']') {
                size_t ra = p->pos;
                uint32_t lo, hi;
                if (!parse_char(p, &lo)) return false;
                hi = lo;
                if (p->pos + 1 < p->len && p->src[p->pos] == '-' && p->src[p->pos + 1] != ']') {
                    p->pos++;
                    if (!parse_char(p, &hi)) return false;
                    if (hi < lo) return perr(p, ra, "character range ends before it starts");
                }
                if (!add_range(p, lo, hi)) return false;
            }
            if (p->pos >= p->len) return perr(p, at, "unterminated character class");
            p->pos++;
            if (p->n_ranges == r0 && !neg) return perr(p, at, "empty character class []");
            uint32_t ci = add_class(p, r0, neg);
            last = seq->n;
            have_last = true;
            if (ci == UINT32_MAX || !add_el(p, seq, EL(E_CHAR, ci))) return false;
        } else if (c == '.') {
            p->pos++;
            uint32_t ci = add_class(p, p->n_ranges, true);
            last = seq->n;
            have_last = true;
            if (ci == UINT32_MAX || !add_el(p, seq, EL(E_CHAR, ci))) return false;
        } else if (is_word((unsigned char)c)) {
            size_t e = at;
            while (e < p->len && is_word((unsigned char)p->src[e])) e++;
            /* a name followed by ::= starts the next rule: the sequence ends */
            size_t k = e;
            while (k < p->len && (p->src[k] == ' ' || p->src[k] == '\t')) k++;
            if (k + 3 <= p->len && memcmp(p->src + k, "::=", 3) == 0)
                return perr(p, at, "rule '%.*s' starts before the previous rule ended (missing newline?)",
                            (int)(e - at), p->src + at);
            uint32_t r = named_rule(p, p->src + at, e - at, at);
            if (r == UINT32_MAX) return false;
            if (p->ref_at[r] == NO_POS) p->ref_at[r] = at;
            p->pos = e;
            last = seq->n;
            have_last = true;
            if (!add_el(p, seq, EL(E_REF, r))) return false;
        } else if (c == '(') {
            if (p->depth >= KV_GRAMMAR_MAX_NESTING)
                return perr(p, at, "groups nested deeper than %d", KV_GRAMMAR_MAX_NESTING);
            p->pos++;
            skip_space(p, true);
            uint32_t r = helper_rule(p, at);
            if (r == UINT32_MAX) return false;
            p->depth++;
            if (!parse_alternates(p, r, true)) return false;
            p->depth--;
            if (p->pos >= p->len || p->src[p->pos] != ')') return perr(p, at, "unclosed '('");
            p->pos++;
            last = seq->n;
            have_last = true;
            if (!add_el(p, seq, EL(E_REF, r))) return false;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (!have_last || last == seq->n) return perr(p, at, "'%c' has nothing to repeat", c);
            uint32_t m = 0, n = UINT32_MAX;
            p->pos++;
            if (c == '+') m = 1;
            else if (c == '?') n = 1;
            else if (c == '{') {
                skip_space(p, nested);
                if (!parse_count(p, &m)) return false;
                skip_space(p, nested);
                n = m;
                if (p->pos < p->len && p->src[p->pos] == ',') {
                    p->pos++;
                    skip_space(p, nested);
                    n = UINT32_MAX;
                    if (p->pos < p->len && p->src[p->pos] >= '0' && p->src[p->pos] <= '9') {
                        if (!parse_count(p, &n)) return false;
                        if (n < m) return perr(p, at, "repetition {%u,%u}: the maximum is below the minimum", m, n);
                    }
                    skip_space(p, nested);
                }
                if (p->pos >= p->len || p->src[p->pos] != '}') return perr(p, at, "expected '}' to close '{'");
                p->pos++;
            }
            if (!repeat(p, seq, last, m, n, at)) return false;
            have_last = false; /* x** is an error, as in llama.cpp's parser */
        } else {
            break;
        }
        skip_space(p, nested);
    }
    return p->st == KV_OK;
}

static bool parse_alternates(g_parser *p, uint32_t rule, bool nested) {
    u32vec body = {0};
    bool ok = parse_sequence(p, &body, nested);
    while (ok && p->pos < p->len && p->src[p->pos] == '|') {
        ok = add_el(p, &body, EL(E_ALT, 0));
        p->pos++;
        skip_space(p, true);
        ok = ok && parse_sequence(p, &body, nested);
    }
    ok = ok && add_el(p, &body, EL(E_END, 0));
    if (!ok) {
        free(body.v);
        return false;
    }
    free(p->rules[rule].v);
    p->rules[rule] = body;
    return true;
}

static bool parse_grammar(g_parser *p) {
    skip_space(p, true);
    while (p->pos < p->len && p->st == KV_OK) {
        size_t at = p->pos;
        size_t e = at;
        while (e < p->len && is_word((unsigned char)p->src[e])) e++;
        if (e == at) return perr(p, at, "expected a rule name");
        p->pos = e;
        skip_space(p, false);
        if (p->pos + 3 > p->len || memcmp(p->src + p->pos, "::=", 3) != 0)
            return perr(p, p->pos, "expected '::=' after the rule name '%.*s'", (int)(e - at), p->src + at);
        p->pos += 3;
        skip_space(p, true);
        uint32_t r = named_rule(p, p->src + at, e - at, at);
        if (r == UINT32_MAX) return false;
        if (p->def_at[r] != NO_POS) {
            int l, c;
            line_col(p->src, p->def_at[r], &l, &c);
            return perr(p, at, "rule '%s' is defined twice (first at line %d, column %d)", p->names[r], l, c);
        }
        p->def_at[r] = at;
        p->cur = r;
        p->helpers = 0;
        if (!parse_alternates(p, r, false)) return false;
        if (p->pos < p->len && p->src[p->pos] != '\n' && p->src[p->pos] != '\r') {
            char c = p->src[p->pos];
            if (c == ')') return perr(p, p->pos, "unexpected ')' without a matching '('");
            return perr(p, p->pos, "unexpected '%c'", c);
        }
        skip_space(p, true);
    }
    return p->st == KV_OK;
}

/* ==== checks: undefined rules, left recursion, empty language ============= */

static bool check_grammar(g_parser *p, kv_grammar *g) {
    int n = g->n_rules;
    /* nullable / productive by fixed point */
    bool *nullable = calloc((size_t)n, 1), *productive = calloc((size_t)n, 1);
    uint32_t *edge0 = NULL, *edges = NULL, *stk = NULL, *at = NULL;
    uint8_t *color = NULL;
    bool ok = false;
    if (!nullable || !productive) goto nomem;
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < n; r++) {
            for (uint32_t a = g->alt0[r]; a < g->alt0[r + 1]; a++) {
                bool nul = true, prod = true;
                for (uint32_t i = g->alts[a]; !IS_END(g->code[i]); i++) {
                    uint32_t el = g->code[i];
                    if (EL_T(el) == E_CHAR) {
                        nul = false;
                        if (class_empty(g, EL_V(el))) prod = false;
                    } else {
                        if (!nullable[EL_V(el)]) nul = false;
                        if (!productive[EL_V(el)]) prod = false;
                    }
                }
                if (nul && !nullable[r]) nullable[r] = changed = true;
                if (prod && !productive[r]) productive[r] = changed = true;
            }
        }
    }
    /* edges r -> s where s can come first in r (everything before it nullable) */
    edge0 = malloc(((size_t)n + 1) * sizeof *edge0);
    u32vec ev = {0};
    if (!edge0) goto nomem;
    for (int r = 0; r < n; r++) {
        edge0[r] = (uint32_t)ev.n;
        for (uint32_t a = g->alt0[r]; a < g->alt0[r + 1]; a++) {
            for (uint32_t i = g->alts[a]; !IS_END(g->code[i]); i++) {
                uint32_t el = g->code[i];
                if (EL_T(el) == E_CHAR) break;
                if (!u32_push(&ev, EL_V(el))) goto nomem_ev;
                if (!nullable[EL_V(el)]) break;
            }
        }
    }
    edge0[n] = (uint32_t)ev.n;
    edges = ev.v;
    /* cycles: iterative DFS, colors 0 white 1 on the path 2 done */
    color = calloc((size_t)n, 1);
    stk = malloc((size_t)n * sizeof *stk);
    at = malloc((size_t)n * sizeof *at);
    if (!color || !stk || !at) goto nomem;
    for (int s = 0; s < n; s++) {
        if (color[s]) continue;
        int sp = 0;
        stk[sp] = (uint32_t)s;
        at[sp] = edge0[s];
        color[s] = 1;
        sp = 1;
        while (sp > 0) {
            uint32_t r = stk[sp - 1];
            if (at[sp - 1] == edge0[r + 1]) {
                color[r] = 2;
                sp--;
                continue;
            }
            uint32_t t = edges[at[sp - 1]++];
            if (color[t] == 1) { /* a cycle: t .. r on the path */
                char path[300];
                size_t k = 0;
                int from = sp - 1;
                while (stk[from] != t) from--;
                for (int i = from; i < sp && k < 200; i++)
                    k += (size_t)snprintf(path + k, sizeof path - k, "%s -> ", g->names[stk[i]]);
                snprintf(path + k, sizeof path - k, "%s", g->names[t]);
                perr(p, p->def_at[t], "left recursion: rule '%s' can reach itself without consuming input (%s)",
                     g->names[t], path);
                goto out;
            }
            if (color[t] == 0) {
                color[t] = 1;
                stk[sp] = t;
                at[sp] = edge0[t];
                sp++;
            }
        }
    }
    if (!productive[g->root]) {
        perr(p, p->def_at[g->root], "the grammar matches no string: rule '%s' can never complete",
             g->names[g->root]);
        goto out;
    }
    ok = true;
    goto out;
nomem_ev:
    free(ev.v);
nomem:
    pnomem(p);
out:
    free(nullable);
    free(productive);
    free(edge0);
    free(edges);
    free(color);
    free(stk);
    free(at);
    return ok;
}

kv_status kv_grammar_compile(const char *text, size_t len, const char *root, kv_grammar **out, kv_error *e) {
    *out = NULL;
    if (!text) return kv_fail(e, KV_ERR_ARG, "grammar: no text");
    if (len > KV_GRAMMAR_MAX_TEXT)
        return kv_fail(e, KV_ERR_FORMAT, "grammar: text of %zu bytes is above the limit %d", len,
                       KV_GRAMMAR_MAX_TEXT);
    if (!root) root = "root";
    g_parser p = {.src = text, .len = len, .e = e, .st = KV_OK};
    kv_grammar *g = NULL;
    /* never NULL, even for a grammar of `.` only (ranges + 0 on NULL is undefined) */
    if (!grow((void **)&p.ranges, &p.cap_ranges, 1, sizeof *p.ranges)) goto nomem;
    if (!parse_grammar(&p)) goto fail;
    /* undefined rules: the earliest reference */
    size_t first = NO_POS;
    uint32_t which = 0;
    for (uint32_t r = 0; r < p.n_rules; r++)
        if (p.def_at[r] == NO_POS && p.ref_at[r] < first) first = p.ref_at[r], which = r;
    if (first != NO_POS) {
        perr(&p, first, "undefined rule '%s'", p.names[which]);
        goto fail;
    }
    uint32_t rootid = UINT32_MAX; /* named rules only: helper rules are not in the name table */
    for (uint64_t k = name_hash(root, strlen(root));; k = mix64(k) | 1) {
        uint32_t *v = map_find(&p.names_ht, k);
        if (!v) break;
        if (strcmp(p.names[*v], root) == 0) {
            rootid = *v;
            break;
        }
    }
    if (rootid == UINT32_MAX) {
        if (p.n_rules == 0) perr(&p, 0, "empty grammar: no rules");
        else perr(&p, 0, "no rule named '%s' (the start rule)", root);
        goto fail;
    }
    /* flatten */
    g = calloc(1, sizeof *g);
    if (!g) goto nomem;
    g->refs = 1;
    g->n_rules = (int)p.n_rules;
    g->root = rootid;
    size_t total = 0, n_alts = 0;
    for (uint32_t r = 0; r < p.n_rules; r++) {
        total += p.rules[r].n;
        for (size_t i = 0; i < p.rules[r].n; i++) n_alts += IS_END(p.rules[r].v[i]);
    }
    g->code = malloc((total + 1) * sizeof *g->code);
    g->rule_start = malloc((p.n_rules + 1) * sizeof *g->rule_start);
    g->alt0 = malloc((p.n_rules + 1) * sizeof *g->alt0);
    g->alts = malloc((n_alts + 1) * sizeof *g->alts);
    if (!g->code || !g->rule_start || !g->alt0 || !g->alts) goto nomem;
    size_t k = 0, na = 0;
    for (uint32_t r = 0; r < p.n_rules; r++) {
        g->rule_start[r] = (uint32_t)k;
        g->alt0[r] = (uint32_t)na;
        g->alts[na++] = (uint32_t)k;
        for (size_t i = 0; i < p.rules[r].n; i++) {
            uint32_t el = p.rules[r].v[i];
            g->code[k++] = el;
            if (EL_T(el) == E_ALT) g->alts[na++] = (uint32_t)k;
        }
    }
    g->rule_start[p.n_rules] = (uint32_t)k;
    g->alt0[p.n_rules] = (uint32_t)na;
    g->code[k] = EL(E_END, 0);
    g->n_code = k;
    g->classes = p.classes, p.classes = NULL;
    g->n_classes = p.n_classes;
    g->ranges = p.ranges, p.ranges = NULL;
    g->n_ranges = p.n_ranges;
    g->names = p.names, p.names = NULL;
    if (!check_grammar(&p, g)) goto fail;
    for (uint32_t r = 0; r < p.n_rules; r++) free(p.rules[r].v);
    free(p.rules);
    free(p.def_at);
    free(p.ref_at);
    map_free(&p.names_ht);
    *out = g;
    return KV_OK;
nomem:
    pnomem(&p);
fail:
    if (g && !g->names) {
        g->names = p.names;
        p.names = NULL;
    }
    kv_grammar_free(g);
    for (uint32_t r = 0; r < p.n_rules; r++) {
        free(p.rules[r].v);
        if (p.names) free(p.names[r]);
    }
    free(p.rules);
    free(p.names);
    free(p.def_at);
    free(p.ref_at);
    free(p.classes);
    free(p.ranges);
    map_free(&p.names_ht);
    return p.st;
}

/* ---- printing (debugging, tests) ---- */

typedef struct {
    char *buf;
    size_t cap, n;
} g_out;

static void outf(g_out *o, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char tmp[64];
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    for (int i = 0; i < k && i < (int)sizeof tmp - 1; i++, o->n++)
        if (o->n + 1 < o->cap) o->buf[o->n] = tmp[i];
}

static void out_cp(g_out *o, uint32_t cp) {
    if (cp == '\n') outf(o, "\\n");
    else if (cp == '\r') outf(o, "\\r");
    else if (cp == '\t') outf(o, "\\t");
    else if (cp == '\\' || cp == ']' || cp == '[' || cp == '-' || cp == '^' || cp == '"') outf(o, "\\%c", (int)cp);
    else if (cp < 0x20 || cp == 0x7f) outf(o, "\\x%02X", cp);
    else if (cp < 0x80) outf(o, "%c", (int)cp);
    else if (cp < 0x10000) outf(o, "\\u%04X", cp);
    else outf(o, "\\U%08X", cp);
}

size_t kv_grammar_print(const kv_grammar *g, char *buf, size_t cap) {
    g_out o = {buf, cap, 0};
    for (int r = 0; r < g->n_rules; r++) {
        for (const char *s = g->names[r]; *s; s++) outf(&o, "%c", *s);
        outf(&o, " ::=");
        for (uint32_t i = g->rule_start[r];; i++) {
            uint32_t el = g->code[i];
            if (EL_T(el) == E_END) break;
            if (EL_T(el) == E_ALT) {
                outf(&o, " |");
            } else if (EL_T(el) == E_REF) {
                outf(&o, " ");
                for (const char *s = g->names[EL_V(el)]; *s; s++) outf(&o, "%c", *s);
            } else {
                const g_class *c = &g->classes[EL_V(el)];
                outf(&o, c->neg ? " [^" : " [");
                for (uint32_t j = 0; j < c->nr; j++) {
                    const g_range *rg = &g->ranges[c->r0 + j];
                    out_cp(&o, rg->lo);
                    if (rg->hi != rg->lo) {
                        outf(&o, "-");
                        out_cp(&o, rg->hi);
                    }
                }
                outf(&o, "]");
            }
        }
        outf(&o, "\n");
    }
    if (cap) buf[o.n < cap ? o.n : cap - 1] = '\0';
    return o.n;
}

/* ==== vocabulary trie ===================================================== */

enum { TOK_NEVER = 0, TOK_TEXT = 1, TOK_EOG = 2 };

typedef struct {
    uint32_t skip;   /* next node in preorder outside this subtree */
    uint32_t tok0;   /* tokens ending here: sorted[tok0 .. tok0 + ntok) */
    uint16_t depth;  /* bytes from the root (>= 1) */
    uint16_t ntok;
    uint8_t byte;
} g_tnode;

struct kv_grammar_vocab {
    int refs;
    int32_t n;
    uint8_t *kind;      /* TOK_* per id */
    uint64_t *off;      /* piece of id: blob[off[id] .. off[id + 1]) */
    char *blob;
    g_tnode *nodes;     /* preorder */
    size_t n_nodes;
    int32_t *sorted;    /* text token ids by their bytes */
    uint32_t max_depth;
    int32_t *eog;
    size_t n_eog;
};

static const kv_grammar_vocab *sort_gv;
static int piece_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    const kv_grammar_vocab *gv = sort_gv;
    size_t lx = gv->off[x + 1] - gv->off[x], ly = gv->off[y + 1] - gv->off[y];
    int c = memcmp(gv->blob + gv->off[x], gv->blob + gv->off[y], lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

void kv_grammar_vocab_free(kv_grammar_vocab *gv) {
    if (!gv || --gv->refs > 0) return;
    free(gv->kind);
    free(gv->off);
    free(gv->blob);
    free(gv->nodes);
    free(gv->sorted);
    free(gv->eog);
    free(gv);
}

int32_t kv_grammar_vocab_n(const kv_grammar_vocab *gv) { return gv->n; }
size_t kv_grammar_vocab_nodes(const kv_grammar_vocab *gv) { return gv->n_nodes; }

kv_status kv_grammar_vocab_new(int32_t n, const char *const *pieces, const size_t *lens, const bool *eog,
                               kv_grammar_vocab **out, kv_error *e) {
    *out = NULL;
    if (n < 0 || n > (1 << 26)) return kv_fail(e, KV_ERR_ARG, "grammar vocab: bad size %d", (int)n);
    kv_grammar_vocab *gv = calloc(1, sizeof *gv);
    if (!gv) return kv_fail(e, KV_ERR_NOMEM, "grammar vocab: out of memory");
    gv->refs = 1;
    gv->n = n;
    gv->kind = calloc((size_t)n + 1, 1);
    gv->off = calloc((size_t)n + 2, sizeof *gv->off);
    gv->sorted = malloc(((size_t)n + 1) * sizeof *gv->sorted);
    gv->eog = malloc(((size_t)n + 1) * sizeof *gv->eog);
    if (!gv->kind || !gv->off || !gv->sorted || !gv->eog) goto nomem;
    uint64_t total = 0;
    size_t n_text = 0;
    for (int32_t i = 0; i < n; i++) {
        gv->off[i] = total;
        if (eog && eog[i]) {
            gv->kind[i] = TOK_EOG;
            gv->eog[gv->n_eog++] = i;
        } else if (pieces[i] && lens[i] > 0 && lens[i] <= 65535) {
            gv->kind[i] = TOK_TEXT;
            total += lens[i];
            gv->sorted[n_text++] = i;
        }
    }
    gv->off[n] = total;
    gv->blob = malloc(total + 1);
    if (!gv->blob) goto nomem;
    for (int32_t i = 0; i < n; i++)
        if (gv->kind[i] == TOK_TEXT) memcpy(gv->blob + gv->off[i], pieces[i], lens[i]);
    sort_gv = gv; /* qsort has no context argument in C11 */
    qsort(gv->sorted, n_text, sizeof *gv->sorted, piece_cmp);
    sort_gv = NULL;
    /* preorder nodes from the sorted strings: each string opens the nodes
     * past its common prefix with the previous one */
    size_t cap = 0, maxl = 0;
    for (size_t t = 0; t < n_text; t++) {
        size_t l = gv->off[gv->sorted[t] + 1] - gv->off[gv->sorted[t]];
        if (l > maxl) maxl = l;
    }
    uint32_t *path = malloc((maxl + 1) * sizeof *path);
    if (!path) goto nomem;
    size_t depth = 0;
    const unsigned char *prev = NULL;
    size_t lprev = 0;
    for (size_t t = 0; t < n_text; t++) {
        int32_t id = gv->sorted[t];
        const unsigned char *s = (const unsigned char *)gv->blob + gv->off[id];
        size_t l = gv->off[id + 1] - gv->off[id];
        size_t lcp = 0;
        while (prev && lcp < l && lcp < lprev && s[lcp] == prev[lcp]) lcp++;
        for (size_t d = depth; d > lcp; d--) gv->nodes[path[d]].skip = (uint32_t)gv->n_nodes;
        for (size_t d = lcp + 1; d <= l; d++) {
            if (gv->n_nodes >= UINT32_MAX - 1 ||
                !grow((void **)&gv->nodes, &cap, gv->n_nodes + 1, sizeof *gv->nodes)) {
                free(path);
                goto nomem;
            }
            g_tnode *nd = &gv->nodes[gv->n_nodes];
            memset(nd, 0, sizeof *nd);
            nd->byte = s[d - 1];
            nd->depth = (uint16_t)d;
            nd->tok0 = (uint32_t)t;
            path[d] = (uint32_t)gv->n_nodes++;
        }
        depth = l;
        if (l > gv->max_depth) gv->max_depth = (uint32_t)l;
        g_tnode *end = &gv->nodes[path[l]];
        if (end->ntok == 0) end->tok0 = (uint32_t)t;
        if (end->ntok < UINT16_MAX) end->ntok++;
        prev = s;
        lprev = l;
    }
    for (size_t d = depth; d > 0; d--) gv->nodes[path[d]].skip = (uint32_t)gv->n_nodes;
    free(path);
    *out = gv;
    return KV_OK;
nomem:
    kv_grammar_vocab_free(gv);
    return kv_fail(e, KV_ERR_NOMEM, "grammar vocab: out of memory");
}

kv_status kv_grammar_vocab_build(const kv_vocab *v, kv_grammar_vocab **out, kv_error *e) {
    *out = NULL;
    int32_t n = kv_vocab_n(v);
    char **pieces = calloc((size_t)n + 1, sizeof *pieces);
    size_t *lens = calloc((size_t)n + 1, sizeof *lens);
    bool *eog = calloc((size_t)n + 1, sizeof *eog);
    kv_status st = KV_OK;
    if (!pieces || !lens || !eog) {
        st = kv_fail(e, KV_ERR_NOMEM, "grammar vocab: out of memory");
        goto out;
    }
    char buf[256];
    for (int32_t i = 0; i < n; i++) {
        if (kv_vocab_is_eog(v, i)) {
            eog[i] = true;
            continue;
        }
        int attr = kv_vocab_attr(v, i);
        if (attr & (KV_TOKEN_CONTROL | KV_TOKEN_UNKNOWN | KV_TOKEN_UNUSED)) continue;
        size_t l = kv_token_piece(v, i, false, buf, sizeof buf);
        if (l == 0) continue;
        pieces[i] = malloc(l);
        if (!pieces[i]) {
            st = kv_fail(e, KV_ERR_NOMEM, "grammar vocab: out of memory");
            goto out;
        }
        if (l <= sizeof buf) memcpy(pieces[i], buf, l);
        else kv_token_piece(v, i, false, pieces[i], l);
        lens[i] = l;
    }
    st = kv_grammar_vocab_new(n, (const char *const *)pieces, lens, eog, out, e);
out:
    if (pieces)
        for (int32_t i = 0; i < n; i++) free(pieces[i]);
    free(pieces);
    free(lens);
    free(eog);
    return st;
}

/* ==== matcher: stacks, stack sets, the lazy automaton ===================== */

#define DS_UNKNOWN 0xFFFFFFFFu /* a row entry not computed yet */
#define DS_DEAD 0xFFFFFFFEu    /* the byte is rejected */
#define DS_LIMIT 0xFFFFFFFDu   /* rejected because a limit was hit */
#define MAX_STATES (1u << 22)
#define MAX_ROWS 16384           /* memo rows kept (1 KiB each) before they are dropped */
#define MASK_BUDGET (64u << 20)  /* bytes of cached masks */

struct kv_grammar_matcher {
    int refs;
    kv_grammar *g;
    kv_grammar_vocab *gv;
    /* stack nodes; node 0 is the empty stack */
    uint32_t *npos, *nparent, *ndepth, *visit;
    size_t n_nodes, cap_nodes;
    u64map node_map;
    uint32_t stamp;
    /* stack sets: sorted node ids in pool[off[s] .. off[s] + len[s]) */
    uint32_t *pool;
    size_t n_pool, cap_pool;
    uint32_t *set_off, *set_len;
    uint64_t *set_hash;
    size_t n_sets, cap_sets;
    uint32_t *set_ht; /* open table of set ids (UINT32_MAX: empty) */
    size_t set_ht_cap;
    /* automaton states: (set, pending bytes of a code point) */
    uint32_t *ds_set, *ds_v;
    uint8_t *ds_n, *ds_len; /* bytes still expected, and the sequence's length */
    uint32_t **rows;        /* successor per byte (DS_*), or NULL */
    int32_t *mask_slot;     /* cached mask of a state, -1 */
    size_t n_ds, cap_ds, n_rows;
    u64map ds_map;
    u64map adv_map; /* (set, stacks matching a code point) -> set after it */
    /* masks */
    size_t words, max_masks, n_masks;
    uint32_t *mask_bits;    /* max_masks * words */
    int32_t *mask_count, *mask_owner;
    uint32_t *scratch;      /* words: an uncached mask */
    uint32_t *dsd;          /* automaton state per trie depth */
    /* scratch of an expansion */
    u32vec work, out;
    const char *limit; /* what limit the last DS_LIMIT hit */
    kv_grammar_stats stats;
};

kv_grammar_matcher *kv_grammar_matcher_retain(kv_grammar_matcher *m) {
    m->refs++;
    return m;
}

const kv_grammar_vocab *kv_grammar_matcher_vocab(const kv_grammar_matcher *m) { return m->gv; }

void kv_grammar_matcher_free(kv_grammar_matcher *m) {
    if (!m || --m->refs > 0) return;
    kv_grammar_free(m->g);
    kv_grammar_vocab_free(m->gv);
    free(m->npos);
    free(m->nparent);
    free(m->ndepth);
    free(m->visit);
    map_free(&m->node_map);
    free(m->pool);
    free(m->set_off);
    free(m->set_len);
    free(m->set_hash);
    free(m->set_ht);
    free(m->ds_set);
    free(m->ds_v);
    free(m->ds_n);
    free(m->ds_len);
    if (m->rows)
        for (size_t i = 0; i < m->n_ds; i++) free(m->rows[i]);
    free(m->rows);
    free(m->mask_slot);
    map_free(&m->ds_map);
    map_free(&m->adv_map);
    free(m->mask_bits);
    free(m->mask_count);
    free(m->mask_owner);
    free(m->scratch);
    free(m->dsd);
    free(m->work.v);
    free(m->out.v);
    free(m);
}

/* The stack pos on top of parent (a node id), or UINT32_MAX at a limit. */
static uint32_t node_get(kv_grammar_matcher *m, uint32_t pos, uint32_t parent) {
    uint64_t key = (((uint64_t)pos << 32) | parent) + 1;
    uint32_t *v = map_find(&m->node_map, key);
    if (v) return *v;
    if (m->ndepth[parent] + 1 > KV_GRAMMAR_MAX_DEPTH) {
        m->limit = "a stack deeper than " "16384" " (nesting too deep)";
        return UINT32_MAX;
    }
    if (m->n_nodes >= KV_GRAMMAR_MAX_NODES) {
        m->limit = "more than 4194304 stack nodes";
        return UINT32_MAX;
    }
    if (m->n_nodes == m->cap_nodes) {
        size_t nc = m->cap_nodes * 2;
        uint32_t *a = realloc(m->npos, nc * sizeof *a);
        if (a) m->npos = a;
        uint32_t *b = realloc(m->nparent, nc * sizeof *b);
        if (b) m->nparent = b;
        uint32_t *c = realloc(m->ndepth, nc * sizeof *c);
        if (c) m->ndepth = c;
        uint32_t *d = realloc(m->visit, nc * sizeof *d);
        if (d) m->visit = d;
        if (!a || !b || !c || !d) {
            m->limit = "out of memory";
            return UINT32_MAX;
        }
        memset(m->visit + m->cap_nodes, 0, (nc - m->cap_nodes) * sizeof *d);
        m->cap_nodes = nc;
    }
    uint32_t id = (uint32_t)m->n_nodes;
    if (!map_put(&m->node_map, key, id)) {
        m->limit = "out of memory";
        return UINT32_MAX;
    }
    m->npos[id] = pos;
    m->nparent[id] = parent;
    m->ndepth[id] = m->ndepth[parent] + 1;
    m->visit[id] = 0;
    m->n_nodes++;
    return id;
}

/* Where a stack goes once the element on top of s is done: s popped, and
 * the next element of the same sequence pushed unless the sequence ends. */
static uint32_t node_next(kv_grammar_matcher *m, uint32_t s) {
    uint32_t nx = m->npos[s] + 1;
    if (IS_END(m->g->code[nx])) return m->nparent[s];
    return node_get(m, nx, m->nparent[s]);
}

/* Expands the stacks on the work list until each has a character class on
 * top (or is empty), into m->out; each node once per stamp. */
static bool expand(kv_grammar_matcher *m) {
    const kv_grammar *g = m->g;
    while (m->work.n) {
        uint32_t s = m->work.v[--m->work.n];
        if (s == UINT32_MAX) return false;
        if (m->visit[s] == m->stamp) continue;
        m->visit[s] = m->stamp;
        uint32_t el = s ? g->code[m->npos[s]] : 0;
        if (s == 0 || EL_T(el) == E_CHAR) {
            if (m->out.n >= KV_GRAMMAR_MAX_STACKS) {
                m->limit = "more than 4096 stacks alive at once (an ambiguous grammar)";
                return false;
            }
            if (!u32_push(&m->out, s)) return (m->limit = "out of memory"), false;
            continue;
        }
        uint32_t r = EL_V(el);
        uint32_t base = node_next(m, s);
        if (base == UINT32_MAX) return false;
        for (uint32_t a = g->alt0[r]; a < g->alt0[r + 1]; a++) {
            uint32_t p = g->alts[a];
            uint32_t t = IS_END(g->code[p]) ? base : node_get(m, p, base);
            if (t == UINT32_MAX) return false;
            if (!u32_push(&m->work, t)) return (m->limit = "out of memory"), false;
        }
    }
    return true;
}

static void new_stamp(kv_grammar_matcher *m) {
    if (++m->stamp == 0) {
        memset(m->visit, 0, m->cap_nodes * sizeof *m->visit);
        m->stamp = 1;
    }
    m->work.n = m->out.n = 0;
}

static int u32_cmp(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Interns m->out (as a sorted set): its set id, or UINT32_MAX. */
static uint32_t set_intern(kv_grammar_matcher *m) {
    uint32_t *v = m->out.v;
    size_t n = m->out.n;
    if (n > 1) qsort(v, n, sizeof *v, u32_cmp);
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    for (size_t i = 0; i < n; i++) h = mix64(h ^ v[i]);
    if (2 * (m->n_sets + 1) > m->set_ht_cap) {
        size_t nc = m->set_ht_cap ? m->set_ht_cap * 2 : 256;
        uint32_t *nt = malloc(nc * sizeof *nt);
        if (!nt) return (m->limit = "out of memory"), UINT32_MAX;
        memset(nt, 0xFF, nc * sizeof *nt);
        for (size_t s = 0; s < m->n_sets; s++) {
            size_t j = m->set_hash[s] & (nc - 1);
            while (nt[j] != UINT32_MAX) j = (j + 1) & (nc - 1);
            nt[j] = (uint32_t)s;
        }
        free(m->set_ht);
        m->set_ht = nt;
        m->set_ht_cap = nc;
    }
    size_t mask = m->set_ht_cap - 1, j = h & mask;
    for (; m->set_ht[j] != UINT32_MAX; j = (j + 1) & mask) {
        uint32_t s = m->set_ht[j];
        if (m->set_hash[s] == h && m->set_len[s] == n && memcmp(m->pool + m->set_off[s], v, n * sizeof *v) == 0)
            return s;
    }
    if (m->n_sets >= MAX_STATES) return (m->limit = "more than 4194304 stack sets"), UINT32_MAX;
    if (!grow((void **)&m->pool, &m->cap_pool, m->n_pool + n, sizeof *m->pool))
        return (m->limit = "out of memory"), UINT32_MAX;
    size_t c1 = m->cap_sets, c2 = m->cap_sets, c3 = m->cap_sets;
    if (!grow((void **)&m->set_off, &c1, m->n_sets + 1, sizeof *m->set_off) ||
        !grow((void **)&m->set_len, &c2, m->n_sets + 1, sizeof *m->set_len) ||
        !grow((void **)&m->set_hash, &c3, m->n_sets + 1, sizeof *m->set_hash))
        return (m->limit = "out of memory"), UINT32_MAX;
    m->cap_sets = c1 < c2 ? (c1 < c3 ? c1 : c3) : (c2 < c3 ? c2 : c3);
    uint32_t s = (uint32_t)m->n_sets++;
    memcpy(m->pool + m->n_pool, v, n * sizeof *v);
    m->set_off[s] = (uint32_t)m->n_pool;
    m->set_len[s] = (uint32_t)n;
    m->set_hash[s] = h;
    m->n_pool += n;
    m->set_ht[j] = s;
    m->stats.sets = m->n_sets;
    return s;
}

/* The automaton state (set, pending v with n of len bytes), or UINT32_MAX. */
static uint32_t ds_intern(kv_grammar_matcher *m, uint32_t set, uint32_t v, uint32_t n, uint32_t len) {
    uint64_t key = (((uint64_t)set << 24) | ((uint64_t)len << 20) | ((uint64_t)n << 18) | v) + 1;
    uint32_t *f = map_find(&m->ds_map, key);
    if (f) return *f;
    if (m->n_ds >= MAX_STATES) return (m->limit = "more than 4194304 automaton states"), UINT32_MAX;
    if (m->n_ds == m->cap_ds) {
        size_t nc = m->cap_ds ? m->cap_ds * 2 : 256;
        uint32_t *a = realloc(m->ds_set, nc * sizeof *a);
        if (a) m->ds_set = a;
        uint32_t *b = realloc(m->ds_v, nc * sizeof *b);
        if (b) m->ds_v = b;
        uint8_t *c = realloc(m->ds_n, nc);
        if (c) m->ds_n = c;
        uint8_t *d = realloc(m->ds_len, nc);
        if (d) m->ds_len = d;
        uint32_t **r = realloc(m->rows, nc * sizeof *r);
        if (r) m->rows = r;
        int32_t *s = realloc(m->mask_slot, nc * sizeof *s);
        if (s) m->mask_slot = s;
        if (!a || !b || !c || !d || !r || !s) return (m->limit = "out of memory"), UINT32_MAX;
        m->cap_ds = nc;
    }
    uint32_t id = (uint32_t)m->n_ds;
    if (!map_put(&m->ds_map, key, id)) return (m->limit = "out of memory"), UINT32_MAX;
    m->ds_set[id] = set;
    m->ds_v[id] = v;
    m->ds_n[id] = (uint8_t)n;
    m->ds_len[id] = (uint8_t)len;
    m->rows[id] = NULL;
    m->mask_slot[id] = -1;
    m->n_ds++;
    m->stats.states = m->n_ds;
    return id;
}

/* The stack set after code point cp, DS_DEAD or DS_LIMIT. */
static uint32_t advance(kv_grammar_matcher *m, uint32_t set, uint32_t cp) {
    const kv_grammar *g = m->g;
    new_stamp(m);
    const uint32_t *v = m->pool + m->set_off[set];
    uint32_t n = m->set_len[set];
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = v[i];
        if (s == 0 || !class_match(g, EL_V(g->code[m->npos[s]]), cp)) continue;
        uint32_t t = node_next(m, s);
        if (t == UINT32_MAX || !u32_push(&m->work, t)) return DS_LIMIT;
    }
    if (!m->work.n) return DS_DEAD;
    if (!expand(m)) return DS_LIMIT;
    uint32_t r = set_intern(m);
    return r == UINT32_MAX ? DS_LIMIT : r;
}

/* advance, memoized per (set, which of its stacks match cp): the result
 * depends on the code point only through that, and the automaton meets
 * the same set with thousands of different characters (a vocabulary's
 * CJK tokens, say), each completing from its own pending-bytes state. */
static uint32_t advance_memo(kv_grammar_matcher *m, uint32_t set, uint32_t cp) {
    uint32_t n = m->set_len[set];
    if (n > 40) return advance(m, set, cp);
    const uint32_t *v = m->pool + m->set_off[set];
    uint64_t sig = 0;
    for (uint32_t i = 0; i < n; i++)
        if (v[i] && class_match(m->g, EL_V(m->g->code[m->npos[v[i]]]), cp)) sig |= 1ull << i;
    if (!sig) return DS_DEAD;
    uint64_t key = (((uint64_t)set << 40) | sig) + 1;
    uint32_t *f = map_find(&m->adv_map, key);
    if (f) return *f;
    uint32_t r = advance(m, set, cp);
    if (r != DS_LIMIT && m->adv_map.n < MAX_STATES) map_put(&m->adv_map, key, r); /* a cache: a failed put is fine */
    return r;
}

/* Whether some stack of set may match a code point in [lo, hi]. */
static bool set_meets(kv_grammar_matcher *m, uint32_t set, uint32_t lo, uint32_t hi) {
    const uint32_t *v = m->pool + m->set_off[set];
    for (uint32_t i = 0; i < m->set_len[set]; i++)
        if (v[i] && class_meets(m->g, EL_V(m->g->code[m->npos[v[i]]]), lo, hi)) return true;
    return false;
}

static uint32_t step_compute(kv_grammar_matcher *m, uint32_t ds, uint8_t b) {
    uint32_t set = m->ds_set[ds], v = m->ds_v[ds], n = m->ds_n[ds], len = m->ds_len[ds];
    uint32_t r;
    if (n == 0) {
        if (b < 0x80) {
            r = advance_memo(m, set, b);
            return r >= DS_LIMIT ? r : ds_intern(m, r, 0, 0, 0);
        }
        if (b >= 0xC2 && b <= 0xDF) v = b & 0x1fu, n = 1;
        else if (b >= 0xE0 && b <= 0xEF) v = b & 0x0fu, n = 2;
        else if (b >= 0xF0 && b <= 0xF4) v = b & 0x07u, n = 3;
        else return DS_DEAD;
        len = n + 1;
    } else {
        if ((b & 0xC0) != 0x80) return DS_DEAD;
        v = v << 6 | (b & 0x3fu);
        n--;
        if (n == 0) {
            static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
            if (v < min[len] || v > CP_MAX || (v >= 0xD800 && v <= 0xDFFF)) return DS_DEAD;
            r = advance_memo(m, set, v);
            return r >= DS_LIMIT ? r : ds_intern(m, r, 0, 0, 0);
        }
    }
    /* the code points this prefix can still become: no overlong forms, no
     * surrogates, nothing past U+10FFFF */
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    uint32_t lo = v << (6 * n), hi = ((v + 1) << (6 * n)) - 1;
    if (lo < min_cp[len]) lo = min_cp[len];
    if (hi > CP_MAX) hi = CP_MAX;
    bool meets = false;
    if (lo <= hi && lo < 0xD800) meets = set_meets(m, set, lo, hi < 0xD7FF ? hi : 0xD7FF);
    if (!meets && lo <= hi && hi > 0xDFFF) meets = set_meets(m, set, lo > 0xE000 ? lo : 0xE000, hi);
    if (!meets) return DS_DEAD;
    r = ds_intern(m, set, v, n, len);
    return r == UINT32_MAX ? DS_LIMIT : r;
}

/* The successor of automaton state ds on byte b (memoized). */
static inline uint32_t step(kv_grammar_matcher *m, uint32_t ds, uint8_t b) {
    uint32_t *row = m->rows[ds];
    if (row && row[b] != DS_UNKNOWN) return row[b];
    m->limit = NULL;
    uint32_t r = step_compute(m, ds, b);
    if (r == UINT32_MAX) r = DS_LIMIT;
    if (!m->rows[ds]) {
        if (m->n_rows >= MAX_ROWS) { /* a cache: drop every row */
            for (size_t i = 0; i < m->n_ds; i++) {
                free(m->rows[i]);
                m->rows[i] = NULL;
            }
            m->n_rows = 0;
        }
        uint32_t *nr = malloc(256 * sizeof *nr);
        if (!nr) return r;
        memset(nr, 0xFF, 256 * sizeof *nr);
        m->rows[ds] = nr;
        m->n_rows++;
    }
    if (r != DS_LIMIT) m->rows[ds][b] = r; /* a limit may pass once tables are dropped: not memoized */
    return r;
}

kv_status kv_grammar_matcher_new(kv_grammar *g, kv_grammar_vocab *gv, kv_grammar_matcher **out, kv_error *e) {
    *out = NULL;
    kv_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(e, KV_ERR_NOMEM, "grammar: out of memory");
    m->refs = 1;
    m->g = g;
    m->gv = gv;
    g->refs++;
    gv->refs++;
    m->cap_nodes = 1024;
    m->npos = malloc(m->cap_nodes * sizeof *m->npos);
    m->nparent = malloc(m->cap_nodes * sizeof *m->nparent);
    m->ndepth = malloc(m->cap_nodes * sizeof *m->ndepth);
    m->visit = calloc(m->cap_nodes, sizeof *m->visit);
    m->words = ((size_t)gv->n + 31) / 32;
    size_t mask_bytes = (m->words ? m->words : 1) * sizeof(uint32_t);
    m->max_masks = MASK_BUDGET / mask_bytes;
    if (m->max_masks > 4096) m->max_masks = 4096;
    if (m->max_masks < 4) m->max_masks = 4;
    m->mask_bits = malloc(m->max_masks * mask_bytes);
    m->mask_count = malloc(m->max_masks * sizeof *m->mask_count);
    m->mask_owner = malloc(m->max_masks * sizeof *m->mask_owner);
    m->scratch = malloc(mask_bytes);
    m->dsd = malloc(((size_t)gv->max_depth + 1) * sizeof *m->dsd);
    if (!m->npos || !m->nparent || !m->ndepth || !m->visit || !m->mask_bits || !m->mask_count ||
        !m->mask_owner || !m->scratch || !m->dsd) {
        kv_grammar_matcher_free(m);
        return kv_fail(e, KV_ERR_NOMEM, "grammar: out of memory");
    }
    m->npos[0] = UINT32_MAX;
    m->nparent[0] = 0;
    m->ndepth[0] = 0;
    m->n_nodes = 1;
    *out = m;
    return KV_OK;
}

kv_status kv_grammar_start(kv_grammar_matcher *m, kv_grammar_state *st, kv_error *e) {
    const kv_grammar *g = m->g;
    new_stamp(m);
    m->limit = NULL;
    uint32_t r = g->root;
    bool ok = true;
    for (uint32_t a = g->alt0[r]; a < g->alt0[r + 1] && ok; a++) {
        uint32_t p = g->alts[a];
        uint32_t t = IS_END(g->code[p]) ? 0 : node_get(m, p, 0);
        ok = t != UINT32_MAX && u32_push(&m->work, t);
    }
    ok = ok && expand(m);
    uint32_t set = ok ? set_intern(m) : UINT32_MAX;
    uint32_t ds = set != UINT32_MAX ? ds_intern(m, set, 0, 0, 0) : UINT32_MAX;
    if (ds == UINT32_MAX)
        return kv_fail(e, KV_ERR_ARG, "grammar: %s", m->limit ? m->limit : "out of memory");
    st->ds = ds;
    st->ended = false;
    return KV_OK;
}

bool kv_grammar_can_end(kv_grammar_matcher *m, const kv_grammar_state *st) {
    if (st->ended) return true;
    uint32_t set = m->ds_set[st->ds];
    return m->ds_n[st->ds] == 0 && m->set_len[set] > 0 && m->pool[m->set_off[set]] == 0;
}

bool kv_grammar_can_continue(kv_grammar_matcher *m, const kv_grammar_state *st) {
    if (st->ended) return false;
    uint32_t set = m->ds_set[st->ds];
    uint32_t n = m->set_len[set];
    return n > 1 || (n == 1 && m->pool[m->set_off[set]] != 0);
}

static kv_status accept_raw(kv_grammar_matcher *m, uint32_t *ds, const unsigned char *b, size_t n, size_t *bad) {
    uint32_t d = *ds;
    for (size_t i = 0; i < n; i++) {
        uint32_t t = step(m, d, b[i]);
        if (t >= DS_LIMIT) {
            *bad = i;
            return t == DS_LIMIT ? KV_ERR_UNSUPPORTED : KV_ERR_ARG;
        }
        d = t;
    }
    *ds = d;
    return KV_OK;
}

kv_status kv_grammar_accept_bytes(kv_grammar_matcher *m, kv_grammar_state *st, const void *bytes, size_t n,
                                  kv_error *e) {
    if (st->ended && n) return kv_fail(e, KV_ERR_ARG, "grammar: text after the end of generation");
    size_t bad = 0;
    uint32_t ds = st->ds;
    kv_status s = accept_raw(m, &ds, bytes, n, &bad);
    if (s == KV_ERR_UNSUPPORTED)
        return kv_fail(e, KV_ERR_ARG, "grammar: limit reached at byte %zu: %s", bad,
                       m->limit ? m->limit : "a table is full");
    if (s != KV_OK) return kv_fail(e, KV_ERR_ARG, "grammar: byte %zu (0x%02X) does not match the grammar", bad,
                                   ((const unsigned char *)bytes)[bad]);
    st->ds = ds;
    return KV_OK;
}

kv_status kv_grammar_accept_token(kv_grammar_matcher *m, kv_grammar_state *st, int32_t id, kv_error *e) {
    const kv_grammar_vocab *gv = m->gv;
    if (id < 0 || id >= gv->n) return kv_fail(e, KV_ERR_ARG, "grammar: token id %d out of range", (int)id);
    if (gv->kind[id] == TOK_EOG) {
        if (!kv_grammar_can_end(m, st))
            return kv_fail(e, KV_ERR_ARG, "grammar: end-of-generation token %d before the grammar can end", (int)id);
        st->ended = true;
        return KV_OK;
    }
    if (gv->kind[id] == TOK_NEVER)
        return kv_fail(e, KV_ERR_ARG, "grammar: token %d is a control (or unused) token, never allowed", (int)id);
    if (st->ended) return kv_fail(e, KV_ERR_ARG, "grammar: token %d after the end of generation", (int)id);
    size_t bad = 0;
    uint32_t ds = st->ds;
    kv_status s = accept_raw(m, &ds, (const unsigned char *)gv->blob + gv->off[id], gv->off[id + 1] - gv->off[id],
                             &bad);
    if (s == KV_ERR_UNSUPPORTED)
        return kv_fail(e, KV_ERR_ARG, "grammar: limit reached in token %d: %s", (int)id,
                       m->limit ? m->limit : "a table is full");
    if (s != KV_OK) {
        char txt[40];
        size_t l = gv->off[id + 1] - gv->off[id], k = 0;
        for (size_t i = 0; i < l && k + 5 < sizeof txt; i++) {
            unsigned char c = (unsigned char)gv->blob[gv->off[id] + i];
            k += (size_t)snprintf(txt + k, sizeof txt - k, c >= 0x20 && c < 0x7f && c != '\'' ? "%c" : "\\x%02X", c);
        }
        return kv_fail(e, KV_ERR_ARG, "grammar: token %d ('%s') does not match the grammar here", (int)id, txt);
    }
    st->ds = ds;
    return KV_OK;
}

static int32_t popcount_bits(const uint32_t *bits, size_t words) {
    int32_t c = 0;
    for (size_t i = 0; i < words; i++) c += __builtin_popcount(bits[i]);
    return c;
}

/* The mask of automaton state ds into bits (words words, zeroed here);
 * false when a limit (or out of memory) cut a branch: the mask is short. */
static bool mask_walk(kv_grammar_matcher *m, uint32_t ds, uint32_t *bits) {
    const kv_grammar_vocab *gv = m->gv;
    bool whole = true;
    const char *why = NULL;
    memset(bits, 0, m->words * sizeof *bits);
    uint32_t *dsd = m->dsd;
    dsd[0] = ds;
    const g_tnode *nodes = gv->nodes;
    size_t n = gv->n_nodes;
    for (size_t i = 0; i < n;) {
        const g_tnode *nd = &nodes[i];
        uint32_t from = dsd[nd->depth - 1];
        uint32_t *row = m->rows[from];
        uint32_t t = row && row[nd->byte] != DS_UNKNOWN ? row[nd->byte] : step(m, from, nd->byte);
        if (t >= DS_LIMIT) {
            if (t == DS_LIMIT && whole) whole = false, why = m->limit; /* later steps clear m->limit */
            i = nd->skip;
            continue;
        }
        dsd[nd->depth] = t;
        for (uint32_t k = 0; k < nd->ntok; k++) {
            int32_t id = gv->sorted[nd->tok0 + k];
            bits[id >> 5] |= 1u << (id & 31);
        }
        i++;
    }
    if (!whole) m->limit = why;
    return whole;
}

kv_status kv_grammar_mask(kv_grammar_matcher *m, const kv_grammar_state *st, const uint32_t **bits,
                          int32_t *n_allowed, kv_error *e) {
    const kv_grammar_vocab *gv = m->gv;
    m->stats.masks++;
    uint32_t *b;
    int32_t cnt;
    if (st->ended) {
        b = m->scratch;
        memset(b, 0, m->words * sizeof *b);
    } else {
        int32_t slot = m->mask_slot[st->ds];
        if (slot >= 0) {
            m->stats.mask_hits++;
            *bits = m->mask_bits + (size_t)slot * m->words;
            if (n_allowed) *n_allowed = m->mask_count[slot];
            return KV_OK;
        }
        if (m->n_masks == m->max_masks) { /* a cache: drop every mask */
            for (size_t i = 0; i < m->n_masks; i++) m->mask_slot[m->mask_owner[i]] = -1;
            m->n_masks = 0;
        }
        slot = (int32_t)m->n_masks;
        b = m->mask_bits + (size_t)slot * m->words;
        uint32_t ds = st->ds;
        if (!mask_walk(m, ds, b)) /* tokens the grammar may allow are missing: no mask, none kept */
            return kv_fail(e, m->limit && !strcmp(m->limit, "out of memory") ? KV_ERR_NOMEM : KV_ERR_ARG,
                           "grammar: limit reached computing the mask: %s", m->limit ? m->limit : "a table is full");
        if (kv_grammar_can_end(m, st))
            for (size_t i = 0; i < gv->n_eog; i++) b[gv->eog[i] >> 5] |= 1u << (gv->eog[i] & 31);
        cnt = popcount_bits(b, m->words);
        m->mask_slot[ds] = slot;
        m->mask_owner[slot] = (int32_t)ds;
        m->mask_count[slot] = cnt;
        m->n_masks++;
        *bits = b;
        if (n_allowed) *n_allowed = cnt;
        return KV_OK;
    }
    for (size_t i = 0; i < gv->n_eog; i++) b[gv->eog[i] >> 5] |= 1u << (gv->eog[i] & 31);
    *bits = b;
    if (n_allowed) *n_allowed = popcount_bits(b, m->words);
    return KV_OK;
}

void kv_grammar_matcher_stats(const kv_grammar_matcher *m, kv_grammar_stats *out) {
    *out = m->stats;
    out->nodes = m->n_nodes;
    out->sets = m->n_sets;
    out->states = m->n_ds;
}
