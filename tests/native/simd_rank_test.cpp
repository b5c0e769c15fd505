// The native rank builder (wna16_marlin_rank_host, kernels/host.cpp) at every SIMD level this build
// and CPU have, on pseudo-random sources of several shapes (4-bit and 8-bit, grouped and channel
// scales, 2- and 4-byte scales, two TP ranks): every level must write the scalar loop's bytes.
// Prints one line per case and level, "<case> <level> <digest>" (the digest of all four outputs),
// so that a run on another architecture (aarch64 under qemu-user) can be compared with this one's;
// then "ok <cases>" and exit 0, or the mismatches and exit 1.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "capi.h"

namespace {

struct Case {
  int64_t hidden, intermediate;
  int tp, bits;
  int64_t group;
  int scale_bytes;
};

const Case kCases[] = {
    {256, 128, 1, 4, 128, 2}, {1024, 768, 2, 4, 128, 2}, {512, 256, 2, 4, -1, 4},
    {384, 256, 2, 8, 128, 2}, {1024, 512, 2, 8, -1, 4},  {512, 384, 2, 8, 64, 2},
};
const int kLevels[] = {WNA16_SIMD_SCALAR, WNA16_SIMD_AVX2, WNA16_SIMD_AVX512, WNA16_SIMD_NEON};
const char* kNames[] = {"scalar", "auto", "avx2", "avx512", "neon"};

uint64_t state = 0x9e3779b97f4a7c15ULL;
uint32_t next_word() {  // xorshift64*: the same words on every architecture
  state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
  return (uint32_t)((state * 0x2545f4914f6cdd1dULL) >> 32);
}

uint64_t fnv(uint64_t h, const void* data, size_t n) {
  const uint8_t* p = (const uint8_t*)data;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

}  // namespace

int main() {
  int failures = 0, cases = 0;
  const int experts = 2;
  for (const Case& c : kCases) {
    const int pf = 32 / c.bits;
    const int64_t h = c.hidden, i = c.intermediate;
    const int64_t g13 = c.group == -1 ? 1 : h / c.group, g2 = c.group == -1 ? 1 : i / c.group;
    // per expert: gate, up [I, H/pf], down [H, I/pf], then the scales [I, G13], [I, G13], [H, G2]
    std::vector<std::vector<uint32_t>> tensors;
    std::vector<const void*> src;
    for (int e = 0; e < experts; ++e) {
      const int64_t words[6] = {i * h / pf, i * h / pf, h * i / pf, (i * g13 * c.scale_bytes + 3) / 4,
                                (i * g13 * c.scale_bytes + 3) / 4, (h * g2 * c.scale_bytes + 3) / 4};
      for (int t = 0; t < 6; ++t) {
        tensors.emplace_back((size_t)words[t]);
        for (auto& w : tensors.back()) w = next_word();
      }
    }
    for (auto& t : tensors) src.push_back(t.data());
    for (int rank = 0; rank < c.tp; ++rank, ++cases) {
      const int64_t ip = i / c.tp;
      const size_t w13 = (size_t)(experts * h * 2 * ip / pf), w2 = (size_t)(experts * ip * h / pf);
      const size_t s13 = (size_t)(experts * g13 * 2 * ip * c.scale_bytes),
                   s2 = (size_t)(experts * g2 * h * c.scale_bytes);
      const int grouped13 = c.group != -1 && c.group < h, grouped2 = c.group != -1 && c.group < i;
      std::vector<uint64_t> digests;
      for (int level : kLevels) {
        if (wna16_simd_level(level) != level) continue;
        std::vector<uint8_t> a(w13 * 4, 0xee), b(w2 * 4, 0xee), s(s13, 0xee), t(s2, 0xee);
        const int rc = wna16_marlin_rank_host(src.data(), experts, h, i, c.tp, rank, c.bits, c.group, 1,
                                              c.scale_bytes, grouped13, grouped2, a.data(), b.data(), s.data(),
                                              t.data(), level, 2);
        if (rc != WNA16_OK) {
          printf("case %d: level %s failed: %s\n", cases, kNames[level], wna16_last_error());
          ++failures;
          continue;
        }
        uint64_t d = 0xcbf29ce484222325ULL;
        d = fnv(fnv(fnv(fnv(d, a.data(), a.size()), b.data(), b.size()), s.data(), s.size()), t.data(), t.size());
        printf("%d %s %016llx\n", cases, kNames[level], (unsigned long long)d);
        digests.push_back(d);
      }
      for (uint64_t d : digests)
        if (d != digests[0]) {
          printf("case %d: the levels disagree\n", cases);
          ++failures;
          break;
        }
    }
  }
  if (failures) return 1;
  printf("ok %d\n", cases);
  return 0;
}
