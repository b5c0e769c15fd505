// A checking reader of safetensors headers: inspect's fast path (wna16ctl/sources/header_digest.py).
//
// It accepts only headers it can prove valid under the rules wna16ctl/sources/headers.py enforces
// (the safetensors library's rules plus "no repeated name"), in the form every writer produces:
// UTF-8 JSON, one object whose members are `__metadata__` (an object of strings) and tensor
// entries {"dtype", "shape", "data_offsets"} with non-negative integers, names without escapes.
// Anything else -- an error or merely an unusual spelling -- is answered "not accepted" and the
// Python reader decides, so every error message comes from one place and this file never has to
// reproduce one.  The tests compare both readers on generated and mutated headers.
//
// What it returns for an accepted header (one buffer, see wna16_header_scan below):
//   * every tensor name in header order, '\n'-separated (a name cannot hold a raw newline);
//   * a JSON document with the `__metadata__` object as written, the entries of the tensors whose
//     name lacks ".experts." as written, and the expert tensors summarised per
//     (prefix, projection, suffix) group: expert numbers, distinct dtypes, the shape they share.
// Python then builds a few thousand objects per shard instead of one dict per tensor.
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "capi.h"

namespace {

enum : int { kAccepted = 0, kNotAccepted = 1, kTooSmall = 2 };

// Python's json.loads and UTF-8 decoder are the reference: strict UTF-8 (no overlong forms, no
// surrogates, nothing above U+10FFFF).
bool valid_utf8(const unsigned char* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    // ASCII runs, eight bytes at a time
    while (i + 8 <= n) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    unsigned char c = s[i];
    if (c < 0x80) { ++i; continue; }
    int len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) { len = 3; lo = 0xA0; }
    else if (c >= 0xE1 && c <= 0xEC) len = 3;
    else if (c == 0xED) { len = 3; hi = 0x9F; }
    else if (c >= 0xEE && c <= 0xEF) len = 3;
    else if (c == 0xF0) { len = 4; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) { len = 4; hi = 0x8F; }
    else return false;
    if (i + len > n) return false;
    if (s[i + 1] < lo || s[i + 1] > hi) return false;
    for (int k = 2; k < len; ++k)
      if ((s[i + k] & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

// bits per element of every dtype the safetensors library reads (headers.py: DTYPE_BITS)
int dtype_bits(std::string_view d) {
  using namespace std::string_view_literals;
  static constexpr std::pair<std::string_view, int> table[] = {
      {"BOOL"sv, 8}, {"U8"sv, 8},  {"I8"sv, 8},  {"F8_E4M3"sv, 8}, {"F8_E5M2"sv, 8}, {"F8_E8M0"sv, 8},
      {"I16"sv, 16}, {"U16"sv, 16}, {"F16"sv, 16}, {"BF16"sv, 16},  {"I32"sv, 32},    {"U32"sv, 32},
      {"F32"sv, 32}, {"I64"sv, 64}, {"U64"sv, 64}, {"F64"sv, 64},  {"C64"sv, 64},    {"F4"sv, 4},
      {"F6_E2M3"sv, 6}, {"F6_E3M2"sv, 6},
  };
  for (const auto& [name, bits] : table)
    if (d == name) return bits;
  return 0;
}

struct Group {
  std::string_view prefix, proj, suffix;
  std::vector<std::string_view> experts;
  std::vector<std::string_view> dtypes;  // distinct, first-seen order
  std::string_view shape;                // the shape's JSON text, as written by the first tensor
  std::vector<uint64_t> dims;
  bool mixed = false;                    // tensors of the group differ in shape
};

struct GroupKey {
  std::string_view prefix, proj, suffix;
  bool operator==(const GroupKey& o) const { return prefix == o.prefix && proj == o.proj && suffix == o.suffix; }
};
struct GroupKeyHash {
  size_t operator()(const GroupKey& k) const {
    std::hash<std::string_view> h;
    return h(k.prefix) * 31u + h(k.proj) * 17u + h(k.suffix);
  }
};

struct Reader {
  const unsigned char* p;
  const unsigned char* end;

  void ws() {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) ++p;
  }
  bool eat(unsigned char c) {
    ws();
    if (p < end && *p == c) { ++p; return true; }
    return false;
  }
  // A string without escapes or control characters; `out` is its content.  The closing quote is
  // found with memchr, then the content is checked eight bytes at a time.
  bool plain_string(std::string_view& out) {
    ws();
    if (p >= end || *p != '"') return false;
    const unsigned char* s = p + 1;
    const unsigned char* q = static_cast<const unsigned char*>(memchr(s, '"', end - s));
    if (q == nullptr) return false;
    const unsigned char* t = s;
    constexpr uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    for (; t + 8 <= q; t += 8) {
      uint64_t w;
      memcpy(&w, t, 8);
      uint64_t bs = w ^ (ones * '\\');
      // a zero byte in `bs` is a backslash; a byte below 0x20 is a control character
      if (((bs - ones) & ~bs & highs) | ((w - ones * 0x20) & ~w & highs)) return false;
    }
    for (; t < q; ++t)
      if (*t == '\\' || *t < 0x20) return false;
    out = std::string_view(reinterpret_cast<const char*>(s), q - s);
    p = q + 1;
    return true;
  }
  // Any JSON string (escapes checked for form only: Python decodes them later).
  bool any_string() {
    ws();
    if (p >= end || *p != '"') return false;
    ++p;
    while (p < end && *p != '"') {
      if (*p < 0x20) return false;
      if (*p == '\\') {
        ++p;
        if (p >= end) return false;
        unsigned char e = *p;
        if (e == 'u') {
          if (end - p < 5) return false;
          for (int k = 1; k <= 4; ++k) {
            unsigned char h = p[k];
            if (!((h >= '0' && h <= '9') || (h >= 'a' && h <= 'f') || (h >= 'A' && h <= 'F'))) return false;
          }
          p += 4;
        } else if (!strchr("\"\\/bfnrt", e) || e == 0) {
          return false;
        }
      }
      ++p;
    }
    if (p >= end) return false;
    ++p;
    return true;
  }
  // A non-negative integer in JSON's form (no leading zero), below 2^62.
  bool uint(uint64_t& v) {
    ws();
    if (p >= end || *p < '0' || *p > '9') return false;
    if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') return false;
    v = 0;
    int digits = 0;
    while (p < end && *p >= '0' && *p <= '9') {
      v = v * 10 + (*p - '0');
      ++p;
      if (++digits > 18) return false;
    }
    return true;
  }
  bool uint_array(std::vector<uint64_t>& out) {
    out.clear();
    if (!eat('[')) return false;
    if (eat(']')) return true;
    do {
      uint64_t v;
      if (!uint(v)) return false;
      out.push_back(v);
    } while (eat(','));
    return eat(']');
  }
};

struct Entry {
  std::string_view name, dtype, shape_text;
  const unsigned char* value_begin;
  const unsigned char* value_end;
  uint64_t start, end;
};

// One entry's value: {"dtype": ..., "shape": [...], "data_offsets": [a, b]}, each key once, no other.
bool read_entry(Reader& r, Entry& e, std::vector<uint64_t>& shape, std::vector<uint64_t>& offsets) {
  r.ws();
  e.value_begin = r.p;
  if (!r.eat('{')) return false;
  bool have_dtype = false, have_shape = false, have_offsets = false;
  do {
    std::string_view key;
    if (!r.plain_string(key) || !r.eat(':')) return false;
    if (key == "dtype") {
      if (have_dtype || !r.plain_string(e.dtype)) return false;
      have_dtype = true;
    } else if (key == "shape") {
      if (have_shape) return false;
      r.ws();
      const unsigned char* s = r.p;
      if (!r.uint_array(shape)) return false;
      e.shape_text = std::string_view(reinterpret_cast<const char*>(s), r.p - s);
      have_shape = true;
    } else if (key == "data_offsets") {
      if (have_offsets || !r.uint_array(offsets) || offsets.size() != 2) return false;
      have_offsets = true;
    } else {
      return false;
    }
  } while (r.eat(','));
  if (!r.eat('}') || !have_dtype || !have_shape || !have_offsets) return false;
  e.value_end = r.p;
  e.start = offsets[0];
  e.end = offsets[1];
  if (e.start > e.end) return false;
  int bits = dtype_bits(e.dtype);
  if (bits == 0) return false;
  // element count and bit count below 2^64 (headers.py refuses larger), byte count exact
  uint64_t numel = 1, total = 0;
  for (uint64_t d : shape)
    if (__builtin_mul_overflow(numel, d, &numel)) return false;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(bits), &total)) return false;
  if (total % 8 || total / 8 != e.end - e.start) return false;
  return true;
}

struct Out {
  char* buf;
  int64_t cap;
  int64_t len = 0;
  bool overflow = false;
  void put(const void* s, size_t n) {
    if (len + static_cast<int64_t>(n) > cap) { overflow = true; return; }
    memcpy(buf + len, s, n);
    len += n;
  }
  void put(std::string_view s) { put(s.data(), s.size()); }
  void put(const unsigned char* b, const unsigned char* e) { put(b, e - b); }
  void str(std::string_view s) { put("\"", 1); put(s); put("\"", 1); }
};

bool ends_with(std::string_view s, std::string_view t) {
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

int scan(const unsigned char* blob, int64_t n, int64_t data_len, Out& out) {
  if (n < 2 || data_len < 0 || !valid_utf8(blob, n)) return kNotAccepted;
  Reader r{blob, blob + n};
  if (!r.eat('{')) return kNotAccepted;
  std::vector<Entry> entries;
  entries.reserve(static_cast<size_t>(n / 96) + 1);
  std::vector<uint64_t> shape, offsets;
  const unsigned char *meta_begin = nullptr, *meta_end = nullptr;
  std::vector<std::vector<uint64_t>> shapes;  // of expert tensors only (kept for the groups)
  if (!r.eat('}')) {
    do {
      std::string_view key;
      if (!r.plain_string(key) || !r.eat(':')) return kNotAccepted;
      if (key == "__metadata__") {
        if (meta_begin) return kNotAccepted;
        r.ws();
        meta_begin = r.p;
        if (!r.eat('{')) return kNotAccepted;
        if (!r.eat('}')) {
          do {
            if (!r.any_string() || !r.eat(':') || !r.any_string()) return kNotAccepted;
          } while (r.eat(','));
          if (!r.eat('}')) return kNotAccepted;
        }
        meta_end = r.p;
        continue;
      }
      if (key.empty()) return kNotAccepted;  // would not survive the '\n'-joined name list
      Entry e;
      e.name = key;
      if (!read_entry(r, e, shape, offsets)) return kNotAccepted;
      entries.push_back(e);
    } while (r.eat(','));
    if (!r.eat('}')) return kNotAccepted;
  }
  r.ws();
  if (r.p != r.end) return kNotAccepted;

  // the offsets tile the data section exactly
  {
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    spans.reserve(entries.size());
    for (const Entry& e : entries) spans.emplace_back(e.start, e.end);
    std::sort(spans.begin(), spans.end());
    uint64_t pos = 0;
    for (const auto& [s, t] : spans) {
      if (s != pos) return kNotAccepted;
      pos = t;
    }
    if (pos != static_cast<uint64_t>(data_len)) return kNotAccepted;
  }

  // names, then the JSON part
  int64_t names_len = 0;
  for (const Entry& e : entries) names_len += e.name.size() + 1;
  if (names_len) --names_len;
  out.put(&names_len, 8);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i) out.put("\n", 1);
    out.put(entries[i].name);
  }
  // the same names sorted bytewise: `assemble` compares them with the index's (wna16_index_scan)
  {
    std::vector<std::string_view> sorted;
    sorted.reserve(entries.size());
    for (const Entry& e : entries) sorted.push_back(e.name);
    // writers emit names in order, so the sort is usually a check
    if (!std::is_sorted(sorted.begin(), sorted.end())) std::sort(sorted.begin(), sorted.end());
    // no name twice (json.loads would keep the last; the library refuses)
    for (size_t i = 1; i < sorted.size(); ++i)
      if (sorted[i] == sorted[i - 1]) return kNotAccepted;
    out.put(&names_len, 8);
    for (size_t i = 0; i < sorted.size(); ++i) {
      if (i) out.put("\n", 1);
      out.put(sorted[i]);
    }
  }
  out.put("{\"metadata\":");
  if (meta_begin) out.put(meta_begin, meta_end);
  else out.put("null");
  out.put(",\"plain\":{");
  bool first = true;
  std::vector<Group> groups;
  std::unordered_map<GroupKey, size_t, GroupKeyHash> group_of;
  bool ungrouped = false;  // an expert tensor's name with fewer than four dot-separated parts
  for (const Entry& e : entries) {
    std::string_view name = e.name;
    if (name.find(".experts.") == std::string_view::npos) {
      if (!first) out.put(",", 1);
      first = false;
      out.str(name);
      out.put(":", 1);
      out.put(e.value_begin, e.value_end);
      continue;
    }
    if (ends_with(name, ".weight_shape")) continue;
    // <prefix>.<expert>.<proj>.<suffix>, split at the last three dots
    size_t d3 = name.rfind('.');
    size_t d2 = d3 == 0 || d3 == std::string_view::npos ? std::string_view::npos : name.rfind('.', d3 - 1);
    size_t d1 = d2 == 0 || d2 == std::string_view::npos ? std::string_view::npos : name.rfind('.', d2 - 1);
    if (d1 == std::string_view::npos) { ungrouped = true; continue; }
    std::string_view prefix = name.substr(0, d1), expert = name.substr(d1 + 1, d2 - d1 - 1),
                     proj = name.substr(d2 + 1, d3 - d2 - 1), suffix = name.substr(d3 + 1);
    if (expert.find(',') != std::string_view::npos) return kNotAccepted;
    auto [it, fresh] = group_of.emplace(GroupKey{prefix, proj, suffix}, groups.size());
    if (fresh) {
      Group g;
      g.prefix = prefix;
      g.proj = proj;
      g.suffix = suffix;
      g.shape = e.shape_text;
      groups.push_back(std::move(g));
    }
    Group& g = groups[it->second];
    g.experts.push_back(expert);
    if (std::find(g.dtypes.begin(), g.dtypes.end(), e.dtype) == g.dtypes.end()) g.dtypes.push_back(e.dtype);
    if (!g.mixed && e.shape_text != g.shape) {
      // the same numbers may be spelt with other whitespace: compare them as numbers
      Reader a{reinterpret_cast<const unsigned char*>(g.shape.data()),
               reinterpret_cast<const unsigned char*>(g.shape.data() + g.shape.size())};
      Reader b{reinterpret_cast<const unsigned char*>(e.shape_text.data()),
               reinterpret_cast<const unsigned char*>(e.shape_text.data() + e.shape_text.size())};
      std::vector<uint64_t> x, y;
      a.uint_array(x);
      b.uint_array(y);
      if (x != y) g.mixed = true;
    }
  }
  out.put("},\"ungrouped\":");
  out.put(ungrouped ? "true" : "false");
  out.put(",\"groups\":[");
  for (size_t i = 0; i < groups.size(); ++i) {
    const Group& g = groups[i];
    if (i) out.put(",", 1);
    out.put("[", 1);
    out.str(g.prefix);
    out.put(",", 1);
    out.str(g.proj);
    out.put(",", 1);
    out.str(g.suffix);
    out.put(",\"", 2);
    for (size_t k = 0; k < g.experts.size(); ++k) {
      if (k) out.put(",", 1);
      out.put(g.experts[k]);
    }
    out.put("\",[", 3);
    for (size_t k = 0; k < g.dtypes.size(); ++k) {
      if (k) out.put(",", 1);
      out.str(g.dtypes[k]);
    }
    out.put("],", 2);
    if (g.mixed) out.put("null");
    else out.put(g.shape);
    out.put("]", 1);
  }
  out.put("]}");
  return out.overflow ? kTooSmall : kAccepted;
}

// Any JSON value, checked for form and skipped (the index's "metadata").  Numbers in JSON's form
// and at most 100 characters (Python's int() refuses very long ones); nesting at most 64 deep.
bool skip_value(Reader& r, int depth) {
  if (depth > 64) return false;
  r.ws();
  if (r.p >= r.end) return false;
  unsigned char c = *r.p;
  if (c == '"') return r.any_string();
  if (c == '{') {
    ++r.p;
    if (r.eat('}')) return true;
    do {
      if (!r.any_string() || !r.eat(':') || !skip_value(r, depth + 1)) return false;
    } while (r.eat(','));
    return r.eat('}');
  }
  if (c == '[') {
    ++r.p;
    if (r.eat(']')) return true;
    do {
      if (!skip_value(r, depth + 1)) return false;
    } while (r.eat(','));
    return r.eat(']');
  }
  for (const char* word : {"true", "false", "null"}) {
    size_t len = strlen(word);
    if (static_cast<size_t>(r.end - r.p) >= len && memcmp(r.p, word, len) == 0) {
      r.p += len;
      return true;
    }
  }
  const unsigned char* s = r.p;
  auto digits = [&r]() {
    const unsigned char* d = r.p;
    while (r.p < r.end && *r.p >= '0' && *r.p <= '9') ++r.p;
    return r.p - d;
  };
  if (r.p < r.end && *r.p == '-') ++r.p;
  if (r.p >= r.end || *r.p < '0' || *r.p > '9') return false;
  if (*r.p == '0') ++r.p;
  else digits();
  if (r.p < r.end && *r.p == '.') {
    ++r.p;
    if (digits() == 0) return false;
  }
  if (r.p < r.end && (*r.p == 'e' || *r.p == 'E')) {
    ++r.p;
    if (r.p < r.end && (*r.p == '+' || *r.p == '-')) ++r.p;
    if (digits() == 0) return false;
  }
  return r.p - s <= 100;
}

int scan_index(const unsigned char* blob, int64_t n, Out& out) {
  if (!valid_utf8(blob, n)) return kNotAccepted;
  Reader r{blob, blob + n};
  if (!r.eat('{')) return kNotAccepted;
  std::vector<std::pair<std::string_view, std::string_view>> pairs;  // (name, file)
  bool have_map = false;
  if (!r.eat('}')) {
    do {
      std::string_view key;
      if (!r.plain_string(key) || !r.eat(':')) return kNotAccepted;
      if (key != "weight_map") {
        if (!skip_value(r, 1)) return kNotAccepted;
        continue;
      }
      if (have_map || !r.eat('{')) return kNotAccepted;
      have_map = true;
      if (r.eat('}')) return kNotAccepted;  // empty: the Python reader words the error
      do {
        std::string_view name, file;
        if (!r.plain_string(name) || !r.eat(':') || !r.plain_string(file)) return kNotAccepted;
        pairs.emplace_back(name, file);
      } while (r.eat(','));
      if (!r.eat('}')) return kNotAccepted;
    } while (r.eat(','));
    if (!r.eat('}')) return kNotAccepted;
  }
  r.ws();
  if (r.p != r.end || !have_map) return kNotAccepted;
  // per file, in first-seen order: its names sorted bytewise.  A name given twice is refused when
  // both are for one file (json.loads would keep one); for two files the lists cannot both equal
  // the shards' (a checked shard set holds each name once), so `assemble` falls back and says so.
  std::vector<std::string_view> files;
  std::unordered_map<std::string_view, size_t> file_of;
  std::vector<std::vector<std::string_view>> names_of;
  std::string_view last_file;
  size_t last = 0;
  for (const auto& [name, file] : pairs) {
    if (files.empty() || file != last_file) {  // runs of one file are the rule
      auto [it, fresh] = file_of.emplace(file, files.size());
      if (fresh) {
        files.push_back(file);
        names_of.emplace_back();
      }
      last_file = file;
      last = it->second;
    }
    names_of[last].push_back(name);
  }
  int64_t count = static_cast<int64_t>(files.size());
  out.put(&count, 8);
  for (size_t f = 0; f < files.size(); ++f) {
    int64_t len = static_cast<int64_t>(files[f].size());
    out.put(&len, 8);
    out.put(files[f]);
    std::vector<std::string_view>& names = names_of[f];
    if (!std::is_sorted(names.begin(), names.end())) std::sort(names.begin(), names.end());
    for (size_t i = 1; i < names.size(); ++i)
      if (names[i] == names[i - 1]) return kNotAccepted;
    int64_t total = 0;
    for (std::string_view v : names) total += v.size() + 1;
    total -= 1;
    out.put(&total, 8);
    for (size_t i = 0; i < names.size(); ++i) {
      if (i) out.put("\n", 1);
      out.put(names[i]);
    }
  }
  return out.overflow ? kTooSmall : kAccepted;
}

}  // namespace

extern "C" {

WNA16_API int wna16_abi_version(void) { return WNA16_ABI_VERSION; }

/* Scan one safetensors header: `blob` is the n bytes of JSON after the 8-byte length, `data_len`
 * the bytes of tensor data that follow it in the file.  Returns 0 (accepted: `out` holds
 * u64 names_len | names joined by '\n' | JSON digest, `*out_len` bytes), 1 (not accepted: the
 * Python reader decides) or 2 (`cap` too small; nothing usable in `out`). */
WNA16_API int wna16_header_scan(const char* blob, int64_t n, int64_t data_len, char* out, int64_t cap,
                                int64_t* out_len) {
  Out o{out, cap};
  int rc = scan(reinterpret_cast<const unsigned char*>(blob), n, data_len, o);
  *out_len = o.len;
  return rc;
}

/* Scan a shard index (model.safetensors.index.json).  Returns 0 (accepted: `out` holds
 * i64 file count, then per file in first-seen order: i64 length | file name | i64 length | the
 * names the index assigns to it, sorted bytewise, joined by '\n'), 1 (not accepted: the Python
 * reader decides) or 2 (`cap` too small). */
WNA16_API int wna16_index_scan(const char* blob, int64_t n, char* out, int64_t cap, int64_t* out_len) {
  Out o{out, cap};
  int rc = scan_index(reinterpret_cast<const unsigned char*>(blob), n, o);
  *out_len = o.len;
  return rc;
}

}  // extern "C"
