/*
 * fuzz_grammar.c — libFuzzer entry point for the GBNF compiler and the
 * grammar masks.
 *
 * Compiles the input as GBNF text; a failure must come with a message that
 * names a line and a column. When it compiles, walks a few steps over a
 * small built-in vocabulary (every single byte, some ASCII words, multi-byte
 * characters, one end-of-generation token), picking allowed tokens by the
 * input's own bytes, and traps unless each mask equals feeding every token
 * to a copy of the state (and its count matches). Build and run:
 *
 *   CC=clang cmake -S . -B build-fuzz -DKV_FUZZ=ON -DKV_TESTS=OFF -DCMAKE_BUILD_TYPE=Debug \
 *     -DCMAKE_C_FLAGS_DEBUG="-g -O1" && cmake --build build-fuzz --target fuzz_grammar
 *   build-fuzz/fuzz_grammar -max_len=4096 -max_total_time=60 -timeout=10 -malloc_limit_mb=512
 */
#include "grammar.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REQUIRE(c) do { if (!(c)) __builtin_trap(); } while (0)

static const char *WORDS[] = {"ab", "abc", " the", "{\"", "\":", "\\n", "12", "-1", "true", "null", "é", "ée",
                              "\xce\xb1", "\xe4\xb8\xad", "\xf0\x9f\x98\x80", "\xce", "\xb1x", "\"}", "  ", "\n"};
#define N_WORDS (sizeof WORDS / sizeof WORDS[0])
#define N_VOCAB (256 + N_WORDS + 1)

static kv_grammar_vocab *vocab(void) {
    static kv_grammar_vocab *gv;
    if (gv) return gv;
    static char bytes[256];
    const char *pieces[N_VOCAB];
    size_t lens[N_VOCAB];
    bool eog[N_VOCAB] = {0};
    for (int i = 0; i < 256; i++) {
        bytes[i] = (char)i;
        pieces[i] = &bytes[i];
        lens[i] = 1;
    }
    for (size_t i = 0; i < N_WORDS; i++) {
        pieces[256 + i] = WORDS[i];
        lens[256 + i] = strlen(WORDS[i]);
    }
    pieces[N_VOCAB - 1] = NULL;
    lens[N_VOCAB - 1] = 0;
    eog[N_VOCAB - 1] = true;
    kv_error e;
    REQUIRE(kv_grammar_vocab_new(N_VOCAB, pieces, lens, eog, &gv, &e) == KV_OK);
    return gv;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kv_grammar *g = NULL;
    kv_error e;
    kv_status st = kv_grammar_compile((const char *)data, size, NULL, &g, &e);
    if (st != KV_OK) {
        REQUIRE(!g);
        REQUIRE(st == KV_ERR_NOMEM || (st == KV_ERR_FORMAT && strncmp(e.msg, "line ", 5) == 0) ||
                strstr(e.msg, "above the limit"));
        return 0;
    }
    kv_grammar_vocab *gv = vocab();
    kv_grammar_matcher *m = NULL;
    REQUIRE(kv_grammar_matcher_new(g, gv, &m, &e) == KV_OK);
    kv_grammar_state s;
    if (kv_grammar_start(m, &s, &e) == KV_OK) {
        for (size_t step = 0; step < 8; step++) {
            const uint32_t *bits;
            int32_t cnt = -1;
            REQUIRE(kv_grammar_mask(m, &s, &bits, &cnt, &e) == KV_OK);
            int32_t allowed[N_VOCAB], na = 0;
            for (int32_t id = 0; id < N_VOCAB; id++) {
                kv_grammar_state t = s;
                bool ok = kv_grammar_accept_token(m, &t, id, &e) == KV_OK;
                bool bit = (bits[id >> 5] >> (id & 31)) & 1;
                /* a token refused at a limit may be left out of the mask; never the reverse */
                REQUIRE(bit == ok || (!bit && strstr(e.msg, "limit")));
                if (bit) allowed[na++] = id;
            }
            REQUIRE(cnt == na);
            if (na == 0) break;
            int32_t pick = allowed[(step < size ? data[size - 1 - step] : step) % (uint32_t)na];
            REQUIRE(kv_grammar_accept_token(m, &s, pick, &e) == KV_OK);
            if (s.ended) break;
        }
    }
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);
    return 0;
}
