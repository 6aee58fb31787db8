/* The status table: names, messages and the thread-local detail. */
#include "mpidp/status.h"
#include "test.h"
#include "fail.h"

TEST(status_names_and_messages)
{
    ASSERT_STREQ(mpidp_status_name(MPIDP_OK), "MPIDP_OK");
    ASSERT_STREQ(mpidp_status_name(MPIDP_ETIMEDOUT), "MPIDP_ETIMEDOUT");
    ASSERT_STREQ(mpidp_strerror(MPIDP_EINVAL), "invalid argument");
    ASSERT_STREQ(mpidp_strerror(12345), "unknown status");
    ASSERT_STREQ(mpidp_status_name(-999), "MPIDP_UNKNOWN");
}

TEST(status_codes_are_distinct_and_negative)
{
    static const int codes[] = {
#define X(name, value, msg) value,
        MPIDP_STATUS_TABLE(X)
#undef X
    };
    size_t n = sizeof codes / sizeof codes[0];
    for (size_t i = 0; i < n; i++) {
        ASSERT_TRUE(codes[i] <= 0);
        for (size_t j = i + 1; j < n; j++) ASSERT_TRUE(codes[i] != codes[j]);
    }
}

TEST(error_detail_is_recorded_and_cleared)
{
    mpidp_error_clear();
    ASSERT_STREQ(mpidp_error_detail(), "");
    ASSERT_EQ_INT(mpidp__fail(MPIDP_EINVAL, "argument %s: %d", "n", 7), MPIDP_EINVAL);
    ASSERT_STREQ(mpidp_error_detail(), "argument n: 7");
    mpidp_error_clear();
    ASSERT_STREQ(mpidp_error_detail(), "");
}

TEST_MAIN(status_names_and_messages, status_codes_are_distinct_and_negative,
          error_detail_is_recorded_and_cleared)
