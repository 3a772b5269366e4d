/*
 * pretok.c — the BPE pre-tokenizer, reproducing llama.cpp's word splitting.
 *
 * llama.cpp gives each tokenizer.ggml.pre family a list of regexes and
 * runs them in order; each regex re-splits every piece ("chunk") left by
 * the previous one, and both its matches and the text between matches
 * become pieces. Lookaheads and `$` therefore see the end of the chunk,
 * not of the text. Two of the regexes (GPT-2's and Llama-3's) run through
 * hand-written matchers in the reference; the others run through
 * std::regex on a "collapsed" text (one byte per codepoint: ASCII kept,
 * other codepoints replaced by their class) or, when the pattern has
 * non-ASCII literals, std::wregex on the codepoints with non-ASCII
 * whitespace replaced by U+000B.
 *
 * Here every regex of the supported families is a small hand-written
 * stage over codepoints with the same semantics (leftmost, first
 * alternative wins, greedy). Every stage is linear in its chunk.
 *
 * Pipeline:
 *   bytes --decode--> cps (n) + flags (n) + byte offsets (n + 1)
 *         --stage 1..k--> chunk lengths in codepoints
 *         --offsets--> kv_span (bytes)
 */
#include "pretok.h"

#include <stdlib.h>
#include <string.h>

#include "unicode.h"

/* ---- UTF-8, as the reference reads it ------------------------------------- */

uint32_t kv_utf8_decode(const char *s, size_t len, size_t *adv)
{
    const unsigned char *u = (const unsigned char *)s;
    *adv = 1;
    if (len == 0)
        return 0xFFFD;
    unsigned c0 = u[0];
    if (!(c0 & 0x80))
        return c0;
    if (!(c0 & 0x40))
        return 0xFFFD; /* stray continuation byte */
    if (!(c0 & 0x20)) {
        if (len < 2 || (u[1] & 0xC0) != 0x80)
            return 0xFFFD;
        *adv = 2;
        return ((c0 & 0x1F) << 6) | (u[1] & 0x3F);
    }
    if (!(c0 & 0x10)) {
        if (len < 3 || (u[1] & 0xC0) != 0x80 || (u[2] & 0xC0) != 0x80)
            return 0xFFFD;
        *adv = 3;
        return ((c0 & 0x0F) << 12) | ((u[1] & 0x3F) << 6) | (u[2] & 0x3F);
    }
    if (!(c0 & 0x08)) {
        if (len < 4 || (u[1] & 0xC0) != 0x80 || (u[2] & 0xC0) != 0x80 || (u[3] & 0xC0) != 0x80)
            return 0xFFFD;
        *adv = 4;
        return ((uint32_t)(c0 & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) |
               ((u[2] & 0x3F) << 6) | (u[3] & 0x3F);
    }
    return 0xFFFD; /* 11111xxx */
}

size_t kv_utf8_encode(uint32_t cp, char out[4])
{
    if (cp <= 0x7F) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp <= 0x7FF) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp <= 0xFFFF) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    if (cp <= 0x10FFFF) {
        out[0] = (char)(0xF0 | (cp >> 18));
        out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[3] = (char)(0x80 | (cp & 0x3F));
        return 4;
    }
    return 0;
}

size_t kv_utf8_len(unsigned char lead)
{
    static const unsigned char lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lookup[lead >> 4];
}

size_t kv_pretok_word(const char *text, kv_span sp, char *out, size_t cap)
{
    size_t w = 0, i = 0;
    while (i < sp.len) {
        size_t adv;
        uint32_t cp = kv_utf8_decode(text + sp.off + i, sp.len - i, &adv);
        char buf[4];
        size_t k = kv_utf8_encode(cp, buf);
        if (k == 0 || w + k > cap)
            return (size_t)-1;
        memcpy(out + w, buf, k);
        w += k;
        i += adv;
    }
    return w;
}

/* ---- families ------------------------------------------------------------ */

static const struct {
    const char *name;
    int kind;
} pre_names[] = {
    {"default", KV_PRETOK_DEFAULT},
    /* LLAMA_VOCAB_PRE_TYPE_LLAMA3, DBRX, SMAUG, CHATGLM4: the same regex */
    {"llama3", KV_PRETOK_LLAMA3},
    {"llama-v3", KV_PRETOK_LLAMA3},
    {"llama-bpe", KV_PRETOK_LLAMA3},
    {"falcon3", KV_PRETOK_LLAMA3},
    {"falcon-h1", KV_PRETOK_LLAMA3},
    {"pixtral", KV_PRETOK_LLAMA3},
    {"midm-2.0", KV_PRETOK_LLAMA3},
    {"lfm2", KV_PRETOK_LLAMA3},
    {"jina-v5-nano", KV_PRETOK_LLAMA3},
    {"dbrx", KV_PRETOK_LLAMA3},
    {"smaug-bpe", KV_PRETOK_LLAMA3},
    {"glm4", KV_PRETOK_LLAMA3},
    {"chatglm-bpe", KV_PRETOK_LLAMA3},
    {"deepseek-llm", KV_PRETOK_DEEPSEEK_LLM},
    {"deepseek-coder", KV_PRETOK_DEEPSEEK_CODER},
    {"falcon", KV_PRETOK_FALCON},
    /* GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING */
    {"gpt-2", KV_PRETOK_GPT2},
    {"phi-2", KV_PRETOK_GPT2},
    {"jina-es", KV_PRETOK_GPT2},
    {"jina-de", KV_PRETOK_GPT2},
    {"gigachat", KV_PRETOK_GPT2},
    {"jina-v2-es", KV_PRETOK_GPT2},
    {"jina-v2-de", KV_PRETOK_GPT2},
    {"a.x-4.0", KV_PRETOK_GPT2},
    {"mellum", KV_PRETOK_GPT2},
    {"modern-bert", KV_PRETOK_GPT2},
    {"jina-v1-en", KV_PRETOK_GPT2},
    {"jina-v2-code", KV_PRETOK_GPT2},
    {"roberta-bpe", KV_PRETOK_GPT2},
    {"exaone4", KV_PRETOK_GPT2},
    {"mpt", KV_PRETOK_GPT2},
    {"olmo", KV_PRETOK_GPT2},
    {"jais", KV_PRETOK_GPT2},
    {"trillion", KV_PRETOK_GPT2},
    {"granite-docling", KV_PRETOK_GPT2},
    /* STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2 */
    {"starcoder", KV_PRETOK_STARCODER},
    {"refact", KV_PRETOK_STARCODER},
    {"command-r", KV_PRETOK_STARCODER},
    {"smollm", KV_PRETOK_STARCODER},
    {"codeshell", KV_PRETOK_STARCODER},
    {"exaone", KV_PRETOK_STARCODER},
    {"minerva-7b", KV_PRETOK_STARCODER},
    {"mellum2", KV_PRETOK_STARCODER},
    /* QWEN2, STABLELM2, HUNYUAN, SOLAR_OPEN, GROK_2: the same regex */
    {"qwen2", KV_PRETOK_QWEN2},
    {"deepseek-r1-qwen", KV_PRETOK_QWEN2},
    {"kormo", KV_PRETOK_QWEN2},
    {"f2llmv2", KV_PRETOK_QWEN2},
    {"megrez", KV_PRETOK_QWEN2},
    {"stablelm2", KV_PRETOK_QWEN2},
    {"hunyuan", KV_PRETOK_QWEN2},
    {"solar-open", KV_PRETOK_QWEN2},
    {"grok-2", KV_PRETOK_QWEN2},
    /* BAILINGMOE: '(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|...|\s*[\r\n]|... matches
     * exactly what the qwen2 regex matches */
    {"bailingmoe", KV_PRETOK_QWEN2},
    {"bailingmoe2", KV_PRETOK_QWEN2},
    {"llada-moe", KV_PRETOK_QWEN2},
    {"qwen35", KV_PRETOK_QWEN35},
    {"seed-coder", KV_PRETOK_SEED_CODER},
    {"minicpm5", KV_PRETOK_MINICPM5},
    {"laguna", KV_PRETOK_LAGUNA},
    {"ufakzeka", KV_PRETOK_UFAKZEKA},
};

static const char *kind_names[KV_PRETOK_COUNT] = {
    "default", "gpt-2", "llama-bpe", "qwen2", "starcoder", "deepseek-llm", "deepseek-coder", "falcon",
    "qwen35", "seed-coder", "minicpm5", "laguna", "ufakzeka",
};

int kv_pretok_kind(const char *pre_name)
{
    if (!pre_name)
        return -1;
    for (size_t i = 0; i < sizeof pre_names / sizeof pre_names[0]; i++)
        if (strcmp(pre_names[i].name, pre_name) == 0)
            return pre_names[i].kind;
    return -1;
}

const char *kv_pretok_kind_name(int kind)
{
    return (kind >= 0 && kind < KV_PRETOK_COUNT) ? kind_names[kind] : "?";
}

/* ---- text and chunk lists ------------------------------------------------ */

typedef struct {
    const uint32_t *cp; /* (n) codepoints */
    const uint16_t *fl; /* (n) kv_unicode_flags of each codepoint */
    size_t n;
} text_t;

typedef struct {
    size_t *len; /* (count) chunk lengths in codepoints */
    size_t count, cap;
    int oom;
} chunks_t;

static void emit(chunks_t *c, size_t len)
{
    if (len == 0 || c->oom)
        return;
    if (c->count == c->cap) {
        size_t ncap = c->cap ? c->cap * 2 : 64;
        size_t *p = realloc(c->len, ncap * sizeof *p);
        if (!p) {
            c->oom = 1;
            return;
        }
        c->len = p;
        c->cap = ncap;
    }
    c->len[c->count++] = len;
}

/* flags at i, 0 past the chunk end (the reference's OUT_OF_RANGE) */
#define FL(i) ((i) < end ? t->fl[i] : 0u)
#define CP(i) ((i) < end ? t->cp[i] : 0xFFFFFFFFu)

enum { WS = KV_UC_WHITESPACE, LET = KV_UC_LETTER, NUM = KV_UC_NUMBER };

/* ---- GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
 * (the reference's hand-written matcher; same result as the regex) */

static void stage_gpt2(const text_t *t, size_t ini, size_t end, chunks_t *out)
{
    size_t pos = ini, prev = ini;
#define TOKEN(e) do { emit(out, (e) - prev); prev = (e); pos = (e); } while (0)
    while (pos < end) {
        uint32_t c = t->cp[pos];
        unsigned f = t->fl[pos];
        if (c == '\'' && pos + 1 < end) {
            uint32_t c1 = t->cp[pos + 1];
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                TOKEN(pos + 2);
                continue;
            }
            if (pos + 2 < end) {
                uint32_t c2 = t->cp[pos + 2];
                if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
                    TOKEN(pos + 3);
                    continue;
                }
            }
        }
        unsigned f2 = (c == ' ') ? FL(pos + 1) : f;
        size_t p = pos + (c == ' ');
        if (f2 & LET) {
            while (FL(p) & LET)
                p++;
            TOKEN(p);
            continue;
        }
        if (f2 & NUM) {
            while (FL(p) & NUM)
                p++;
            TOKEN(p);
            continue;
        }
        if (!(f2 & (WS | LET | NUM)) && f2) {
            for (;;) {
                unsigned g = FL(p);
                if ((g & (WS | LET | NUM)) || !g)
                    break;
                p++;
            }
            TOKEN(p);
            continue;
        }
        size_t k = 0;
        while (FL(pos + k) & WS)
            k++;
        if (k > 1 && pos + k < end) { /* \s+(?!\S): leave the last one */
            TOKEN(pos + k - 1);
            continue;
        }
        if (k > 0) {
            TOKEN(pos + k);
            continue;
        }
        TOKEN(pos + 1);
    }
#undef TOKEN
}

/* ---- Llama-3 family:
 * (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|
 * \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * llama3 runs through the reference's hand-written matcher; its relatives
 * (qwen2: \p{N}; qwen35: [\p{L}\p{M}]+ and [^\s\p{L}\p{M}\p{N}]; seed-coder:
 * no [\r\n]* after punctuation; minicpm5: \p{N}+; ufakzeka: no contraction
 * alternative) through std::regex, with the same leftmost-first semantics,
 * which this one loop reproduces for all of them. */

typedef struct {
    size_t maxn;       /* \p{N}{1,maxn}; 0: \p{N}+ */
    unsigned word;     /* the run class of alternative 2: LET, or LET|MARK */
    unsigned punct_ex; /* classes excluded from the punctuation run (besides WS) */
    int contractions;  /* the leading 's|'t|... alternative is present */
    int punct_crlf;    /* [\r\n]* follows the punctuation run */
} l3_params;

static const l3_params L3_LLAMA3 = {3, LET, LET | NUM, 1, 1};
static const l3_params L3_QWEN2 = {1, LET, LET | NUM, 1, 1};
static const l3_params L3_QWEN35 = {1, LET | KV_UC_MARK, LET | KV_UC_MARK | NUM, 1, 1};
static const l3_params L3_SEED_CODER = {1, LET, LET | NUM, 1, 0};
static const l3_params L3_MINICPM5 = {0, LET, LET | NUM, 1, 1};
static const l3_params L3_UFAKZEKA = {1, LET, LET | NUM, 0, 1};

static uint32_t ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

static void stage_llama3(const text_t *t, size_t ini, size_t end, chunks_t *out, const l3_params *lp)
{
    const unsigned word = lp->word, pex = WS | lp->punct_ex;
    size_t pos = ini, prev = ini;
#define TOKEN(e) do { emit(out, (e) - prev); prev = (e); pos = (e); } while (0)
    while (pos < end) {
        uint32_t c = t->cp[pos];
        unsigned f = t->fl[pos];
        if (lp->contractions && c == '\'' && pos + 1 < end) {
            uint32_t c1 = ascii_lower(t->cp[pos + 1]);
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                TOKEN(pos + 2);
                continue;
            }
            if (pos + 2 < end) {
                uint32_t c2 = ascii_lower(t->cp[pos + 2]);
                if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
                    TOKEN(pos + 3);
                    continue;
                }
            }
        }
        /* [^\r\n\p{L}\p{N}]?WORD+ : a codepoint of WORD starts a run; so does
         * any other non-\r\n non-L non-N codepoint followed by one */
        if (!(c == '\r' || c == '\n' || (f & NUM)) && ((f & word) || (FL(pos + 1) & word))) {
            size_t p = pos + 1;
            while (FL(p) & word)
                p++;
            TOKEN(p);
            continue;
        }
        if (f & NUM) {
            size_t p = pos;
            while (p < end && (t->fl[p] & NUM)) {
                size_t q = p;
                while (q < end && (lp->maxn == 0 || q - p < lp->maxn) && (t->fl[q] & NUM))
                    q++;
                emit(out, q - prev);
                prev = q;
                p = q;
            }
            pos = p;
            continue;
        }
        /*  ?[^\s\p{L}\p{N}]+[\r\n]* (f != 0 always holds inside the chunk) */
        unsigned f2 = (c == ' ') ? FL(pos + 1) : f;
        if (!(f2 & pex) && f) {
            size_t p = pos + (c == ' ');
            for (;;) {
                unsigned g = FL(p);
                if ((g & pex) || !g)
                    break;
                p++;
            }
            if (lp->punct_crlf)
                while (CP(p) == '\r' || CP(p) == '\n')
                    p++;
            TOKEN(p);
            continue;
        }
        size_t k = 0, last_rn = 0;
        while (FL(pos + k) & WS) {
            uint32_t d = t->cp[pos + k];
            if (d == '\r' || d == '\n')
                last_rn = pos + k + 1;
            k++;
        }
        if (last_rn) { /* \s*[\r\n]+ */
            TOKEN(last_rn);
            continue;
        }
        if (k > 1 && pos + k < end) { /* \s+(?!\S) */
            TOKEN(pos + k - 1);
            continue;
        }
        if (k > 0) {
            TOKEN(pos + k);
            continue;
        }
        TOKEN(pos + 1);
    }
#undef TOKEN
}

/* ---- generic "matches and gaps" stages (std::regex in the reference) ----- */

/* A class test on one codepoint (with its flags). */
typedef int (*cls_fn)(uint32_t cp, unsigned fl);

/* X+ : maximal runs of the class are pieces; so are the gaps. */
static void stage_runs(const text_t *t, size_t ini, size_t end, chunks_t *out, cls_fn in)
{
    size_t pos = ini, gap = ini;
    while (pos < end) {
        if (!in(t->cp[pos], t->fl[pos])) {
            pos++;
            continue;
        }
        size_t p = pos + 1;
        while (p < end && in(t->cp[p], t->fl[p]))
            p++;
        emit(out, pos - gap);
        emit(out, p - pos);
        pos = gap = p;
    }
    emit(out, end - gap);
}

/* X : every codepoint of the class is its own piece; gaps are pieces. */
static void stage_singles(const text_t *t, size_t ini, size_t end, chunks_t *out, cls_fn in)
{
    size_t gap = ini;
    for (size_t pos = ini; pos < end; pos++) {
        if (in(t->cp[pos], t->fl[pos])) {
            emit(out, pos - gap);
            emit(out, 1);
            gap = pos + 1;
        }
    }
    emit(out, end - gap);
}

/* \s?X+ : leftmost; a whitespace codepoint is taken only when X follows. */
static void stage_ws_runs(const text_t *t, size_t ini, size_t end, chunks_t *out, cls_fn in)
{
    size_t pos = ini, gap = ini;
    while (pos < end) {
        size_t p;
        if ((t->fl[pos] & WS) && pos + 1 < end && in(t->cp[pos + 1], t->fl[pos + 1]))
            p = pos + 1;
        else if (in(t->cp[pos], t->fl[pos]))
            p = pos;
        else {
            pos++;
            continue;
        }
        while (p < end && in(t->cp[p], t->fl[p]))
            p++;
        emit(out, pos - gap);
        emit(out, p - pos);
        pos = gap = p;
    }
    emit(out, end - gap);
}

/* \s+$ : the whitespace run that ends the chunk. */
static void stage_trailing_ws(const text_t *t, size_t ini, size_t end, chunks_t *out)
{
    size_t p = end;
    while (p > ini && (t->fl[p - 1] & WS))
        p--;
    emit(out, p - ini);
    emit(out, end - p);
}

/* [0-9][0-9][0-9] : leftmost non-overlapping ASCII digit triples. */
static int is_ascii_digit(uint32_t c) { return c >= '0' && c <= '9'; }

static void stage_digit3(const text_t *t, size_t ini, size_t end, chunks_t *out)
{
    size_t pos = ini, gap = ini;
    while (pos + 3 <= end) {
        if (is_ascii_digit(t->cp[pos]) && is_ascii_digit(t->cp[pos + 1]) && is_ascii_digit(t->cp[pos + 2])) {
            emit(out, pos - gap);
            emit(out, 3);
            pos = gap = pos + 3;
        } else {
            pos++;
        }
    }
    emit(out, end - gap);
}

/* \p{N}{1,3} : runs of numbers cut into threes from the left; gaps are pieces. */
static void stage_num3(const text_t *t, size_t ini, size_t end, chunks_t *out)
{
    size_t pos = ini, gap = ini;
    while (pos < end) {
        if (!(t->fl[pos] & NUM)) {
            pos++;
            continue;
        }
        emit(out, pos - gap);
        size_t p = pos;
        while (p < end && p - pos < 3 && (t->fl[p] & NUM))
            p++;
        emit(out, p - pos);
        pos = gap = p;
    }
    emit(out, end - gap);
}

/* ---- classes ---------------------------------------------------------------
 * Collapsed classes (\p{..} in std::regex): for these families they equal
 * the codepoint flags (ASCII letters/digits/punctuation agree with Unicode;
 * the reference's one ASCII quirk, `~` missing from \p{S}, is not used).
 * std::wregex classes test the codepoint with non-ASCII whitespace replaced
 * by U+000B, hence the `!(fl & WS)` on non-ASCII ranges. */

static int cls_number(uint32_t c, unsigned fl) { (void)c; return (fl & NUM) != 0; }
static int cls_letter(uint32_t c, unsigned fl) { (void)c; return (fl & LET) != 0; }
static int cls_punct(uint32_t c, unsigned fl) { (void)c; return (fl & KV_UC_PUNCT) != 0; }
static int cls_crlf(uint32_t c, unsigned fl) { (void)fl; return c == '\r' || c == '\n'; }
static int cls_lf(uint32_t c, unsigned fl) { (void)fl; return c == '\n'; }

/* [\p{P}\$\+<=>\^~\|]+ (default) */
static int cls_default_punct(uint32_t c, unsigned fl)
{
    return (fl & KV_UC_PUNCT) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' ||
           c == '~' || c == '|';
}

/* [\p{P}\$\+<=>\^~\|`]+ (falcon) */
static int cls_falcon_punct(uint32_t c, unsigned fl) { return cls_default_punct(c, fl) || c == '`'; }

typedef struct {
    uint32_t lo, hi;
} cp_range;

static int in_ranges(const cp_range *r, size_t n, uint32_t c)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c < r[mid].lo)
            hi = mid;
        else if (c > r[mid].hi)
            lo = mid + 1;
        else
            return 1;
    }
    return 0;
}

/* [一-龥ࠀ-一가-퟿]+ (deepseek) */
static const cp_range cjk_ranges[] = {{0x0800, 0x9FA5}, {0xAC00, 0xD7FF}};
static int cls_cjk(uint32_t c, unsigned fl)
{
    return !(fl & WS) && in_ranges(cjk_ranges, 2, c);
}

/* deepseek-llm letters: the literal class of \s?[A-Za-zµÀ-ÖØ-öø-ƺ...]+ */
static const cp_range dsl_letter_ranges[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xB5, 0xB5}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x1BA},
    {0x1BC, 0x1BF}, {0x1C4, 0x293}, {0x295, 0x2AF}, {0x370, 0x373}, {0x376, 0x377},
    {0x37B, 0x37D}, {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C},
    {0x38E, 0x3A1}, {0x3A3, 0x3F5}, {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556},
    {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD}, {0x1C90, 0x1CBA}, {0x1CBD, 0x1CBF},
    {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A}, {0x1E00, 0x1F15}, {0x1F18, 0x1F1D},
    {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE},
    {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC},
    {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC}, {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113},
    {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126}, {0x2128, 0x2128},
    {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139}, {0x213C, 0x213F}, {0x2145, 0x2149},
    {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B}, {0x2C7E, 0x2CE4}, {0x2CEB, 0x2CEE},
    {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F}, {0xA771, 0xA787},
    {0xA78B, 0xA78E}, {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17}, {0xFF21, 0xFF3A},
    {0xFF41, 0xFF5A}, {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};
static int cls_dsl_letter(uint32_t c, unsigned fl)
{
    return !(fl & WS) && in_ranges(dsl_letter_ranges, sizeof dsl_letter_ranges / sizeof dsl_letter_ranges[0], c);
}

/* deepseek-llm punctuation: \s?[!-/:-~！-／：-～‘-‟　-。]+ */
static const cp_range dsl_punct_ranges[] = {
    {0x21, 0x2F}, {0x3A, 0x7E}, {0x2018, 0x201F}, {0x3000, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E},
};
static int cls_dsl_punct(uint32_t c, unsigned fl)
{
    return !(fl & WS) && in_ranges(dsl_punct_ranges, sizeof dsl_punct_ranges / sizeof dsl_punct_ranges[0], c);
}

/* ---- family pipelines ------------------------------------------------------ */

typedef enum {
    ST_GPT2, ST_L3, ST_RUNS, ST_SINGLES, ST_WS_RUNS, ST_TRAILING_WS, ST_DIGIT3, ST_NUM3,
} stage_kind;

typedef struct {
    stage_kind kind;
    cls_fn cls;            /* ST_RUNS, ST_SINGLES, ST_WS_RUNS */
    const l3_params *l3;   /* ST_L3 */
} stage;

#define MAX_STAGES 6

/* The regex lists of llama.cpp's llm_tokenizer_bpe, one stage per regex. */
static const struct {
    int n;
    stage st[MAX_STAGES];
} pipelines[KV_PRETOK_COUNT] = {
    /* [\p{P}\$\+<=>\^~\|]+ , GPT-2 , \p{N}+ , [0-9][0-9][0-9] */
    [KV_PRETOK_DEFAULT] = {4, {{ST_RUNS, cls_default_punct, 0}, {ST_GPT2, 0, 0}, {ST_RUNS, cls_number, 0},
                               {ST_DIGIT3, 0, 0}}},
    [KV_PRETOK_GPT2] = {1, {{ST_GPT2, 0, 0}}},
    [KV_PRETOK_LLAMA3] = {1, {{ST_L3, 0, &L3_LLAMA3}}},
    [KV_PRETOK_QWEN2] = {1, {{ST_L3, 0, &L3_QWEN2}}},
    /* \p{N} , GPT-2 */
    [KV_PRETOK_STARCODER] = {2, {{ST_SINGLES, cls_number, 0}, {ST_GPT2, 0, 0}}},
    /* [\r\n] , \s?[A-Za-z...]+ , \s?[!-/:-~...]+ , \s+$ , [一-龥ࠀ-一가-퟿]+ , \p{N}+ */
    [KV_PRETOK_DEEPSEEK_LLM] = {6, {{ST_SINGLES, cls_crlf, 0}, {ST_WS_RUNS, cls_dsl_letter, 0},
                                    {ST_WS_RUNS, cls_dsl_punct, 0}, {ST_TRAILING_WS, 0, 0},
                                    {ST_RUNS, cls_cjk, 0}, {ST_RUNS, cls_number, 0}}},
    /* [\r\n] , \s?\p{L}+ , \s?\p{P}+ , [一-龥ࠀ-一가-퟿]+ , \p{N} */
    [KV_PRETOK_DEEPSEEK_CODER] = {5, {{ST_SINGLES, cls_crlf, 0}, {ST_WS_RUNS, cls_letter, 0},
                                      {ST_WS_RUNS, cls_punct, 0}, {ST_RUNS, cls_cjk, 0},
                                      {ST_SINGLES, cls_number, 0}}},
    /* [\p{P}\$\+<=>\^~\|`]+ , GPT-2 , [0-9][0-9][0-9] */
    [KV_PRETOK_FALCON] = {3, {{ST_RUNS, cls_falcon_punct, 0}, {ST_GPT2, 0, 0}, {ST_DIGIT3, 0, 0}}},
    [KV_PRETOK_QWEN35] = {1, {{ST_L3, 0, &L3_QWEN35}}},
    [KV_PRETOK_SEED_CODER] = {1, {{ST_L3, 0, &L3_SEED_CODER}}},
    /* \p{N}{1,3} , llama3 with \p{N}+ */
    [KV_PRETOK_MINICPM5] = {2, {{ST_NUM3, 0, 0}, {ST_L3, 0, &L3_MINICPM5}}},
    /* [^\n]+|[\n]+ , qwen2 */
    [KV_PRETOK_LAGUNA] = {2, {{ST_RUNS, cls_lf, 0}, {ST_L3, 0, &L3_QWEN2}}},
    [KV_PRETOK_UFAKZEKA] = {1, {{ST_L3, 0, &L3_UFAKZEKA}}},
};

static void run_stage(const stage *s, const text_t *t, size_t ini, size_t end, chunks_t *out)
{
    switch (s->kind) {
    case ST_GPT2: stage_gpt2(t, ini, end, out); break;
    case ST_L3: stage_llama3(t, ini, end, out, s->l3); break;
    case ST_RUNS: stage_runs(t, ini, end, out, s->cls); break;
    case ST_SINGLES: stage_singles(t, ini, end, out, s->cls); break;
    case ST_WS_RUNS: stage_ws_runs(t, ini, end, out, s->cls); break;
    case ST_TRAILING_WS: stage_trailing_ws(t, ini, end, out); break;
    case ST_DIGIT3: stage_digit3(t, ini, end, out); break;
    case ST_NUM3: stage_num3(t, ini, end, out); break;
    }
}

/* ---- entry point ------------------------------------------------------------ */

kv_status kv_pretokenize(int kind, const char *text, size_t len, kv_span **spans, size_t *n, kv_error *e)
{
    if (!spans || !n)
        return kv_fail(e, KV_ERR_ARG, "pretokenize: NULL output");
    *spans = NULL;
    *n = 0;
    if (kind < 0 || kind >= KV_PRETOK_COUNT)
        return kv_fail(e, KV_ERR_ARG, "pretokenize: unknown pre-tokenizer kind %d", kind);
    if (len == 0)
        return KV_OK;
    if (!text)
        return kv_fail(e, KV_ERR_ARG, "pretokenize: NULL text");
    if (len > SIZE_MAX / (sizeof(uint32_t) + sizeof(uint16_t) + sizeof(size_t)) - 1)
        return kv_fail(e, KV_ERR_ARG, "pretokenize: text too long (%zu bytes)", len);

    kv_status st = KV_OK;
    uint32_t *cp = malloc(len * sizeof *cp);        /* (ncp) */
    uint16_t *fl = malloc(len * sizeof *fl);        /* (ncp) */
    size_t *boff = malloc((len + 1) * sizeof *boff); /* (ncp + 1) byte offsets */
    chunks_t a = {0}, b = {0};
    if (!cp || !fl || !boff) {
        st = kv_fail(e, KV_ERR_NOMEM, "pretokenize: out of memory (%zu bytes of text)", len);
        goto done;
    }

    size_t ncp = 0;
    for (size_t i = 0; i < len;) {
        size_t adv = 1;
        uint32_t c = (unsigned char)text[i] < 0x80 ? (unsigned char)text[i] : kv_utf8_decode(text + i, len - i, &adv);
        if (c > 0x10FFFF) {
            st = kv_fail(e, KV_ERR_FORMAT, "pretokenize: byte %zu decodes to U+%X, above U+10FFFF", i, (unsigned)c);
            goto done;
        }
        cp[ncp] = c;
        fl[ncp] = (uint16_t)kv_unicode_flags(c);
        boff[ncp] = i;
        ncp++;
        i += adv;
    }
    boff[ncp] = len;

    text_t t = {cp, fl, ncp};
    emit(&a, ncp);
    for (int s = 0; s < pipelines[kind].n && !a.oom; s++) {
        b.count = 0;
        size_t start = 0;
        for (size_t i = 0; i < a.count; i++) {
            run_stage(&pipelines[kind].st[s], &t, start, start + a.len[i], &b);
            start += a.len[i];
        }
        chunks_t tmp = a;
        a = b;
        b = tmp;
        if (b.oom)
            a.oom = 1;
    }
    if (a.oom) {
        st = kv_fail(e, KV_ERR_NOMEM, "pretokenize: out of memory (chunk list)");
        goto done;
    }

    kv_span *out = malloc(a.count * sizeof *out);
    if (!out) {
        st = kv_fail(e, KV_ERR_NOMEM, "pretokenize: out of memory (%zu spans)", a.count);
        goto done;
    }
    size_t start = 0;
    for (size_t i = 0; i < a.count; i++) {
        out[i].off = boff[start];
        out[i].len = boff[start + a.len[i]] - boff[start];
        start += a.len[i];
    }
    *spans = out;
    *n = a.count;

done:
    free(cp);
    free(fl);
    free(boff);
    free(a.len);
    free(b.len);
    return st;
}
