/*
 * kvcl_program.c — the kernel program of a context: the embedded .cl files
 * (cmake/embed-kernels.cmake) built for the device, and the cache of built
 * binaries on disk.
 *
 * Cache: one file per (device, driver, sources, build options), named by a
 * BLAKE2b hash (libsodium crypto_generichash) of all of them, in
 * $XDG_CACHE_HOME/kvlua/cl (default ~/.cache/kvlua/cl). File layout:
 *   "KVCLBIN1" (8) | key (32) | payload bytes n (u64, little endian) |
 *   hash of the payload (32) | payload (the driver's program binary)
 * A file that is short, has another key or a payload that does not hash
 * right, or that the driver refuses, is ignored: the program is built from
 * source and the file rewritten (to a temporary name, then renamed, so
 * concurrent writers never leave a torn file).
 */
#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvcl_internal.h"

#define KEY_BYTES 32
#define MAGIC "KVCLBIN1"
#define HEADER_BYTES (8 + KEY_BYTES + 8 + KEY_BYTES)

/* ==== identity of what is built ============================================= */

static void hash_str(crypto_generichash_state *h, const char *s) {
    /* with the length, so ("ab", "c") and ("a", "bc") differ */
    uint64_t n = strlen(s);
    crypto_generichash_update(h, (const unsigned char *)&n, sizeof n);
    crypto_generichash_update(h, (const unsigned char *)s, n);
}

static void hash_device_info(crypto_generichash_state *h, cl_device_id dev, cl_device_info what) {
    char buf[1024] = {0};
    clGetDeviceInfo(dev, what, sizeof buf - 1, buf, NULL);
    hash_str(h, buf);
}

/* platform, device, vendor, driver and OpenCL versions */
static void hash_device(crypto_generichash_state *h, cl_device_id dev) {
    cl_platform_id plat = NULL;
    char buf[1024] = {0};
    clGetDeviceInfo(dev, CL_DEVICE_PLATFORM, sizeof plat, &plat, NULL);
    clGetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof buf - 1, buf, NULL);
    hash_str(h, buf);
    memset(buf, 0, sizeof buf);
    clGetPlatformInfo(plat, CL_PLATFORM_VERSION, sizeof buf - 1, buf, NULL);
    hash_str(h, buf);
    hash_device_info(h, dev, CL_DEVICE_NAME);
    hash_device_info(h, dev, CL_DEVICE_VENDOR);
    hash_device_info(h, dev, CL_DRIVER_VERSION);
    hash_device_info(h, dev, CL_DEVICE_VERSION);
}

static void device_key(cl_device_id dev, unsigned char key[KEY_BYTES]) {
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KEY_BYTES);
    hash_str(&h, "kvcl device 1");
    hash_device(&h, dev);
    crypto_generichash_final(&h, key, KEY_BYTES);
}

static void program_key(cl_device_id dev, const char *options, const char *extra, unsigned char key[KEY_BYTES]) {
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KEY_BYTES);
    hash_str(&h, "kvcl program 1");
    hash_device(&h, dev);
    hash_str(&h, options);
    for (int i = 0; i < kvcl_kernel_count; i++) {
        hash_str(&h, kvcl_kernel_sources[i].name);
        hash_str(&h, kvcl_kernel_sources[i].text);
    }
    hash_str(&h, extra ? extra : "");
    crypto_generichash_final(&h, key, KEY_BYTES);
}

/* Whether the integer kernels may write vpdpbusd (KVCL_VNNI): the device
 * is a PoCL CPU device, which runs the kernels on this process's CPU, and
 * that CPU has AVX512-VNNI and AVX512-VL. PoCL may compile for an older
 * CPU name than the one it runs on (its LLVM does not know it), so the
 * kernels cannot tell by themselves. */
static bool host_vnni(const kvcl_ctx *c) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    cl_device_type type = 0;
    cl_platform_id plat = NULL;
    char pname[64] = {0};
    if (clGetDeviceInfo(c->dev, CL_DEVICE_TYPE, sizeof type, &type, NULL) != CL_SUCCESS ||
        clGetDeviceInfo(c->dev, CL_DEVICE_PLATFORM, sizeof plat, &plat, NULL) != CL_SUCCESS ||
        clGetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof pname - 1, pname, NULL) != CL_SUCCESS)
        return false;
    if (!(type & CL_DEVICE_TYPE_CPU) || strcmp(pname, "Portable Computing Language") != 0 ||
        strncmp(c->info.name, "remote", 6) == 0)
        return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
    (void)c;
    return false;
#endif
}

/* the build options; vnni: KVCL_VNNI where host_vnni allows it */
static void build_options(const kvcl_ctx *c, const kvcl_options *o, bool vnni, char *out, size_t cap) {
    cl_device_fp_config fp = 0;
    clGetDeviceInfo(c->dev, CL_DEVICE_SINGLE_FP_CONFIG, sizeof fp, &fp, NULL);
    /* correctly rounded x / y and sqrt: the Q8_0 scales and RMS factors
     * then match the CPU's bit for bit */
    snprintf(out, cap, "-cl-std=CL1.2%s%s%s%s",
             (fp & CL_FP_CORRECTLY_ROUNDED_DIVIDE_SQRT) ? " -cl-fp32-correctly-rounded-divide-sqrt" : "",
             o->portable ? " -DKVCL_PORTABLE" : "", o->no_fp64 ? " -DKVCL_NO_FP64" : "",
             vnni && !o->portable && !o->no_vnni && host_vnni(c) ? " -DKVCL_VNNI" : "");
}

/* ==== cache files ============================================================ */

static void hex(const unsigned char *k, char *out) {
    for (int i = 0; i < KEY_BYTES; i++) sprintf(out + 2 * i, "%02x", k[i]);
}

static void cache_file(const kvcl_ctx *c, const unsigned char key[KEY_BYTES], const char *suffix, char *out,
                       size_t cap) {
    char h[2 * KEY_BYTES + 1];
    hex(key, h);
    snprintf(out, cap, "%s/%s%s", c->cache_dir, h, suffix);
}

void kvcl_cache_path(const kvcl_ctx *c, const char *suffix, char *out, size_t cap) {
    cache_file(c, c->dev_key, suffix, out, cap);
}

/* o->cache_dir, or $XDG_CACHE_HOME/kvlua/cl, or $HOME/.cache/kvlua/cl, made
 * if missing; "" when there is none. */
static void cache_dir(kvcl_ctx *c, const kvcl_options *o) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char *d = c->cache_dir;
    const size_t cap = sizeof c->cache_dir;
    if (o->cache_dir)
        snprintf(d, cap, "%s", o->cache_dir);
    else if (xdg && *xdg)
        snprintf(d, cap, "%s/kvlua/cl", xdg);
    else if (home && *home)
        snprintf(d, cap, "%s/.cache/kvlua/cl", home);
    else
        d[0] = 0;
    /* mkdir -p */
    for (char *p = d + 1; *d && *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        mkdir(d, 0755);
        *p = '/';
    }
    if (*d && mkdir(d, 0755) != 0 && errno != EEXIST) d[0] = 0;
}

/* The cached binary for key, or NULL (missing, short, other key, bad hash). */
static unsigned char *cache_read(const char *path, const unsigned char key[KEY_BYTES], size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char head[HEADER_BYTES], sum[KEY_BYTES];
    unsigned char *bin = NULL;
    uint64_t n = 0;
    if (fread(head, 1, sizeof head, f) != sizeof head || memcmp(head, MAGIC, 8) != 0 ||
        memcmp(head + 8, key, KEY_BYTES) != 0)
        goto fail;
    for (int i = 0; i < 8; i++) n |= (uint64_t)head[8 + KEY_BYTES + i] << (8 * i);
    if (n == 0 || n > (uint64_t)1 << 31 || !(bin = malloc(n))) goto fail;
    if (fread(bin, 1, n, f) != n || fgetc(f) != EOF) goto fail;
    crypto_generichash(sum, KEY_BYTES, bin, n, NULL, 0);
    if (memcmp(sum, head + 8 + KEY_BYTES + 8, KEY_BYTES) != 0) goto fail;
    fclose(f);
    *len = n;
    return bin;
fail:
    free(bin);
    fclose(f);
    return NULL;
}

/* Best effort: a cache that cannot be written only costs the next build. */
static void cache_write(const char *path, const unsigned char key[KEY_BYTES], const unsigned char *bin, size_t n) {
    unsigned char head[HEADER_BYTES];
    memcpy(head, MAGIC, 8);
    memcpy(head + 8, key, KEY_BYTES);
    for (int i = 0; i < 8; i++) head[8 + KEY_BYTES + i] = (unsigned char)((uint64_t)n >> (8 * i));
    crypto_generichash(head + 8 + KEY_BYTES + 8, KEY_BYTES, bin, n, NULL, 0);
    char tmp[1300];
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return;
    bool ok = fwrite(head, 1, sizeof head, f) == sizeof head && fwrite(bin, 1, n, f) == n;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) remove(tmp);
}

/* ==== building ================================================================ */

/* The message carries the build log from its first error line: a log
 * can hold many warnings first (PoCL notes an ABI change for every float16
 * argument on a CPU without AVX-512: 44 KB), which a message of
 * KV_ERROR_MAX bytes would end before the error (and a buffer that size
 * could not take the log at all). */
static kv_status build_failed(kvcl_ctx *c, cl_int err, kv_error *e) {
    size_t n = 0;
    char *log = NULL;
    if (clGetProgramBuildInfo(c->prog, c->dev, CL_PROGRAM_BUILD_LOG, 0, NULL, &n) == CL_SUCCESS && n > 0 &&
        (log = calloc(1, n + 1)) != NULL &&
        clGetProgramBuildInfo(c->prog, c->dev, CL_PROGRAM_BUILD_LOG, n, log, NULL) != CL_SUCCESS)
        log[0] = '\0';
    const char *l = log ? log : "";
    const char *er = strstr(l, "error:");
    if (er) { /* the start of its line */
        while (er > l && er[-1] != '\n') er--;
        l = er;
    }
    while (*l == ' ' || *l == '\n') l++;
    kv_status st = kv_fail(e, KV_ERR_DEVICE, "OpenCL kernel build failed on %s (%s): %s", c->info.name,
                           kvcl_errstr(err), l);
    free(log);
    return st;
}

static kv_status build_from_source(kvcl_ctx *c, const char *options, const char *extra, kv_error *e) {
    const char *texts[64];
    size_t lens[64];
    int n = 0;
    for (int i = 0; i < kvcl_kernel_count && n < 63; i++, n++) {
        texts[n] = kvcl_kernel_sources[i].text;
        lens[n] = kvcl_kernel_sources[i].len;
    }
    if (extra) {
        texts[n] = extra;
        lens[n++] = strlen(extra);
    }
    cl_int err;
    c->prog = clCreateProgramWithSource(c->ctx, (cl_uint)n, texts, lens, &err);
    if (err != CL_SUCCESS) {
        c->prog = NULL;
        return kv_fail(e, kvcl_status_of(err), "OpenCL program: %s", kvcl_errstr(err));
    }
    err = clBuildProgram(c->prog, 1, &c->dev, options, NULL, NULL);
    return err == CL_SUCCESS ? KV_OK : build_failed(c, err, e);
}

static bool build_from_binary(kvcl_ctx *c, const char *options, const unsigned char *bin, size_t n) {
    cl_int err, status;
    c->prog = clCreateProgramWithBinary(c->ctx, 1, &c->dev, &n, &bin, &status, &err);
    if (err == CL_SUCCESS && status == CL_SUCCESS && clBuildProgram(c->prog, 1, &c->dev, options, NULL, NULL) == CL_SUCCESS)
        return true;
    if (c->prog) clReleaseProgram(c->prog);
    c->prog = NULL;
    return false;
}

static unsigned char *program_binary(kvcl_ctx *c, size_t *n) {
    size_t size = 0;
    if (clGetProgramInfo(c->prog, CL_PROGRAM_BINARY_SIZES, sizeof size, &size, NULL) != CL_SUCCESS || size == 0)
        return NULL;
    unsigned char *bin = malloc(size);
    if (bin && clGetProgramInfo(c->prog, CL_PROGRAM_BINARIES, sizeof bin, &bin, NULL) == CL_SUCCESS) {
        *n = size;
        return bin;
    }
    free(bin);
    return NULL;
}

/* the program built with these options: from the cache, else from source (then cached) */
static kv_status load_built(kvcl_ctx *c, const kvcl_options *o, const char *options, kv_error *e) {
    char path[1200];
    unsigned char key[KEY_BYTES];
    program_key(c->dev, options, o->extra_source, key);
    if (c->cache_dir[0]) {
        cache_file(c, key, ".bin", path, sizeof path);
        size_t n = 0;
        unsigned char *bin = cache_read(path, key, &n);
        c->from_cache = bin && build_from_binary(c, options, bin, n);
        free(bin);
        if (c->from_cache) return KV_OK;
    }
    kv_status st = build_from_source(c, options, o->extra_source, e);
    if (st != KV_OK || !c->cache_dir[0]) return st;
    size_t n = 0;
    unsigned char *bin = program_binary(c, &n);
    if (bin) cache_write(path, key, bin, n);
    free(bin);
    return KV_OK;
}

kv_status kvcl_program_load(kvcl_ctx *c, const kvcl_options *o, kv_error *e) {
    if (sodium_init() < 0) return kv_fail(e, KV_ERR_UNSUPPORTED, "libsodium failed to initialize");
    char options[256];
    build_options(c, o, true, options, sizeof options);
    c->vnni = strstr(options, "-DKVCL_VNNI") != NULL;
    device_key(c->dev, c->dev_key);
    cache_dir(c, o);
    kv_status st = load_built(c, o, options, e);
    if (st != KV_OK && c->vnni) { /* a compiler that does not take vpdpbusd: the kernels without it */
        if (c->prog) clReleaseProgram(c->prog);
        c->prog = NULL, c->vnni = false;
        build_options(c, o, false, options, sizeof options);
        st = load_built(c, o, options, e);
    }
    return st;
}
