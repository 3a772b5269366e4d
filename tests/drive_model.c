/*
 * drive_model.c — a hand-built driver for the engine on a real GGUF (not a
 * ctest test: it needs a model file).
 *
 *   gcc -O2 -Iengine engine/[a-z]*.c tests/drive_model.c -o drive_model -lm -lpthread
 *
 *   drive_model check MODEL CASES [threads]
 *       CASES: text lines, per prompt: "prompt NAME", "ids N id...",
 *       "top N id...", "topl N logit...", "greedy N id...", "margin N m..."
 *       (the reference's top logits and greedy continuation, e.g. dumped
 *       from tests/fixtures/ref_logits_<model>.lua). Compares the top-10
 *       ids (order), their logits (|diff| <= 0.05) and the greedy tokens.
 *   drive_model bench MODEL [threads] [n_prompt 512] [n_gen 128]
 *       prefill n_prompt tokens, then n_gen decode steps at depth 16 and
 *       at depth 1792; prints tokens/s. BENCH_DEPTH=D: decode at depth D only.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvlua.h"

/* Wall clock, or process CPU time with BENCH_CPU=1 (steadier on a busy
 * machine with 1 thread; with more threads it counts spinning too). */
static double now(void) {
    static int cpu = -1;
    if (cpu < 0) cpu = getenv("BENCH_CPU") != NULL;
    struct timespec ts;
    clock_gettime(cpu ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* ==== check ====================================================================== */

typedef struct {
    char name[64];
    int n_ids, n_top, n_greedy;
    int32_t ids[4096], top[32], greedy[64];
    float topl[32], margin[64];
} fixture;

static int read_list(FILE *f, const char *tag, int cap, void *out, bool is_float) {
    char t[32];
    int n;
    if (fscanf(f, "%31s %d", t, &n) != 2 || strcmp(t, tag) != 0 || n < 0 || n > cap) return -1;
    for (int i = 0; i < n; i++) {
        if (is_float ? fscanf(f, "%f", (float *)out + i) != 1 : fscanf(f, "%d", (int32_t *)out + i) != 1)
            return -1;
    }
    return n;
}

static int check(const char *path, const char *cases, int threads) {
    kv_error e;
    kv_model *m;
    kv_model_params p = {.threads = threads};
    if (kv_model_open(path, &p, &m, &e)) {
        fprintf(stderr, "open: %s\n", e.msg);
        return 1;
    }
    const int V = kv_model_info_get(m)->n_vocab;
    FILE *f = fopen(cases, "r");
    if (!f) return 1;
    float *lg = malloc(sizeof(float) * V);
    static fixture fx;
    int n_ok = 0, n_bad = 0;
    double worst = 0, dsum = 0;
    int dn = 0;
    char tag[32];
    while (fscanf(f, "%31s %63s", tag, fx.name) == 2) {
        if ((fx.n_ids = read_list(f, "ids", 4096, fx.ids, false)) < 0 ||
            (fx.n_top = read_list(f, "top", 32, fx.top, false)) < 0 ||
            read_list(f, "topl", 32, fx.topl, true) < 0 ||
            (fx.n_greedy = read_list(f, "greedy", 64, fx.greedy, false)) < 0 ||
            read_list(f, "margin", 64, fx.margin, true) < 0) {
            fprintf(stderr, "bad cases file\n");
            return 1;
        }
        kv_session *s;
        if (kv_session_open(m, 2048, &s, &e)) {
            fprintf(stderr, "session: %s\n", e.msg);
            return 1;
        }
        if (kv_session_eval(s, fx.ids, fx.n_ids, KV_LOGITS_LAST, lg, &e)) {
            fprintf(stderr, "eval: %s\n", e.msg);
            return 1;
        }
        /* top-10 */
        int order_ok = 1;
        double maxd = 0;
        float *tmp = malloc(sizeof(float) * V);
        memcpy(tmp, lg, sizeof(float) * V);
        int mine[10];
        for (int k = 0; k < 10; k++) {
            mine[k] = argmax(tmp, V);
            tmp[mine[k]] = -INFINITY;
        }
        free(tmp);
        for (int k = 0; k < 10 && k < fx.n_top; k++) {
            if (mine[k] != fx.top[k]) order_ok = 0;
            double d = fabs(lg[fx.top[k]] - fx.topl[k]);
            if (d > maxd) maxd = d;
            dsum += d;
            dn++;
        }
        if (maxd > worst) worst = maxd;
        /* greedy */
        int first_bad = -1;
        for (int i = 0; i < fx.n_greedy; i++) {
            int32_t t = argmax(lg, V);
            if (t != fx.greedy[i]) {
                first_bad = i;
                break;
            }
            if (kv_session_eval(s, &t, 1, KV_LOGITS_LAST, lg, &e)) {
                fprintf(stderr, "eval: %s\n", e.msg);
                return 1;
            }
        }
        bool ok = order_ok && maxd <= 0.05 && first_bad < 0;
        ok ? n_ok++ : n_bad++;
        printf("%-4s %-20s n=%-4d top10 order %s, max |dlogit| %.4f, greedy %s", ok ? "ok" : "BAD", fx.name,
               fx.n_ids, order_ok ? "same" : "DIFF", maxd, first_bad < 0 ? "same" : "DIFF");
        if (first_bad >= 0) printf(" at %d (ref margin %.3f)", first_bad, fx.margin[first_bad]);
        printf("\n");
        kv_session_close(s);
    }
    printf("%d ok, %d differ; top-10 |dlogit| worst %.4f, mean %.4f\n", n_ok, n_bad, worst, dn ? dsum / dn : 0.0);
    fclose(f);
    free(lg);
    kv_model_close(m);
    return n_bad ? 1 : 0;
}

/* ==== bench ===================================================================== */

static int bench(const char *path, int threads, int n_prompt, int n_gen) {
    kv_error e;
    kv_model *m;
    kv_model_params p = {.threads = threads};
    if (kv_model_open(path, &p, &m, &e)) {
        fprintf(stderr, "open: %s\n", e.msg);
        return 1;
    }
    const int V = kv_model_info_get(m)->n_vocab;
    float *lg = malloc(sizeof(float) * V);
    int n_ids = 1792 + 16;
    int32_t *ids = malloc(sizeof(int32_t) * n_ids);
    for (int i = 0; i < n_ids; i++) ids[i] = 100 + (i * 7919) % (V - 200);
    kv_session *s;
    if (kv_session_open(m, 2048, &s, &e)) return 1;
    /* warm-up */
    kv_session_eval(s, ids, 32, KV_LOGITS_LAST, lg, &e);
    kv_session_rewind(s, 32);

    double t0 = now();
    kv_session_eval(s, ids, n_prompt, KV_LOGITS_LAST, lg, &e);
    double tp = now() - t0;
    kv_session_rewind(s, n_prompt);

    const char *only = getenv("BENCH_DEPTH"); /* one depth only, e.g. for profiling decode */
    int depths[2] = {only ? atoi(only) : 16, 1792};
    double dec[2] = {0, 0}, pre[2] = {0, 0};
    for (int d = 0; d < (only ? 1 : 2); d++) {
        kv_session_rewind(s, kv_session_pos(s));
        t0 = now();
        kv_session_eval(s, ids, depths[d], KV_LOGITS_LAST, lg, &e);
        pre[d] = depths[d] / (now() - t0);
        t0 = now();
        for (int i = 0; i < n_gen; i++) {
            int32_t t = argmax(lg, V);
            if (kv_session_eval(s, &t, 1, KV_LOGITS_LAST, lg, &e)) {
                fprintf(stderr, "decode: %s\n", e.msg);
                return 1;
            }
        }
        dec[d] = n_gen / (now() - t0);
    }
    printf("threads %d: prefill %d: %.1f tok/s; decode %d @%d: %.1f tok/s; @1792: %.1f tok/s (%.0f%% of @16); "
           "prefill 1792: %.1f tok/s\n",
           threads, n_prompt, n_prompt / tp, n_gen, depths[0], dec[0], dec[1], 100 * dec[1] / dec[0], pre[1]);
    kv_session_close(s);
    kv_model_close(m);
    free(lg);
    free(ids);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "check") == 0)
        return check(argv[2], argv[3], argc > 4 ? atoi(argv[4]) : 2);
    if (argc >= 3 && strcmp(argv[1], "bench") == 0)
        return bench(argv[2], argc > 3 ? atoi(argv[3]) : 2, argc > 4 ? atoi(argv[4]) : 512,
                     argc > 5 ? atoi(argv[5]) : 128);
    fprintf(stderr, "usage: drive_model check MODEL CASES [threads] | bench MODEL [threads] [n_prompt] [n_gen]\n");
    return 2;
}
