/*
 * kvfile.c — session files: a session's tokens and K/V pages on disk,
 * restored bit for bit into a new session (same model file, same types).
 *
 * Layout:
 *   "KVLUAKV1"  u32 version (2)  u32 flags (1: encrypted)
 *   (version 2: quantized pages hold Hadamard-rotated rows, quant.h; a
 *   version 1 file restores only when its pages are f16/f32. These 16
 *   bytes are authenticated as they are on disk, version included: a
 *   changed version reads as an altered file, never as an older one)
 *   encrypted:  crypto_secretstream_xchacha20poly1305 header (24 bytes), then
 *               records [u32 n][n bytes of ciphertext]; the first is
 *               authenticated together with the 16 bytes above (additional
 *               data), the last carries TAG_FINAL; nothing may follow it.
 *   plain:      records [u32 n][n bytes], then [u32 0][BLAKE2b-256 of the 16
 *               bytes above and every record, lengths included]; nothing may
 *               follow it.
 * The records' payloads, concatenated, are the stream:
 *   u8[32] model fingerprint; u32 page_tokens, n_groups, n_layer,
 *   n_head_kv, head_dim, head_dim_v, n_ctx, n_tokens, n_pages;
 *   u32 window[n_groups]; u32 ktype[n_layer], vtype[n_layer];
 *   i32 tokens[n_tokens];
 *   n_pages x (u32 group, u32 logical page, the page's bytes: for each layer
 *   of the group and each KV head, pt K rows then pt V rows).
 * Records hold at most 1 MiB, so a large session is streamed straight from
 * and into its pages without a second copy. Everything little-endian.
 *
 * Cache files (kv_cache_save, kv_cache_restore) use the same container
 * under the magic "KVLUAKC1" (same version, flags, records and trailer), so
 * neither kind is ever read as the other. Their stream:
 *   u8[32] model fingerprint; u32 page_tokens, n_groups, n_layer,
 *   n_head_kv, head_dim, head_dim_v, n_nodes, n_pages;
 *   u32 window[n_groups]; u32 ktype[n_layer], vtype[n_layer];
 *   n_nodes x (u32 parent: 0 for a chain's first page, else 1 + the index
 *     of an earlier node; i32 ids[page_tokens]), parents first: node k
 *     stands for the prefix ids(root) .. ids(parent) ids(k), and its hash
 *     is recomputed on restore as h_k = BLAKE2b(h_parent || ids), from the
 *     target cache's h_0 for a root;
 *   n_pages x (u32 node, u32 group, the page's bytes as in a session file).
 * A node appears once however many prefixes reach it, a (node, group)
 * page at most once. The header's counts are checked against the file's
 * size before anything is allocated; pages go into free pages only and are
 * sealed once the whole stream has been verified (all or nothing).
 *
 * Writing goes to a temporary file beside the target (kvf_out: symbolic
 * links followed, nothing but a regular file replaced, one locked
 * temporary name per target), renamed over it only once complete; every
 * failure removes it. Reading opens regular files only (a FIFO is refused,
 * not waited on), checks every count against the model and the file
 * before it allocates, and any failure frees what the restore took: the
 * live cache and sessions do not change (except pages evicted to make
 * room, as any prefill may).
 */
#include "model_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quant.h"
#include "types.h"

#define KVF_MAGIC "KVLUAKV1" /* session files */
#define KVC_MAGIC "KVLUAKC1" /* cache files */
#define KVF_VERSION 2u /* 2: quantized pages hold Hadamard-rotated rows */
#define KVF_CHUNK ((size_t)1 << 20)
#define KVF_ABYTES crypto_secretstream_xchacha20poly1305_ABYTES

/* ==== record streams ========================================================= */

typedef struct {
    FILE *f;
    bool enc;
    crypto_secretstream_xchacha20poly1305_state ss;
    crypto_generichash_state hs; /* plain: over everything written */
    uint8_t pre[16];             /* magic, version, flags: the first record's additional data */
    bool first;
    uint8_t *buf, *cbuf;         /* (KVF_CHUNK) payload, (KVF_CHUNK + ABYTES) ciphertext */
    size_t n;                    /* bytes in buf */
    bool eof;                    /* reader: the final record was read */
    size_t pos;                  /* reader: next byte of buf */
    kv_error *e;
    kv_status st;
} kvf_stream;

static kv_status io_fail(kvf_stream *s, const char *what) {
    if (s->st == KV_OK) s->st = kv_fail(s->e, KV_ERR_IO, "kv file: %s: %s", what, errno ? strerror(errno) : "error");
    return s->st;
}

static kv_status fmt_fail(kvf_stream *s, const char *msg) {
    if (s->st == KV_OK) s->st = kv_fail(s->e, KV_ERR_FORMAT, "kv file: %s", msg);
    return s->st;
}

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Writes the buffered payload as one record (final: the last one). */
static kv_status w_flush(kvf_stream *s, bool final) {
    if (s->st) return s->st;
    uint8_t len[4];
    const uint8_t *out = s->buf;
    size_t n = s->n;
    if (s->enc) {
        unsigned long long cl = 0;
        crypto_secretstream_xchacha20poly1305_push(&s->ss, s->cbuf, &cl, s->buf, s->n, s->first ? s->pre : NULL,
                                                   s->first ? sizeof s->pre : 0,
                                                   final ? crypto_secretstream_xchacha20poly1305_TAG_FINAL : 0);
        out = s->cbuf, n = (size_t)cl;
    }
    put_u32(len, (uint32_t)n);
    if (fwrite(len, 4, 1, s->f) != 1 || (n && fwrite(out, 1, n, s->f) != n)) return io_fail(s, "write");
    if (!s->enc) {
        crypto_generichash_update(&s->hs, len, 4);
        crypto_generichash_update(&s->hs, out, n);
    }
    s->first = false;
    s->n = 0;
    return KV_OK;
}

static kv_status w_bytes(kvf_stream *s, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n && !s->st) {
        if (s->n == KVF_CHUNK && w_flush(s, false)) break;
        size_t k = KVF_CHUNK - s->n < n ? KVF_CHUNK - s->n : n;
        memcpy(s->buf + s->n, b, k);
        s->n += k, b += k, n -= k;
    }
    return s->st;
}

static kv_status w_u32(kvf_stream *s, uint32_t v) {
    uint8_t b[4];
    put_u32(b, v);
    return w_bytes(s, b, 4);
}

/* Plain files end with [u32 0] and the hash of everything before it. */
static kv_status r_checksum(kvf_stream *s) {
    uint8_t want[32], got[32];
    crypto_generichash_final(&s->hs, want, sizeof want);
    if (fread(got, 32, 1, s->f) != 1) return fmt_fail(s, "truncated (no checksum)");
    if (sodium_memcmp(want, got, 32) != 0) return fmt_fail(s, "checksum mismatch (altered, reordered or damaged)");
    s->eof = true;
    return KV_OK;
}

/* Reads the next record into buf. */
static kv_status r_fill(kvf_stream *s) {
    if (s->st) return s->st;
    if (s->eof) return fmt_fail(s, "truncated (the stream ends before what the header promises)");
    uint8_t len[4];
    if (fread(len, 4, 1, s->f) != 1) return fmt_fail(s, "truncated (no final record)");
    size_t n = get_u32(len);
    if (n > (s->enc ? KVF_CHUNK + KVF_ABYTES : KVF_CHUNK)) return fmt_fail(s, "record larger than allowed");
    if (!s->enc && n == 0) { /* the end came before the data did */
        if (r_checksum(s)) return s->st;
        return fmt_fail(s, "truncated (the stream ends before what the header promises)");
    }
    uint8_t *dst = s->enc ? s->cbuf : s->buf;
    if (n && fread(dst, 1, n, s->f) != n) return fmt_fail(s, "truncated record");
    if (s->enc) {
        unsigned long long ml = 0;
        unsigned char tag = 0;
        if (n < KVF_ABYTES ||
            crypto_secretstream_xchacha20poly1305_pull(&s->ss, s->buf, &ml, &tag, s->cbuf, n, s->first ? s->pre : NULL,
                                                       s->first ? sizeof s->pre : 0) != 0)
            return fmt_fail(s, "decryption failed (wrong key, or the file was altered)");
        s->n = (size_t)ml;
        if (tag == crypto_secretstream_xchacha20poly1305_TAG_FINAL) s->eof = true;
    } else {
        crypto_generichash_update(&s->hs, len, 4);
        crypto_generichash_update(&s->hs, dst, n);
        s->n = n;
    }
    s->first = false;
    s->pos = 0;
    return KV_OK;
}

static kv_status r_bytes(kvf_stream *s, void *p, size_t n) {
    uint8_t *b = p;
    while (n && !s->st) {
        if (s->pos == s->n && r_fill(s)) break;
        size_t k = s->n - s->pos < n ? s->n - s->pos : n;
        memcpy(b, s->buf + s->pos, k);
        s->pos += k, b += k, n -= k;
    }
    return s->st;
}

static uint32_t r_u32(kvf_stream *s) {
    uint8_t b[4] = {0};
    r_bytes(s, b, 4);
    return get_u32(b);
}

/* After the last page: the stream must end exactly here. */
static kv_status r_end(kvf_stream *s) {
    if (s->st) return s->st;
    if (s->pos != s->n) return fmt_fail(s, "more data than the header promises");
    if (!s->enc) {
        uint8_t len[4];
        if (fread(len, 4, 1, s->f) != 1) return fmt_fail(s, "truncated (no checksum)");
        if (get_u32(len) != 0) return fmt_fail(s, "more records than the header promises");
        if (r_checksum(s)) return s->st;
    } else if (!s->eof) {
        return fmt_fail(s, "more records than the header promises");
    }
    if (fgetc(s->f) != EOF) return fmt_fail(s, "data after the end of the stream");
    return KV_OK;
}

/* A plain file of an older version: its checksum is verified over the
 * whole file before anything in it is believed, so that a refusal by
 * version (r_types) concerns a file as it was written, and a version
 * changed on disk reads as an altered file. (An encrypted file needs no
 * second pass: the version is the first record's additional data, and the
 * types come after it.) The stream is left where it was. */
static kv_status r_older(kvf_stream *s, uint32_t version) {
    if (s->enc || version == KVF_VERSION) return KV_OK;
    const long start = ftell(s->f);
    if (start < 0) return io_fail(s, "tell");
    const crypto_generichash_state hs = s->hs; /* the 16 bytes only */
    for (;;) {
        uint8_t len[4];
        if (fread(len, 4, 1, s->f) != 1) return fmt_fail(s, "truncated (no checksum)");
        const size_t n = get_u32(len);
        if (n == 0) break;
        if (n > KVF_CHUNK) return fmt_fail(s, "record larger than allowed");
        if (fread(s->buf, 1, n, s->f) != n) return fmt_fail(s, "truncated record");
        crypto_generichash_update(&s->hs, len, 4);
        crypto_generichash_update(&s->hs, s->buf, n);
    }
    if (r_checksum(s)) return s->st;
    s->hs = hs, s->eof = false;
    if (fseek(s->f, start, SEEK_SET) != 0) return io_fail(s, "seek");
    return KV_OK;
}

/* version: the writer's KVF_VERSION, or the version a reader found in the
 * file: the 16 bytes are authenticated as they are on disk (the first
 * record's additional data, or the start of the checksum), so a changed
 * version reads as an altered file. */
static kv_status stream_init(kvf_stream *s, FILE *f, bool enc, const char *magic, uint32_t version, kv_error *e) {
    memset(s, 0, sizeof *s);
    s->f = f, s->enc = enc, s->e = e, s->first = true;
    s->buf = malloc(KVF_CHUNK);
    s->cbuf = enc ? malloc(KVF_CHUNK + KVF_ABYTES) : NULL;
    if (!s->buf || (enc && !s->cbuf)) { /* neither is kept: readers free the stream only when buf is set */
        free(s->buf);
        free(s->cbuf);
        s->buf = s->cbuf = NULL;
        return kv_fail(e, KV_ERR_NOMEM, "kv file: out of memory");
    }
    memcpy(s->pre, magic, 8);
    put_u32(s->pre + 8, version);
    put_u32(s->pre + 12, enc ? 1u : 0u);
    crypto_generichash_init(&s->hs, NULL, 0, 32);
    crypto_generichash_update(&s->hs, s->pre, sizeof s->pre);
    return KV_OK;
}

static void stream_free(kvf_stream *s) {
    if (s->buf) sodium_memzero(s->buf, KVF_CHUNK);
    free(s->buf);
    free(s->cbuf);
    sodium_memzero(&s->ss, sizeof s->ss);
}

/* ==== save ==================================================================== */

/* The file a save writes (kvf_out): the target and its temporary file.
 *
 * The target is path, or the end of path's chain of symbolic links
 * (a relative link read from the link's folder), so that a save through a
 * link replaces the file it points to and the link stays a link; a
 * dangling link gets its target created, as a shell's ">" would. What
 * exists there must be a regular file: a directory, a FIFO, a device or a
 * socket is refused before anything is written.
 *
 * The temporary file is ".NAME.kvlua-tmp" beside the target (a hash of
 * NAME when that name would be too long), the same name for every save to
 * one target: a save killed midway leaves it behind, and the next save
 * takes it over. A live save holds an exclusive flock on it from open to
 * rename, so a second save to the same target meanwhile is refused rather
 * than writing into the first's file; a stale file holds no lock (the
 * kernel drops a dead process's locks). */
typedef struct {
    char *target, *tmp;
    int fd;   /* the temporary file, locked; -1: none */
    FILE *f;  /* on fd */
} kvf_out;

#define KVF_MAX_LINKS 40 /* as the kernel's limit on a path's links */

static const char *file_kind(mode_t mode) {
    return S_ISDIR(mode) ? "a directory" : S_ISFIFO(mode) ? "a FIFO" : S_ISCHR(mode) ? "a character device"
         : S_ISBLK(mode) ? "a block device" : S_ISSOCK(mode) ? "a socket" : "a file of an unknown kind";
}

/* *out: path with its symbolic links followed (malloc'd), a regular file
 * or nothing yet. */
static kv_status save_target(const char *path, char **out, kv_error *e) {
    *out = NULL;
    char *p = strdup(path);
    if (!p) return kv_fail(e, KV_ERR_NOMEM, "save: out of memory");
    for (int hops = 0;; hops++) {
        struct stat st;
        if (lstat(p, &st) != 0) {
            if (errno == ENOENT) break; /* a new file (or no such folder: the temporary file says so) */
            kv_status r = kv_fail(e, KV_ERR_IO, "save: %s: %s", p, strerror(errno));
            free(p);
            return r;
        }
        if (S_ISREG(st.st_mode)) break;
        if (!S_ISLNK(st.st_mode)) {
            kv_status r = kv_fail(e, KV_ERR_IO, "save: %s is %s, not a regular file: nothing written", p,
                                  file_kind(st.st_mode));
            free(p);
            return r;
        }
        if (hops == KVF_MAX_LINKS) {
            free(p);
            return kv_fail(e, KV_ERR_IO, "save: %s: too many levels of symbolic links", path);
        }
        /* the link's text (st_size is its length, unless it changes meanwhile) */
        char *t = NULL;
        ssize_t n;
        for (size_t cap = (size_t)(st.st_size > 0 ? st.st_size : 63) + 1;; cap *= 2) {
            char *nt = realloc(t, cap);
            if (!nt) {
                free(t), free(p);
                return kv_fail(e, KV_ERR_NOMEM, "save: out of memory");
            }
            t = nt;
            if ((n = readlink(p, t, cap)) < 0) {
                kv_status r = kv_fail(e, KV_ERR_IO, "save: %s: %s", p, strerror(errno));
                free(t), free(p);
                return r;
            }
            if ((size_t)n < cap) break;
        }
        t[n] = '\0';
        char *np;
        const char *slash = strrchr(p, '/');
        if (t[0] == '/' || !slash) {
            np = t, t = NULL;
        } else { /* relative to the link's folder */
            const size_t dl = (size_t)(slash - p) + 1;
            np = malloc(dl + strlen(t) + 1);
            if (np) memcpy(np, p, dl), strcpy(np + dl, t);
        }
        free(t), free(p);
        if (!(p = np)) return kv_fail(e, KV_ERR_NOMEM, "save: out of memory");
    }
    *out = p;
    return KV_OK;
}

/* o->tmp: ".NAME.kvlua-tmp" beside o->target. */
static kv_status tmp_name(kvf_out *o, kv_error *e) {
    const char *slash = strrchr(o->target, '/');
    const char *name = slash ? slash + 1 : o->target;
    const size_t dl = (size_t)(name - o->target), nl = strlen(name);
    char hex[33];
    if (1 + nl + strlen(".kvlua-tmp") > 255) { /* past NAME_MAX: a hash of the name stands for it */
        uint8_t h[16];
        crypto_generichash(h, sizeof h, (const uint8_t *)name, nl, NULL, 0);
        sodium_bin2hex(hex, sizeof hex, h, sizeof h);
        name = hex;
    }
    const size_t n = dl + 1 + strlen(name) + sizeof ".kvlua-tmp";
    if (!(o->tmp = malloc(n))) return kv_fail(e, KV_ERR_NOMEM, "save: out of memory");
    snprintf(o->tmp, n, "%.*s.%s.kvlua-tmp", (int)dl, o->target, name);
    return KV_OK;
}

/* o->fd: the temporary file, opened (created, or a stale one taken over
 * and emptied) and locked. */
static kv_status tmp_open(kvf_out *o, const char *path, kv_error *e) {
    for (int tries = 0; tries < 100; tries++) {
        /* O_NOFOLLOW: never written through a link planted under that name;
         * O_NONBLOCK: a FIFO under that name is refused below, not waited
         * for (no effect on a regular file) */
        int fd = open(o->tmp, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
        if (fd < 0) return kv_fail(e, KV_ERR_IO, "save: cannot create %s: %s", o->tmp, strerror(errno));
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const int err = errno;
            close(fd);
            if (err == EWOULDBLOCK)
                return kv_fail(e, KV_ERR_IO, "save: another save to %s is under way (%s is locked)", path, o->tmp);
            return kv_fail(e, KV_ERR_IO, "save: cannot lock %s: %s", o->tmp, strerror(err));
        }
        /* the save that held the lock before may have renamed or removed
         * the file meanwhile: then the lock is on its file, not this name's */
        struct stat a, b;
        if (fstat(fd, &a) != 0) {
            const int err = errno;
            close(fd);
            return kv_fail(e, KV_ERR_IO, "save: %s: %s", o->tmp, strerror(err));
        }
        if (lstat(o->tmp, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
            close(fd);
            continue;
        }
        if (!S_ISREG(a.st_mode)) {
            close(fd);
            return kv_fail(e, KV_ERR_IO, "save: %s is %s, not a regular file", o->tmp, file_kind(a.st_mode));
        }
        if (ftruncate(fd, 0) != 0) { /* a stale one */
            const int err = errno;
            close(fd);
            return kv_fail(e, KV_ERR_IO, "save: %s: %s", o->tmp, strerror(err));
        }
        o->fd = fd;
        return KV_OK;
    }
    return kv_fail(e, KV_ERR_IO, "save: %s keeps being replaced by other saves", o->tmp);
}

/* The target and its temporary file (o), with the stream's first bytes
 * written: magic, version, flags and, with a key, the secretstream header.
 * On failure what was made is for save_close to remove. */
static kv_status save_open(kvf_stream *w, const char *path, const char *magic, const uint8_t *key, kvf_out *o,
                           kv_error *e) {
    *o = (kvf_out){.fd = -1};
    kv_status st;
    if ((st = save_target(path, &o->target, e)) || (st = tmp_name(o, e)) || (st = tmp_open(o, path, e))) return st;
    /* a descriptor of its own for the FILE: fclose leaves o->fd, and the lock, until the rename */
    const int fd2 = fcntl(o->fd, F_DUPFD_CLOEXEC, 0);
    if (fd2 < 0 || !(o->f = fdopen(fd2, "wb"))) {
        const int err = errno;
        if (fd2 >= 0) close(fd2);
        return kv_fail(e, KV_ERR_IO, "save: %s: %s", o->tmp, strerror(err));
    }
    if ((st = stream_init(w, o->f, key != NULL, magic, KVF_VERSION, e))) {
        stream_free(w);
        return st;
    }
    errno = 0;
    if (fwrite(w->pre, sizeof w->pre, 1, o->f) != 1) io_fail(w, "write");
    if (key && !w->st) {
        uint8_t hdr[crypto_secretstream_xchacha20poly1305_HEADERBYTES];
        crypto_secretstream_xchacha20poly1305_init_push(&w->ss, hdr, key);
        if (fwrite(hdr, sizeof hdr, 1, o->f) != 1) io_fail(w, "write");
    }
    return KV_OK;
}

/* The header both kinds of file start with: the model fingerprint, nh
 * counts, the groups' attention windows and the layers' K then V types. */
static void w_head(kvf_stream *w, const uint8_t fp[32], const uint32_t *hv, int nh, const kv_cache *c) {
    w_bytes(w, fp, 32);
    for (int i = 0; i < nh; i++) w_u32(w, hv[i]);
    for (int g = 0; g < c->n_groups; g++) w_u32(w, (uint32_t)c->groups[g].window);
    for (int il = 0; il < 2 * c->n_layer; il++) w_u32(w, (uint32_t)c->ktypes[il]); /* K types, then V types */
}

/* The K and V rows of page id (group g), from the device first when the
 * backend keeps pages there. */
static void w_page(kvf_stream *w, kv_backend *be, kv_cache *c, int g, int32_t id, kv_error *e) {
    if (be->page_sync && (w->st = be->page_sync(be, c, g, id, false, e))) return;
    for (int li = 0; li < c->groups[g].n_layers; li++)
        for (int h = 0; h < c->n_kv; h++) {
            const int il = c->groups[g].layer_ids[li];
            w_bytes(w, kv_pool_row(c, g, id, li, h, 0, false), (size_t)c->pt * c->krows[il]);
            w_bytes(w, kv_pool_row(c, g, id, li, h, 0, true), (size_t)c->pt * c->vrows[il]);
        }
}

/* The end of a written stream: the last record (TAG_FINAL when encrypted),
 * the checksum record when plain, everything on disk. Frees the stream. */
static kv_status save_finish(kvf_stream *w, FILE *f, const uint8_t *key) {
    if (key || w->n) w_flush(w, true); /* plain: no empty record (it would read as the end) */
    if (!key && !w->st) { /* the checksum record */
        uint8_t end[4] = {0}, h[32];
        crypto_generichash_final(&w->hs, h, sizeof h);
        if (fwrite(end, 4, 1, f) != 1 || fwrite(h, 32, 1, f) != 1) io_fail(w, "write");
    }
    if (!w->st && (fflush(f) != 0 || fsync(fileno(f)) != 0)) io_fail(w, "write");
    kv_status st = w->st;
    stream_free(w);
    return st;
}

/* Closes the temporary file and renames it over the target when
 * everything went well, else removes it; the lock is let go last. Frees
 * what o holds. */
static kv_status save_close(kvf_out *o, kv_status st, kv_error *e) {
    if (o->f && fclose(o->f) != 0 && st == KV_OK)
        st = kv_fail(e, KV_ERR_IO, "save: %s: %s", o->tmp, strerror(errno));
    if (st == KV_OK && rename(o->tmp, o->target) != 0)
        st = kv_fail(e, KV_ERR_IO, "save: cannot rename %s to %s: %s", o->tmp, o->target, strerror(errno));
    if (st != KV_OK && o->fd >= 0) unlink(o->tmp); /* ours: locked */
    if (o->fd >= 0) close(o->fd);
    free(o->target);
    free(o->tmp);
    *o = (kvf_out){.fd = -1};
    return st;
}

kv_status kv_session_save(kv_session *s, const char *path, const uint8_t *key, kv_error *e) {
    if (!s || !path) return kv_fail(e, KV_ERR_ARG, "save: session or path is NULL");
    if (sodium_init() < 0) return kv_fail(e, KV_ERR_IO, "save: libsodium failed to initialize");
    const kv_cache *c = s->kv->pool;
    uint8_t fp[32];
    kv_status st = kv_model_fingerprint(s->m, fp, NULL, e);
    if (st) return st;
    kvf_out o;
    kvf_stream w;
    if ((st = save_open(&w, path, KVF_MAGIC, key, &o, e)) == KV_OK) {
        /* header */
        uint32_t n_pages = 0;
        for (int g = 0; g < c->n_groups; g++)
            for (int lp = 0; lp < s->kv->n_lp; lp++) n_pages += s->kv->tab[g][lp] >= 0;
        const kv_model_info *in = &s->m->info;
        const uint32_t hv[9] = {(uint32_t)c->pt, (uint32_t)c->n_groups, (uint32_t)in->n_layer,
                                (uint32_t)in->n_head_kv, (uint32_t)in->head_dim, (uint32_t)in->head_dim_v,
                                (uint32_t)s->n_ctx, (uint32_t)s->pos, n_pages};
        w_head(&w, fp, hv, 9, c);
        for (int i = 0; i < s->pos; i++) w_u32(&w, (uint32_t)s->tokens[i]);
        /* pages, straight from the pool */
        for (int g = 0; g < c->n_groups && !w.st; g++)
            for (int lp = 0; lp < s->kv->n_lp && !w.st; lp++) {
                int32_t id = s->kv->tab[g][lp];
                if (id < 0) continue;
                w_u32(&w, (uint32_t)g);
                w_u32(&w, (uint32_t)lp);
                w_page(&w, &s->m->be, (kv_cache *)c, g, id, e);
            }
        st = save_finish(&w, o.f, key);
    }
    st = save_close(&o, st, e);
    return st;
}

/* ==== restore =================================================================== */

/* The K and V rows of page id (group g) from the stream, then to the
 * device when the backend keeps pages there. */
static void r_page(kvf_stream *r, kv_backend *be, kv_cache *c, int g, int32_t id, kv_error *e) {
    for (int li = 0; li < c->groups[g].n_layers && !r->st; li++)
        for (int h = 0; h < c->n_kv && !r->st; h++) {
            const int il = c->groups[g].layer_ids[li];
            r_bytes(r, kv_pool_row(c, g, id, li, h, 0, false), (size_t)c->pt * c->krows[il]);
            r_bytes(r, kv_pool_row(c, g, id, li, h, 0, true), (size_t)c->pt * c->vrows[il]);
        }
    if (!r->st && be->page_sync) r->st = be->page_sync(be, c, g, id, true, e);
}

/* The 16 bytes after the magic: version and flags, checked against the
 * key (session and cache files alike). */
static kv_status read_pre(const uint8_t pre[16], const uint8_t *key, uint32_t *version, bool *enc, kv_error *e) {
    uint32_t flags = get_u32(pre + 12);
    *version = get_u32(pre + 8);
    if (*version > KVF_VERSION)
        return kv_fail(e, KV_ERR_UNSUPPORTED, "kv file: format version %u is newer than this kvlua reads (%u)",
                       *version, KVF_VERSION);
    if (*version == 0 || flags > 1) return kv_fail(e, KV_ERR_FORMAT, "kv file: bad version or flags");
    *enc = flags & 1;
    if (*enc && !key) return kv_fail(e, KV_ERR_ARG, "kv file: the file is encrypted: a key is needed");
    if (!*enc && key) return kv_fail(e, KV_ERR_FORMAT, "kv file: the file is not encrypted, but a key was given");
    return KV_OK;
}

/* The stream's pull header (encrypted files), the model fingerprint
 * (checked against m) and nh header words. */
static kv_status read_head(kvf_stream *r, FILE *f, bool enc, const uint8_t *key, kv_model *m, uint32_t *hv, int nh,
                           kv_error *e) {
    if (enc) {
        uint8_t hdr[crypto_secretstream_xchacha20poly1305_HEADERBYTES];
        if (fread(hdr, sizeof hdr, 1, f) != 1 || crypto_secretstream_xchacha20poly1305_init_pull(&r->ss, hdr, key) != 0)
            return kv_fail(e, KV_ERR_FORMAT, "kv file: truncated or bad stream header");
    }
    uint8_t fp[32], mine[32];
    r_bytes(r, fp, 32);
    for (int i = 0; i < nh; i++) hv[i] = r_u32(r);
    if (r->st) return r->st;
    kv_status st = kv_model_fingerprint(m, mine, NULL, e);
    if (st) return st;
    if (sodium_memcmp(fp, mine, 32) != 0)
        return kv_fail(e, KV_ERR_ARG, "model fingerprint mismatch (the file was saved with another model file)");
    return KV_OK;
}

/* The layers' K then V types (*types, n_layer * 2, the caller frees it);
 * version 1 stored quantized pages unrotated (quant.h): refused by its
 * version, once the file is known to be as written (r_older, or the
 * authenticated first record). */
static kv_status r_types(kvf_stream *r, uint32_t version, int n_layer, int **types, kv_error *e) {
    if (!(*types = malloc(2 * (size_t)n_layer * sizeof(int)))) return kv_fail(e, KV_ERR_NOMEM, "restore: out of memory");
    for (int i = 0; i < 2 * n_layer; i++) (*types)[i] = (int)r_u32(r);
    for (int i = 0; i < 2 * n_layer && version < 2 && !r->st; i++)
        if (kv_type_rotated((*types)[i]))
            r->st = kv_fail(e, KV_ERR_UNSUPPORTED,
                            "%s file version 1: this kvlua reads version 2, and version 1 only with f16/f32 pages "
                            "(its quantized pages lack the rotation this kvlua applies): prefill and save it again",
                            memcmp(r->pre, KVC_MAGIC, 8) == 0 ? "cache" : "session");
    return r->st;
}

kv_status kv_session_restore_fp(kv_model *m, FILE *f, const uint8_t *key, kv_cache *cache, int min_ctx,
                                kv_session **out, kv_error *e) {
    *out = NULL;
    if (sodium_init() < 0) return kv_fail(e, KV_ERR_IO, "restore: libsodium failed to initialize");
    if (!m->info.has_weights) return kv_fail(e, KV_ERR_ARG, "restore: the model has no weights");
    uint8_t pre[16];
    const bool got = fread(pre, 16, 1, f) == 1;
    if (got && memcmp(pre, KVC_MAGIC, 8) == 0)
        return kv_fail(e, KV_ERR_FORMAT, "kv file: a cache file, not a session file (restore it into a cache)");
    if (!got || memcmp(pre, KVF_MAGIC, 8) != 0)
        return kv_fail(e, KV_ERR_FORMAT, "kv file: not a kvlua session file (bad magic)");
    uint32_t version;
    bool enc;
    kv_status st = read_pre(pre, key, &version, &enc, e);
    if (st) return st;
    kvf_stream r;
    st = stream_init(&r, f, enc, KVF_MAGIC, version, e);
    kv_session *s = NULL;
    kv_cache *pool = NULL;
    int *types = NULL;
    if (st) goto done;
    uint32_t hv[9];
    if ((st = r_older(&r, version)) || (st = read_head(&r, f, enc, key, m, hv, 9, e))) goto done;
    const kv_model_info *in = &m->info;
    const int pt = (int)hv[0], n_groups = (int)hv[1];
    const uint32_t n_ctx = hv[6], n_tokens = hv[7], n_pages = hv[8];
    if (hv[2] != (uint32_t)in->n_layer || hv[3] != (uint32_t)in->n_head_kv || hv[4] != (uint32_t)in->head_dim ||
        hv[5] != (uint32_t)in->head_dim_v || n_ctx == 0 || n_ctx > (1u << 24) || n_tokens > n_ctx ||
        n_groups < 1 || n_groups > KV_MAX_GROUPS || pt <= 0 || pt > 65536 || (pt & (pt - 1))) {
        st = fmt_fail(&r, "header does not describe a session of this model");
        goto done;
    }
    uint32_t windows[KV_MAX_GROUPS];
    for (int g = 0; g < n_groups; g++) windows[g] = r_u32(&r);
    if ((st = r_types(&r, version, in->n_layer, &types, e))) goto done;
    int ctx = (int)n_ctx > min_ctx ? (int)n_ctx : min_ctx;
    if (cache) {
        if (cache->m != m) {
            st = kv_fail(e, KV_ERR_ARG, "restore: the cache belongs to another model");
            goto done;
        }
        if (memcmp(cache->ktypes, types, 2 * (size_t)in->n_layer * sizeof(int)) != 0 || cache->pt != pt) {
            st = kv_fail(e, KV_ERR_ARG, "restore: the file's K/V types or page size differ from the cache's");
            goto done;
        }
        pool = cache;
        kv_cache_retain(pool);
    } else {
        kv_cache_params cp = {.page_tokens = pt, .ktypes = types, .vtypes = types + in->n_layer, .prefix = true};
        if ((st = kv_pool_open(m, &cp, ctx, &pool, e))) goto done;
    }
    if (pool->n_groups != n_groups) {
        st = fmt_fail(&r, "layer groups differ from the model's");
        goto done;
    }
    for (int g = 0; g < n_groups; g++)
        if (windows[g] != (uint32_t)pool->groups[g].window) {
            st = fmt_fail(&r, "attention windows differ from the model's");
            goto done;
        }
    if ((st = kv_session_alloc(m, ctx, pool, &s, e))) goto done;
    for (uint32_t i = 0; i < n_tokens && !r.st; i++) {
        uint32_t id = r_u32(&r);
        if (id >= (uint32_t)in->n_vocab) fmt_fail(&r, "token id out of range");
        s->tokens[i] = (int32_t)id;
    }
    if (n_pages > (uint32_t)n_groups * (uint32_t)s->kv->n_lp) fmt_fail(&r, "more pages than the session can hold");
    for (uint32_t k = 0; k < n_pages && !r.st; k++) {
        uint32_t g = r_u32(&r), lp = r_u32(&r);
        if (r.st) break;
        if (g >= (uint32_t)n_groups || lp >= (uint32_t)s->kv->n_lp || (uint64_t)lp * pt >= n_tokens ||
            s->kv->tab[g][lp] >= 0) {
            fmt_fail(&r, "a page out of place (group, index, or twice)");
            break;
        }
        int32_t id;
        if ((st = kv_pool_take(pool, (int)g, 1, &id, e))) {
            r.st = st;
            break;
        }
        s->kv->tab[g][lp] = id;
        pool->groups[g].pages[id].lp = (int32_t)lp;
        r_page(&r, &m->be, pool, (int)g, id, e);
    }
    if ((st = r.st) || (st = r_end(&r))) goto done;
    s->pos = (int)n_tokens;
    kv_session_after_restore(s);
    *out = s;
    s = NULL;
done:
    if (r.buf) stream_free(&r);
    free(types);
    kv_session_close(s); /* releases every page it took */
    if (pool) kv_cache_close(pool);
    return st;
}

/* path opened for reading when it is a regular file, else NULL and *err
 * (an errno value, or 0 with *mode: not a regular file). O_NONBLOCK: a FIFO
 * is refused at once, not waited on for a writer (as kv_gguf_open does). */
static FILE *open_regular(const char *path, int *err, mode_t *mode) {
    *err = 0, *mode = 0;
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        *err = errno;
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        *err = errno;
        close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        *mode = st.st_mode;
        close(fd);
        return NULL;
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        *err = errno;
        close(fd);
    }
    return f;
}

/* open_regular, or the message a restore returns. */
static kv_status restore_open(const char *path, FILE **f, kv_error *e) {
    int err;
    mode_t mode;
    if ((*f = open_regular(path, &err, &mode))) return KV_OK;
    if (err) return kv_fail(e, KV_ERR_IO, "restore: %s: %s", path, strerror(err));
    return kv_fail(e, KV_ERR_IO, "restore: %s is %s, not a regular file", path, file_kind(mode));
}

kv_status kv_session_restore(kv_model *m, const char *path, const uint8_t *key, kv_cache *cache, int min_ctx,
                             kv_session **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "restore: out is NULL");
    *out = NULL;
    if (!m || !path) return kv_fail(e, KV_ERR_ARG, "restore: model or path is NULL");
    FILE *f;
    kv_status st = restore_open(path, &f, e);
    if (st) return st;
    st = kv_session_restore_fp(m, f, key, cache, min_ctx, out, e);
    fclose(f);
    return st;
}

/* ==== cache files ================================================================ */

/* A stream of a cache file: as a session file's, under the cache magic. */
/* Consumes n bytes of the stream (a page the cache already holds). */
static kv_status r_skip(kvf_stream *s, size_t n) {
    while (n && !s->st) {
        if (s->pos == s->n && r_fill(s)) break;
        size_t k = s->n - s->pos < n ? s->n - s->pos : n;
        s->pos += k, n -= k;
    }
    return s->st;
}

/* The cache's token nodes to write: want[n] 2 (its pages go in the file),
 * 1 (only its ids: an ancestor), 0; order: the nodes to write, parents
 * first. */
static kv_status cache_pick(kv_cache *c, const int32_t *const *prefixes, const size_t *lens, size_t n_prefixes,
                            uint8_t **want_out, int32_t **order_out, int32_t *n_out, kv_error *e) {
    const int32_t N = c->n_tnodes;
    uint8_t *want = calloc((size_t)(N ? N : 1), 1);
    int32_t *order = malloc((size_t)(N ? N : 1) * sizeof *order);
    if (!want || !order) {
        free(want);
        free(order);
        return kv_fail(e, KV_ERR_NOMEM, "save: out of memory");
    }
    if (!prefixes) {
        for (int g = 0; g < c->n_groups; g++)
            for (int32_t id = 0; id < c->groups[g].n_pages; id++) {
                const kv_page *p = &c->groups[g].pages[id];
                if (p->state == KV_PAGE_SEALED && p->tnode >= 0) want[p->tnode] = 2;
            }
    } else {
        for (size_t i = 0; i < n_prefixes; i++) {
            kv_hash h = c->h0;
            for (size_t j = 0; j + (size_t)c->pt <= lens[i]; j += (size_t)c->pt) {
                kv_chain_hash(&h, prefixes[i] + j, c->pt, &h);
                int32_t n = kv_pool_tnode_find(c, &h);
                if (n < 0) break; /* no sealed page of this prefix from here on */
                want[n] = 2;
            }
        }
    }
    for (int32_t n = 0; n < N; n++)
        if (want[n] == 2)
            for (int32_t p = c->tnodes[n].parent; p >= 0 && !want[p]; p = c->tnodes[p].parent) want[p] = 1;
    /* by depth (a counting sort): parents before children */
    int32_t k = 0, max_depth = 0;
    for (int32_t n = 0; n < N; n++)
        if (want[n] && c->tnodes[n].depth > max_depth) max_depth = c->tnodes[n].depth;
    int32_t *at = calloc((size_t)max_depth + 2, sizeof *at);
    if (!at) {
        free(want);
        free(order);
        return kv_fail(e, KV_ERR_NOMEM, "save: out of memory");
    }
    for (int32_t n = 0; n < N; n++)
        if (want[n]) at[c->tnodes[n].depth + 1]++, k++;
    for (int32_t d = 0; d <= max_depth; d++) at[d + 1] += at[d];
    for (int32_t n = 0; n < N; n++)
        if (want[n]) order[at[c->tnodes[n].depth]++] = n;
    free(at);
    *want_out = want, *order_out = order, *n_out = k;
    return KV_OK;
}

kv_status kv_cache_save(kv_cache *c, const char *path, const uint8_t *key, const int32_t *const *prefixes,
                        const size_t *lens, size_t n_prefixes, int64_t *pages_written, kv_error *e) {
    if (pages_written) *pages_written = 0;
    if (!c || !path) return kv_fail(e, KV_ERR_ARG, "save: cache or path is NULL");
    if (!c->m) return kv_fail(e, KV_ERR_ARG, "save: the cache has no model");
    if (prefixes && n_prefixes && !lens) return kv_fail(e, KV_ERR_ARG, "save: prefix lengths are NULL");
    if (prefixes)
        for (size_t i = 0; i < n_prefixes; i++)
            if (!prefixes[i] && lens[i]) return kv_fail(e, KV_ERR_ARG, "save: prefix %zu is NULL", i + 1);
    if (sodium_init() < 0) return kv_fail(e, KV_ERR_IO, "save: libsodium failed to initialize");
    kv_model *m = c->m;
    const kv_model_info *in = &m->info;
    uint8_t fp[32];
    kv_status st = kv_model_fingerprint(m, fp, NULL, e);
    if (st) return st;
    uint8_t *want = NULL;
    int32_t *order = NULL, n_nodes = 0;
    if ((st = cache_pick(c, prefixes, lens, n_prefixes, &want, &order, &n_nodes, e))) return st;
    int32_t *fidx = malloc((size_t)(c->n_tnodes ? c->n_tnodes : 1) * sizeof *fidx);
    if (!fidx) {
        free(want);
        free(order);
        return kv_fail(e, KV_ERR_NOMEM, "save: out of memory");
    }
    uint32_t n_pages = 0;
    for (int32_t k = 0; k < n_nodes; k++) {
        fidx[order[k]] = k;
        if (want[order[k]] == 2)
            for (int g = 0; g < c->n_groups; g++) n_pages += kv_pool_find(c, g, &c->tnodes[order[k]].hash) >= 0;
    }
    kvf_out o;
    kvf_stream w;
    if ((st = save_open(&w, path, KVC_MAGIC, key, &o, e)) == KV_OK) {
        const uint32_t hv[8] = {(uint32_t)c->pt, (uint32_t)c->n_groups, (uint32_t)in->n_layer,
                                (uint32_t)in->n_head_kv, (uint32_t)in->head_dim, (uint32_t)in->head_dim_v,
                                (uint32_t)n_nodes, n_pages};
        w_head(&w, fp, hv, 8, c);
        for (int32_t k = 0; k < n_nodes && !w.st; k++) {
            const kv_tnode *t = &c->tnodes[order[k]];
            w_u32(&w, t->parent < 0 ? 0u : (uint32_t)fidx[t->parent] + 1u);
            const int32_t *ids = kv_pool_tnode_ids(c, order[k]);
            for (int i = 0; i < c->pt; i++) w_u32(&w, (uint32_t)ids[i]);
        }
        /* pages, straight from the pool */
        for (int32_t k = 0; k < n_nodes && !w.st; k++) {
            if (want[order[k]] != 2) continue;
            for (int g = 0; g < c->n_groups && !w.st; g++) {
                int32_t id = kv_pool_find(c, g, &c->tnodes[order[k]].hash);
                if (id < 0) continue;
                w_u32(&w, (uint32_t)k);
                w_u32(&w, (uint32_t)g);
                w_page(&w, &m->be, c, g, id, e);
            }
        }
        st = save_finish(&w, o.f, key);
    }
    st = save_close(&o, st, e);
    free(want);
    free(order);
    free(fidx);
    if (st == KV_OK && pages_written) *pages_written = n_pages;
    return st;
}

kv_status kv_cache_restore_fp(kv_cache *c, FILE *f, const uint8_t *key, int64_t *pages_added, kv_error *e) {
    if (pages_added) *pages_added = 0;
    if (!c || !f) return kv_fail(e, KV_ERR_ARG, "restore: cache or file is NULL");
    if (!c->m) return kv_fail(e, KV_ERR_ARG, "restore: the cache has no model");
    if (!c->prefix) return kv_fail(e, KV_ERR_ARG, "restore: the cache does not reuse prefixes (prefix = false)");
    if (sodium_init() < 0) return kv_fail(e, KV_ERR_IO, "restore: libsodium failed to initialize");
    kv_model *m = c->m;
    const kv_model_info *in = &m->info;
    uint8_t pre[16];
    if (fread(pre, 16, 1, f) != 1) return kv_fail(e, KV_ERR_FORMAT, "kv file: not a kvlua cache file (too short)");
    if (memcmp(pre, KVF_MAGIC, 8) == 0)
        return kv_fail(e, KV_ERR_FORMAT, "kv file: a session file, not a cache file (restore it as a session)");
    if (memcmp(pre, KVC_MAGIC, 8) != 0) return kv_fail(e, KV_ERR_FORMAT, "kv file: not a kvlua cache file (bad magic)");
    uint32_t version;
    bool enc;
    kv_status st = read_pre(pre, key, &version, &enc, e);
    if (st) return st;
    /* the file's size bounds what its header may promise */
    long here = ftell(f);
    uint64_t size = 0;
    if (here < 0 || fseek(f, 0, SEEK_END) != 0) return kv_fail(e, KV_ERR_IO, "kv file: cannot tell the file's size");
    long end = ftell(f);
    if (end < 0 || fseek(f, here, SEEK_SET) != 0) return kv_fail(e, KV_ERR_IO, "kv file: cannot tell the file's size");
    size = (uint64_t)end;

    kvf_stream r;
    st = stream_init(&r, f, enc, KVC_MAGIC, version, e);
    int *types = NULL;
    kv_hash *hash = NULL;
    int32_t *parent = NULL, *ids = NULL, *slot = NULL, *pn = NULL;
    uint32_t n_nodes = 0;
    const int G = c->n_groups, pt = c->pt;
    if (st) goto done;
    uint32_t hv[8];
    if ((st = r_older(&r, version)) || (st = read_head(&r, f, enc, key, m, hv, 8, e))) goto done;
    if (hv[2] != (uint32_t)in->n_layer || hv[3] != (uint32_t)in->n_head_kv || hv[4] != (uint32_t)in->head_dim ||
        hv[5] != (uint32_t)in->head_dim_v || hv[1] != (uint32_t)G) {
        st = fmt_fail(&r, "header does not describe a cache of this model");
        goto done;
    }
    n_nodes = hv[6];
    const uint32_t n_pages = hv[7];
    for (int g = 0; g < G; g++)
        if (r_u32(&r) != (uint32_t)c->groups[g].window && !r.st) fmt_fail(&r, "attention windows differ from the model's");
    if ((st = r_types(&r, version, in->n_layer, &types, e))) goto done;
    if (hv[0] != (uint32_t)pt || memcmp(c->ktypes, types, 2 * (size_t)in->n_layer * sizeof(int)) != 0) {
        st = kv_fail(e, KV_ERR_ARG, "restore: the file's K/V types or page size differ from the cache's");
        goto done;
    }
    {
        uint64_t min_page = UINT64_MAX;
        for (int g = 0; g < G; g++)
            if (c->groups[g].page_bytes < min_page) min_page = c->groups[g].page_bytes;
        const uint64_t need = (uint64_t)n_nodes * (4 + 4 * (uint64_t)pt) + (uint64_t)n_pages * (8 + min_page);
        if (n_nodes > (uint32_t)INT32_MAX / (uint32_t)(G + 1) || need > size) {
            st = fmt_fail(&r, "truncated (the header promises more than the file holds)");
            goto done;
        }
    }
    const size_t NN = n_nodes ? n_nodes : 1;
    hash = malloc(NN * sizeof *hash);
    parent = malloc(NN * sizeof *parent);
    ids = malloc(NN * (size_t)pt * sizeof *ids);
    slot = malloc(NN * (size_t)G * sizeof *slot);
    pn = malloc(NN * sizeof *pn);
    for (size_t i = 0; slot && i < NN * (size_t)G; i++) slot[i] = -1; /* before any failure: done reads it */
    if (!hash || !parent || !ids || !slot || !pn) {
        st = kv_fail(e, KV_ERR_NOMEM, "restore: out of memory");
        goto done;
    }
    /* nodes: every hash recomputed from this cache's h_0 */
    int32_t *depth = pn; /* (until the nodes are made) */
    for (uint32_t k = 0; k < n_nodes && !r.st; k++) {
        uint32_t p = r_u32(&r);
        if (p > k) {
            fmt_fail(&r, "a node before its parent");
            break;
        }
        parent[k] = (int32_t)p - 1;
        int32_t *ki = ids + (size_t)k * pt;
        for (int i = 0; i < pt && !r.st; i++) {
            uint32_t id = r_u32(&r);
            if (id >= (uint32_t)in->n_vocab && !r.st) fmt_fail(&r, "token id out of range");
            ki[i] = (int32_t)id;
        }
        depth[k] = p ? depth[p - 1] + 1 : 0;
        if ((uint64_t)depth[k] >= (uint64_t)INT32_MAX / (uint64_t)pt && !r.st) fmt_fail(&r, "a chain too long");
        kv_chain_hash(p ? &hash[p - 1] : &c->h0, ki, pt, &hash[k]);
    }
    /* pages: into free pages (nothing is evicted for a restore) */
    kv_backend *be = &m->be;
    for (uint32_t j = 0; j < n_pages && !r.st; j++) {
        uint32_t k = r_u32(&r), g = r_u32(&r);
        if (r.st) break;
        if (k >= n_nodes || g >= (uint32_t)G || slot[(size_t)k * G + g] != -1) {
            fmt_fail(&r, "a page out of place (node, group, or twice)");
            break;
        }
        const kv_group *Gp = &c->groups[g];
        if (kv_pool_find(c, (int)g, &hash[k]) >= 0) { /* already here */
            slot[(size_t)k * G + g] = -2;
            r_skip(&r, Gp->page_bytes);
            continue;
        }
        int32_t id;
        if ((st = kv_pool_take_free(c, (int)g, &id, e))) {
            r.st = st;
            break;
        }
        slot[(size_t)k * G + g] = id;
        r_page(&r, be, c, (int)g, id, e);
    }
    if ((st = r.st) || (st = r_end(&r))) goto done;
    /* the file is whole: its nodes join the cache's, its pages are sealed, unreferenced */
    int64_t added = 0;
    for (uint32_t k = 0; k < n_nodes; k++) {
        const int32_t d = depth[k];
        int32_t n = kv_pool_tnode_find(c, &hash[k]);
        if (n < 0) n = kv_pool_tnode_add(c, &hash[k], parent[k] >= 0 ? pn[parent[k]] : -1, ids + (size_t)k * pt, d);
        pn[k] = n; /* depth[k] is read before pn[k] is written: they share the array */
        for (int g = 0; g < G; g++) {
            int32_t id = slot[(size_t)k * G + g];
            if (id < 0) continue;
            int32_t got = kv_pool_seal_node(c, g, id, d, &hash[k], n);
            if (got == id && c->groups[g].pages[id].state == KV_PAGE_SEALED) added++;
            kv_pool_unref(c, g, id); /* sealed: cached; else (a twin, a collision): free again */
            slot[(size_t)k * G + g] = -2;
        }
    }
    for (uint32_t k = n_nodes; k-- > 0;) kv_pool_tnode_trim(c, pn[k]);
    if (pages_added) *pages_added = added;
done:
    if (st != KV_OK && slot)
        for (size_t i = 0; i < (size_t)n_nodes * G; i++)
            if (slot[i] >= 0) kv_pool_unref(c, (int)(i % G), slot[i]); /* back to the free list */
    if (r.buf) stream_free(&r);
    free(types);
    free(hash);
    free(parent);
    free(ids);
    free(slot);
    free(pn);
    return st;
}

kv_status kv_cache_restore(kv_cache *c, const char *path, const uint8_t *key, int64_t *pages_added, kv_error *e) {
    if (pages_added) *pages_added = 0;
    if (!c || !path) return kv_fail(e, KV_ERR_ARG, "restore: cache or path is NULL");
    FILE *f;
    kv_status st = restore_open(path, &f, e);
    if (st) return st;
    st = kv_cache_restore_fp(c, f, key, pages_added, e);
    fclose(f);
    return st;
}

int kv_file_kind(const char *path) {
    int err;
    mode_t mode;
    FILE *f = path ? open_regular(path, &err, &mode) : NULL;
    if (!f) return KV_FILE_NONE;
    char magic[8];
    int kind = KV_FILE_NONE;
    if (fread(magic, 8, 1, f) == 1)
        kind = !memcmp(magic, KVF_MAGIC, 8) ? KV_FILE_SESSION : !memcmp(magic, KVC_MAGIC, 8) ? KV_FILE_CACHE : KV_FILE_NONE;
    fclose(f);
    return kind;
}
