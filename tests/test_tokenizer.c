/*
 * test_tokenizer.c — the tokenizer against llama.cpp's own test vectors,
 * plus a table of inconsistent vocabularies and the edge cases of pieces,
 * detokenization and streaming UTF-8.
 *
 * Conformance: for every tests/data/vocab/ggml-vocab-*.gguf
 * each input of NAME.gguf.inp (separated by "\n__ggml_vocab_test__\n",
 * read as bytes) must tokenize (no BOS/EOS, no special parsing) to exactly
 * the ids on the matching line of NAME.gguf.out, and detokenize back to the
 * input where the tokenizer is lossless for it. The data is llama.cpp's;
 * a missing directory is reported and counted as a failure.
 *
 * Ends with the line "N passed, N failed"; exit status 1 on any failure.
 */
#define _GNU_SOURCE /* memmem */
#include "kvlua.h"
#include "gguf_writer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

static const char *CONF_DIR = "tests/data/vocab";

/* ==== helpers ============================================================= */

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t k;
    while (buf && (k = fread(buf + n, 1, cap - n, f)) > 0) {
        n += k;
        if (n == cap) {
            char *nb = realloc(buf, 2 * cap + 1);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[n] = '\0';
    *len = n;
    return buf;
}

static kv_status open_vocab(const char *path, kv_gguf **g, kv_vocab **v, kv_error *e) {
    *v = NULL;
    kv_status st = kv_gguf_open(path, g, e);
    if (st != KV_OK) return st;
    st = kv_vocab_load(*g, v, e);
    if (st != KV_OK) {
        kv_gguf_close(*g);
        *g = NULL;
    }
    return st;
}

/* open_vocab on the vendored vocabulary NAME (tests/data/vocab/ggml-vocab-NAME.gguf);
 * a failure is a failed check "NAME: message". */
static bool open_named_vocab(const char *name, kv_gguf **g, kv_vocab **v) {
    char path[512];
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", CONF_DIR, name);
    kv_error e = {{0}};
    if (open_vocab(path, g, v, &e) != KV_OK) {
        CHECK(0, "%s: %s", name, e.msg);
        return false;
    }
    return true;
}

static void print_ids(const char *what, const int32_t *ids, size_t n) {
    printf("    %s:", what);
    for (size_t i = 0; i < n && i < 40; i++) printf(" %d", (int)ids[i]);
    if (n > 40) printf(" ...");
    printf("\n");
}

static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = u[i];
        size_t l = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!l || i + l > n) return false;
        for (size_t k = 1; k < l; k++)
            if ((u[i + k] & 0xc0) != 0x80) return false;
        i += l;
    }
    return true;
}

/* Where detokenize(tokenize(s)) == s is expected: valid UTF-8, and no
 * pattern that the reference's clean_up_tokenization_spaces rewrites when
 * the vocabulary enables it (gpt-2, starcoder). */
static bool lossless(const kv_vocab *v, const char *name, const char *s, size_t n) {
    if (!valid_utf8(s, n)) return false;
    bool clean = strcmp(kv_vocab_model_name(v), "gpt2") == 0 && strstr(name, "deepseek") == NULL;
    if (!clean) return true;
    for (size_t i = 0; i + 1 < n; i++) {
        if (s[i] != ' ') continue;
        char x = s[i + 1];
        if (x == '?' || x == '!' || x == '.' || x == ',' || x == '\'') return false;
    }
    return true;
}

/* ==== conformance ========================================================= */

static void conformance_file(const char *name) {
    char path[512], inp_path[520], out_path[520];
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", CONF_DIR, name);
    snprintf(inp_path, sizeof inp_path, "%s.inp", path);
    snprintf(out_path, sizeof out_path, "%s.out", path);

    int pass0 = n_pass, fail0 = n_fail;
    kv_gguf *g = NULL;
    kv_vocab *v = NULL;
    kv_error e = {{0}};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kv_status st = open_vocab(path, &g, &v, &e);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    CHECK(st == KV_OK && v, "%s: load: %s", name, e.msg);
    if (st != KV_OK || !v) return;

    size_t inp_len, out_len;
    char *inp = read_file(inp_path, &inp_len), *out = read_file(out_path, &out_len);
    CHECK(inp && out, "%s: cannot read the .inp/.out files", name);
    if (!inp || !out) goto done;

    static const char SEP[] = "\n__ggml_vocab_test__\n";
    const size_t seplen = sizeof SEP - 1;
    char *ip = inp, *op = out;
    int cases = 0, roundtrips = 0;
    for (;;) {
        char *sep = memmem(ip, inp_len - (size_t)(ip - inp), SEP, seplen);
        if (!sep) {
            /* the first input may be directly followed by a separator at offset 0 */
            break;
        }
        size_t tlen = (size_t)(sep - ip);
        char *nl = strchr(op, '\n');
        if (!nl) {
            CHECK(0, "%s: .out has fewer lines than .inp", name);
            break;
        }
        *nl = '\0';
        /* expected ids */
        int32_t exp[4096];
        size_t ne = 0;
        for (char *p = op; *p && ne < 4096;) {
            char *end;
            long x = strtol(p, &end, 10);
            if (end == p) break;
            exp[ne++] = (int32_t)x;
            p = end;
        }
        int32_t *ids = NULL;
        size_t n = 0;
        st = kv_tokenize(v, ip, tlen, false, false, &ids, &n, &e);
        bool same = st == KV_OK && n == ne && (n == 0 || memcmp(ids, exp, n * sizeof *ids) == 0);
        CHECK(same, "%s case %d: tokenize '%.*s' (%zu bytes)", name, cases, (int)(tlen > 60 ? 60 : tlen), ip, tlen);
        if (!same) {
            print_ids("expected", exp, ne);
            print_ids("got     ", ids, n);
        }
        if (st == KV_OK && lossless(v, name, ip, tlen)) {
            char *txt = NULL;
            size_t tl = 0;
            st = kv_detokenize(v, ids, n, false, false, &txt, &tl, &e);
            CHECK(st == KV_OK && tl == tlen && memcmp(txt, ip, tlen) == 0, "%s case %d: detokenize gives '%.*s'",
                  name, cases, (int)(tl > 60 ? 60 : tl), txt ? txt : "");
            free(txt);
            roundtrips++;
        }
        free(ids);
        cases++;
        ip = sep + seplen;
        op = nl + 1;
        if ((size_t)(ip - inp) >= inp_len) break;
    }
    CHECK(cases > 0, "%s: no cases", name);
    printf("%-15s %3d cases, %3d round trips: %d passed, %d failed (load %.1f ms)\n", name, cases, roundtrips,
           n_pass - pass0, n_fail - fail0,
           (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
done:
    free(inp);
    free(out);
    kv_vocab_free(v);
    kv_gguf_close(g);
}

/* ==== reference cases on the conformance vocabularies ===================== */

/* Expected ids below come from llama.cpp (llama_tokenize through the
 * xllamacpp wheel, scripts/ref/llama_ref.py), not from this code. */
typedef struct {
    const char *vocab;
    const char *text;
    size_t len;
    bool add_special, parse_special;
    int32_t ids[24];
    int n;
} ref_case;

#define S(x) x, sizeof(x) - 1

static const ref_case REF_CASES[] = {
#include "tokenizer_ref_cases.inc"
};

static void reference_cases(void) {
    const char *loaded = NULL;
    kv_gguf *g = NULL;
    kv_vocab *v = NULL;
    kv_error e = {{0}};
    for (size_t i = 0; i < sizeof REF_CASES / sizeof REF_CASES[0]; i++) {
        const ref_case *c = &REF_CASES[i];
        if (!loaded || strcmp(loaded, c->vocab)) {
            kv_vocab_free(v);
            kv_gguf_close(g);
            char path[512];
            snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", CONF_DIR, c->vocab);
            if (open_vocab(path, &g, &v, &e) != KV_OK) {
                CHECK(0, "ref case %zu: load %s: %s", i, c->vocab, e.msg);
                loaded = NULL;
                continue;
            }
            loaded = c->vocab;
        }
        int32_t *ids = NULL;
        size_t n = 0;
        kv_status st = kv_tokenize(v, c->text, c->len, c->add_special, c->parse_special, &ids, &n, &e);
        bool same = st == KV_OK && n == (size_t)c->n && (n == 0 || memcmp(ids, c->ids, n * sizeof *ids) == 0);
        CHECK(same, "ref case %zu (%s): '%.*s' special=%d/%d", i, c->vocab, (int)c->len, c->text, c->add_special,
              c->parse_special);
        if (!same) {
            print_ids("expected", c->ids, (size_t)c->n);
            print_ids("got     ", ids, n);
        }
        free(ids);
    }
    kv_vocab_free(v);
    kv_gguf_close(g);
}

/* ==== inconsistent metadata =============================================== */

typedef enum {
    BAD_NONE,          /* a valid tiny BPE vocab */
    BAD_NO_MODEL,      /* no tokenizer.ggml.model: no vocab, not an error */
    BAD_MODEL_BERT,    /* unsupported model */
    BAD_PRE_UNKNOWN,   /* unsupported pre-tokenizer */
    BAD_SCORES_COUNT,  /* scores count differs */
    BAD_TYPES_COUNT,   /* token_type count differs */
    BAD_TYPES_F32,     /* token_type of the wrong element type */
    BAD_MERGE_UNKNOWN, /* merge names an unknown token */
    BAD_MERGE_NOSPACE, /* merge without a separating space */
    BAD_NO_MERGES,     /* gpt2 without merges */
    BAD_BOS_RANGE,     /* bos id out of range */
    BAD_DUPLICATE,     /* the same text twice */
    BAD_ADD_BOS_NULL,  /* add_bos_token with no valid bos id */
    BAD_NO_TOKENS,     /* model named but no token list */
    BAD_TOKENS_TYPE,   /* token list is not strings */
} bad_kind;

static const char *const TINY_TOKENS[] = {"a", "b", "c", "ab", "abc", "\xc4\xa0", "<|endoftext|>"};
enum { TINY_N = 7 };

static kv_status load_tiny(bad_kind k, kv_vocab **out, kv_error *e) {
    gw *w = gw_new(3);
    if (k != BAD_NO_MODEL) gw_kv_str(w, "tokenizer.ggml.model", k == BAD_MODEL_BERT ? "bert" : "gpt2");
    gw_kv_str(w, "tokenizer.ggml.pre", k == BAD_PRE_UNKNOWN ? "no-such-pre" : "gpt-2");
    const char *toks[TINY_N];
    memcpy(toks, TINY_TOKENS, sizeof toks);
    if (k == BAD_DUPLICATE) toks[4] = "ab";
    if (k == BAD_TOKENS_TYPE) {
        int32_t x[TINY_N] = {0};
        gw_kv_arr(w, "tokenizer.ggml.tokens", KV_GGUF_I32, x, TINY_N);
    } else if (k != BAD_NO_TOKENS) {
        gw_kv_arr_str(w, "tokenizer.ggml.tokens", toks, TINY_N);
    }
    int32_t types[TINY_N] = {1, 1, 1, 1, 1, 1, 3};
    if (k == BAD_TYPES_F32) {
        float f[TINY_N] = {0};
        gw_kv_arr(w, "tokenizer.ggml.token_type", KV_GGUF_F32, f, TINY_N);
    } else {
        gw_kv_arr(w, "tokenizer.ggml.token_type", KV_GGUF_I32, types, k == BAD_TYPES_COUNT ? TINY_N - 1 : TINY_N);
    }
    if (k == BAD_SCORES_COUNT) {
        float sc[TINY_N + 1] = {0};
        gw_kv_arr(w, "tokenizer.ggml.scores", KV_GGUF_F32, sc, TINY_N + 1);
    }
    const char *merges[3] = {"a b", "ab c", "\xc4\xa0 a"};
    if (k == BAD_MERGE_UNKNOWN) merges[1] = "ab zz";
    if (k == BAD_MERGE_NOSPACE) merges[1] = "abc";
    if (k != BAD_NO_MERGES) gw_kv_arr_str(w, "tokenizer.ggml.merges", merges, k == BAD_NONE ? 2 : 3);
    gw_kv_u32(w, "tokenizer.ggml.eos_token_id", 6);
    if (k == BAD_BOS_RANGE) gw_kv_u32(w, "tokenizer.ggml.bos_token_id", 99);
    if (k == BAD_ADD_BOS_NULL) gw_kv_bool(w, "tokenizer.ggml.add_bos_token", true);
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = gw_finish(w, &buf, &len);
    gw_free(w);
    if (rc != 0) return kv_fail(e, KV_ERR_NOMEM, "writer failed");
    kv_gguf *g = NULL;
    kv_status st = kv_gguf_parse(buf, len, &g, e);
    if (st == KV_OK) {
        st = kv_vocab_load(g, out, e);
        /* the vocab copies what it keeps: closing the file must not matter */
        kv_gguf_close(g);
    }
    free(buf);
    return st;
}

static void bad_vocabs(void) {
    static const struct {
        bad_kind k;
        kv_status want;
        const char *msg; /* substring of the message */
    } cases[] = {
        {BAD_NONE, KV_OK, ""},
        {BAD_NO_MODEL, KV_OK, ""},
        {BAD_MODEL_BERT, KV_ERR_UNSUPPORTED, "bert"},
        {BAD_PRE_UNKNOWN, KV_ERR_UNSUPPORTED, "no-such-pre"},
        {BAD_SCORES_COUNT, KV_ERR_FORMAT, "scores"},
        {BAD_TYPES_COUNT, KV_ERR_FORMAT, "token types"},
        {BAD_TYPES_F32, KV_ERR_FORMAT, "token_type"},
        {BAD_MERGE_UNKNOWN, KV_ERR_FORMAT, "zz"},
        {BAD_MERGE_NOSPACE, KV_ERR_FORMAT, "abc"},
        {BAD_NO_MERGES, KV_ERR_FORMAT, "merges"},
        {BAD_BOS_RANGE, KV_ERR_FORMAT, "bos_token_id"},
        {BAD_DUPLICATE, KV_ERR_FORMAT, "duplicate"},
        {BAD_ADD_BOS_NULL, KV_ERR_FORMAT, "add_bos_token"},
        {BAD_NO_TOKENS, KV_ERR_FORMAT, "tokenizer.ggml.tokens"},
        {BAD_TOKENS_TYPE, KV_ERR_FORMAT, "tokenizer.ggml.tokens"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kv_vocab *v = NULL;
        kv_error e = {{0}};
        kv_status st = load_tiny(cases[i].k, &v, &e);
        CHECK(st == cases[i].want && strstr(e.msg, cases[i].msg), "bad vocab %zu: status %s (want %s), '%s'", i,
              kv_status_to_string(st), kv_status_to_string(cases[i].want), e.msg);
        if (cases[i].k == BAD_NO_MODEL) CHECK(st == KV_OK && v == NULL, "no model: expected no vocabulary");
        if (cases[i].k == BAD_NONE && v) {
            /* merges "a b" (rank 0) then "ab c" (rank 1): "abc" is one token;
             * "bca" has no applicable merge */
            int32_t *ids = NULL;
            size_t n = 0;
            st = kv_tokenize(v, "abc", 3, false, false, &ids, &n, &e);
            CHECK(st == KV_OK && n == 1 && ids[0] == 4, "tiny: 'abc' -> abc");
            free(ids);
            st = kv_tokenize(v, "bca", 3, false, false, &ids, &n, &e);
            CHECK(st == KV_OK && n == 3 && ids[0] == 1 && ids[1] == 2 && ids[2] == 0, "tiny: 'bca' -> b c a");
            free(ids);
            CHECK(kv_vocab_is_eog(v, 6) && !kv_vocab_is_eog(v, 0), "tiny: eos is EOG");
            st = kv_tokenize(v, "a<|endoftext|>b", 15, false, true, &ids, &n, &e);
            CHECK(st == KV_OK && n == 3 && ids[1] == 6, "tiny: special token parsed");
            free(ids);
            st = kv_tokenize(v, "a<|endoftext|>b", 15, false, false, &ids, &n, &e);
            /* as text, "<|endoftext|>" has no tokens in this vocabulary: dropped */
            CHECK(st == KV_OK && n == 2 && ids[0] == 0 && ids[1] == 1, "tiny: special token not parsed without parse_special");
            free(ids);
            /* ids out of range: no crash */
            char buf[8];
            CHECK(kv_token_piece(v, -1, true, buf, sizeof buf) == 0 && kv_token_piece(v, 99, true, buf, sizeof buf) == 0,
                  "piece of an id out of range is empty");
            int32_t badids[2] = {0, 1234};
            char *txt = NULL;
            size_t tl;
            CHECK(kv_detokenize(v, badids, 2, false, false, &txt, &tl, &e) == KV_ERR_ARG && txt == NULL,
                  "detokenize rejects an id out of range");
            CHECK(kv_vocab_attr(v, 1234) == 0 && kv_vocab_text(v, 1234, &tl) == NULL && !kv_vocab_is_eog(v, -5),
                  "accessors tolerate ids out of range");
            CHECK(kv_tokenize(NULL, "a", 1, false, false, &ids, &n, &e) == KV_ERR_ARG, "tokenize(NULL vocab)");
        }
        kv_vocab_free(v);
    }
}

/* ==== pieces, detokenize, streaming ======================================= */

static void utf8_prefix(void) {
    static const struct { const char *s; size_t n, want; } c[] = {
        {"", 0, 0},
        {"abc", 3, 3},
        {"a\xc3", 2, 1},               /* lead of a 2-byte sequence */
        {"a\xc3\xa9", 3, 3},           /* é complete */
        {"\xe2\x96", 2, 0},            /* 2 of 3 */
        {"x\xe2\x96\x81", 4, 4},       /* ▁ complete */
        {"\xf0\x9f\x98", 3, 0},        /* 3 of 4 */
        {"ab\xf0\x9f\x98\x80", 6, 6},  /* 😀 complete */
        {"a\x80", 2, 2},               /* stray continuation: emit */
        {"a\xff", 2, 2},               /* invalid byte: emit */
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
        CHECK(kv_utf8_complete_prefix(c[i].s, c[i].n) == c[i].want, "utf8 prefix case %zu: got %zu want %zu", i,
              kv_utf8_complete_prefix(c[i].s, c[i].n), c[i].want);
}

static void spm_pieces(void) {
    kv_gguf *g = NULL;
    kv_vocab *v = NULL;
    if (!open_named_vocab("llama-spm", &g, &v)) return;
    kv_error e = {{0}};
    const kv_vocab_special *sp = kv_vocab_specials(v);
    CHECK(sp->bos == 1 && sp->eos == 2 && sp->unk == 0 && sp->add_bos && !sp->add_eos && sp->add_space_prefix &&
              sp->nl == 13,
          "llama-spm specials (bos %d eos %d unk %d nl %d)", sp->bos, sp->eos, sp->unk, sp->nl);
    CHECK(strcmp(kv_vocab_model_name(v), "llama") == 0 && kv_vocab_n(v) == 32000, "llama-spm name/n");
    int32_t *ids = NULL;
    size_t n = 0;
    kv_tokenize(v, "Hello", 5, true, false, &ids, &n, &e);
    CHECK(n == 2 && ids[0] == 1, "BOS added");
    char *txt = NULL;
    size_t tl = 0;
    kv_detokenize(v, ids, n, true, false, &txt, &tl, &e);
    /* the reference keeps the prefix space when it removes BOS */
    CHECK(tl == 6 && memcmp(txt, " Hello", 6) == 0, "detokenize(remove_special) = '%s'", txt);
    free(txt);
    kv_detokenize(v, ids, n, false, true, &txt, &tl, &e);
    CHECK(tl == 9 && strcmp(txt, "<s> Hello") == 0, "unparse_special = '%s'", txt);
    free(txt);
    free(ids);
    char buf[16];
    size_t k = kv_token_piece(v, 13, false, buf, sizeof buf); /* <0x0A> */
    CHECK(k == 1 && buf[0] == '\n', "byte piece");
    CHECK(kv_token_piece(v, 1, false, buf, sizeof buf) == 0, "control piece hidden");
    CHECK(kv_token_piece(v, 1, true, buf, sizeof buf) == 3 && memcmp(buf, "<s>", 3) == 0, "control piece shown");
    CHECK(kv_token_piece(v, 15043, false, buf, 2) == 6 && buf[0] == ' ', "piece truncated, full length returned");
    kv_vocab_free(v);
    kv_gguf_close(g);
}

/* kv_tokenize_literal with every byte literal reads no special token: the
 * ids are llama.cpp's for the text without special parsing
 * (scripts/ref/llama_ref.py, llama_tokenize(parse_special = false)). It
 * used to sort a NULL list of no special tokens (qsort(NULL, 0), undefined:
 * UBSan stops the sanitizer build there; found by tests/fuzz_tokenizer.c). */
static void literal_masks(void) {
    kv_gguf *g = NULL;
    kv_vocab *v = NULL;
    if (!open_named_vocab("gpt-2", &g, &v)) return;
    kv_error e = {{0}};
    static const char text[] = "a<|endoftext|>b";
    static const int32_t as_text[] = {64, 27, 91, 437, 1659, 5239, 91, 29, 65};
    const size_t len = sizeof text - 1;
    uint8_t literal[sizeof text - 1];
    memset(literal, 1, len);
    int32_t *ids = NULL;
    size_t n = 0;
    kv_status st = kv_tokenize_literal(v, text, len, false, true, literal, &ids, &n, &e);
    bool same = st == KV_OK && n == 9 && memcmp(ids, as_text, sizeof as_text) == 0;
    CHECK(same, "all literal: the special text is text");
    if (!same) print_ids("got", ids, n);
    free(ids);
    kv_vocab_free(v);
    kv_gguf_close(g);
}

/* ctest runs from the repository root (tests/data/vocab). When run from
 * elsewhere, look next to this source file (tests/data/vocab). */
static void find_conf_dir(void) {
    static char buf[1024];
    FILE *f = fopen("tests/data/vocab/ggml-vocab-gpt-2.gguf", "rb");
    if (f) {
        fclose(f);
        return;
    }
    const char *slash = strrchr(__FILE__, '/');
    if (!slash) return;
    snprintf(buf, sizeof buf, "%.*s/data/vocab", (int)(slash - __FILE__), __FILE__);
    CONF_DIR = buf;
}

int main(int argc, char **argv) {
    find_conf_dir();
    if (argc > 1) CONF_DIR = argv[1];
    static const char *const files[] = {"llama-spm", "phi-3", "gpt-2", "starcoder", "deepseek-coder"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) conformance_file(files[i]);
    reference_cases();
    bad_vocabs();
    utf8_prefix();
    spm_pieces();
    literal_masks();
    return kvt_finish();
}
