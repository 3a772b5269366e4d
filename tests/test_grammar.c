/*
 * test_grammar.c — the GBNF compiler and the grammar masks.
 *
 *   - a table of bad grammars, one per malformation, each with the message
 *     (line and column) it must fail with;
 *   - sentences accepted and rejected byte by byte (repetitions, classes,
 *     negation, escapes, UTF-8 split across calls);
 *   - masks against brute force: on random walks through a corpus of
 *     grammars (JSON, arithmetic, lists, Unicode classes) over real
 *     vocabularies (tests/data/vocab: gpt-2's byte-level BPE, llama-spm's
 *     SentencePiece with byte tokens), every token's bit in the mask must
 *     equal whether feeding that token's bytes to a second, independent
 *     matcher succeeds;
 *   - hostile grammars fail at compile time within the limits.
 *
 * Ends with the line "N passed, N failed"; exit status 1 on any failure.
 */
#include "grammar.h"
#include "kvlua.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ==== bad input =========================================================== */

typedef struct {
    const char *name, *text, *want; /* want: a substring of the error */
} bad_case;

static const bad_case BAD[] = {
    {"empty", "", "line 1, column 1: empty grammar"},
    {"only a comment", "# nothing\n", "empty grammar"},
    {"no root", "a ::= \"x\"\n", "line 1, column 1: no rule named 'root'"},
    {"missing ::=", "root \"x\"\n", "line 1, column 6: expected '::='"},
    {"no rule name", "::= \"x\"\n", "line 1, column 1: expected a rule name"},
    {"undefined rule", "root ::= a b\na ::= \"x\"\n", "line 1, column 12: undefined rule 'b'"},
    {"defined twice", "root ::= \"x\"\nroot ::= \"y\"\n", "line 2, column 1: rule 'root' is defined twice"},
    {"unterminated literal", "root ::= \"abc\n", "line 1, column 10: unterminated string literal"},
    {"unterminated class", "root ::= [a-z", "line 1, column 10: unterminated character class"},
    {"empty class", "root ::= []", "line 1, column 10: empty character class"},
    {"reversed range", "root ::= [z-a]", "line 1, column 11: character range ends before it starts"},
    {"unclosed group", "root ::= (\"a\" | \"b\"\n", "line 1, column 10: unclosed '('"},
    {"stray paren", "root ::= \"a\")\n", "line 1, column 13: unexpected ')'"},
    {"repeat nothing", "root ::= *\"a\"", "line 1, column 10: '*' has nothing to repeat"},
    {"repeat twice", "root ::= \"a\"**", "line 1, column 14: '*' has nothing to repeat"},
    {"bad escape", "root ::= \"\\q\"", "line 1, column 11: unknown escape '\\q'"},
    {"short hex escape", "root ::= \"\\x4\"", "line 1, column 11: escape \\x needs 2 hexadecimal digits"},
    {"escape beyond unicode", "root ::= \"\\U00110000\"", "beyond U+10FFFF"},
    {"bad utf-8", "root ::= \"\xff\"", "line 1, column 11: invalid UTF-8"},
    {"repetition too large", "root ::= \"x\"{1000000}", "line 1, column 14: repetition count 1000000 is above the limit 4096"},
    {"repetition max < min", "root ::= \"x\"{3,2}", "line 1, column 13: repetition {3,2}: the maximum is below the minimum"},
    {"repetition unclosed", "root ::= \"x\"{3", "expected '}'"},
    {"direct left recursion", "root ::= root \"a\" | \"b\"\n", "line 1, column 1: left recursion: rule 'root'"},
    {"indirect left recursion", "root ::= a\na ::= b \"x\"\nb ::= a | \"y\"\n",
     "left recursion: rule 'a' can reach itself without consuming input (a -> b -> a)"},
    {"left recursion through an empty prefix", "root ::= e root \"x\" | \"y\"\ne ::= \"\" | \"z\"\n",
     "left recursion: rule 'root'"},
    {"repeat of a nullable", "root ::= (\"a\"?)*\n", "line 1, column 16: left recursion"},
    {"empty language", "root ::= \"a\" root\n", "line 1, column 1: the grammar matches no string"},
    {"empty language via class", "root ::= [^\\x00-\\U0010FFFF]\n", "the grammar matches no string"},
    {"next rule too early", "root ::= (\"a\"\nb ::= \"c\")\n", "line 2, column 1: rule 'b' starts before"},
    {"unexpected char", "root ::= \"a\" @\n", "line 1, column 14: unexpected '@'"},
    {"deep nesting", NULL, "groups nested deeper than 128"},
    {"expansion too large", NULL, "grammar too large: more than 1048576 elements"},
};

static void test_bad_input(void) {
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        const bad_case *c = &BAD[i];
        char *text = NULL;
        if (!c->text && strstr(c->want, "nested")) { /* 200 nested groups */
            text = malloc(1000);
            strcpy(text, "root ::= ");
            for (int k = 0; k < 200; k++) strcat(text, "(");
            strcat(text, "\"a\"");
            for (int k = 0; k < 200; k++) strcat(text, ")");
        } else if (!c->text) { /* a literal of 300 characters 4096 times */
            text = malloc(1000);
            strcpy(text, "root ::= \"");
            for (int k = 0; k < 300; k++) strcat(text, "a");
            strcat(text, "\"{4096}");
        }
        const char *t = c->text ? c->text : text;
        kv_grammar *g = NULL;
        kv_error e = {{0}};
        kv_status st = kv_grammar_compile(t, strlen(t), NULL, &g, &e);
        report(st == KV_ERR_FORMAT && !g && strstr(e.msg, c->want), c->name, "status %d, message '%s', want '%s'",
               (int)st, e.msg, c->want);
        kv_grammar_free(g);
        free(text);
    }
}

/* ==== sentences =========================================================== */

static kv_grammar *compile(const char *text) {
    kv_grammar *g = NULL;
    kv_error e;
    if (kv_grammar_compile(text, strlen(text), NULL, &g, &e) != KV_OK) {
        printf("FAIL compile: %s\n%s\n", e.msg, text);
        n_fail++;
        return NULL;
    }
    return g;
}

/* A matcher of g over a vocabulary of one empty token, for feeding bytes;
 * *gv is the vocabulary, freed by the caller after the matcher. */
static kv_grammar_matcher *bytes_matcher(kv_grammar *g, kv_grammar_vocab **gv) {
    kv_error e;
    const char *none[1] = {NULL};
    size_t zero[1] = {0};
    kv_grammar_vocab_new(1, none, zero, NULL, gv, &e);
    kv_grammar_matcher *m;
    kv_grammar_matcher_new(g, *gv, &m, &e);
    return m;
}

/* Whether the whole of s (a sentence or a prefix of one) is accepted,
 * fed in chunks of `chunk` bytes, and whether the grammar can end there. */
static int feed(kv_grammar_matcher *m, const char *s, size_t chunk, bool *can_end) {
    kv_grammar_state st;
    kv_error e;
    if (kv_grammar_start(m, &st, &e) != KV_OK) return -1;
    size_t n = strlen(s);
    for (size_t i = 0; i < n; i += chunk) {
        size_t k = n - i < chunk ? n - i : chunk;
        if (kv_grammar_accept_bytes(m, &st, s + i, k, &e) != KV_OK) return 0;
    }
    *can_end = kv_grammar_can_end(m, &st);
    return 1;
}

typedef struct {
    const char *text;
    int accept; /* 1: a prefix of a sentence, 0: rejected */
    bool end;   /* a whole sentence */
} sentence;

static void check_sentences(const char *name, const char *grammar, const sentence *ss, size_t n) {
    kv_grammar *g = compile(grammar);
    if (!g) return;
    kv_grammar_vocab *gv;
    kv_grammar_matcher *m = bytes_matcher(g, &gv);
    for (size_t i = 0; i < n; i++) {
        for (size_t chunk = 1; chunk <= 8; chunk *= 8) {
            bool end = false;
            int r = feed(m, ss[i].text, chunk, &end);
            bool ok = r == ss[i].accept && (!r || end == ss[i].end);
            char txt[64], nm[200];
            size_t k = 0;
            for (const unsigned char *c = (const unsigned char *)ss[i].text; *c && k + 5 < sizeof txt; c++)
                k += (size_t)snprintf(txt + k, sizeof txt - k, *c >= 0x20 && *c < 0x7f ? "%c" : "\\x%02X", *c);
            txt[k] = '\0';
            snprintf(nm, sizeof nm, "%s: '%s' (chunks of %zu)", name, txt, chunk);
            report(ok, nm, "accepted %d (want %d), can end %d (want %d)", r, ss[i].accept, end, ss[i].end);
        }
    }
    kv_grammar_matcher_free(m);
    kv_grammar_vocab_free(gv);
    kv_grammar_free(g);
}

static void test_sentences(void) {
    static const sentence rep[] = {
        {"", 1, false},    {"ab", 1, false},  {"abb", 1, true},   {"abbbb", 1, true}, {"abbbbb", 0, false},
        {"abbc", 1, true}, {"abbcc", 0, false}, {"b", 0, false},
    };
    check_sentences("repetitions", "root ::= \"a\" \"b\"{2,4} \"c\"?\n", rep, sizeof rep / sizeof rep[0]);

    static const sentence cls[] = {
        {"x", 1, true},       {"-", 1, true},  {"]", 1, true},   {"\"", 0, false}, {"\\", 0, false},
        {"\n", 0, false},     {"abc", 1, true}, {"\xce\xb1", 1, true} /* α */, {"\xce", 1, false},
    };
    check_sentences("negated class", "root ::= [^\"\\\\\\x00-\\x1F]+ # comment\n", cls, sizeof cls / sizeof cls[0]);

    /* Greek lower case only: a split code point waits; its continuation decides */
    static const sentence greek[] = {
        {"\xce\xb1\xce\xb2", 1, true}, {"\xce", 1, false}, {"\xce\xb1\xce", 1, false},
        {"a", 0, false},               {"\xc3\xa9", 0, false} /* é */, {"\xce\x91", 0, false} /* Α upper */,
        {"\xff", 0, false},            {"\xc0\x80", 0, false} /* overlong */,
    };
    check_sentences("unicode class", "root ::= [\\u03B1-\\u03C9]+\n", greek, sizeof greek / sizeof greek[0]);

    static const sentence ws[] = {
        {"[1, 2,3]", 1, true}, {"[]", 1, true}, {"[1,]", 0, false}, {"[1 2]", 0, false}, {"[ 1 ]", 1, true},
    };
    check_sentences("list with groups over lines",
                    "root ::= \"[\" ws (\n  item\n  (\",\" ws item)*\n)? \"]\"\nitem ::= [0-9]+ ws\nws ::= \" \"?\n",
                    ws, sizeof ws / sizeof ws[0]);

    /* no ranges anywhere (the fuzzer's UBSan saw ranges + 0 on a NULL array) */
    static const sentence any[] = {{"x", 1, true}, {"\xe4\xb8\xad", 1, true}, {"xy", 0, false}, {"", 1, false}};
    check_sentences("any character only", "root ::= .\n", any, sizeof any / sizeof any[0]);

    static const sentence named_root[] = {{"yes", 1, true}, {"no", 0, false}};
    kv_grammar *g = NULL;
    kv_error e;
    const char *two = "root ::= \"no\"\nanswer ::= \"yes\"\n";
    CHECK(kv_grammar_compile(two, strlen(two), "answer", &g, &e) == KV_OK, "named start: %s", e.msg);
    if (g) {
        kv_grammar_vocab *gv;
        kv_grammar_matcher *m = bytes_matcher(g, &gv);
        for (int i = 0; i < 2; i++) {
            bool end = false;
            int r = feed(m, named_root[i].text, 1, &end);
            CHECK(r == named_root[i].accept && (!r || end), "named start rule: '%s'", named_root[i].text);
        }
        kv_grammar_matcher_free(m);
        kv_grammar_vocab_free(gv);
        kv_grammar_free(g);
    }
}

/* ==== masks against brute force =========================================== */

static const char *JSON_GBNF =
    "root   ::= object\n"
    "value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n"
    "object ::=\n"
    "  \"{\" ws (\n"
    "            string \":\" ws value\n"
    "    (\",\" ws string \":\" ws value)*\n"
    "  )? \"}\" ws\n"
    "array  ::=\n"
    "  \"[\" ws (\n"
    "            value\n"
    "    (\",\" ws value)*\n"
    "  )? \"]\" ws\n"
    "string ::=\n"
    "  \"\\\"\" (\n"
    "    [^\"\\\\\\x7F\\x00-\\x1F] |\n"
    "    \"\\\\\" ([\"\\\\bfnrt] | \"u\" [0-9a-fA-F]{4}) # escapes\n"
    "  )* \"\\\"\" ws\n"
    "number ::= (\"-\"? ([0-9] | [1-9] [0-9]{0,15})) (\".\" [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws\n"
    "# Optional space\n"
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n";

static const char *ARITH_GBNF =
    "root ::= expr\n"
    "expr ::= term ((\"+\" | \"-\") term)*\n"
    "term ::= factor ((\"*\" | \"/\") factor)*\n"
    "factor ::= [0-9]+ | \"(\" expr \")\" | \"-\" factor\n";

static const char *LIST_GBNF = "root ::= (\"- \" [a-z ]{1,12} \"\\n\"){1,4}\n";

static const char *UNICODE_GBNF = "root ::= \"«\" [à-öø-ÿα-ω\\u4E00-\\u9FFF ]+ \"»\"\n";

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}

static void masks_vs_brute(const char *vname, const kv_vocab *v, kv_grammar_vocab *gv, const char *gname,
                           const char *text, int walks, int steps) {
    kv_grammar *g = compile(text);
    if (!g) return;
    kv_error e;
    kv_grammar_matcher *m, *ref;
    CHECK(kv_grammar_matcher_new(g, gv, &m, &e) == KV_OK, "%s", e.msg);
    CHECK(kv_grammar_matcher_new(g, gv, &ref, &e) == KV_OK, "%s", e.msg);
    int32_t n = kv_grammar_vocab_n(gv);
    int32_t *allowed = malloc((size_t)n * sizeof *allowed);
    int mismatches = 0, states = 0;
    long total_allowed = 0;
    for (int w = 0; w < walks; w++) {
        kv_grammar_state st, rst;
        kv_grammar_start(m, &st, &e);
        kv_grammar_start(ref, &rst, &e);
        for (int step = 0; step < steps; step++) {
            const uint32_t *bits;
            int32_t cnt = -1;
            if (kv_grammar_mask(m, &st, &bits, &cnt, &e) != KV_OK) {
                CHECK(0, "mask: %s", e.msg);
                break;
            }
            int32_t na = 0;
            for (int32_t id = 0; id < n; id++) {
                kv_grammar_state t = rst;
                kv_error e2;
                bool brute = kv_grammar_accept_token(ref, &t, id, &e2) == KV_OK;
                bool bit = (bits[id >> 5] >> (id & 31)) & 1;
                if (brute != bit && mismatches++ < 5) {
                    char piece[64];
                    size_t l = kv_token_piece(v, id, false, piece, sizeof piece - 1);
                    piece[l < sizeof piece ? l : sizeof piece - 1] = '\0';
                    printf("  %s/%s walk %d step %d: token %d '%s' mask %d brute %d\n", vname, gname, w, step, id,
                           piece, bit, brute);
                }
                if (bit) allowed[na++] = id;
            }
            CHECK(cnt == na, "%s/%s: mask count %d, bits %d", vname, gname, cnt, na);
            /* no dead ends: every allowed token leads somewhere (a lead byte
             * whose code points the grammar refuses must not be allowed) */
            CHECK(na > 0, "%s/%s walk %d step %d: nothing allowed", vname, gname, w, step);
            states++;
            total_allowed += na;
            if (na == 0) break;
            /* next: mostly short tokens, so walks reach deep structure */
            int32_t pick = allowed[rnd() % (uint32_t)na];
            for (int k = 0; k < 3; k++) {
                int32_t c = allowed[rnd() % (uint32_t)na];
                char tmp[8];
                if (kv_token_piece(v, c, false, tmp, sizeof tmp) <= 2) pick = c;
            }
            if (kv_vocab_is_eog(v, pick)) break;
            CHECK(kv_grammar_accept_token(m, &st, pick, &e) == KV_OK, "accept %d: %s", pick, e.msg);
            CHECK(kv_grammar_accept_token(ref, &rst, pick, &e) == KV_OK, "ref accept %d: %s", pick, e.msg);
        }
    }
    char nm[160];
    snprintf(nm, sizeof nm, "masks = brute force: %s, %s (%d states, %.0f tokens allowed on average)", vname, gname,
             states, states ? (double)total_allowed / states : 0.0);
    report(mismatches == 0 && states > 0, nm, "%d mismatches", mismatches);
    free(allowed);
    kv_grammar_matcher_free(m);
    kv_grammar_matcher_free(ref);
    kv_grammar_free(g);
}

static void test_masks(const char *file) {
    char path[256];
    snprintf(path, sizeof path, "tests/data/vocab/%s", file);
    kv_gguf *gg = NULL;
    kv_vocab *v = NULL;
    kv_error e;
    if (kv_gguf_open(path, &gg, &e) != KV_OK || kv_vocab_load(gg, &v, &e) != KV_OK) {
        report(false, path, "cannot open: %s", e.msg);
        kv_gguf_close(gg);
        return;
    }
    kv_grammar_vocab *gv = NULL;
    if (kv_grammar_vocab_build(v, &gv, &e) != KV_OK) {
        report(false, path, "vocab: %s", e.msg);
    } else {
        masks_vs_brute(file, v, gv, "json", JSON_GBNF, 3, 30);
        masks_vs_brute(file, v, gv, "arithmetic", ARITH_GBNF, 3, 20);
        masks_vs_brute(file, v, gv, "list", LIST_GBNF, 3, 20);
        masks_vs_brute(file, v, gv, "unicode", UNICODE_GBNF, 3, 20);
    }
    kv_grammar_vocab_free(gv);
    kv_vocab_free(v);
    kv_gguf_close(gg);
}

/* A byte token carrying half a code point: allowed exactly when the
 * class admits a character starting with it. */
static void test_byte_tokens(void) {
    kv_gguf *gg = NULL;
    kv_vocab *v = NULL;
    kv_error e;
    if (kv_gguf_open("tests/data/vocab/ggml-vocab-llama-spm.gguf", &gg, &e) != KV_OK ||
        kv_vocab_load(gg, &v, &e) != KV_OK) {
        report(false, "byte tokens", "cannot open: %s", e.msg);
        kv_gguf_close(gg);
        return;
    }
    kv_grammar_vocab *gv = NULL;
    kv_grammar *g = compile("root ::= [\\u03B1-\\u03C9]+\n");
    kv_grammar_matcher *m = NULL;
    if (g && kv_grammar_vocab_build(v, &gv, &e) == KV_OK && kv_grammar_matcher_new(g, gv, &m, &e) == KV_OK) {
        int32_t ce = -1, cf = -1, c3 = -1, b1 = -1, a = -1;
        for (int32_t id = 0; id < kv_vocab_n(v); id++) {
            size_t l;
            const char *t = kv_vocab_text(v, id, &l);
            if (l == 6 && !memcmp(t, "<0xCE>", 6)) ce = id;
            if (l == 6 && !memcmp(t, "<0xCF>", 6)) cf = id;
            if (l == 6 && !memcmp(t, "<0xC3>", 6)) c3 = id;
            if (l == 6 && !memcmp(t, "<0xB1>", 6)) b1 = id;
            if (l == 1 && t[0] == 'a') a = id;
        }
        kv_grammar_state st;
        kv_grammar_start(m, &st, &e);
        const uint32_t *bits;
#define BIT(id) ((id) >= 0 && ((bits[(id) >> 5] >> ((id)&31)) & 1))
        kv_grammar_mask(m, &st, &bits, NULL, &e);
        CHECK(ce >= 0 && cf >= 0 && c3 >= 0 && b1 >= 0 && a >= 0, "byte tokens found");
        CHECK(BIT(ce) && BIT(cf), "lead bytes of Greek lower case allowed");
        CHECK(!BIT(c3) && !BIT(a) && !BIT(b1), "other lead bytes, ASCII and a lone continuation refused");
        CHECK(kv_grammar_accept_token(m, &st, ce, &e) == KV_OK, "accept <0xCE>: %s", e.msg);
        CHECK(!kv_grammar_can_end(m, &st), "half a character cannot end");
        kv_grammar_mask(m, &st, &bits, NULL, &e);
        CHECK(BIT(b1) && !BIT(ce) && !BIT(a), "after <0xCE>: the continuation <0xB1> (α), not a lead byte");
        CHECK(kv_grammar_accept_token(m, &st, b1, &e) == KV_OK, "accept <0xB1>: %s", e.msg);
        CHECK(kv_grammar_can_end(m, &st), "α is a sentence");
        int32_t eos = kv_vocab_specials(v)->eos;
        kv_grammar_mask(m, &st, &bits, NULL, &e);
        CHECK(BIT(eos), "EOS allowed once the grammar can end");
        kv_grammar_state st0;
        kv_grammar_start(m, &st0, &e);
        kv_grammar_mask(m, &st0, &bits, NULL, &e);
        CHECK(!BIT(eos), "EOS refused before");
        CHECK(kv_grammar_accept_token(m, &st0, eos, &e) != KV_OK, "accepting EOS too early fails");
        int32_t bos = kv_vocab_specials(v)->bos;
        CHECK(!BIT(bos) && kv_grammar_accept_token(m, &st0, bos, &e) != KV_OK, "BOS never allowed");
#undef BIT
        report(true, "byte tokens carry half a code point", "%s", "");
    } else {
        report(false, "byte tokens", "%s", e.msg);
    }
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);
    kv_grammar_vocab_free(gv);
    kv_vocab_free(v);
    kv_gguf_close(gg);
}

/* Hostile but valid grammars stay bounded: an ambiguous one reaches the
 * stack limit with an error, not a hang. */
static void test_limits(void) {
    kv_grammar *g = compile("root ::= x*\nx ::= \"a\" | \"a\" \"a\" | \"a\" \"a\" \"a\" | \"a\"{1,30}\n");
    if (!g) return;
    kv_grammar_vocab *gv;
    kv_error e;
    kv_grammar_matcher *m = bytes_matcher(g, &gv);
    kv_grammar_state st;
    kv_grammar_start(m, &st, &e);
    kv_status s = KV_OK;
    for (int i = 0; i < 2000 && s == KV_OK; i++) s = kv_grammar_accept_bytes(m, &st, "a", 1, &e);
    CHECK(s == KV_OK, "ambiguous repetition stays within the stack limit (dedup): %s", e.msg);
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);

    /* nesting deeper than the stack limit: an error naming it */
    g = compile("root ::= \"(\" root \")\" | \"x\"\n");
    kv_grammar_matcher_new(g, gv, &m, &e);
    kv_grammar_start(m, &st, &e);
    s = KV_OK;
    int i = 0;
    for (; i < KV_GRAMMAR_MAX_DEPTH + 10 && s == KV_OK; i++) s = kv_grammar_accept_bytes(m, &st, "(", 1, &e);
    CHECK(s != KV_OK && strstr(e.msg, "limit") && strstr(e.msg, "deeper"), "deep nesting: %s after %d", e.msg, i);
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);
    kv_grammar_vocab_free(gv);
}

int main(void) {
    test_bad_input();
    test_sentences();
    test_byte_tokens();
    test_limits();
    test_masks("ggml-vocab-gpt-2.gguf");
    test_masks("ggml-vocab-llama-spm.gguf");
    return kvt_finish();
}
