/*
 * make_fuzz_seeds.c — writes a seed corpus of small valid GGUF files for
 * fuzz_gguf: v2 and v3, one file per metadata value type (scalar and
 * array), nested arrays, arrays of strings, tensors of several ggml types,
 * a custom alignment, and a vocabulary-only file.
 *
 *   make_fuzz_seeds DIR      (DIR must exist)
 */
#include "gguf_writer.h"
#include "types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *g_dir;
static int g_count, g_failed;

static void emit(gw *w, const char *name) {
    uint8_t *buf;
    size_t len;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, name);
    if (gw_finish(w, &buf, &len) != 0 || gw_write_file(path, buf, len) != 0) {
        fprintf(stderr, "make_fuzz_seeds: cannot write %s\n", path);
        g_failed++;
    } else {
        g_count++;
    }
    free(buf);
    gw_free(w);
}

static const char *const k_tokens[] = {"<unk>", "<s>", "</s>", "hello", "\xe2\x96\x81world", ""};

static void tiny_tensors(gw *w, uint32_t type, int64_t ne0) {
    int64_t ne[2] = {ne0, 2};
    size_t nb = gw_tensor_nbytes(2, ne, type);
    uint8_t *d = malloc(nb ? nb : 1);
    for (size_t i = 0; i < nb; i++) d[i] = (uint8_t)(i * 13 + 5);
    gw_tensor(w, "blk.0.attn_q.weight", 2, ne, type, d);
    int64_t ne1[1] = {ne0};
    gw_tensor(w, "output_norm.weight", 1, ne1, KV_TYPE_F32, NULL);
    free(d);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: make_fuzz_seeds DIR\n");
        return 2;
    }
    g_dir = argv[1];
    gw *w;

    for (uint32_t v = 2; v <= 3; v++) {
        char name[32];
        snprintf(name, sizeof name, "basic_v%u", v);
        w = gw_new(v);
        gw_kv_str(w, "general.architecture", "llama");
        gw_kv_u32(w, "llama.block_count", 1);
        gw_kv_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
        gw_kv_arr_str(w, "tokenizer.ggml.tokens", k_tokens, 6);
        tiny_tensors(w, KV_TYPE_F32, 8);
        emit(w, name);
    }

    /* one scalar of each type, and an array of each scalar type */
    static const uint8_t bytes[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    static const uint32_t scalars[] = {0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12};
    static const size_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 8, 8, 8};
    for (unsigned i = 0; i < sizeof scalars / sizeof scalars[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "scalar_%u", scalars[i]);
        w = gw_new(3);
        gw_kv_raw(w, "k", scalars[i], bytes, sizes[i]);
        emit(w, name);
        snprintf(name, sizeof name, "array_%u", scalars[i]);
        w = gw_new(3);
        gw_kv_arr(w, "k", scalars[i], bytes, 16 / sizes[i]);
        emit(w, name);
    }
    w = gw_new(3);
    gw_kv_str(w, "general.name", "seed");
    emit(w, "scalar_string");
    w = gw_new(3);
    gw_kv_arr_str(w, "tokenizer.ggml.tokens", k_tokens, 6);
    emit(w, "array_string");

    /* nested arrays: [[1,2],[3]] of i32 and [["x"],[]] */
    w = gw_new(3);
    gw_buf b = {0};
    gw_buf_u32(&b, 9); gw_buf_u64(&b, 2);
    gw_buf_u32(&b, 5); gw_buf_u64(&b, 2); gw_buf_u32(&b, 1); gw_buf_u32(&b, 2);
    gw_buf_u32(&b, 5); gw_buf_u64(&b, 1); gw_buf_u32(&b, 3);
    gw_kv_raw(w, "n.ints", 9, b.p, b.n);
    gw_buf_free(&b);
    gw_buf_u32(&b, 9); gw_buf_u64(&b, 2);
    gw_buf_u32(&b, 8); gw_buf_u64(&b, 1); gw_buf_str(&b, "x");
    gw_buf_u32(&b, 8); gw_buf_u64(&b, 0);
    gw_kv_raw(w, "n.strs", 9, b.p, b.n);
    gw_buf_free(&b);
    emit(w, "nested");

    /* tensors of several types */
    static const struct { uint32_t type; int64_t ne0; } typed[] = {
        {KV_TYPE_F16, 8}, {KV_TYPE_BF16, 8}, {KV_TYPE_Q4_0, 32}, {KV_TYPE_Q4_1, 32}, {KV_TYPE_Q8_0, 64},
        {KV_TYPE_Q4_K, 256}, {KV_TYPE_Q6_K, 256}, {KV_TYPE_I32, 3},
    };
    for (unsigned i = 0; i < sizeof typed / sizeof typed[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "tensor_%s", kv_type_traits_get((int)typed[i].type)->name);
        w = gw_new(3);
        gw_kv_str(w, "general.architecture", "llama");
        tiny_tensors(w, typed[i].type, typed[i].ne0);
        emit(w, name);
    }

    /* 3- and 4-dim tensors, custom alignment */
    w = gw_new(3);
    gw_kv_u32(w, "general.alignment", 64);
    gw_set_alignment(w, 64);
    int64_t ne3[3] = {4, 3, 2}, ne4[4] = {2, 2, 2, 2};
    gw_tensor(w, "t3", 3, ne3, KV_TYPE_F32, NULL);
    gw_tensor(w, "t4", 4, ne4, KV_TYPE_F16, NULL);
    emit(w, "align64_dims");

    /* vocabulary only */
    w = gw_new(3);
    gw_kv_str(w, "general.architecture", "llama");
    gw_kv_str(w, "tokenizer.ggml.model", "gpt2");
    gw_kv_arr_str(w, "tokenizer.ggml.tokens", k_tokens, 6);
    static const char *const merges[] = {"h e", "l l"};
    gw_kv_arr_str(w, "tokenizer.ggml.merges", merges, 2);
    int32_t types[6] = {2, 3, 3, 1, 1, 1};
    gw_kv_arr(w, "tokenizer.ggml.token_type", 5, types, 6);
    gw_kv_u32(w, "tokenizer.ggml.bos_token_id", 1);
    gw_kv_bool(w, "tokenizer.ggml.add_bos_token", 1);
    emit(w, "vocab_only");

    printf("make_fuzz_seeds: %d files in %s\n", g_count, g_dir);
    return g_failed ? 1 : 0;
}
