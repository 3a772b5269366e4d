/*
 * pretok.h — the BPE pre-tokenizer: splitting text into "words" before
 * merges, exactly as llama.cpp does for each tokenizer.ggml.pre family.
 *
 * A BPE vocabulary names its pre-tokenizer in the GGUF key
 * tokenizer.ggml.pre ("gpt-2", "llama-bpe", "qwen2", "smollm", ...). Each
 * name selects a list of regexes; llama.cpp applies them in turn, each one
 * re-splitting the pieces left by the previous one. kv_pretokenize()
 * reproduces the resulting word boundaries with hand-written matchers over
 * Unicode codepoints (categories from UnicodeData.txt, see unicode.h).
 *
 * Usage:
 *
 *     int kind = kv_pretok_kind(pre_name);        // -1: unknown name
 *     kv_span *w; size_t n;
 *     if (kv_pretokenize(kind, text, len, &w, &n, &err) != KV_OK) ...
 *     for (size_t i = 0; i < n; i++) use(text + w[i].off, w[i].len);
 *     free(w);
 *
 * Spans are in bytes of the input, cover it completely, in order, without
 * overlap, and never split a UTF-8 sequence as kv_utf8_decode reads it.
 *
 * Invalid UTF-8: the reference decodes each invalid byte as U+FFFD and its
 * word strings hold the RE-ENCODED codepoints. So the exact word text the
 * reference feeds to BPE is: for each codepoint decoded with
 * kv_utf8_decode() over the span, kv_utf8_encode() it. For valid UTF-8 this
 * is the span itself; kv_pretok_word() does the conversion for a span.
 */
#ifndef KV_PRETOK_H
#define KV_PRETOK_H

#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"

typedef struct {
    size_t off, len; /* byte span in the input */
} kv_span;

/* Pre-tokenizer families (each is one list of regexes in llama.cpp). */
typedef enum {
    KV_PRETOK_DEFAULT = 0, /* "default" (and a BPE vocab without the key) */
    KV_PRETOK_GPT2,        /* "gpt-2", "mpt", "olmo", "jais", ...     */
    KV_PRETOK_LLAMA3,      /* "llama-bpe", "llama3", "dbrx", "smaug-bpe", ... */
    KV_PRETOK_QWEN2,       /* "qwen2", "stablelm2", "bailingmoe", ... */
    KV_PRETOK_STARCODER,   /* "starcoder", "smollm", "refact", "command-r", ... */
    KV_PRETOK_DEEPSEEK_LLM,
    KV_PRETOK_DEEPSEEK_CODER,
    KV_PRETOK_FALCON,
    KV_PRETOK_QWEN35,     /* "qwen35": qwen2 with \p{M} joined to letters */
    KV_PRETOK_SEED_CODER, /* "seed-coder" */
    KV_PRETOK_MINICPM5,   /* "minicpm5" */
    KV_PRETOK_LAGUNA,     /* "laguna": newline runs, then qwen2 */
    KV_PRETOK_UFAKZEKA,   /* "ufakzeka": qwen2 without contractions */
    KV_PRETOK_COUNT
} kv_pretok_family;

/* tokenizer.ggml.pre name -> kind (a kv_pretok_family), -1 if unknown. */
int kv_pretok_kind(const char *pre_name);

/* Static name of a kind ("gpt-2", ...), "?" if out of range. */
const char *kv_pretok_kind_name(int kind);

/* Splits text[0..len) into words. *spans is malloc'ed (NULL when *n == 0)
 * and owned by the caller. KV_ERR_ARG for a bad kind, KV_ERR_NOMEM. */
kv_status kv_pretokenize(int kind, const char *text, size_t len,
                         kv_span **spans, size_t *n, kv_error *e);

/* ---- UTF-8, exactly as the reference reads it --------------------------
 * Decodes one codepoint at s[0..len) (len >= 1) and sets *adv to the bytes
 * consumed (>= 1). The reference's rules: the lead byte decides the length
 * (0xxxxxxx 1, 110xxxxx 2, 1110xxxx 3, 11110xxx 4); a stray continuation
 * byte, a 11111xxx byte, a truncated sequence or a missing continuation
 * byte yields U+FFFD with *adv = 1. Overlong forms and surrogates are NOT
 * rejected (decoded arithmetically), as in the reference. */
uint32_t kv_utf8_decode(const char *s, size_t len, size_t *adv);

/* Encodes cp into out (1..4 bytes) and returns the length; 0 for
 * cp > 0x10FFFF (the reference throws there). Surrogates are encoded. */
size_t kv_utf8_encode(uint32_t cp, char out[4]);

/* Byte length of the sequence announced by a lead byte (1 for a
 * continuation or invalid byte), as the reference's unicode_len_utf8. */
size_t kv_utf8_len(unsigned char lead);

/* Writes the reference's word text for span sp of text into out (capacity
 * cap, needs at most 3 * sp.len bytes) and returns its length; for valid
 * UTF-8 it is a plain copy. Returns (size_t)-1 if cap is too small. */
size_t kv_pretok_word(const char *text, kv_span sp, char *out, size_t cap);

#endif
