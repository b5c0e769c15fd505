// The emulated device's settings, for a library of the CUDA kernel sources built with g++ against
// kernels/emu/intrinsics_host.h (wna16ctl/native/emulated.py). That library runs the real
// kernels, launchers and grid math on CPU threads; this file is only its configuration entry
// point and is never part of the nvcc build or of the host library.
#include "capi.h"
#include "intrinsics.cuh"

extern "C" WNA16_API int wna16_emu_configure(int sms, int concurrent_blocks, int timeout_s) {
  wna16::emu::Device& d = wna16::emu::device();
  if (sms > 0) d.sms = sms;
  if (concurrent_blocks > 0) d.concurrent_blocks = concurrent_blocks;
  if (timeout_s > 0) d.timeout_s = timeout_s;
  return WNA16_OK;
}
