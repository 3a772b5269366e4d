/* quant_avx2.c — AVX2/FMA/F16C kernels (placeholder: scalar only for now). */
#include "quant_impl.h"

int kv_kernels_avx2(kv_kernels *k) {
    (void)k;
    return 0;
}
