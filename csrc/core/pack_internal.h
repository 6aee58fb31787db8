/* Core-private: the pack kernels' tables, chooser and self-check, shared by
 * the pack_*.c files and the C tests. */
#ifndef MPIDP_CORE_PACK_INTERNAL_H
#define MPIDP_CORE_PACK_INTERNAL_H

#include "mpidp/pack.h"

/* The reference table (always available). */
extern const mpidp_pack_kernels_t mpidp__pack_ref;

/* The SIMD tables, or NULL when that file was compiled without its instruction
 * set flags (a non-x86 build). Whether the CPU can run them is dispatch's job. */
const mpidp_pack_kernels_t *mpidp__pack_avx2_table(void);
const mpidp_pack_kernels_t *mpidp__pack_avx512_table(void);
const mpidp_pack_kernels_t *mpidp__pack_avx512_bf16_table(void);

/* Makes the first candidate that passes mpidp__pack_selfcheck the current
 * table (the reference when none does; it is never checked) and records in
 * mpidp_pack_fallback_reason why each one before it was skipped. mpidp_pack_init
 * passes the available paths best first; tests pass a broken table. */
void mpidp__pack_choose(const mpidp_pack_kernels_t *const *candidates, size_t n);

/* Compares every kernel of k with the reference on special and pseudo-random
 * data at several odd lengths and misalignments, also checking that nothing
 * outside [0, n) is written and that unpack with a == 0 never reads dst.
 * Returns 0 when all agree bit for bit; otherwise nonzero, with the first
 * difference described in why (kernel, length, offset, index, input, got, want). */
int mpidp__pack_selfcheck(const mpidp_pack_kernels_t *k, char *why, size_t why_len);

#endif /* MPIDP_CORE_PACK_INTERNAL_H */
