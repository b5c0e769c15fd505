// Error reporting shared by both kernel libraries: a return code plus a per-thread message that
// wna16_last_error() hands to the caller (ctypes cannot catch C++ exceptions).
#pragma once

#include <stdarg.h>
#include <stdint.h>

#include "capi.h"

// Formats the message and returns `code`, so call sites read `return wna16_fail(...)`.
int wna16_fail(int code, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void wna16_clear_error(void);
