/*
 * kvlua.h — the kvlua engine, the whole public C surface.
 *
 *   model   = a GGUF file opened for inference: metadata, vocabulary and
 *             memory-mapped weights, plus the CPU thread pool.
 *   vocab   = the model's tokenizer (text <-> token ids); a vocabulary-only
 *             GGUF (no tensors) opens as a model with a vocab and no weights.
 *   cache   = a pool of KV pages (K and V of page_tokens positions) that
 *             sessions draw from; full pages are named by a chained hash of
 *             the tokens they end, so a prefix computed once is reused by
 *             any session of the cache (kv_cache_open; engine/kvpool.h).
 *   session = one token sequence being evaluated against a model: its page
 *             tables into a cache (its own private pool when none is
 *             given), its position, the tokens it holds.
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
#include <stdio.h>

#include "kv_error.h"
#include "gguf.h"

#define KVLUA_VERSION "0.1.0"

typedef struct kv_model kv_model;
typedef struct kv_vocab kv_vocab;
typedef struct kv_session kv_session;
typedef struct kv_cache kv_cache;

/* ==== models =========================================================== */

#define KV_MAX_THREADS 256

/* Where the forward pass runs. AUTO: the first OpenCL device of type
 * "gpu", else the CPU. */
enum { KV_BACKEND_CPU = 0, KV_BACKEND_OPENCL = 1, KV_BACKEND_AUTO = 2 };

typedef struct {
    int threads; /* CPU threads, at most KV_MAX_THREADS (more: KV_ERR_ARG); <= 0: physical cores */
    int backend; /* KV_BACKEND_* */
    int device;  /* OpenCL device index (kvcl_devices order) */
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
    char backend[16];     /* "cpu" or "opencl" */
    char device[128];     /* "cpu", or the OpenCL device's name */
    int device_index;     /* OpenCL device index, -1 on the CPU */
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
/* The same for pages of pt positions: what a session holding n_ctx
 * positions references (page-rounded; a window layer keeps the pages that
 * overlap its last window - 1 positions). UINT64_MAX when it overflows. */
uint64_t kv_model_kv_bytes_paged(const kv_model *m, int64_t n_ctx, int ktype, int vtype, int pt);
/* The same with types per layer (n_layer entries each). */
uint64_t kv_model_kv_bytes_layers(const kv_model *m, int64_t n_ctx, const int *ktypes, const int *vtypes, int pt);
/* BLAKE2b fingerprint of the model file (computed on first use: what cache
 * pages are named after), and the seconds that took. */
kv_status kv_model_fingerprint(kv_model *m, uint8_t out[32], double *seconds, kv_error *e);
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
/* kv_tokenize where literal (NULL, or len bytes) marks bytes read as with
 * parse_special false: a control or unknown token's text overlapping a
 * nonzero literal[i] is not recognized (a chat's message contents,
 * tokenized inside its markup); user-defined tokens are, as always. */
kv_status kv_tokenize_literal(const kv_vocab *v, const char *text, size_t len, bool add_special,
                              bool parse_special, const uint8_t *literal, int32_t **ids, size_t *n, kv_error *e);

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

/* ==== caches =========================================================== */

typedef struct {
    uint64_t bytes;  /* capacity in bytes (0: use pages) */
    int64_t pages;   /* capacity in pages of each layer group (0: use bytes) */
    int page_tokens; /* positions per page, a power of two (0: 16) */
    int ktype, vtype; /* K and V storage of every layer: F16, F32, Q8_0 or Q4_0 */
    const int *ktypes, *vtypes; /* or per layer (n_layer entries each; NULL: ktype / vtype) */
    bool prefix;     /* hash full pages and reuse them across sessions */
} kv_cache_params;

/* One candidate for eviction: a cached page (full, hashed, used by no
 * session, not pinned). */
typedef struct {
    int32_t id;       /* page id inside its layer group */
    int group;        /* layer group (0: the first group, see kv_cache_group_window) */
    int64_t tokens;   /* length of the prefix the page ends */
    uint32_t hits;    /* times it was reused */
    uint64_t last_use; /* cache tick (a counter of page events) of its last use */
    size_t bytes;
} kv_evict_candidate;

/* Eviction policy: candidates of one group (oldest first) and the number
 * of pages needed; writes the ids to evict (each a candidate, no
 * duplicates) into chosen and their count. Fewer than need means the
 * request fails with "cache full". A failure status aborts the request
 * with nothing evicted. Called only between forward passes, never while
 * the pool is inconsistent. Nothing it does can change the evaluation that
 * called it: meanwhile the pool takes, evicts and pins nothing (those calls
 * fail with KV_ERR_ARG, kv_cache_clear evicts nothing) and the sessions of
 * the evaluation refuse every change (kv_session_rewind leaves them as they
 * are); closing one of them is not allowed. Its answer is checked again
 * once it returns. */
typedef kv_status (*kv_evict_fn)(void *ud, const kv_evict_candidate *cands, int n, int need,
                                 int32_t *chosen, int *n_chosen, kv_error *e);

typedef struct {
    int64_t pages;     /* capacity in pages (all groups; private pools: pages with storage) */
    int64_t used;      /* referenced by sessions */
    int64_t cached;    /* sealed, referenced by no session (evictable unless pinned) */
    int64_t pinned;    /* cached pages that are pinned */
    int64_t free;      /* never used or evicted */
    uint64_t hits, misses, reused_tokens, evictions;
    uint64_t bytes;    /* bytes of the used and cached pages */
    uint64_t capacity_bytes; /* 0: grows on demand (private pool) */
} kv_cache_stats;

kv_status kv_cache_open(kv_model *m, const kv_cache_params *p, kv_cache **out, kv_error *e);
/* Drops the owner's reference: sessions using the cache keep it alive. */
void kv_cache_close(kv_cache *c);
void kv_cache_get_stats(const kv_cache *c, kv_cache_stats *st);
int kv_cache_page_tokens(const kv_cache *c);
int kv_cache_n_groups(const kv_cache *c);
int kv_cache_group_window(const kv_cache *c, int g); /* 0: full attention */
/* K and V types of layer il (layer 0 for a cache of one type). */
void kv_cache_types(const kv_cache *c, int il, int *ktype, int *vtype);
/* Bytes of K and V one position takes over every layer. */
uint64_t kv_cache_bytes_per_token(const kv_cache *c);
const kv_model *kv_cache_model(const kv_cache *c);
void kv_cache_set_policy(kv_cache *c, kv_evict_fn fn, void *ud);
/* How many leading tokens of ids a prefill into an empty session would
 * reuse now, and why not more ("never seen", "evicted", "window pages
 * dropped", "other types", "partial page", or NULL when all are). */
kv_status kv_cache_lookup(kv_cache *c, const int32_t *ids, size_t n, int64_t *cached, const char **reason,
                          kv_error *e);
/* Pins (or unpins) the full pages of the prefix ids: pinned pages are never
 * evicted; pages that arrive later under a pinned hash are pinned too.
 * Pinning more pages than the cache holds fails. */
kv_status kv_cache_pin(kv_cache *c, const int32_t *ids, size_t n, bool pin, kv_error *e);
/* Evicts every cached, unpinned page; returns how many. */
int64_t kv_cache_clear(kv_cache *c);

/* ==== sessions ========================================================= */

enum { KV_LOGITS_NONE = 0, KV_LOGITS_LAST = 1, KV_LOGITS_ALL = 2 };

typedef struct {
    int n_ctx;
    int ktype, vtype; /* storage of a private pool (ignored with a cache) */
    const int *ktypes, *vtypes; /* or per layer (n_layer entries; NULL: ktype / vtype) */
    kv_cache *cache;  /* NULL: a private pool */
} kv_session_params;

/* Opens a session; with p->cache it draws pages from that cache (which it
 * keeps alive), else from a private pool sized for n_ctx. */
kv_status kv_session_open_p(kv_model *m, const kv_session_params *p, kv_session **out, kv_error *e);
/* A new session holding the same tokens and sharing every page of s
 * (copy-on-write: the first write into a shared page copies that page). */
kv_status kv_session_fork(kv_session *s, kv_session **out, kv_error *e);
kv_cache *kv_session_cache(const kv_session *s);
/* Tokens taken from the cache instead of computed, over the session's life. */
uint64_t kv_session_reused_tokens(const kv_session *s);

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
 * the logits hold NaN/Inf, KV_ERR_CACHE_FULL when the cache has no page to
 * give. With a cache that reuses prefixes, leading pages of the sequence
 * already in the cache are taken instead of computed (bit-identical). */
kv_status kv_session_eval(kv_session *s, const int32_t *ids, size_t n, int logits_mode,
                          float *logits, kv_error *e);

/* One forward pass decoding ids[i] in session ss[i] for n distinct sessions
 * of one model: the weights are read once per step, attention runs per
 * session through its own pages. logits: n * n_vocab floats. Each row is
 * the same bits a kv_session_eval of that token alone gives. All or
 * nothing: on failure no session has moved. */
kv_status kv_decode_batch(kv_session *const *ss, const int32_t *ids, size_t n, float *logits, kv_error *e);

/* kv_session_eval of ids[i] (n_ids[i] >= 1 tokens) in session ss[i] for n
 * distinct sessions of one model, rows of several sessions going through
 * each forward pass together (up to KV_CHUNK rows a pass). logits_mode as
 * kv_session_eval, logits[i] its output for session i (n_ids[i] or 1 rows of
 * n_vocab; not read for KV_LOGITS_NONE). Every session ends with the same
 * tokens, pages and logits, bit for bit, as kv_session_eval gives it alone
 * (prefix reuse included). All or nothing: on failure every session is back
 * at its position before the call. */
kv_status kv_prefill_batch(kv_session *const *ss, const int32_t *const *ids, const size_t *n_ids, size_t n,
                           int logits_mode, float *const *logits, kv_error *e);

/* Writes the session (tokens and K/V pages) to path: written aside, renamed
 * over path once complete (a symbolic link is followed: the file it leads
 * to is replaced; a path that is not a regular file is refused). key: 32
 * bytes (encrypted and authenticated with XChaCha20-Poly1305 secretstream),
 * or NULL (a BLAKE2b checksum). */
kv_status kv_session_save(kv_session *s, const char *path, const uint8_t *key, kv_error *e);
/* A new session from a file written by kv_session_save with this very
 * model file (else "model fingerprint mismatch"), in cache (its types must
 * match the file's) or a private pool; its context is the saved one or
 * min_ctx, whichever is larger. Any alteration, truncation, reordering or
 * appended data is an error, and nothing is kept of a failed restore. */
kv_status kv_session_restore(kv_model *m, const char *path, const uint8_t *key, kv_cache *cache, int min_ctx,
                             kv_session **out, kv_error *e);
/* The same from an open stream (positioned at the start of the file). */
kv_status kv_session_restore_fp(kv_model *m, FILE *f, const uint8_t *key, kv_cache *cache, int min_ctx,
                                kv_session **out, kv_error *e);

/* Cache files: the sealed pages of a cache with the token ids of their
 * chains (a session file and a cache file are told apart by their magic).
 * kv_cache_save writes, for each of the n_prefixes token prefixes, every
 * full page of its chain sealed in the cache, in every layer group (a page
 * reached by several prefixes once); prefixes NULL: every sealed page.
 * Same container as session files (key: XChaCha20-Poly1305, or NULL: a
 * BLAKE2b checksum; written aside and renamed). pages_written: pages in
 * the file (may be NULL). */
kv_status kv_cache_save(kv_cache *c, const char *path, const uint8_t *key, const int32_t *const *prefixes,
                        const size_t *lens, size_t n_prefixes, int64_t *pages_written, kv_error *e);
/* Puts the pages of a cache file into c as sealed, unreferenced (cached)
 * pages, every chain hash recomputed from c's h_0 and the stored ids. The
 * file must come from this model file ("model fingerprint mismatch") with
 * c's K/V types and page size. Pages c already holds are skipped; the rest
 * go into free pages only (nothing is evicted): if they do not fit, "cache
 * full: ..." and nothing is added. All or nothing: on any failure (wrong
 * key, altered, truncated or appended data, ...) c is as before.
 * pages_added: pages added (may be NULL). */
kv_status kv_cache_restore(kv_cache *c, const char *path, const uint8_t *key, int64_t *pages_added, kv_error *e);
kv_status kv_cache_restore_fp(kv_cache *c, FILE *f, const uint8_t *key, int64_t *pages_added, kv_error *e);
/* What the file at path is by its magic (KV_FILE_NONE: neither, or unreadable). */
enum { KV_FILE_NONE = 0, KV_FILE_SESSION = 1, KV_FILE_CACHE = 2 };
int kv_file_kind(const char *path);

/* Context shift: drops positions [keep, keep + drop) and moves the later
 * ones down by drop, their keys re-rotated (RoPE) for the new positions;
 * quantized pages are re-quantized. The result approximates a cold prefill
 * of the shortened sequence (rotations in float), so a shifted session's
 * pages are never shared through the prefix index. Fails without change
 * when the cache has no room for the rewritten pages. */
kv_status kv_session_shift(kv_session *s, int keep, int drop, kv_error *e);

int kv_session_pos(const kv_session *s);
int kv_session_ctx(const kv_session *s);
const int32_t *kv_session_tokens(const kv_session *s); /* pos ids */
/* Drops the last n tokens (n > pos: drops all); their pages go back to the
 * cache (full ones stay there, reusable, until evicted). */
void kv_session_rewind(kv_session *s, int n);
/* Bytes of the pages the session references now. */
uint64_t kv_session_kv_bytes(const kv_session *s);

#endif
