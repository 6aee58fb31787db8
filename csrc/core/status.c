/* The status table and the thread-local failure detail. */
#include "mpidp/status.h"
#include "fail.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char error_detail[512];

const char *mpidp_strerror(int status)
{
    switch (status) {
#define MPIDP__MSG(name, value, msg) case name: return msg;
        MPIDP_STATUS_TABLE(MPIDP__MSG)
#undef MPIDP__MSG
    }
    return "unknown status";
}

const char *mpidp_status_name(int status)
{
    switch (status) {
#define MPIDP__NAME(name, value, msg) case name: return #name;
        MPIDP_STATUS_TABLE(MPIDP__NAME)
#undef MPIDP__NAME
    }
    return "MPIDP_UNKNOWN";
}

const char *mpidp_error_detail(void) { return error_detail; }

void mpidp_error_clear(void) { error_detail[0] = '\0'; }

void mpidp_error_set(const char *detail) { snprintf(error_detail, sizeof error_detail, "%s", detail); }

int mpidp__fail(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_detail, sizeof error_detail, fmt, ap);
    va_end(ap);
    return status;
}
