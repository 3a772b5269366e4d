/*
 * fuzz_tokenizer.c — libFuzzer entry point for the tokenizer (engine/
 * tokenizer.c, engine/pretok.c): text -> ids -> text.
 *
 * At start-up it loads every vendored vocabulary, tests/data/vocab/
 * ggml-vocab-*.gguf (another folder through TOKENIZER_VOCAB_DIR; run from
 * the repository root), once; if TOKENIZER_SEEDS names a folder, it writes
 * every input of the vocabularies' .inp files there as a seed. Each fuzz
 * input is text (any bytes), tokenized against every vocabulary with and
 * without special-token parsing, with and without BOS/EOS, and with a
 * literal mask. It traps unless what the engine promises holds:
 *
 *   - tokenize succeeds and every id is in [0, n_vocab);
 *   - add_special only adds the vocabulary's BOS in front and EOS behind;
 *   - a literal mask of all zeros is no mask; an all-ones mask gives the
 *     ids of parse_special = false (literal bytes read no control or
 *     unknown token, user-defined ones as always);
 *   - detokenize gives back the input bytes where the tokenizer is lossless
 *     (the same rule as tests/test_tokenizer.c): the text is valid UTF-8,
 *     no unknown / control / user-defined token came out (an unknown token
 *     stands for lost text, phi-3's user-defined tokens eat the spaces after
 *     them), a SentencePiece text holds no U+2581 (it comes back as a
 *     space) and, in a vocabulary that cleans up tokenization spaces, the
 *     text holds none of the patterns the clean-up rewrites. A byte-level
 *     BPE vocabulary is also lossless with special tokens read and written
 *     back (no space is added after them, unlike SentencePiece);
 *   - where detokenize neither strips a leading space nor cleans up, it is
 *     the concatenation of kv_token_piece.
 *
 * Run it with tests/run-fuzz.sh SECONDS.
 */
#define _GNU_SOURCE /* memmem */
#include "kvlua.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REQUIRE(c) do { if (!(c)) __builtin_trap(); } while (0)

typedef struct {
    char name[64];
    kv_gguf *g;
    kv_vocab *v;
    bool bpe, clean; /* byte-level BPE; cleans up tokenization spaces */
} vocab_slot;

enum { MAX_VOCABS = 16 };
static vocab_slot g_voc[MAX_VOCABS];
static int g_nvoc;

/* Strictly valid UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
static bool valid_utf8(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        size_t l;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xc2 && c <= 0xdf) { l = 2; cp = c & 0x1f; }
        else if (c >= 0xe0 && c <= 0xef) { l = 3; cp = c & 0x0f; }
        else if (c >= 0xf0 && c <= 0xf4) { l = 4; cp = c & 0x07; }
        else return false;
        if (i + l > n) return false;
        for (size_t k = 1; k < l; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        if ((l == 3 && cp < 0x800) || (l == 4 && cp < 0x10000) || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += l;
    }
    return true;
}

/* The patterns clean_up_tokenization_spaces rewrites: a space before ?!.,' */
static bool has_cleanup_pattern(const uint8_t *s, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (s[i] != ' ') continue;
        uint8_t x = s[i + 1];
        if (x == '?' || x == '!' || x == '.' || x == ',' || x == '\'') return true;
    }
    return false;
}

static bool same_ids(const int32_t *a, size_t na, const int32_t *b, size_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

static bool any_attr(const kv_vocab *v, const int32_t *ids, size_t n, int mask) {
    for (size_t i = 0; i < n; i++)
        if (kv_vocab_attr(v, ids[i]) & mask) return true;
    return false;
}

static void require_in_range(const kv_vocab *v, const int32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++) REQUIRE(ids[i] >= 0 && ids[i] < kv_vocab_n(v));
}

/* detokenize(ids) must be exactly the input. */
static void require_round_trip(const kv_vocab *v, const int32_t *ids, size_t n, bool special, const uint8_t *data,
                               size_t size) {
    char *txt = NULL;
    size_t tl = 0;
    kv_error e;
    REQUIRE(kv_detokenize(v, ids, n, false, special, &txt, &tl, &e) == KV_OK);
    REQUIRE(tl == size && (size == 0 || memcmp(txt, data, size) == 0));
    free(txt);
}

/* The pieces of ids, concatenated, equal detokenize's text. */
static void require_pieces(const kv_vocab *v, const int32_t *ids, size_t n) {
    char *txt = NULL;
    size_t tl = 0;
    kv_error e;
    REQUIRE(kv_detokenize(v, ids, n, false, false, &txt, &tl, &e) == KV_OK);
    size_t at = 0;
    char buf[4096];
    for (size_t i = 0; i < n; i++) {
        size_t k = kv_token_piece(v, ids[i], false, buf, sizeof buf);
        REQUIRE(k <= sizeof buf && at + k <= tl && memcmp(txt + at, buf, k) == 0);
        at += k;
    }
    REQUIRE(at == tl);
    free(txt);
}

static void one_vocab(const vocab_slot *s, const uint8_t *data, size_t size, uint8_t *mask) {
    const kv_vocab *v = s->v;
    const kv_vocab_special *sp = kv_vocab_specials(v);
    const char *text = (const char *)data;
    kv_error e;
    int32_t *plain = NULL, *spec = NULL, *both = NULL, *lit = NULL;
    size_t n_plain = 0, n_spec = 0, n_both = 0, n_lit = 0;

    REQUIRE(kv_tokenize(v, text, size, false, false, &plain, &n_plain, &e) == KV_OK);
    require_in_range(v, plain, n_plain);
    REQUIRE(kv_tokenize(v, text, size, false, true, &spec, &n_spec, &e) == KV_OK);
    require_in_range(v, spec, n_spec);

    /* add_special: BOS in front and EOS behind, as the vocabulary says, nothing else */
    REQUIRE(kv_tokenize(v, text, size, true, true, &both, &n_both, &e) == KV_OK);
    size_t lead = sp->add_bos && sp->bos >= 0, tail = sp->add_eos && sp->eos >= 0;
    REQUIRE(n_both == n_spec + lead + tail);
    if (lead) REQUIRE(both[0] == sp->bos);
    if (tail) REQUIRE(both[n_both - 1] == sp->eos);
    REQUIRE(same_ids(both + lead, n_both - lead - tail, spec, n_spec));

    /* literal masks: all zeros is no mask; all ones is parse_special = false */
    memset(mask, 0, size);
    REQUIRE(kv_tokenize_literal(v, text, size, false, true, mask, &lit, &n_lit, &e) == KV_OK);
    REQUIRE(same_ids(lit, n_lit, spec, n_spec));
    free(lit);
    memset(mask, 1, size);
    REQUIRE(kv_tokenize_literal(v, text, size, false, true, mask, &lit, &n_lit, &e) == KV_OK);
    require_in_range(v, lit, n_lit);
    REQUIRE(same_ids(lit, n_lit, plain, n_plain));
    free(lit);
    /* a mask with holes: only the range check */
    for (size_t i = 0; i < size; i++) mask[i] = (uint8_t)((i * 2654435761u >> 7) & 1);
    REQUIRE(kv_tokenize_literal(v, text, size, true, true, mask, &lit, &n_lit, &e) == KV_OK);
    require_in_range(v, lit, n_lit);
    free(lit);

    /* SentencePiece writes a space as U+2581, so a U+2581 in the text comes back as a space */
    const bool text_ok = valid_utf8(data, size) && !(s->clean && has_cleanup_pattern(data, size)) &&
                         (s->bpe || !memmem(data, size, "\xe2\x96\x81", 3));
    const int lossy = KV_TOKEN_UNKNOWN | KV_TOKEN_CONTROL | KV_TOKEN_USER_DEFINED;
    if (text_ok && !any_attr(v, plain, n_plain, lossy)) require_round_trip(v, plain, n_plain, false, data, size);
    if (text_ok && s->bpe && !any_attr(v, spec, n_spec, KV_TOKEN_UNKNOWN))
        require_round_trip(v, spec, n_spec, true, data, size);
    if (!s->clean && !sp->add_space_prefix) require_pieces(v, plain, n_plain);

    free(plain);
    free(spec);
    free(both);
}

/* Every input of an .inp file (separated by "\n__ggml_vocab_test__\n") as a seed file in dir. */
static void write_seeds(const char *dir, const char *inp_path, const char *name) {
    FILE *f = fopen(inp_path, "rb");
    if (!f) return;
    size_t cap = 1 << 16, n = 0, k;
    char *buf = malloc(cap);
    while (buf && (k = fread(buf + n, 1, cap - n, f)) > 0)
        if ((n += k) == cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) { free(buf); buf = NULL; }
            buf = nb;
        }
    fclose(f);
    if (!buf) return;
    static const char SEP[] = "\n__ggml_vocab_test__\n";
    char *p = buf, *end = buf + n;
    for (int i = 0; p < end; i++) {
        char *q = memmem(p, (size_t)(end - p), SEP, sizeof SEP - 1);
        if (!q) q = end;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s-%03d", dir, name, i);
        FILE *o = fopen(path, "wb");
        if (o) {
            fwrite(p, 1, (size_t)(q - p), o);
            fclose(o);
        }
        p = q + (q < end ? sizeof SEP - 1 : 0);
    }
    free(buf);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *dir = getenv("TOKENIZER_VOCAB_DIR");
    if (!dir) dir = "tests/data/vocab";
    const char *seeds = getenv("TOKENIZER_SEEDS");
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "fuzz_tokenizer: cannot open %s (run from the repository root)\n", dir);
        abort();
    }
    struct dirent *de;
    while ((de = readdir(d)) && g_nvoc < MAX_VOCABS) {
        size_t l = strlen(de->d_name);
        if (strncmp(de->d_name, "ggml-vocab-", 11) != 0 || l < 16 || strcmp(de->d_name + l - 5, ".gguf") != 0) continue;
        vocab_slot *s = &g_voc[g_nvoc];
        snprintf(s->name, sizeof s->name, "%.*s", (int)(l - 16), de->d_name + 11);
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        kv_error e;
        if (kv_gguf_open(path, &s->g, &e) != KV_OK || kv_vocab_load(s->g, &s->v, &e) != KV_OK) {
            fprintf(stderr, "fuzz_tokenizer: %s: %s\n", path, e.msg);
            abort();
        }
        s->bpe = strcmp(kv_vocab_model_name(s->v), "gpt2") == 0;
        /* whether detokenize cleans up: " ," comes back as "," (the token ids do not matter) */
        int32_t *ids = NULL;
        size_t n = 0;
        char *txt = NULL;
        size_t tl = 0;
        if (kv_tokenize(s->v, "a ,", 3, false, false, &ids, &n, &e) != KV_OK ||
            kv_detokenize(s->v, ids, n, false, false, &txt, &tl, &e) != KV_OK)
            abort();
        s->clean = tl != 3;
        free(ids);
        free(txt);
        if (seeds) {
            strcat(path, ".inp");
            write_seeds(seeds, path, s->name);
        }
        g_nvoc++;
    }
    closedir(d);
    if (g_nvoc == 0) {
        fprintf(stderr, "fuzz_tokenizer: no ggml-vocab-*.gguf in %s\n", dir);
        abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *mask = malloc(size ? size : 1);
    REQUIRE(mask);
    for (int i = 0; i < g_nvoc; i++) one_vocab(&g_voc[i], data, size, mask);
    free(mask);
    return 0;
}
