/*
 * bench_pretok.c — pre-tokenizer throughput on ~1 MB of mixed text, per
 * family. Prints MB/s; asserts nothing (scripts/bench-pretok.sh builds it).
 *
 *   bench_pretok [file]   (default: built-in mix of prose, code, CJK,
 *                          Cyrillic, Arabic, emoji, digits, whitespace runs)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pretok.h"

static const char *pieces[] = {
    "The quick brown fox jumps over the lazy dog. It's 12:45 and we're late! ",
    "def main(argv):\n    for i in range(1000):\n        print(f\"{i:08d}\")  # loop\n\n",
    "中文字符测试，包含标点。日本語のテキストです。한국어 텍스트 ",
    "Привет, мир! Это тест 2024 года. مرحبا بالعالم ١٢٣ ",
    "😀 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🦙.cpp   \t\t  \n\n\n",
    "Ünïcödé àccents: café, naïve, Führer, Cửa Việt — “quotes” …\r\n",
    "x = [1, 2, 3]; y = {'a': 0x1F, \"b\": 3.14159e-10}; // done\n",
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    size_t len = 0, cap = 1 << 20;
    char *text = malloc(cap + 256);
    if (argc > 1) {
        FILE *f = fopen(argv[1], "rb");
        if (!f) {
            perror(argv[1]);
            return 1;
        }
        len = fread(text, 1, cap, f);
        fclose(f);
    } else {
        for (size_t i = 0; len < cap; i = (i * 7 + 3) % (sizeof pieces / sizeof pieces[0])) {
            size_t k = strlen(pieces[i]);
            memcpy(text + len, pieces[i], k);
            len += k;
        }
    }
    printf("input: %zu bytes\n", len);
    for (int kind = 0; kind < KV_PRETOK_COUNT; kind++) {
        double best = 1e9;
        size_t n = 0;
        for (int rep = 0; rep < 5; rep++) {
            kv_span *w;
            kv_error e;
            double t0 = now();
            if (kv_pretokenize(kind, text, len, &w, &n, &e) != KV_OK) {
                printf("%s: %s\n", kv_pretok_kind_name(kind), e.msg);
                return 1;
            }
            double dt = now() - t0;
            free(w);
            if (dt < best)
                best = dt;
        }
        printf("%-15s %8zu words  %7.2f ms  %7.1f MB/s\n", kv_pretok_kind_name(kind), n, best * 1e3,
               len / best / 1e6);
    }
    free(text);
    return 0;
}
