/* types.c — the table of ggml type ids and block layouts (see types.h). */
#include "types.h"

#define T(id, nm, bl, sz, ok) [id] = {nm, bl, sz, ok}

static const kv_type_traits k_traits[KV_TYPE_COUNT] = {
    T(KV_TYPE_F32, "F32", 1, 4, true),
    T(KV_TYPE_F16, "F16", 1, 2, true),
    T(KV_TYPE_Q4_0, "Q4_0", 32, 18, true),
    T(KV_TYPE_Q4_1, "Q4_1", 32, 20, true),
    T(KV_TYPE_Q5_0, "Q5_0", 32, 22, true),
    T(KV_TYPE_Q5_1, "Q5_1", 32, 24, true),
    T(KV_TYPE_Q8_0, "Q8_0", 32, 34, true),
    T(KV_TYPE_Q8_1, "Q8_1", 32, 36, false),
    T(KV_TYPE_Q2_K, "Q2_K", 256, 84, false),
    T(KV_TYPE_Q3_K, "Q3_K", 256, 110, false),
    T(KV_TYPE_Q4_K, "Q4_K", 256, 144, true),
    T(KV_TYPE_Q5_K, "Q5_K", 256, 176, true),
    T(KV_TYPE_Q6_K, "Q6_K", 256, 210, true),
    T(KV_TYPE_Q8_K, "Q8_K", 256, 292, false),
    T(KV_TYPE_IQ2_XXS, "IQ2_XXS", 256, 66, false),
    T(KV_TYPE_IQ2_XS, "IQ2_XS", 256, 74, false),
    T(KV_TYPE_IQ3_XXS, "IQ3_XXS", 256, 98, false),
    T(KV_TYPE_IQ1_S, "IQ1_S", 256, 50, false),
    T(KV_TYPE_IQ4_NL, "IQ4_NL", 32, 18, false),
    T(KV_TYPE_IQ3_S, "IQ3_S", 256, 110, false),
    T(KV_TYPE_IQ2_S, "IQ2_S", 256, 82, false),
    T(KV_TYPE_IQ4_XS, "IQ4_XS", 256, 136, false),
    T(KV_TYPE_I8, "I8", 1, 1, false),
    T(KV_TYPE_I16, "I16", 1, 2, false),
    T(KV_TYPE_I32, "I32", 1, 4, false),
    T(KV_TYPE_I64, "I64", 1, 8, false),
    T(KV_TYPE_F64, "F64", 1, 8, false),
    T(KV_TYPE_IQ1_M, "IQ1_M", 256, 56, false),
    T(KV_TYPE_BF16, "BF16", 1, 2, true),
    T(KV_TYPE_TQ1_0, "TQ1_0", 256, 54, false),
    T(KV_TYPE_TQ2_0, "TQ2_0", 256, 66, false),
    T(KV_TYPE_MXFP4, "MXFP4", 32, 17, false),
};

const kv_type_traits *kv_type_traits_get(int type) {
    if (type < 0 || type >= KV_TYPE_COUNT || k_traits[type].name == NULL) return NULL;
    return &k_traits[type];
}

size_t kv_row_size(int type, int64_t n) {
    const kv_type_traits *t = kv_type_traits_get(type);
    if (!t || n < 0 || n % t->blck != 0) return 0;
    return (size_t)(n / t->blck) * t->type_size;
}
