/*
 * quant_vnni.c — the kernels of quant_avx2.c compiled a second time for
 * CPUs with AVX512-VNNI (+VL, BW): the u8 x s8 products go through
 * vpdpbusd and the K-quant scale products through vpdpwssd, still on
 * 256-bit vectors. kv_kernels_vnni() checks the CPU and returns 0 when it
 * lacks them; quant.c then installs the AVX2 set.
 */
#define KV_VNNI 1
#include "quant_avx2.c"
