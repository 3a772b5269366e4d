/*
 * grammar.h — constrained generation: GBNF grammars, their pushdown state
 * and the token masks they allow.
 *
 *   grammar = GBNF text compiled into rules (alternatives of sequences of
 *             character classes and rule references); repetitions become
 *             right-recursive helper rules. Immutable once compiled.
 *   vocab   = the byte strings of a vocabulary's tokens in a trie (which
 *             tokens end the generation, which are never allowed).
 *   matcher = a grammar against a vocab: the runtime tables (stacks shared
 *             by hash-consing, stack sets, a lazily built byte automaton
 *             over them) and a cache of masks. States are plain values.
 *
 *   kv_grammar *g; kv_grammar_vocab *gv; kv_grammar_matcher *m; kv_error e;
 *   if (kv_grammar_compile(text, len, "root", &g, &e) != KV_OK) puts(e.msg); // "line 2, column 9: ..."
 *   kv_grammar_vocab_build(kv_model_vocab(model), &gv, &e);
 *   kv_grammar_matcher_new(g, gv, &m, &e);
 *   kv_grammar_state st;  kv_grammar_start(m, &st, &e);
 *   const uint32_t *bits; kv_grammar_mask(m, &st, &bits, &e);  // bit id set: allowed
 *   kv_grammar_accept_token(m, &st, id, &e);                   // advance
 *
 * The three objects are reference counted (kv_..._free drops one
 * reference); a matcher holds its grammar and vocab. Not thread-safe: a
 * matcher and its states belong to one thread at a time.
 */
#ifndef KV_GRAMMAR_H
#define KV_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"

typedef struct kv_vocab kv_vocab;
typedef struct kv_grammar kv_grammar;
typedef struct kv_grammar_vocab kv_grammar_vocab;
typedef struct kv_grammar_matcher kv_grammar_matcher;

/* Limits on hostile grammars (each exceeded one is an error naming it). */
#define KV_GRAMMAR_MAX_TEXT (1 << 20)      /* bytes of GBNF text */
#define KV_GRAMMAR_MAX_ELEMENTS (1 << 20)  /* elements after expanding repetitions */
#define KV_GRAMMAR_MAX_RULES 65536         /* rules, helper rules included */
#define KV_GRAMMAR_MAX_REPEAT 4096         /* m and n of x{m,n} */
#define KV_GRAMMAR_MAX_NESTING 128         /* nested groups */
#define KV_GRAMMAR_MAX_STACKS 4096         /* stacks alive at once in one state */
#define KV_GRAMMAR_MAX_DEPTH 16384         /* depth of one stack (nesting in the text) */
#define KV_GRAMMAR_MAX_NODES (1u << 22)    /* distinct stack nodes over a matcher's life */

/* GBNF (llama.cpp's dialect): rules `name ::= alternatives`, `|`, groups,
 * literals "..." with escapes (\n \r \t \\ \" \[ \] \xHH \uHHHH
 * \UHHHHHHHH), character classes [a-z] [^"\\] with ranges, negation and
 * escapes, `.` (any character), `*` `+` `?` `{m}` `{m,}` `{m,n}`, comments
 * from # to the end of the line. A rule ends at a newline unless inside
 * parentheses or after `|` / `::=`. root: the start rule (NULL: "root").
 * Errors (KV_ERR_FORMAT) read "line L, column C: ..." for a syntax error,
 * an undefined rule, a rule defined twice, left recursion (direct,
 * indirect, or through a prefix that can be empty), a grammar that matches
 * no string, or a limit above. */
kv_status kv_grammar_compile(const char *text, size_t len, const char *root, kv_grammar **out, kv_error *e);
void kv_grammar_free(kv_grammar *g); /* NULL is fine */
int kv_grammar_n_rules(const kv_grammar *g);
/* Writes the compiled rules as GBNF (helper rules included) into buf, like
 * snprintf; for debugging and tests. */
size_t kv_grammar_print(const kv_grammar *g, char *buf, size_t cap);

/* The vocabulary's tokens as byte strings (kv_token_piece without
 * specials): control, unknown and unused tokens are never allowed; the
 * end-of-generation tokens only where the grammar can end. */
kv_status kv_grammar_vocab_build(const kv_vocab *v, kv_grammar_vocab **out, kv_error *e);
/* The same from n pieces (pieces[i] == NULL: never allowed) and flags
 * (eog[i]: ends the generation; eog may be NULL). */
kv_status kv_grammar_vocab_new(int32_t n, const char *const *pieces, const size_t *lens, const bool *eog,
                               kv_grammar_vocab **out, kv_error *e);
void kv_grammar_vocab_free(kv_grammar_vocab *gv); /* NULL is fine */
int32_t kv_grammar_vocab_n(const kv_grammar_vocab *gv);
size_t kv_grammar_vocab_nodes(const kv_grammar_vocab *gv); /* trie nodes */

kv_status kv_grammar_matcher_new(kv_grammar *g, kv_grammar_vocab *gv, kv_grammar_matcher **out, kv_error *e);
void kv_grammar_matcher_free(kv_grammar_matcher *m); /* NULL is fine */
kv_grammar_matcher *kv_grammar_matcher_retain(kv_grammar_matcher *m);
const kv_grammar_vocab *kv_grammar_matcher_vocab(const kv_grammar_matcher *m);

/* Where a generation stands: copy it to fork. */
typedef struct {
    uint32_t ds;   /* the matcher's automaton state (a stack set and pending UTF-8 bytes) */
    bool ended;    /* an end-of-generation token was accepted */
} kv_grammar_state;

kv_status kv_grammar_start(kv_grammar_matcher *m, kv_grammar_state *st, kv_error *e);
/* Bytes of text, as if generated (a code point may be split over calls:
 * its pending bytes are kept in the state). KV_ERR_ARG when the grammar
 * rejects them, with st unchanged. */
kv_status kv_grammar_accept_bytes(kv_grammar_matcher *m, kv_grammar_state *st, const void *bytes, size_t n,
                                  kv_error *e);
/* One token (its bytes, or the end for an end-of-generation token).
 * KV_ERR_ARG when the grammar rejects it, with st unchanged. */
kv_status kv_grammar_accept_token(kv_grammar_matcher *m, kv_grammar_state *st, int32_t id, kv_error *e);
/* Whether the text so far is a whole sentence of the grammar. */
bool kv_grammar_can_end(kv_grammar_matcher *m, const kv_grammar_state *st);
/* Whether the grammar allows any more text after this (false: only the end). */
bool kv_grammar_can_continue(kv_grammar_matcher *m, const kv_grammar_state *st);
/* The tokens allowed next: a bitset of n_vocab bits (bit id % 32 of word
 * id / 32), owned by the matcher and valid until its next call. *n_allowed
 * (may be NULL) counts them. A limit or out of memory met on the way is an
 * error (KV_ERR_NOMEM, else KV_ERR_ARG naming the limit), never a mask
 * missing tokens. */
kv_status kv_grammar_mask(kv_grammar_matcher *m, const kv_grammar_state *st, const uint32_t **bits,
                          int32_t *n_allowed, kv_error *e);

typedef struct {
    uint64_t masks, mask_hits;  /* masks asked for, and answered from the cache */
    uint64_t nodes, sets, states; /* table sizes */
} kv_grammar_stats;
void kv_grammar_matcher_stats(const kv_grammar_matcher *m, kv_grammar_stats *out);

#endif
