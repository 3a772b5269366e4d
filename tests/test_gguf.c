/*
 * test_gguf.c — the GGUF reader against a table of valid and malformed files.
 *
 * One enum value per case; each case builds a file with the test writer
 * (tests/support/gguf_writer.h), parses it from an exactly-sized heap copy
 * (so a sanitizer catches any over-read) and checks the outcome: ok (plus
 * content checks) or an error whose message contains a given fragment.
 * Then: every truncation of a rich valid file must fail cleanly, the typed
 * getters' errors, kv_gguf_open on a temp file, and the real SmolLM2 model
 * when scripts/fetch-models.sh can provide it.
 *
 * Prints one line per case and "N passed, N failed"; exits 1 on failure.
 */
#include "gguf.h"
#include "gguf_writer.h"
#include "types.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

/* ==== the cases ============================================================ */

typedef enum {
    /* valid files */
    C_V2_VALID,
    C_V3_VALID,
    C_EVERY_TYPE,
    C_EMPTY_ARRAYS,
    C_NESTED_ARRAYS,
    C_STRING_ARRAY,
    C_CUSTOM_ALIGNMENT,
    C_VOCAB_ONLY,
    C_TENSOR_TYPES,
    C_MANY_KEYS_AND_TENSORS,
    C_TENSORS_OUT_OF_ORDER,
    /* header */
    C_EMPTY_FILE,
    C_BAD_MAGIC,
    C_VERSION_1,
    C_VERSION_4,
    C_BIG_ENDIAN,
    C_N_TENSORS_HUGE,
    C_N_KV_HUGE,
    C_N_KV_MAX,
    C_COUNTS_TOGETHER_TOO_BIG,
    /* metadata */
    C_KEY_LEN_PAST_END,
    C_EMPTY_KEY,
    C_STRING_PAST_END,
    C_STRING_2_40,
    C_STRING_U64_MAX,
    C_ARRAY_COUNT_PAST_END,
    C_ARRAY_COUNT_OVERFLOW,
    C_STRING_ARRAY_COUNT_PAST_END,
    C_STRING_IN_ARRAY_PAST_END,
    C_NESTED_ARRAY_COUNT_PAST_END,
    C_NESTING_TOO_DEEP,
    C_UNKNOWN_VALUE_TYPE,
    C_UNKNOWN_ARRAY_ELEM_TYPE,
    C_DUPLICATE_KEY,
    C_DUPLICATE_LONG_KEY,
    C_ALIGNMENT_0,
    C_ALIGNMENT_NOT_POW2,
    C_ALIGNMENT_ABSURD,
    C_ALIGNMENT_WRONG_TYPE,
    /* tensor infos */
    C_DUPLICATE_TENSOR,
    C_EMPTY_TENSOR_NAME,
    C_TENSOR_NAME_PAST_END,
    C_N_DIMS_0,
    C_N_DIMS_5,
    C_NEGATIVE_DIM,
    C_ZERO_DIM,
    C_ELEMENT_COUNT_OVERFLOW,
    C_BYTE_SIZE_OVERFLOW,
    C_UNKNOWN_TENSOR_TYPE,
    C_UNKNOWN_TENSOR_TYPE_HUGE,
    C_ROW_NOT_BLOCK_MULTIPLE,
    C_OFFSET_NOT_ALIGNED,
    C_OFFSET_NOT_ALIGNED_CUSTOM,
    C_TENSORS_OVERLAP,
    C_TENSOR_PAST_END,
    C_TENSOR_OFFSET_HUGE,
    C_DATA_SECTION_MISSING,
    C_COUNT
} case_id;

typedef struct {
    const char *name;
    const char *frag; /* NULL: must parse; else a fragment of the error */
} case_spec;

static const case_spec k_cases[C_COUNT] = {
    [C_V2_VALID] = {"valid v2", NULL},
    [C_V3_VALID] = {"valid v3", NULL},
    [C_EVERY_TYPE] = {"every value type, scalar and array", NULL},
    [C_EMPTY_ARRAYS] = {"empty arrays", NULL},
    [C_NESTED_ARRAYS] = {"nested arrays", NULL},
    [C_STRING_ARRAY] = {"array of strings", NULL},
    [C_CUSTOM_ALIGNMENT] = {"custom alignment 64", NULL},
    [C_VOCAB_ONLY] = {"vocabulary-only (no tensors)", NULL},
    [C_TENSOR_TYPES] = {"tensors of several ggml types", NULL},
    [C_MANY_KEYS_AND_TENSORS] = {"2000 keys and 1000 tensors, hashed lookups", NULL},
    [C_TENSORS_OUT_OF_ORDER] = {"tensor infos not in offset order", NULL},
    [C_EMPTY_FILE] = {"empty file", "too short"},
    [C_BAD_MAGIC] = {"bad magic", "bad magic"},
    [C_VERSION_1] = {"version 1", "unsupported version 1"},
    [C_VERSION_4] = {"version 4", "unsupported version 4"},
    [C_BIG_ENDIAN] = {"big-endian version", "big-endian"},
    [C_N_TENSORS_HUGE] = {"n_tensors absurd", "n_tensors 1152921504606846976 cannot fit"},
    [C_N_KV_HUGE] = {"n_kv absurd", "n_kv 1099511627776 cannot fit"},
    [C_N_KV_MAX] = {"n_kv = UINT64_MAX", "n_kv 18446744073709551615 cannot fit"},
    [C_COUNTS_TOGETHER_TOO_BIG] = {"n_kv + n_tensors too big together", "cannot fit"},
    [C_KEY_LEN_PAST_END] = {"key length past the end", "key 1 length 4096 runs past the end"},
    [C_EMPTY_KEY] = {"empty key", "key 1 is empty"},
    [C_STRING_PAST_END] = {"string length past the end", "key 'bad.str': string length 100 runs past the end"},
    [C_STRING_2_40] = {"string length 2^40", "length 1099511627776 is absurd"},
    [C_STRING_U64_MAX] = {"string length UINT64_MAX", "is absurd"},
    [C_ARRAY_COUNT_PAST_END] = {"array count past the end", "key 'bad.arr': array of 1000 i32 needs 4000 bytes"},
    [C_ARRAY_COUNT_OVERFLOW] = {"array count * size overflows", "array of 4611686018427387905 u64"},
    [C_STRING_ARRAY_COUNT_PAST_END] = {"string array count past the end", "array of 1000000 strings needs at least 8000000 bytes"},
    [C_STRING_IN_ARRAY_PAST_END] = {"string inside an array past the end", "string 1 of the array length 999 runs past the end"},
    [C_NESTED_ARRAY_COUNT_PAST_END] = {"nested array count past the end", "array of 1000 arrays needs at least"},
    [C_NESTING_TOO_DEEP] = {"arrays nested 9 deep", "nested deeper than 8"},
    [C_UNKNOWN_VALUE_TYPE] = {"unknown value type", "key 'bad.type': unknown value type 13"},
    [C_UNKNOWN_ARRAY_ELEM_TYPE] = {"unknown array element type", "unknown array element type 99"},
    [C_DUPLICATE_KEY] = {"duplicate key", "key 'general.name': duplicate key"},
    [C_DUPLICATE_LONG_KEY] = {"duplicate 300-byte key with control bytes: message shortened", "key 'x?y?xxxxx"},
    [C_ALIGNMENT_0] = {"alignment 0", "'general.alignment' is 0"},
    [C_ALIGNMENT_NOT_POW2] = {"alignment not a power of two", "'general.alignment' is 48"},
    [C_ALIGNMENT_ABSURD] = {"alignment absurd", "'general.alignment' is 16777216"},
    [C_ALIGNMENT_WRONG_TYPE] = {"alignment of type u64", "'general.alignment' has type u64, expected u32"},
    [C_DUPLICATE_TENSOR] = {"duplicate tensor name", "tensor 'a': duplicate tensor name"},
    [C_EMPTY_TENSOR_NAME] = {"empty tensor name", "tensor 1 has an empty name"},
    [C_TENSOR_NAME_PAST_END] = {"tensor name past the end", "name of tensor 0 length 5000 runs past the end"},
    [C_N_DIMS_0] = {"n_dims 0", "tensor 'a': n_dims 0 not in 1..4"},
    [C_N_DIMS_5] = {"n_dims 5", "tensor 'a': n_dims 5 not in 1..4"},
    [C_NEGATIVE_DIM] = {"negative dimension", "tensor 'a': dimension 1 is -3"},
    [C_ZERO_DIM] = {"zero dimension", "tensor 'a': dimension 0 is 0"},
    [C_ELEMENT_COUNT_OVERFLOW] = {"element count overflow", "tensor 'a': element count overflows"},
    [C_BYTE_SIZE_OVERFLOW] = {"byte size overflow", "tensor 'a': byte size overflows"},
    [C_UNKNOWN_TENSOR_TYPE] = {"unknown tensor type (4)", "tensor 'a': unknown ggml type 4"},
    [C_UNKNOWN_TENSOR_TYPE_HUGE] = {"unknown tensor type (2^31)", "unknown ggml type 2147483648"},
    [C_ROW_NOT_BLOCK_MULTIPLE] = {"ne[0] not a multiple of the block", "row length 48 is not a multiple of the Q4_0 block size 32"},
    [C_OFFSET_NOT_ALIGNED] = {"offset not aligned", "tensor 'b': offset 8 not aligned to 32"},
    [C_OFFSET_NOT_ALIGNED_CUSTOM] = {"offset not aligned to custom alignment", "offset 32 not aligned to 64"},
    [C_TENSORS_OVERLAP] = {"tensors overlap", "tensor 'a' [0, +64) overlaps tensor 'b' at offset 32"},
    [C_TENSOR_PAST_END] = {"tensor data past the end", "tensor 'b': data [64, +64) runs past the end"},
    [C_TENSOR_OFFSET_HUGE] = {"tensor offset near 2^64", "runs past the end"},
    [C_DATA_SECTION_MISSING] = {"data section starts past the end", "truncated: the tensor data section starts at"},
};

/* ==== builders ============================================================= */

static const char *const k_tokens[] = {"<unk>", "<s>", "</s>", "", "hello", "\xe2\x96\x81world", "a b"};
#define N_TOKENS (sizeof k_tokens / sizeof k_tokens[0])

static float k_f32_data[64 * 4];

static void fill_data(void) {
    for (int i = 0; i < 64 * 4; i++) k_f32_data[i] = (float)i * 0.25f - 3.0f;
}

/* A small llama-ish file: a few kvs and two F32 tensors. */
static void add_basic(gw *w) {
    gw_kv_str(w, "general.architecture", "llama");
    gw_kv_str(w, "general.name", "tiny");
    gw_kv_u32(w, "llama.block_count", 2);
    gw_kv_arr_str(w, "tokenizer.ggml.tokens", k_tokens, N_TOKENS);
    int64_t ne_a[2] = {64, 2}, ne_b[1] = {16};
    gw_tensor(w, "a", 2, ne_a, KV_TYPE_F32, k_f32_data);
    gw_tensor(w, "b", 1, ne_b, KV_TYPE_F32, k_f32_data + 128);
}

static void add_every_type(gw *w) {
    gw_kv_u8(w, "t.u8", 200);
    gw_kv_i8(w, "t.i8", -100);
    gw_kv_u16(w, "t.u16", 60000);
    gw_kv_i16(w, "t.i16", -30000);
    gw_kv_u32(w, "t.u32", 4000000000u);
    gw_kv_i32(w, "t.i32", -2000000000);
    gw_kv_f32(w, "t.f32", 1.5f);
    gw_kv_bool(w, "t.bool", true);
    gw_kv_str(w, "t.string", "h\xc3\xa9llo");
    gw_kv_u64(w, "t.u64", 18000000000000000000ull);
    gw_kv_i64(w, "t.i64", -9000000000000000000ll);
    gw_kv_f64(w, "t.f64", -2.25);
    uint8_t u8[3] = {1, 2, 255};
    int8_t i8[3] = {-1, 0, 127};
    uint16_t u16[2] = {1, 65535};
    int16_t i16[2] = {-32768, 7};
    uint32_t u32[2] = {0, 4294967295u};
    int32_t i32[3] = {-5, 0, 5};
    float f32[2] = {0.5f, -1e30f};
    uint8_t bo[3] = {1, 0, 1};
    uint64_t u64[2] = {0, UINT64_MAX};
    int64_t i64[2] = {INT64_MIN, INT64_MAX};
    double f64[2] = {3.25, -0.125};
    gw_kv_arr(w, "a.u8", 0, u8, 3);
    gw_kv_arr(w, "a.i8", 1, i8, 3);
    gw_kv_arr(w, "a.u16", 2, u16, 2);
    gw_kv_arr(w, "a.i16", 3, i16, 2);
    gw_kv_arr(w, "a.u32", 4, u32, 2);
    gw_kv_arr(w, "a.i32", 5, i32, 3);
    gw_kv_arr(w, "a.f32", 6, f32, 2);
    gw_kv_arr(w, "a.bool", 7, bo, 3);
    gw_kv_arr_str(w, "a.string", k_tokens, N_TOKENS);
    gw_kv_arr(w, "a.u64", 10, u64, 2);
    gw_kv_arr(w, "a.i64", 11, i64, 2);
    gw_kv_arr(w, "a.f64", 12, f64, 2);
}

/* Nested: [[1,2],[3]] of i32, [["x"],[]] of strings, and depth 3. */
static void add_nested(gw *w) {
    gw_buf b = {0};
    gw_buf_u32(&b, KV_GGUF_ARRAY);
    gw_buf_u64(&b, 2);
    gw_buf_u32(&b, KV_GGUF_I32); gw_buf_u64(&b, 2); gw_buf_u32(&b, 1); gw_buf_u32(&b, 2);
    gw_buf_u32(&b, KV_GGUF_I32); gw_buf_u64(&b, 1); gw_buf_u32(&b, 3);
    gw_kv_raw(w, "n.ints", KV_GGUF_ARRAY, b.p, b.n);
    gw_buf_free(&b);
    gw_buf_u32(&b, KV_GGUF_ARRAY);
    gw_buf_u64(&b, 2);
    gw_buf_u32(&b, KV_GGUF_STRING); gw_buf_u64(&b, 1); gw_buf_str(&b, "x");
    gw_buf_u32(&b, KV_GGUF_STRING); gw_buf_u64(&b, 0);
    gw_kv_raw(w, "n.strs", KV_GGUF_ARRAY, b.p, b.n);
    gw_buf_free(&b);
    gw_buf_u32(&b, KV_GGUF_ARRAY); gw_buf_u64(&b, 1);
    gw_buf_u32(&b, KV_GGUF_ARRAY); gw_buf_u64(&b, 1);
    gw_buf_u32(&b, KV_GGUF_F64); gw_buf_u64(&b, 1); gw_buf_f64(&b, 7.5);
    gw_kv_raw(w, "n.deep", KV_GGUF_ARRAY, b.p, b.n);
    gw_buf_free(&b);
}

/* Arrays nested `depth` deep (depth 1 = a plain array of u8). */
static void add_deep(gw *w, const char *key, int depth) {
    gw_buf b = {0};
    for (int d = 1; d < depth; d++) {
        gw_buf_u32(&b, KV_GGUF_ARRAY);
        gw_buf_u64(&b, 1);
    }
    gw_buf_u32(&b, KV_GGUF_U8);
    gw_buf_u64(&b, 1);
    gw_buf_u8(&b, 42);
    gw_kv_raw(w, key, KV_GGUF_ARRAY, b.p, b.n);
    gw_buf_free(&b);
}

static const struct { uint32_t type; int64_t ne0, ne1; } k_typed[] = {
    {KV_TYPE_F32, 8, 3},   {KV_TYPE_F16, 16, 2},  {KV_TYPE_BF16, 4, 1},  {KV_TYPE_Q4_0, 64, 2},
    {KV_TYPE_Q4_1, 32, 1}, {KV_TYPE_Q8_0, 32, 3}, {KV_TYPE_Q4_K, 256, 2}, {KV_TYPE_Q6_K, 512, 1},
    {KV_TYPE_I8, 3, 1},    {KV_TYPE_MXFP4, 32, 1},
};
#define N_TYPED (sizeof k_typed / sizeof k_typed[0])

static void typed_bytes(uint8_t *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(seed * 31 + i * 7);
}

static void add_typed(gw *w) {
    for (unsigned i = 0; i < N_TYPED; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%u.%s", i, kv_type_traits_get((int)k_typed[i].type)->name);
        int64_t ne[2] = {k_typed[i].ne0, k_typed[i].ne1};
        size_t nb = gw_tensor_nbytes(2, ne, k_typed[i].type);
        uint8_t *d = malloc(nb);
        typed_bytes(d, nb, i);
        gw_tensor(w, name, 2, ne, k_typed[i].type, d);
        free(d);
    }
}

/* A one-kv file with a key and a raw value body. */
static void raw_value(gw *w, const char *key, uint32_t vtype, gw_buf *b) {
    gw_kv_str(w, "general.architecture", "llama");
    gw_kv_raw(w, key, vtype, b->p, b->n);
    gw_buf_free(b);
}

/* A file whose one tensor info has raw dims and type. */
static void raw_tensor(gw *w, uint32_t n_dims, const uint64_t *ne, uint32_t type) {
    gw_kv_str(w, "general.architecture", "llama");
    gw_tensor_ex(w, "a", n_dims, ne, type, GW_AUTO, NULL, 64);
}

static void patch_u32(uint8_t *p, size_t at, uint32_t v) { memcpy(p + at, &v, 4); }
static void patch_u64(uint8_t *p, size_t at, uint64_t v) { memcpy(p + at, &v, 8); }

/* Builds the file of case c into buf, len (malloc'd). 0 on success. */
static int build(case_id c, uint8_t **buf, size_t *len) {
    gw *w = gw_new(c == C_V2_VALID ? 2 : 3);
    if (!w) return -1;
    gw_buf b = {0};
    int64_t ne[4];
    uint64_t une[8];
    switch (c) {
    case C_V2_VALID:
    case C_V3_VALID:
    case C_EMPTY_FILE:
    case C_BAD_MAGIC:
    case C_VERSION_1:
    case C_VERSION_4:
    case C_BIG_ENDIAN:
    case C_N_TENSORS_HUGE:
    case C_N_KV_HUGE:
    case C_N_KV_MAX:
    case C_COUNTS_TOGETHER_TOO_BIG:
    case C_DATA_SECTION_MISSING:
        add_basic(w);
        break;
    case C_EVERY_TYPE:
        add_every_type(w);
        add_basic(w);
        break;
    case C_EMPTY_ARRAYS:
        gw_kv_arr(w, "e.u32", KV_GGUF_U32, NULL, 0);
        gw_kv_arr_str(w, "e.str", NULL, 0);
        gw_buf_u32(&b, KV_GGUF_ARRAY);
        gw_buf_u64(&b, 0);
        gw_kv_raw(w, "e.arr", KV_GGUF_ARRAY, b.p, b.n);
        gw_buf_free(&b);
        break;
    case C_NESTED_ARRAYS:
        add_nested(w);
        add_deep(w, "n.depth8", 8);
        break;
    case C_STRING_ARRAY:
        gw_kv_arr_str(w, "tokenizer.ggml.tokens", k_tokens, N_TOKENS);
        break;
    case C_CUSTOM_ALIGNMENT:
        gw_kv_u32(w, "general.alignment", 64);
        gw_set_alignment(w, 64);
        add_basic(w);
        break;
    case C_VOCAB_ONLY:
        gw_kv_str(w, "general.architecture", "llama");
        gw_kv_str(w, "tokenizer.ggml.model", "gpt2");
        gw_kv_arr_str(w, "tokenizer.ggml.tokens", k_tokens, N_TOKENS);
        break;
    case C_TENSOR_TYPES:
        add_typed(w);
        break;
    case C_MANY_KEYS_AND_TENSORS:
        for (int i = 0; i < 2000; i++) {
            char k[32];
            snprintf(k, sizeof k, "many.key.%d", i);
            gw_kv_i32(w, k, i * 3);
        }
        for (int i = 0; i < 1000; i++) {
            char k[32];
            snprintf(k, sizeof k, "blk.%d.w", i);
            ne[0] = 1 + i % 5;
            gw_tensor(w, k, 1, ne, KV_TYPE_I8, NULL);
        }
        break;
    case C_TENSORS_OUT_OF_ORDER:
        une[0] = 16;
        gw_tensor_ex(w, "late", 1, une, KV_TYPE_F32, 64, k_f32_data, 64);
        gw_tensor_ex(w, "early", 1, une, KV_TYPE_F32, 0, k_f32_data + 16, 64);
        break;
    case C_KEY_LEN_PAST_END:
        gw_kv_str(w, "general.architecture", "llama");
        gw_buf_u64(&b, 4096);
        gw_buf_bytes(&b, "abc", 3);
        gw_raw_kv(w, b.p, b.n);
        gw_buf_free(&b);
        break;
    case C_EMPTY_KEY:
        gw_kv_str(w, "general.architecture", "llama");
        gw_kv_u32(w, "", 1);
        break;
    case C_STRING_PAST_END:
        gw_buf_u64(&b, 100);
        gw_buf_bytes(&b, "short", 5);
        raw_value(w, "bad.str", KV_GGUF_STRING, &b);
        break;
    case C_STRING_2_40:
        gw_buf_u64(&b, 1ull << 40);
        raw_value(w, "bad.str", KV_GGUF_STRING, &b);
        break;
    case C_STRING_U64_MAX:
        gw_buf_u64(&b, UINT64_MAX);
        raw_value(w, "bad.str", KV_GGUF_STRING, &b);
        break;
    case C_ARRAY_COUNT_PAST_END:
        gw_buf_u32(&b, KV_GGUF_I32);
        gw_buf_u64(&b, 1000);
        gw_buf_u32(&b, 7);
        raw_value(w, "bad.arr", KV_GGUF_ARRAY, &b);
        break;
    case C_ARRAY_COUNT_OVERFLOW:
        gw_buf_u32(&b, KV_GGUF_U64);
        gw_buf_u64(&b, (1ull << 62) + 1); /* * 8 wraps to 8 */
        gw_buf_u64(&b, 7);
        raw_value(w, "bad.arr", KV_GGUF_ARRAY, &b);
        break;
    case C_STRING_ARRAY_COUNT_PAST_END:
        gw_buf_u32(&b, KV_GGUF_STRING);
        gw_buf_u64(&b, 1000000);
        gw_buf_str(&b, "one");
        raw_value(w, "bad.arr", KV_GGUF_ARRAY, &b);
        break;
    case C_STRING_IN_ARRAY_PAST_END:
        gw_buf_u32(&b, KV_GGUF_STRING);
        gw_buf_u64(&b, 3);
        gw_buf_str(&b, "one");
        gw_buf_u64(&b, 999);
        gw_buf_bytes(&b, "two.......", 10);
        raw_value(w, "bad.arr", KV_GGUF_ARRAY, &b);
        break;
    case C_NESTED_ARRAY_COUNT_PAST_END:
        gw_buf_u32(&b, KV_GGUF_ARRAY);
        gw_buf_u64(&b, 1000);
        gw_buf_u32(&b, KV_GGUF_U8);
        gw_buf_u64(&b, 0);
        raw_value(w, "bad.arr", KV_GGUF_ARRAY, &b);
        break;
    case C_NESTING_TOO_DEEP:
        add_deep(w, "bad.deep", 9);
        break;
    case C_UNKNOWN_VALUE_TYPE:
        gw_buf_u32(&b, 0);
        raw_value(w, "bad.type", 13, &b);
        break;
    case C_UNKNOWN_ARRAY_ELEM_TYPE:
        gw_buf_u32(&b, 99);
        gw_buf_u64(&b, 1);
        gw_buf_u32(&b, 0);
        raw_value(w, "bad.arr", KV_GGUF_ARRAY, &b);
        break;
    case C_DUPLICATE_KEY:
        add_basic(w);
        gw_kv_str(w, "general.name", "again");
        break;
    case C_DUPLICATE_LONG_KEY: {
        char k[301];
        memset(k, 'x', 300);
        k[300] = '\0';
        k[1] = '\n';
        k[3] = '\x7f';
        k[2] = 'y';
        gw_kv_u32(w, k, 1);
        gw_kv_u32(w, k, 2);
        break;
    }
    case C_ALIGNMENT_0:
        gw_kv_u32(w, "general.alignment", 0);
        add_basic(w);
        break;
    case C_ALIGNMENT_NOT_POW2:
        gw_kv_u32(w, "general.alignment", 48);
        add_basic(w);
        break;
    case C_ALIGNMENT_ABSURD:
        gw_kv_u32(w, "general.alignment", 1u << 24);
        add_basic(w);
        break;
    case C_ALIGNMENT_WRONG_TYPE:
        gw_kv_u64(w, "general.alignment", 32);
        add_basic(w);
        break;
    case C_DUPLICATE_TENSOR:
        ne[0] = 16;
        gw_tensor(w, "a", 1, ne, KV_TYPE_F32, NULL);
        gw_tensor(w, "a", 1, ne, KV_TYPE_F32, NULL);
        break;
    case C_EMPTY_TENSOR_NAME:
        ne[0] = 16;
        gw_tensor(w, "a", 1, ne, KV_TYPE_F32, NULL);
        gw_tensor(w, "", 1, ne, KV_TYPE_F32, NULL);
        break;
    case C_TENSOR_NAME_PAST_END:
        gw_kv_str(w, "general.architecture", "llama");
        gw_set_counts(w, 1, 1);
        gw_buf_u64(&b, 5000);
        gw_buf_bytes(&b, NULL, 40);
        gw_raw_kv(w, b.p, b.n); /* bytes after the kvs: read as the tensor info */
        gw_buf_free(&b);
        break;
    case C_N_DIMS_0:
        raw_tensor(w, 0, une, KV_TYPE_F32);
        break;
    case C_N_DIMS_5:
        for (int d = 0; d < 5; d++) une[d] = 1;
        raw_tensor(w, 5, une, KV_TYPE_F32);
        break;
    case C_NEGATIVE_DIM:
        une[0] = 16;
        une[1] = (uint64_t)-3;
        raw_tensor(w, 2, une, KV_TYPE_F32);
        break;
    case C_ZERO_DIM:
        une[0] = 0;
        raw_tensor(w, 1, une, KV_TYPE_F32);
        break;
    case C_ELEMENT_COUNT_OVERFLOW:
        une[0] = 1ull << 32;
        une[1] = 1ull << 32;
        raw_tensor(w, 2, une, KV_TYPE_F32);
        break;
    case C_BYTE_SIZE_OVERFLOW:
        une[0] = 1ull << 32;
        une[1] = 1ull << 30; /* 2^62 elements fit in int64, 2^65 bytes do not */
        raw_tensor(w, 2, une, KV_TYPE_F64);
        break;
    case C_UNKNOWN_TENSOR_TYPE:
        une[0] = 16;
        raw_tensor(w, 1, une, 4);
        break;
    case C_UNKNOWN_TENSOR_TYPE_HUGE:
        une[0] = 16;
        raw_tensor(w, 1, une, 0x80000000u);
        break;
    case C_ROW_NOT_BLOCK_MULTIPLE:
        une[0] = 48;
        raw_tensor(w, 1, une, KV_TYPE_Q4_0);
        break;
    case C_OFFSET_NOT_ALIGNED:
        une[0] = 2;
        gw_tensor_ex(w, "a", 1, une, KV_TYPE_F32, 0, NULL, 8);
        gw_tensor_ex(w, "b", 1, une, KV_TYPE_F32, 8, NULL, 8);
        break;
    case C_OFFSET_NOT_ALIGNED_CUSTOM:
        gw_kv_u32(w, "general.alignment", 64);
        gw_set_alignment(w, 64);
        une[0] = 8;
        gw_tensor_ex(w, "a", 1, une, KV_TYPE_F32, 0, NULL, 32);
        gw_tensor_ex(w, "b", 1, une, KV_TYPE_F32, 32, NULL, 32);
        break;
    case C_TENSORS_OVERLAP:
        une[0] = 16;
        gw_tensor_ex(w, "a", 1, une, KV_TYPE_F32, 0, NULL, 64);
        gw_tensor_ex(w, "b", 1, une, KV_TYPE_F32, 32, NULL, 64);
        break;
    case C_TENSOR_PAST_END:
        une[0] = 16;
        gw_tensor_ex(w, "a", 1, une, KV_TYPE_F32, 0, NULL, 64);
        gw_tensor_ex(w, "b", 1, une, KV_TYPE_F32, 64, NULL, 32); /* 32 of its 64 bytes */
        break;
    case C_TENSOR_OFFSET_HUGE:
        une[0] = 16;
        gw_tensor_ex(w, "a", 1, une, KV_TYPE_F32, 0, NULL, 64);
        gw_tensor_ex(w, "b", 1, une, KV_TYPE_F32, UINT64_MAX - 31, NULL, 0);
        break;
    case C_COUNT:
        break;
    }
    int rc = gw_finish(w, buf, len);
    gw_free(w);
    if (rc) return rc;
    uint8_t *p = *buf;
    switch (c) {
    case C_EMPTY_FILE: *len = 0; break;
    case C_BAD_MAGIC: memcpy(p, "GGML", 4); break;
    case C_VERSION_1: patch_u32(p, 4, 1); break;
    case C_VERSION_4: patch_u32(p, 4, 4); break;
    case C_BIG_ENDIAN: patch_u32(p, 4, 0x03000000u); break;
    case C_N_TENSORS_HUGE: patch_u64(p, 8, 1ull << 60); break;
    case C_N_KV_HUGE: patch_u64(p, 16, 1ull << 40); break;
    case C_N_KV_MAX: patch_u64(p, 16, UINT64_MAX); break;
    case C_COUNTS_TOGETHER_TOO_BIG: /* each alone fits, together they don't */
        patch_u64(p, 8, (*len - 24) / 33);
        patch_u64(p, 16, (*len - 24) / 14);
        break;
    case C_DATA_SECTION_MISSING: { /* cut right after the tensor infos */
        kv_gguf *g; kv_error e;
        if (kv_gguf_parse(p, *len, &g, &e) == KV_OK) {
            *len = (size_t)g->data_offset - 1;
            kv_gguf_close(g);
        }
        break;
    }
    default: break;
    }
    return 0;
}

/* ==== content checks for the valid cases ==================================== */

#undef CHECK /* here: a case-local check that explains why */
#define CHECK(cond, ...) do { if (!(cond)) { snprintf(why, whylen, __VA_ARGS__); return false; } } while (0)

static bool str_is(const kv_gguf_value *v, const char *s) {
    return v && v->type == KV_GGUF_STRING && kv_gguf_str_eq(v->v.s, s);
}

static bool check_basic(const kv_gguf *g, char *why, size_t whylen) {
    CHECK(g->n_tensors == 2, "n_tensors %llu", (unsigned long long)g->n_tensors);
    CHECK(str_is(kv_gguf_get(g, "general.architecture"), "llama"), "architecture");
    const kv_gguf_value *tok = kv_gguf_get(g, "tokenizer.ggml.tokens");
    CHECK(tok && tok->type == KV_GGUF_ARRAY && tok->v.arr.type == KV_GGUF_STRING && tok->v.arr.n == N_TOKENS,
          "tokens");
    for (unsigned i = 0; i < N_TOKENS; i++) CHECK(kv_gguf_str_eq(tok->v.arr.strs[i], k_tokens[i]), "token %u", i);
    const kv_gguf_tensor *a = kv_gguf_tensor_find(g, "a"), *b = kv_gguf_tensor_find(g, "b");
    CHECK(a && b && !kv_gguf_tensor_find(g, "c"), "find");
    CHECK(a->n_dims == 2 && a->ne[0] == 64 && a->ne[1] == 2 && a->ne[2] == 1 && a->ne[3] == 1, "a shape");
    CHECK(a->type == KV_TYPE_F32 && a->nbytes == 512 && b->nbytes == 64, "a type/nbytes");
    CHECK(memcmp(a->data, k_f32_data, 512) == 0 && memcmp(b->data, k_f32_data + 128, 64) == 0, "data");
    CHECK(g->data_offset % g->alignment == 0, "data offset %llu", (unsigned long long)g->data_offset);
    CHECK((const uint8_t *)a->data == g->base + g->data_offset + a->offset, "data pointer");
    return true;
}

static bool check_every_type(const kv_gguf *g, char *why, size_t whylen) {
    const kv_gguf_value *v;
    v = kv_gguf_get(g, "t.u8"); CHECK(v && v->type == KV_GGUF_U8 && v->v.u == 200, "u8");
    v = kv_gguf_get(g, "t.i8"); CHECK(v && v->type == KV_GGUF_I8 && v->v.i == -100, "i8");
    v = kv_gguf_get(g, "t.u16"); CHECK(v && v->type == KV_GGUF_U16 && v->v.u == 60000, "u16");
    v = kv_gguf_get(g, "t.i16"); CHECK(v && v->type == KV_GGUF_I16 && v->v.i == -30000, "i16");
    v = kv_gguf_get(g, "t.u32"); CHECK(v && v->type == KV_GGUF_U32 && v->v.u == 4000000000u, "u32");
    v = kv_gguf_get(g, "t.i32"); CHECK(v && v->type == KV_GGUF_I32 && v->v.i == -2000000000, "i32");
    v = kv_gguf_get(g, "t.f32"); CHECK(v && v->type == KV_GGUF_F32 && v->v.f == 1.5, "f32");
    v = kv_gguf_get(g, "t.bool"); CHECK(v && v->type == KV_GGUF_BOOL && v->v.b, "bool");
    CHECK(str_is(kv_gguf_get(g, "t.string"), "h\xc3\xa9llo"), "string");
    v = kv_gguf_get(g, "t.u64"); CHECK(v && v->type == KV_GGUF_U64 && v->v.u == 18000000000000000000ull, "u64");
    v = kv_gguf_get(g, "t.i64"); CHECK(v && v->type == KV_GGUF_I64 && v->v.i == -9000000000000000000ll, "i64");
    v = kv_gguf_get(g, "t.f64"); CHECK(v && v->type == KV_GGUF_F64 && v->v.f == -2.25, "f64");
    static const struct { const char *key; int type; uint64_t n; double x0, xlast; } arrs[] = {
        {"a.u8", 0, 3, 1, 255}, {"a.i8", 1, 3, -1, 127}, {"a.u16", 2, 2, 1, 65535}, {"a.i16", 3, 2, -32768, 7},
        {"a.u32", 4, 2, 0, 4294967295.0}, {"a.i32", 5, 3, -5, 5}, {"a.f32", 6, 2, 0.5, (double)-1e30f},
        {"a.bool", 7, 3, 1, 1}, {"a.u64", 10, 2, 0, 18446744073709551615.0},
        {"a.i64", 11, 2, -9223372036854775808.0, 9223372036854775807.0}, {"a.f64", 12, 2, 3.25, -0.125},
    };
    for (unsigned i = 0; i < sizeof arrs / sizeof arrs[0]; i++) {
        v = kv_gguf_get(g, arrs[i].key);
        CHECK(v && v->type == KV_GGUF_ARRAY && (int)v->v.arr.type == arrs[i].type && v->v.arr.n == arrs[i].n,
              "%s", arrs[i].key);
        CHECK(kv_gguf_arr_num(v, 0) == arrs[i].x0 && kv_gguf_arr_num(v, arrs[i].n - 1) == arrs[i].xlast,
              "%s values %g %g", arrs[i].key, kv_gguf_arr_num(v, 0), kv_gguf_arr_num(v, arrs[i].n - 1));
        CHECK(kv_gguf_arr_num(v, arrs[i].n) == 0, "%s out of range", arrs[i].key);
    }
    v = kv_gguf_get(g, "a.i32");
    CHECK(kv_gguf_arr_int(v, 0) == -5 && kv_gguf_arr_int(v, 2) == 5, "arr_int i32");
    v = kv_gguf_get(g, "a.i64");
    CHECK(kv_gguf_arr_int(v, 0) == INT64_MIN && kv_gguf_arr_int(v, 1) == INT64_MAX, "arr_int i64");
    v = kv_gguf_get(g, "a.u64");
    CHECK(kv_gguf_arr_int(v, 1) == INT64_MAX, "arr_int u64 saturates");
    v = kv_gguf_get(g, "a.f32");
    CHECK(kv_gguf_arr_int(v, 0) == 0 && kv_gguf_arr_int(v, 1) == INT64_MIN, "arr_int f32 truncates, saturates");
    v = kv_gguf_get(g, "a.bool");
    CHECK(kv_gguf_arr_int(v, 0) == 1 && kv_gguf_arr_int(v, 1) == 0, "arr_int bool");
    v = kv_gguf_get(g, "a.string");
    CHECK(kv_gguf_arr_int(v, 0) == 0 && kv_gguf_arr_num(v, 0) == 0, "arr_int of strings is 0");
    v = kv_gguf_get(g, "a.string");
    CHECK(v && v->v.arr.type == KV_GGUF_STRING && v->v.arr.n == N_TOKENS && v->v.arr.strs[3].len == 0,
          "a.string");
    return check_basic(g, why, whylen) || (snprintf(why, whylen, "basic part"), false);
}

static bool check_empty_arrays(const kv_gguf *g, char *why, size_t whylen) {
    const char *keys[] = {"e.u32", "e.str", "e.arr"};
    for (int i = 0; i < 3; i++) {
        const kv_gguf_value *v = kv_gguf_get(g, keys[i]);
        CHECK(v && v->type == KV_GGUF_ARRAY && v->v.arr.n == 0, "%s", keys[i]);
    }
    CHECK(g->n_tensors == 0, "n_tensors");
    return true;
}

static bool check_nested(const kv_gguf *g, char *why, size_t whylen) {
    const kv_gguf_value *v = kv_gguf_get(g, "n.ints");
    CHECK(v && v->type == KV_GGUF_ARRAY && v->v.arr.type == KV_GGUF_ARRAY && v->v.arr.n == 2, "n.ints");
    const kv_gguf_value *x = &v->v.arr.items[0], *y = &v->v.arr.items[1];
    CHECK(x->type == KV_GGUF_ARRAY && x->v.arr.type == KV_GGUF_I32 && x->v.arr.n == 2, "n.ints[0]");
    CHECK(kv_gguf_arr_int(x, 0) == 1 && kv_gguf_arr_int(x, 1) == 2 && kv_gguf_arr_int(y, 0) == 3 &&
              y->v.arr.n == 1, "n.ints values");
    v = kv_gguf_get(g, "n.strs");
    CHECK(v && v->v.arr.n == 2 && v->v.arr.items[0].v.arr.n == 1 &&
              kv_gguf_str_eq(v->v.arr.items[0].v.arr.strs[0], "x") && v->v.arr.items[1].v.arr.n == 0,
          "n.strs");
    v = kv_gguf_get(g, "n.deep");
    CHECK(v && kv_gguf_arr_num(&v->v.arr.items[0].v.arr.items[0], 0) == 7.5, "n.deep");
    v = kv_gguf_get(g, "n.depth8");
    for (int d = 1; d < 8; d++) {
        CHECK(v && v->type == KV_GGUF_ARRAY && v->v.arr.type == KV_GGUF_ARRAY && v->v.arr.n == 1, "depth %d", d);
        v = &v->v.arr.items[0];
    }
    CHECK(v->v.arr.type == KV_GGUF_U8 && kv_gguf_arr_int(v, 0) == 42, "depth 8 leaf");
    return true;
}

static bool check_string_array(const kv_gguf *g, char *why, size_t whylen) {
    const kv_gguf_value *v;
    kv_error e;
    CHECK(kv_gguf_get_arr(g, "tokenizer.ggml.tokens", KV_GGUF_STRING, &v, true, &e) == KV_OK, "%s", e.msg);
    for (unsigned i = 0; i < N_TOKENS; i++) CHECK(kv_gguf_str_eq(v->v.arr.strs[i], k_tokens[i]), "token %u", i);
    return true;
}

static bool check_custom_alignment(const kv_gguf *g, char *why, size_t whylen) {
    CHECK(g->alignment == 64, "alignment %llu", (unsigned long long)g->alignment);
    CHECK(g->data_offset % 64 == 0, "data_offset %llu", (unsigned long long)g->data_offset);
    const kv_gguf_tensor *b = kv_gguf_tensor_find(g, "b");
    CHECK(b && b->offset == 512 && memcmp(b->data, k_f32_data + 128, 64) == 0, "b at 512");
    return true;
}

static bool check_vocab_only(const kv_gguf *g, char *why, size_t whylen) {
    CHECK(g->n_tensors == 0 && g->n_kv == 3, "counts");
    CHECK(kv_gguf_tensor_find(g, "a") == NULL, "find on empty");
    CHECK(str_is(kv_gguf_get(g, "tokenizer.ggml.model"), "gpt2"), "model");
    return true;
}

static bool check_tensor_types(const kv_gguf *g, char *why, size_t whylen) {
    CHECK(g->n_tensors == N_TYPED, "n_tensors");
    for (unsigned i = 0; i < N_TYPED; i++) {
        const kv_gguf_tensor *t = &g->tensors[i];
        const kv_type_traits *tr = kv_type_traits_get((int)k_typed[i].type);
        uint64_t nb = (uint64_t)(k_typed[i].ne0 / tr->blck) * tr->type_size * (uint64_t)k_typed[i].ne1;
        CHECK(t->type == (int)k_typed[i].type && t->nbytes == nb, "tensor %u (%s) nbytes %llu, want %llu", i,
              tr->name, (unsigned long long)t->nbytes, (unsigned long long)nb);
        uint8_t *want = malloc(nb);
        typed_bytes(want, nb, i);
        bool same = memcmp(t->data, want, nb) == 0;
        free(want);
        CHECK(same, "tensor %u data", i);
        CHECK(t->offset % 32 == 0, "tensor %u offset", i);
        char name[32];
        snprintf(name, sizeof name, "t%u.%s", i, tr->name);
        CHECK(kv_gguf_tensor_find(g, name) == t, "find %s", name);
    }
    return true;
}

static bool check_many(const kv_gguf *g, char *why, size_t whylen) {
    kv_error e;
    for (int i = 0; i < 2000; i++) {
        char k[32];
        snprintf(k, sizeof k, "many.key.%d", i);
        int64_t x = -1;
        CHECK(kv_gguf_get_i64(g, k, &x, true, &e) == KV_OK && x == i * 3, "%s", k);
    }
    for (int i = 0; i < 1000; i++) {
        char k[32];
        snprintf(k, sizeof k, "blk.%d.w", i);
        const kv_gguf_tensor *t = kv_gguf_tensor_find(g, k);
        CHECK(t && t == &g->tensors[i] && t->ne[0] == 1 + i % 5, "%s", k);
    }
    CHECK(!kv_gguf_get(g, "many.key.2000") && !kv_gguf_tensor_find(g, "blk.1000.w"), "absent");
    return true;
}

static bool check_out_of_order(const kv_gguf *g, char *why, size_t whylen) {
    const kv_gguf_tensor *l = kv_gguf_tensor_find(g, "late"), *e = kv_gguf_tensor_find(g, "early");
    CHECK(l && e && l->offset == 64 && e->offset == 0, "offsets");
    CHECK(memcmp(e->data, k_f32_data + 16, 64) == 0 && memcmp(l->data, k_f32_data, 64) == 0, "data");
    return true;
}

static bool check_case(case_id c, const kv_gguf *g, char *why, size_t whylen) {
    switch (c) {
    case C_V2_VALID: return g->version == 2 && g->n_kv == 4 && check_basic(g, why, whylen);
    case C_V3_VALID: return g->version == 3 && g->n_kv == 4 && check_basic(g, why, whylen);
    case C_EVERY_TYPE: return check_every_type(g, why, whylen);
    case C_EMPTY_ARRAYS: return check_empty_arrays(g, why, whylen);
    case C_NESTED_ARRAYS: return check_nested(g, why, whylen);
    case C_STRING_ARRAY: return check_string_array(g, why, whylen);
    case C_CUSTOM_ALIGNMENT: return check_custom_alignment(g, why, whylen);
    case C_VOCAB_ONLY: return check_vocab_only(g, why, whylen);
    case C_TENSOR_TYPES: return check_tensor_types(g, why, whylen);
    case C_MANY_KEYS_AND_TENSORS: return check_many(g, why, whylen);
    case C_TENSORS_OUT_OF_ORDER: return check_out_of_order(g, why, whylen);
    default: return true;
    }
}

/* Parses an exactly-sized heap copy of p. */
static kv_status parse_copy(const uint8_t *p, size_t len, kv_gguf **g, kv_error *e) {
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy) return KV_ERR_NOMEM;
    if (len) memcpy(copy, p, len);
    kv_status s = kv_gguf_parse(copy, len, g, e);
    if (s != KV_OK) free(copy);
    return s; /* on success the caller frees g->base */
}

static void run_case(case_id c) {
    const case_spec *cs = &k_cases[c];
    uint8_t *buf;
    size_t len;
    if (build(c, &buf, &len) != 0) {
        report(false, cs->name, "could not build the file");
        return;
    }
    const char *dump = getenv("KVLUA_GGUF_DUMP_DIR"); /* to cross-check the writer with other readers */
    if (dump && cs->frag == NULL) {
        char path[1024];
        snprintf(path, sizeof path, "%s/case%02d.gguf", dump, (int)c);
        gw_write_file(path, buf, len);
    }
    kv_gguf *g = (kv_gguf *)1;
    kv_error e = {{0}};
    kv_status s = parse_copy(buf, len, &g, &e);
    free(buf);
    if (cs->frag == NULL) {
        if (s != KV_OK) {
            report(false, cs->name, "expected ok, got %s: %s", kv_status_to_string(s), e.msg);
            return;
        }
        char why[KV_ERROR_MAX + 64] = "";
        bool ok = check_case(c, g, why, sizeof why);
        report(ok, cs->name, "content: %s", why);
        free((void *)g->base);
        kv_gguf_close(g);
        return;
    }
    if (s == KV_OK) {
        report(false, cs->name, "expected an error containing \"%s\", but it parsed", cs->frag);
        free((void *)g->base);
        kv_gguf_close(g);
        return;
    }
    if (g != NULL) {
        report(false, cs->name, "*out not NULL on failure");
        return;
    }
    if (getenv("KVLUA_GGUF_VERBOSE")) printf("     %s\n", e.msg);
    report(strstr(e.msg, cs->frag) != NULL, cs->name, "message \"%s\" lacks \"%s\"", e.msg, cs->frag);
}

/* ==== truncation =========================================================== */

/* Every proper prefix of a valid file must fail to parse, never crash. */
static void truncations(case_id c) {
    uint8_t *buf;
    size_t len;
    char name[128];
    snprintf(name, sizeof name, "every truncation of '%s'", k_cases[c].name);
    if (build(c, &buf, &len) != 0) {
        report(false, name, "could not build");
        return;
    }
    size_t bad = SIZE_MAX;
    for (size_t n = 0; n < len; n++) {
        kv_gguf *g;
        kv_error e;
        if (parse_copy(buf, n, &g, &e) == KV_OK) {
            free((void *)g->base);
            kv_gguf_close(g);
            if (bad == SIZE_MAX) bad = n;
        }
    }
    free(buf);
    snprintf(name + strlen(name), sizeof name - strlen(name), " (%zu lengths)", len);
    report(bad == SIZE_MAX, name, "a prefix of %zu bytes parsed", bad);
}

/* ==== typed getters ========================================================= */

/* frag NULL: s must be KV_OK; else an error whose message contains frag. */
static void expect_status(const char *label, kv_status s, const kv_error *e, const char *frag) {
    bool ok = s == KV_OK ? frag == NULL : (frag != NULL && strstr(e->msg, frag) != NULL);
    report(ok, label, "status %s, message \"%s\"", kv_status_to_string(s), s == KV_OK ? "" : e->msg);
}

static void getters(void) {
    gw *w = gw_new(3);
    gw_kv_str(w, "llama.block_count", "two");
    gw_kv_i32(w, "neg", -1);
    gw_kv_u64(w, "big", 1ull << 33);
    gw_kv_u64(w, "huge", 1ull << 63);
    gw_kv_u8(w, "small", 7);
    gw_kv_i64(w, "i64", 5);
    gw_kv_f64(w, "f64", 0.5);
    gw_kv_f32(w, "f32", 2.5f);
    gw_kv_u32(w, "u32", 9);
    gw_kv_bool(w, "flag", true);
    gw_kv_arr_str(w, "strs", k_tokens, N_TOKENS);
    int32_t i32[2] = {4, -4};
    gw_kv_arr(w, "ints", KV_GGUF_I32, i32, 2);
    uint8_t *buf;
    size_t len;
    kv_gguf *g = NULL;
    kv_error e;
    if (gw_finish(w, &buf, &len) != 0 || kv_gguf_parse(buf, len, &g, &e) != KV_OK) {
        report(false, "getters: build", "could not build/parse");
        gw_free(w);
        return;
    }
    gw_free(w);

    uint32_t u = 12345;
    int64_t i = 0;
    float f = 0;
    bool b = false;
    kv_gguf_str str;
    const kv_gguf_value *arr;
#define G(label, call, frag_) (e.msg[0] = 0, expect_status(label, (call), &e, frag_))
    G("u32 of a string", kv_gguf_get_u32(g, "llama.block_count", &u, true, &e),
      "key 'llama.block_count' has type string, expected an integer");
    G("u32 of a negative i32", kv_gguf_get_u32(g, "neg", &u, true, &e), "key 'neg' is -1, out of range for u32");
    G("u32 of u64 2^33", kv_gguf_get_u32(g, "big", &u, true, &e), "key 'big' is 8589934592, out of range for u32");
    G("u32 of u8 7", kv_gguf_get_u32(g, "small", &u, true, &e), NULL);
    report(u == 7, "u32 of u8 7: value", "got %u", u);
    G("u32 of i64 5", kv_gguf_get_u32(g, "i64", &u, true, &e), NULL);
    report(u == 5, "u32 of i64 5: value", "got %u", u);
    G("u32 of f32", kv_gguf_get_u32(g, "f32", &u, true, &e), "key 'f32' has type f32, expected an integer");
    G("u32 of array", kv_gguf_get_u32(g, "ints", &u, true, &e), "has type array of i32, expected an integer");
    G("i64 of u64 2^63", kv_gguf_get_i64(g, "huge", &i, true, &e), "out of range for i64");
    G("i64 of u8 7", kv_gguf_get_i64(g, "small", &i, true, &e), NULL);
    report(i == 7, "i64 of u8 7: value", "got %lld", (long long)i);
    G("i64 of i32 -1", kv_gguf_get_i64(g, "neg", &i, true, &e), NULL);
    report(i == -1, "i64 of i32 -1: value", "got %lld", (long long)i);
    G("f32 of f64", kv_gguf_get_f32(g, "f64", &f, true, &e), NULL);
    report(f == 0.5f, "f32 of f64: value", "got %g", f);
    G("f32 of f32", kv_gguf_get_f32(g, "f32", &f, true, &e), NULL);
    report(f == 2.5f, "f32 of f32: value", "got %g", f);
    G("f32 of u32", kv_gguf_get_f32(g, "u32", &f, true, &e), "key 'u32' has type u32, expected a float");
    G("bool of bool", kv_gguf_get_bool(g, "flag", &b, true, &e), NULL);
    report(b, "bool of bool: value", "false");
    G("bool of u8", kv_gguf_get_bool(g, "small", &b, true, &e), "key 'small' has type u8, expected bool");
    G("str of u32", kv_gguf_get_str(g, "u32", &str, true, &e), "key 'u32' has type u32, expected string");
    G("str of array", kv_gguf_get_str(g, "strs", &str, true, &e), "has type array of string, expected string");
    G("str of string", kv_gguf_get_str(g, "llama.block_count", &str, true, &e), NULL);
    report(kv_gguf_str_eq(str, "two"), "str of string: value", "wrong");
    G("arr of strings as i32", kv_gguf_get_arr(g, "strs", KV_GGUF_I32, &arr, true, &e),
      "key 'strs' has type array of string, expected array of i32");
    G("arr of a scalar", kv_gguf_get_arr(g, "u32", KV_GGUF_NTYPES, &arr, true, &e),
      "key 'u32' has type u32, expected an array");
    G("arr any", kv_gguf_get_arr(g, "ints", KV_GGUF_NTYPES, &arr, true, &e), NULL);
    report(kv_gguf_arr_int(arr, 1) == -4 && kv_gguf_arr_num(arr, 0) == 4.0, "arr any: values", "wrong");
    G("missing, required", kv_gguf_get_u32(g, "nope", &u, true, &e), "missing key 'nope'");
    u = 77;
    G("missing, optional", kv_gguf_get_u32(g, "nope", &u, false, &e), NULL);
    report(u == 77, "missing, optional: untouched", "got %u", u);
    report(strcmp(kv_gguf_vtype_name(KV_GGUF_STRING), "string") == 0 &&
               strcmp(kv_gguf_vtype_name((kv_gguf_vtype)99), "unknown") == 0,
           "vtype names", "wrong");
#undef G
    kv_gguf_close(g);
    free(buf);
}

/* ==== files ================================================================= */

static void open_files(void) {
    kv_gguf *g = (kv_gguf *)1;
    kv_error e;
    kv_status s = kv_gguf_open("tests/does-not-exist.gguf", &g, &e);
    report(s == KV_ERR_IO && g == NULL && strstr(e.msg, "does-not-exist"), "open a missing file", "%s", e.msg);

    s = kv_gguf_open("tests", &g, &e);
    report(s == KV_ERR_IO && g == NULL && strstr(e.msg, "not a regular file"), "open a directory", "%s", e.msg);

    /* a FIFO with no writer: refused at once (alarm: a blocking open kills the test) */
    char fifo[] = "/tmp/kvlua_test_fifo_XXXXXX";
    int ffd = mkstemp(fifo);
    if (ffd >= 0) {
        close(ffd);
        unlink(fifo);
    }
    if (ffd >= 0 && mkfifo(fifo, 0600) == 0) {
        alarm(20);
        s = kv_gguf_open(fifo, &g, &e);
        alarm(0);
        report(s == KV_ERR_IO && g == NULL && strstr(e.msg, "not a regular file"), "open a FIFO", "%s", e.msg);
        unlink(fifo);
    } else {
        report(false, "open a FIFO", "cannot make a FIFO");
    }

    char path[] = "/tmp/kvlua_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) {
        report(false, "open a temp file", "mkstemp failed");
        return;
    }
    close(fd);
    s = kv_gguf_open(path, &g, &e);
    report(s == KV_ERR_FORMAT && strstr(e.msg, "empty"), "open an empty file", "%s", e.msg);

    uint8_t *buf;
    size_t len;
    build(C_V3_VALID, &buf, &len);
    gw_write_file(path, buf, len);
    free(buf);
    s = kv_gguf_open(path, &g, &e);
    char why[KV_ERROR_MAX + 64] = "";
    report(s == KV_OK && check_basic(g, why, sizeof why), "open (mmap) a valid file", "%s %s",
           s ? e.msg : "", why);
    if (s == KV_OK) {
        report(kv_gguf_check_file(g, &e) == KV_OK, "the file is intact after open", "%s", e.msg);
        /* shorter on disk than the mapping: its last pages would fault */
        report(truncate(path, (off_t)len / 2) == 0 && kv_gguf_check_file(g, &e) == KV_ERR_IO &&
                   strstr(e.msg, "changed on disk"),
               "a file truncated after open is noticed", "%s", e.msg);
    }
    kv_gguf_close(g);

    build(C_OFFSET_NOT_ALIGNED, &buf, &len);
    gw_write_file(path, buf, len);
    free(buf);
    s = kv_gguf_open(path, &g, &e);
    report(s == KV_ERR_FORMAT && strstr(e.msg, path) && strstr(e.msg, "offset 8 not aligned to 32"),
           "open a bad file: message names the path", "%s", e.msg);
    unlink(path);
    kv_gguf_close(NULL);
}

static void real_model(void) {
    FILE *p = popen("scripts/fetch-models.sh smollm2 2>/dev/null", "r");
    char path[4096] = "";
    if (p) {
        if (!fgets(path, sizeof path, p)) path[0] = '\0';
        pclose(p);
    }
    path[strcspn(path, "\r\n")] = '\0';
    if (!path[0]) {
        printf("skip SmolLM2 (scripts/fetch-models.sh smollm2 gave no path)\n");
        return;
    }
    kv_gguf *g;
    kv_error e;
    if (kv_gguf_open(path, &g, &e) != KV_OK) {
        report(false, "SmolLM2", "%s", e.msg);
        return;
    }
    kv_gguf_str arch = {0};
    uint32_t n_layer = 0;
    const kv_gguf_value *tok = NULL;
    kv_status s1 = kv_gguf_get_str(g, "general.architecture", &arch, true, &e);
    kv_status s2 = kv_gguf_get_u32(g, "llama.block_count", &n_layer, true, &e);
    kv_status s3 = kv_gguf_get_arr(g, "tokenizer.ggml.tokens", KV_GGUF_STRING, &tok, true, &e);
    const kv_gguf_tensor *q = kv_gguf_tensor_find(g, "blk.0.attn_q.weight");
    report(g->n_tensors == 272 && !s1 && kv_gguf_str_eq(arch, "llama"), "SmolLM2: 272 tensors, arch llama",
           "n_tensors %llu, arch '%.*s'", (unsigned long long)g->n_tensors, (int)arch.len, arch.ptr);
    report(!s2 && n_layer == 30 && !s3 && tok->v.arr.n == 49152, "SmolLM2: 30 layers, 49152 tokens",
           "%u layers, %s", n_layer, e.msg);
    report(q && q->ne[0] == 576 && q->ne[1] == 576, "SmolLM2: blk.0.attn_q.weight 576x576", "missing or wrong");
    kv_gguf_close(g);
}

int main(void) {
    fill_data();
    for (int c = 0; c < C_COUNT; c++) run_case((case_id)c);
    truncations(C_EVERY_TYPE);
    truncations(C_NESTED_ARRAYS);
    truncations(C_TENSOR_TYPES);
    truncations(C_CUSTOM_ALIGNMENT);
    truncations(C_VOCAB_ONLY);
    getters();
    open_files();
    real_model();
    return kvt_finish();
}
