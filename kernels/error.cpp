// Per-thread last-error storage for the C ABI (capi.h). Compiled into both libraries.
#include "error.h"

#include <stdio.h>

namespace {
thread_local char g_last_error[512] = "";
}

int wna16_fail(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
  va_end(ap);
  return code;
}

void wna16_clear_error(void) { g_last_error[0] = '\0'; }

extern "C" WNA16_API const char* wna16_last_error(void) { return g_last_error; }

extern "C" WNA16_API int wna16_abi_version(void) { return WNA16_ABI_VERSION; }
