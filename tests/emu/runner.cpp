// Test driver for the emulated kernels: runs one launcher (the real kernels of kernels/*.cu or a
// probe of probes.cu) on inputs that Python wrote into a directory, and writes the outputs back.
// A standalone executable so that the sanitizer builds (-fsanitize=thread, address+undefined) run
// with their runtimes in a process of their own, not preloaded into Python.
//
//   runner DIR      DIR/args.txt: "op NAME", "int KEY VALUE", "buf NAME" (DIR/NAME.bin loaded
//                   into an exactly sized heap block, so an out-of-bounds access is caught),
//                   "out NAME" (written to DIR/NAME.out after the call), "dev sms|cc|blocks|seed VALUE".
// Prints "rc N" and the library's last error; exits 0 when the call ran (whatever rc it gave).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <string>
#include <vector>

#include "capi.h"
#include "intrinsics.cuh"

extern "C" {
int wna16_probe_mma(int, const uint32_t*, const uint32_t*, const float*, float*);
int wna16_probe_ldmatrix(int, const uint16_t*, int, const int*, uint32_t*);
int wna16_probe_warp(const uint32_t*, const int*, uint32_t*);
int wna16_probe_bits(int, const uint32_t*, const uint32_t*, const uint32_t*, const uint32_t*,
                     uint32_t*);
int wna16_probe_half2(int, int, const uint32_t*, const uint32_t*, const uint32_t*, uint32_t*);
int wna16_probe_convert(int, int, const float*, uint32_t*, float*);
int wna16_probe_cp_async(int, int, int, const void*, void*);
int wna16_probe_smem(int, int, const uint32_t*, uint32_t*);
int wna16_probe_flag(int, int, int*, int*, int*);
int wna16_probe_order(int, int*, int*);
int wna16_probe_offbyone(int, int, const uint32_t*, uint32_t*);
int wna16_probe_smem_limit(int, int, int, const uint32_t*, uint32_t*);
int wna16_probe_dims(int*);
int wna16_probe_bad_warp(int, uint32_t*);
}

namespace {

struct Buf {
  void* p = nullptr;
  size_t n = 0;
};

std::string g_dir;
std::map<std::string, Buf> g_bufs;
std::map<std::string, long long> g_ints;
std::vector<std::string> g_outs;

[[noreturn]] void die(const char* what, const std::string& name) {
  fprintf(stderr, "runner: %s %s\n", what, name.c_str());
  exit(3);
}

void load(const std::string& name) {
  const std::string path = g_dir + "/" + name + ".bin";
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) die("cannot open", path);
  fseek(f, 0, SEEK_END);
  Buf b;
  b.n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  b.p = malloc(b.n ? b.n : 1);
  if (b.n && fread(b.p, 1, b.n, f) != b.n) die("short read", path);
  fclose(f);
  g_bufs[name] = b;
}

void save(const std::string& name) {
  const auto it = g_bufs.find(name);
  if (it == g_bufs.end()) die("no buffer for output", name);
  const std::string path = g_dir + "/" + name + ".out";
  FILE* f = fopen(path.c_str(), "wb");
  if (!f || fwrite(it->second.p, 1, it->second.n, f) != it->second.n) die("cannot write", path);
  fclose(f);
}

template <typename T = void>
T* B(const char* name) {  // NULL when the input was not given (optional tensors)
  const auto it = g_bufs.find(name);
  return it == g_bufs.end() ? nullptr : static_cast<T*>(it->second.p);
}

long long I(const char* name) {
  const auto it = g_ints.find(name);
  if (it == g_ints.end()) die("missing int", name);
  return it->second;
}

int run(const std::string& op) {
  if (op == "gemm")
    return wna16_cuda_moe_gemm(
        B("a"), B<int32_t>("b"), B("scales"), B<int32_t>("zp"), B<int32_t>("g_idx"),
        B<int32_t>("perm"), B<int32_t>("sorted_ids"), B<int32_t>("offsets"), B<float>("topk"),
        B("c"), B<int32_t>("ws"), I("num_slots"), I("num_sorted"), I("num_experts"), I("size_n"),
        I("size_k"), I("num_groups"), (int)I("top_k"), (int)I("num_bits"), (int)I("dtype"),
        (int)I("is_k_full"), (int)I("variant"), nullptr);
  if (op == "gemm_v2") {  // the workspace sized by the kernel's own query, exactly
    int64_t words = 0;
    int rc = wna16_cuda_moe_gemm_v2_workspace(I("num_sorted"), I("num_experts"), I("size_n"),
                                              I("size_k"), I("num_groups"), (int)I("num_bits"),
                                              B("perm") != nullptr, (int)I("variant"), &words);
    if (rc) return rc;
    int32_t* ws = static_cast<int32_t*>(malloc((size_t)(words > 0 ? words : 1) * sizeof(int32_t)));
    rc = wna16_cuda_moe_gemm_v2(
        B("a"), B<int32_t>("b"), B("scales"), B<int32_t>("zp"), B<int32_t>("g_idx"),
        B<int32_t>("perm"), B<int32_t>("sorted_ids"), B<int32_t>("offsets"), B<float>("topk"),
        B("c"), ws, I("num_slots"), I("num_sorted"), I("num_experts"), I("size_n"), I("size_k"),
        I("num_groups"), (int)I("top_k"), (int)I("num_bits"), (int)I("dtype"), (int)I("is_k_full"),
        (int)I("variant"), nullptr);
    free(ws);
    return rc;
  }
  if (op == "gemm_v3") {  // a zeroed workspace of the size the kernel's query gives, exactly;
                          // "int calls N": N calls on it, the last one's output is kept, and
                          // the counter words are checked to be zero again after each
    int64_t words = 0;
    int rc = wna16_cuda_moe_gemm_v3_workspace(I("num_sorted"), I("num_experts"), I("size_n"),
                                              I("size_k"), I("num_groups"), (int)I("num_bits"),
                                              B("perm") != nullptr, (int)I("variant"), &words);
    if (rc) return rc;
    int32_t* ws = static_cast<int32_t*>(calloc((size_t)(words > 0 ? words : 1), sizeof(int32_t)));
    const long long calls = g_ints.count("calls") ? I("calls") : 1;
    const long long flag_words = g_ints.count("flag_words") ? I("flag_words") : 0;
    for (long long call = 0; call < calls && rc == 0; ++call) {
      rc = wna16_cuda_moe_gemm_v3(
          B("a"), B<int32_t>("b"), B("scales"), B<int32_t>("zp"), B<int32_t>("g_idx"),
          B<int32_t>("perm"), B<int32_t>("sorted_ids"), B<int32_t>("offsets"), B<float>("topk"),
          B("c"), ws, I("num_slots"), I("num_sorted"), I("num_experts"), I("size_n"), I("size_k"),
          I("num_groups"), (int)I("top_k"), (int)I("num_bits"), (int)I("dtype"),
          (int)I("is_k_full"), (int)I("variant"), nullptr);
      for (long long w = 0; rc == 0 && w < flag_words && w < words; ++w)
        if (ws[w]) {
          fprintf(stderr, "workspace word %lld is %d after call %lld (not reset)\n", w, ws[w], call);
          rc = 99;
        }
    }
    free(ws);
    return rc;
  }
  if (op == "repack")  // out_shift: write `out_shift` words into the buffer (a misaligned output)
    return wna16_cuda_marlin_repack(B<int32_t>("packed"), B<int32_t>("perm"),
                                    B<int32_t>("out") + (g_ints.count("out_shift") ? I("out_shift") : 0),
                                    I("num_experts"), I("size_k"), I("size_n"),
                                    (int)I("num_bits"), nullptr);
  if (op == "scales")
    return wna16_cuda_permute_scales(B("in"), B("out"), I("rows"), I("size_n"),
                                     (int)I("elem_bytes"), (int)I("grouped"), nullptr);
  if (op == "zero_points")
    return wna16_cuda_zero_points(B<int32_t>("in"), B<int32_t>("out"), I("rows"), I("size_n"),
                                  (int)I("num_bits"), nullptr);
  if (op == "device_info") return wna16_cuda_device_info(0, B<int32_t>("info"));
  if (op == "mma")
    return wna16_probe_mma((int)I("bf16"), B<uint32_t>("a"), B<uint32_t>("b"), B<float>("c"),
                           B<float>("d"));
  if (op == "ldmatrix")
    return wna16_probe_ldmatrix((int)I("variant"), B<uint16_t>("src"), (int)I("n"),
                                B<int>("offsets"), B<uint32_t>("out"));
  if (op == "warp") return wna16_probe_warp(B<uint32_t>("v"), B<int>("arg"), B<uint32_t>("out"));
  if (op == "bits")
    return wna16_probe_bits((int)I("n"), B<uint32_t>("a"), B<uint32_t>("b"), B<uint32_t>("c"),
                            B<uint32_t>("sel"), B<uint32_t>("out"));
  if (op == "half2")
    return wna16_probe_half2((int)I("bf16"), (int)I("n"), B<uint32_t>("a"), B<uint32_t>("b"),
                             B<uint32_t>("c"), B<uint32_t>("out"));
  if (op == "convert")
    return wna16_probe_convert((int)I("bf16"), (int)I("n"), B<float>("x"), B<uint32_t>("packed"),
                               B<float>("wide"));
  if (op == "cp_async")
    return wna16_probe_cp_async((int)I("mode"), (int)I("zfill"), (int)I("n"), B("src"), B("out"));
  if (op == "flag")
    return wna16_probe_flag((int)I("mode"), (int)I("n"), B<int>("data"), B<int>("flag"), B<int>("out"));
  if (op == "order") return wna16_probe_order((int)I("blocks"), B<int>("counter"), B<int>("out"));
  if (op == "smem")
    return wna16_probe_smem((int)I("mode"), (int)I("n"), B<uint32_t>("src"), B<uint32_t>("out"));
  if (op == "smem_limit")
    return wna16_probe_smem_limit((int)I("n"), (int)I("bytes"), (int)I("optin"), B<uint32_t>("src"),
                                  B<uint32_t>("out"));
  if (op == "bad_warp") return wna16_probe_bad_warp((int)I("mode"), B<uint32_t>("out"));
  if (op == "dims") return wna16_probe_dims(B<int>("out"));
  if (op == "offbyone")
    return wna16_probe_offbyone((int)I("mode"), (int)I("n"), B<uint32_t>("src"),
                                B<uint32_t>("out"));
  die("unknown op", op);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 3;
  }
  g_dir = argv[1];
  FILE* f = fopen((g_dir + "/args.txt").c_str(), "r");
  if (!f) die("cannot open", g_dir + "/args.txt");
  std::string op;
  char line[512];
  wna16::emu::Device& dev = wna16::emu::device();
  while (fgets(line, sizeof(line), f)) {
    char kind[32], key[128];
    long long value = 0;
    const int got = sscanf(line, "%31s %127s %lld", kind, key, &value);
    if (got < 2) continue;
    const std::string k = kind;
    if (k == "op") op = key;
    else if (k == "buf") load(key);
    else if (k == "out") g_outs.push_back(key);
    else if (k == "int" && got == 3) g_ints[key] = value;
    else if (k == "dev" && got == 3) {
      const std::string d = key;
      if (d == "sms") dev.sms = (int)value;
      else if (d == "cc") dev.cc_major = (int)value / 10, dev.cc_minor = (int)value % 10;
      else if (d == "blocks") dev.concurrent_blocks = (int)value;
      else if (d == "seed") dev.seed = (int)value;
      else die("unknown device setting", d);
    } else {
      die("bad line", line);
    }
  }
  fclose(f);
  const int rc = run(op);
  printf("rc %d\n%s\n", rc, rc && op != "mma" ? wna16_last_error() : "");
  for (const auto& o : g_outs) save(o);
  for (auto& b : g_bufs) free(b.second.p);
  return 0;
}
