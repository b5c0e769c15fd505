// The emulated device's settings, for a library of the CUDA kernel sources built with g++ against
// kernels/emu/intrinsics_host.h (wna16ctl/native/emulated.py). That library runs the real
// kernels, launchers and grid math on CPU threads; this file is only its configuration entry
// point and is never part of the nvcc build or of the host library.
#include "capi.h"
#include "intrinsics.cuh"

// sms, concurrent_blocks (teams), timeout_s: > 0 sets; fibers: 1 runs each team's threads as
// user-level contexts on one OS thread, 0 as OS threads, < 0 leaves it.
extern "C" WNA16_API int wna16_emu_configure(int sms, int concurrent_blocks, int timeout_s, int fibers) {
  wna16::emu::Device& d = wna16::emu::device();
  if (sms > 0) d.sms = sms;
  if (concurrent_blocks > 0) d.concurrent_blocks = concurrent_blocks;
  if (timeout_s > 0) d.timeout_s = timeout_s;
  if (fibers >= 0) d.fibers = fibers != 0;
  return WNA16_OK;
}

// out[0..4]: launches, blocks run, mma rows executed (16 per mma), those multiplied (rows of A
// not all zero), and the OS threads the launches ran on, since the library was loaded.
extern "C" WNA16_API int wna16_emu_counters(int64_t* out) {
  wna16::emu::Counters& c = wna16::emu::counters();
  out[0] = c.launches.load();
  out[1] = c.blocks.load();
  out[2] = c.mma_rows.load();
  out[3] = c.mma_rows_multiplied.load();
  out[4] = c.os_threads.load();
  return WNA16_OK;
}
