// Exhaustive check of the GEMM v2 register dequantisation (kernels/dequant.cuh) on the host:
// every code against every zero point (and the default zero), for fp16 and bf16, 4 and 8 bit,
// with a spread of scales, against the plain conversion dtype(dtype(code - zero) * scale); and
// every output position against layout.cuh's slot map (which rows / columns a B fragment holds).
// The intrinsics come from the host emulation (kernels/emu/intrinsics_host.h); the reference
// conversions below are this file's own. Prints "ok <checked values>" and exits 0, or the first
// mismatches and exits 1.
#include <stdio.h>
#include <string.h>

#include "dequant.cuh"
#include "layout.cuh"

namespace {

using namespace wna16v2;

int failures = 0;
long checked = 0;

uint16_t half_of(uint32_t pair, int h) { return (uint16_t)(pair >> (16 * h)); }

// Reference conversions, round to nearest even (fp16 through GCC's _Float16, bf16 by hand; the
// values here are finite).
float h2f(uint16_t h) {
  _Float16 x;
  memcpy(&x, &h, 2);
  return (float)x;
}
uint16_t f2h(float f) {
  const _Float16 x = (_Float16)f;
  uint16_t h;
  memcpy(&h, &x, 2);
  return h;
}
float b2f(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
uint16_t f2b(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <int DT>
float to_f(uint16_t v) { return DT == kF16 ? h2f(v) : b2f(v); }
template <int DT>
uint16_t from_f(float f) { return DT == kF16 ? f2h(f) : f2b(f); }

// The code that output register o, half h reads, and the (row, column) offset layout.cuh gives
// that slot: rows (r, r+1) / (r+8, r+9) of columns c / c+8 for o = 0..3.
template <int NB>
void source_of(const uint32_t* words, int o, int h, uint32_t* code, int* dk, int* dn) {
  int slot;
  const uint32_t* w = words;
  if (NB == 4) {
    slot = o + 4 * h;               // nibble o of the low half, nibble o + 4 of the high half
  } else {
    w = words + (o >> 1);           // word 0: column c, word 1: column c + 8
    slot = (o & 1) + 2 * h;         // bytes 0, 2 -> out 0; bytes 1, 3 -> out 1
  }
  *code = wna16_code(*w, slot, NB);
  wna16_marlin_slot_delta(NB, slot, dk, dn);
  if (NB == 8) *dn = 8 * (o >> 1);  // the second word is the lane's column c + 8
}

template <int DT, int NB>
void check(const char* name) {
  using Q = Quant<DT, NB>;
  const int ncodes = 1 << NB;
  const float scale_values[] = {1.0f, 0.0123f, 3.75e-3f, 0.5f, 7.0f, 1e-4f, 0.0771f};
  uint32_t state = 12345u;
  for (int zmode = -1; zmode < ncodes; ++zmode) {  // -1: the default zero 2^(NB-1)
    const int z = zmode < 0 ? (1 << (NB - 1)) : zmode;
    for (float sf : scale_values) {
      const uint16_t s16 = from_f<DT>(sf);
      const uint32_t spair = (uint32_t)s16 | ((uint32_t)s16 << 16);
      for (int rep = 0; rep < (NB == 4 ? 8 : 64); ++rep) {
        uint32_t words[2];
        for (int i = 0; i < 2; ++i) {  // pseudo-random words, then every code in slot 0 / byte 0
          state = state * 1664525u + 1013904223u;
          words[i] = state;
        }
        const int base = (rep * 8) % ncodes;
        words[0] = (words[0] & ~((uint32_t)ncodes - 1)) | (uint32_t)base;
        uint32_t zs[4], ss[4], out[4];
        for (int i = 0; i < 4; ++i) zs[i] = Q::zero_pair(z, z), ss[i] = spair;
        Q::dequant(words, zs, ss, out);
        for (int o = 0; o < 4; ++o) {
          for (int h = 0; h < 2; ++h) {
            uint32_t code;
            int dk, dn;
            source_of<NB>(words, o, h, &code, &dk, &dn);
            const int want_dk = (o & 1) * 8 + h, want_dn = (o >> 1) * 8;
            const uint16_t want = from_f<DT>(to_f<DT>(from_f<DT>((float)((int)code - z))) * to_f<DT>(s16));
            const uint16_t got = half_of(out[o], h);
            ++checked;
            if (got != want || dk != want_dk || dn != want_dn) {
              if (++failures <= 10)
                printf("%s: code %u zero %d scale %g out[%d].%d = 0x%04x, expected 0x%04x "
                       "(slot offset %d,%d, fragment wants %d,%d)\n",
                       name, code, z, (double)sf, o, h, got, want, dk, dn, want_dk, want_dn);
            }
          }
        }
      }
    }
  }
}

// Zero points that differ between the two rows of a pair (the g_idx path).
template <int DT, int NB>
void check_row_pairs(const char* name) {
  using Q = Quant<DT, NB>;
  const int ncodes = 1 << NB;
  for (int zlo = 0; zlo < ncodes; zlo += (NB == 4 ? 1 : 7)) {
    for (int zhi = 0; zhi < ncodes; zhi += (NB == 4 ? 1 : 11)) {
      uint32_t words[2] = {0x9f3c61a5u * (uint32_t)(zlo + 1), 0x5b2e8d17u * (uint32_t)(zhi + 3)};
      const uint16_t slo = from_f<DT>(0.031f), shi = from_f<DT>(2.5f);
      uint32_t zs[4], ss[4], out[4];
      for (int i = 0; i < 4; ++i) zs[i] = Q::zero_pair(zlo, zhi), ss[i] = slo | ((uint32_t)shi << 16);
      Q::dequant(words, zs, ss, out);
      for (int o = 0; o < 4; ++o) {
        for (int h = 0; h < 2; ++h) {
          uint32_t code;
          int dk, dn;
          source_of<NB>(words, o, h, &code, &dk, &dn);
          const int z = h ? zhi : zlo;
          const uint16_t s = h ? shi : slo;
          const uint16_t want = from_f<DT>(to_f<DT>(from_f<DT>((float)((int)code - z))) * to_f<DT>(s));
          ++checked;
          if (half_of(out[o], h) != want && ++failures <= 10)
            printf("%s row pairs: code %u zero %d out[%d].%d = 0x%04x, expected 0x%04x\n", name,
                   code, z, o, h, half_of(out[o], h), want);
        }
      }
    }
  }
}

}  // namespace

int main() {
  check<kF16, 4>("fp16 4-bit");
  check<kBF16, 4>("bf16 4-bit");
  check<kF16, 8>("fp16 8-bit");
  check<kBF16, 8>("bf16 8-bit");
  check_row_pairs<kF16, 4>("fp16 4-bit");
  check_row_pairs<kBF16, 4>("bf16 4-bit");
  check_row_pairs<kF16, 8>("fp16 8-bit");
  check_row_pairs<kBF16, 8>("bf16 8-bit");
  if (failures) {
    printf("%d mismatches of %ld\n", failures, checked);
    return 1;
  }
  printf("ok %ld\n", checked);
  return 0;
}
