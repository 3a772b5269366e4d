/*
 * kvlua.h — the kvlua engine, the whole public C surface.
 *
 *   model   = a GGUF file opened for inference: metadata, vocabulary and
 *             memory-mapped weights, plus the CPU thread pool.
 *   vocab   = the model's tokenizer (text <-> token ids); a vocabulary-only
 *             GGUF (no tensors) opens as a model with a vocab and no weights.
 *   session = one token sequence being evaluated against a model: its KV
 *             cache, its position, the tokens it holds.
 *
 *   kv_model *m; kv_error e;
 *   if (kv_model_open("m.gguf", NULL, &m, &e) != KV_OK) puts(e.msg);
 *   kv_session *s; kv_session_open(m, 4096, &s, &e);
 *   int32_t *ids; size_t n;
 *   kv_tokenize(kv_model_vocab(m), "Hello", 5, true, false, &ids, &n, &e);
 *   float *logits = malloc(sizeof(float) * kv_model_info_get(m)->n_vocab);
 *   kv_session_eval(s, ids, n, KV_LOGITS_LAST, logits, &e);  // prefill
 *   kv_session_eval(s, &next, 1, KV_LOGITS_LAST, logits, &e); // decode
 *
 * Failures return a kv_status and fill a kv_error (kv_error.h); the engine
 * never exits or aborts on bad input. Objects are not thread-safe: one
 * thread drives a model and its sessions at a time.
 */
#ifndef KVLUA_H
#define KVLUA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"
#include "gguf.h"

#define KVLUA_VERSION "0.1.0"

typedef struct kv_model kv_model;
typedef struct kv_vocab kv_vocab;
typedef struct kv_session kv_session;

/* ==== models =========================================================== */

#define KV_MAX_THREADS 256

typedef struct {
    int threads; /* CPU threads, at most KV_MAX_THREADS (more: KV_ERR_ARG); <= 0: physical cores */
} kv_model_params;

typedef struct {
    char arch[32];        /* general.architecture */
    char name[128];       /* general.name ("" if absent) */
    int n_layer, n_embd, n_head, n_head_kv, head_dim, head_dim_v;
    int n_ff, n_ctx_train, n_vocab;
    int sliding_window;   /* 0: none */
    int file_type;        /* general.file_type, -1 if absent */
    uint64_t n_params;    /* elements over all tensors */
    uint64_t size_bytes;  /* bytes of tensor data */
    bool has_weights;     /* false for vocabulary-only files */
    int threads;          /* CPU threads in use */
} kv_model_info;

kv_status kv_model_open(const char *path, const kv_model_params *p, kv_model **out, kv_error *e);
void kv_model_close(kv_model *m); /* NULL is fine */
const kv_model_info *kv_model_info_get(const kv_model *m);
const kv_gguf *kv_model_gguf(const kv_model *m);
const kv_vocab *kv_model_vocab(const kv_model *m); /* NULL if the file has no tokenizer */
/* Bytes a KV cache of n_ctx tokens needs, with K and V stored as ktype /
 * vtype (ggml type ids), sliding-window layers counted at their window.
 * Saturates at UINT64_MAX instead of wrapping. */
uint64_t kv_model_kv_bytes(const kv_model *m, int64_t n_ctx, int ktype, int vtype);
/* The weights are memory-mapped: a file truncated on disk after loading
 * would fault (SIGBUS) on the next read of a lost page. KV_ERR_IO, naming
 * both sizes, when the file is now shorter than at load; a cheap fstat,
 * meant to run before each evaluation. (It cannot see a file rewritten in
 * place at the same size, nor a truncation racing the evaluation.) */
kv_status kv_model_check_file(const kv_model *m, kv_error *e);

/* ==== vocabulary ===================================================== */

typedef struct {
    int32_t bos, eos, eot, eom, unk, pad, sep, nl, mask; /* -1 when absent */
    bool add_bos, add_eos, add_space_prefix;
} kv_vocab_special;

/* Token attribute bits (from tokenizer.ggml.token_type). */
enum {
    KV_TOKEN_NORMAL = 1,
    KV_TOKEN_UNKNOWN = 2,
    KV_TOKEN_CONTROL = 4,
    KV_TOKEN_USER_DEFINED = 8,
    KV_TOKEN_UNUSED = 16,
    KV_TOKEN_BYTE = 32,
};

/* Builds a vocabulary from a GGUF's tokenizer.* metadata. Inconsistent
 * metadata (array lengths differ, merges naming unknown tokens, ...) is
 * KV_ERR_FORMAT; an unknown tokenizer.ggml.model / .pre is
 * KV_ERR_UNSUPPORTED. */
kv_status kv_vocab_load(const kv_gguf *g, kv_vocab **out, kv_error *e);
void kv_vocab_free(kv_vocab *v);

int32_t kv_vocab_n(const kv_vocab *v);
const kv_vocab_special *kv_vocab_specials(const kv_vocab *v);
const char *kv_vocab_model_name(const kv_vocab *v); /* "llama", "gpt2" */
const char *kv_vocab_pre_name(const kv_vocab *v);   /* "default", "smollm", ... */
/* Raw token text as stored (e.g. "▁the", "Ġthe"), and its attribute bits. */
const char *kv_vocab_text(const kv_vocab *v, int32_t id, size_t *len);
int kv_vocab_attr(const kv_vocab *v, int32_t id);
/* End of generation: eos, eot, eom and similar control tokens. */
bool kv_vocab_is_eog(const kv_vocab *v, int32_t id);

/* Text -> ids (*ids malloc'ed, caller frees). add_special adds BOS/EOS as
 * the vocabulary says; parse_special recognizes control/user-defined token
 * texts in the input. Invalid UTF-8 is handled as the reference does. */
kv_status kv_tokenize(const kv_vocab *v, const char *text, size_t len, bool add_special,
                      bool parse_special, int32_t **ids, size_t *n, kv_error *e);

/* The bytes one token contributes to text (byte-fallback tokens give their
 * byte, "▁" becomes a space, byte-level BPE symbols map back to bytes;
 * control tokens give their text only when special). Writes at most cap
 * bytes and returns the full length (like snprintf, without NUL). */
size_t kv_token_piece(const kv_vocab *v, int32_t id, bool special, char *buf, size_t cap);

/* Ids -> text, byte-exact inverse of kv_tokenize where it is lossless
 * (e.g. the space prefix a SentencePiece vocabulary adds is removed).
 * *out malloc'ed (NUL-terminated, *len excludes the NUL). */
kv_status kv_detokenize(const kv_vocab *v, const int32_t *ids, size_t n, bool remove_special,
                        bool unparse_special, char **out, size_t *len, kv_error *e);

/* Length of the longest prefix of buf[0..n) that does not end inside an
 * incomplete UTF-8 sequence (what a streaming printer may emit now). */
size_t kv_utf8_complete_prefix(const char *buf, size_t n);

/* ==== sessions ========================================================= */

enum { KV_LOGITS_NONE = 0, KV_LOGITS_LAST = 1, KV_LOGITS_ALL = 2 };

kv_status kv_session_open(kv_model *m, int n_ctx, kv_session **out, kv_error *e);
/* The same with the cache's K and V storage types (ggml type ids): F16
 * (kv_session_open's choice), F32, or Q8_0 (half the bytes of F16; head
 * sizes multiple of 32). Other types: KV_ERR_UNSUPPORTED naming them. */
kv_status kv_session_open_ex(kv_model *m, int n_ctx, int ktype, int vtype, kv_session **out,
                             kv_error *e);
void kv_session_close(kv_session *s); /* NULL is fine */

/* Appends n tokens and runs the forward pass (chunked internally, so a long
 * prompt needs no huge scratch). logits: n_vocab floats (KV_LOGITS_LAST) or
 * n * n_vocab (KV_LOGITS_ALL), row-major. On any failure the session is left
 * as it was before the call: KV_ERR_CONTEXT_FULL (with the numbers) if
 * pos + n > n_ctx, KV_ERR_ARG for an id out of range, KV_ERR_NUMERIC when
 * the logits hold NaN/Inf. */
kv_status kv_session_eval(kv_session *s, const int32_t *ids, size_t n, int logits_mode,
                          float *logits, kv_error *e);

int kv_session_pos(const kv_session *s);
int kv_session_ctx(const kv_session *s);
const int32_t *kv_session_tokens(const kv_session *s); /* pos ids */
/* Drops the last n tokens (n > pos: drops all). */
void kv_session_rewind(kv_session *s, int n);
uint64_t kv_session_kv_bytes(const kv_session *s);

#endif
