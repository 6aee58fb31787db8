/* A fast 64-bit checksum of raw bytes, for telling whether ranks hold
 * bitwise-identical parameters (MPIDP_CHECK). Not cryptographic: it only has
 * to make an accidental collision between two different parameter values
 * vanishingly unlikely. Four independent multiply-rotate lanes over 8-byte
 * words keep it near memory speed. The same bytes give the same value on
 * every rank and every build. */
#ifndef MPIDP_CHECKSUM_H
#define MPIDP_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

uint64_t mpidp_checksum64(const void *data, size_t bytes, uint64_t seed);

#endif /* MPIDP_CHECKSUM_H */
