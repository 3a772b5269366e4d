/*
 * unicode.c — codepoint class lookup over the generated two-level table
 * (engine/unicode_tables.c). One shift, two loads; no allocation.
 */
#include "unicode.h"

#include <stddef.h>

/* ---- generated data (unicode_tables.c) ---------------------------------- */

extern const unsigned kv_ucd_nblocks;
extern const uint16_t kv_ucd_stage1[0x110000 >> 8]; /* (cp >> 8) -> block */
extern const uint8_t kv_ucd_stage2[];                /* (nblocks, 256) codes */

/* ---- lookup ---------------------------------------------------------------- */

/* code = class index (bits 0-2) | whitespace << 3  ->  flags */
static const uint16_t code_to_flags[16] = {
    0x001, 0x002, 0x004, 0x008, 0x010, 0x020, 0x040, 0x080,
    0x101, 0x102, 0x104, 0x108, 0x110, 0x120, 0x140, 0x180,
};

unsigned kv_unicode_flags(uint32_t cp)
{
    if (cp >= 0x110000)
        return KV_UC_UNDEFINED;
    unsigned blk = kv_ucd_stage1[cp >> 8];
    return code_to_flags[kv_ucd_stage2[(size_t)blk * 256 + (cp & 255)] & 15];
}
