/* The checksum: deterministic, sensitive to every byte and to the length,
 * independent of alignment. */
#include "mpidp/checksum.h"
#include "test.h"

TEST(same_bytes_same_value_any_alignment)
{
    unsigned char buf[200], copy[208];
    for (int i = 0; i < 200; i++) buf[i] = (unsigned char)(i * 37 + 11);
    for (size_t shift = 0; shift < 8; shift++) {
        memcpy(copy + shift, buf, sizeof buf);
        ASSERT_EQ_U64(mpidp_checksum64(copy + shift, sizeof buf, 5), mpidp_checksum64(buf, sizeof buf, 5));
    }
}

TEST(every_bit_of_every_byte_matters)
{
    unsigned char buf[100];
    for (int i = 0; i < 100; i++) buf[i] = (unsigned char)i;
    for (size_t n = 0; n <= sizeof buf; n += 33) {
        uint64_t base = mpidp_checksum64(buf, n, 0);
        for (size_t i = 0; i < n; i++)
            for (int bit = 0; bit < 8; bit++) {
                buf[i] ^= (unsigned char)(1u << bit);
                ASSERT_TRUE(mpidp_checksum64(buf, n, 0) != base);
                buf[i] ^= (unsigned char)(1u << bit);
            }
    }
}

TEST(length_and_seed_matter)
{
    unsigned char zeros[64] = {0};
    for (size_t n = 0; n < 64; n++) ASSERT_TRUE(mpidp_checksum64(zeros, n, 0) != mpidp_checksum64(zeros, n + 1, 0));
    ASSERT_TRUE(mpidp_checksum64(zeros, 64, 0) != mpidp_checksum64(zeros, 64, 1));
    /* -0.0 and +0.0 are different bytes: a bitwise check must tell them apart. */
    float pz = 0.0f, nz = -0.0f;
    ASSERT_TRUE(mpidp_checksum64(&pz, 4, 0) != mpidp_checksum64(&nz, 4, 0));
}

TEST_MAIN(same_bytes_same_value_any_alignment, every_bit_of_every_byte_matters, length_and_seed_matter)
