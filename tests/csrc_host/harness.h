// Shared by the host harnesses of tests/test_csrc_host.py: each harness is
// run as `harness <op> <in> <out>`, reads the uint32 words of file <in>, maps
// them through the helper named <op> (record by record) and writes the
// resulting uint32 words to <out>.  `harness consts - -` prints NAME=value
// lines of a harness's compile-time constants (print_consts, if it has any).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

typedef unsigned int word;

struct Io {
  std::vector<word> in, out;
};

inline bool read_words(const char* path, std::vector<word>& v) {
  FILE* f = std::fopen(path, "rb");
  if (!f) return false;
  word w;
  while (std::fread(&w, 4, 1, f) == 1) v.push_back(w);
  std::fclose(f);
  return true;
}

inline bool write_words(const char* path, const std::vector<word>& v) {
  FILE* f = std::fopen(path, "wb");
  if (!f) return false;
  const bool ok = v.empty() || std::fwrite(v.data(), 4, v.size(), f) == v.size();
  return std::fclose(f) == 0 && ok;
}

// Runs op(in record, out) over records of `width` words; false for an unknown op.
#define PRINT_CONST(x) std::printf("%s=%lld\n", #x, (long long)(x))

typedef void (*OpFn)(const word* rec, std::vector<word>& out);
struct Op {
  const char* name;
  int width;
  OpFn fn;
};

inline int run_harness(int argc, char** argv, const Op* ops, int n_ops) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <op> <in> <out>\n", argv[0]);
    return 2;
  }
  for (int i = 0; i < n_ops; ++i) {
    if (std::strcmp(ops[i].name, argv[1]) != 0) continue;
    Io io;
    if (!read_words(argv[2], io.in)) {
      std::fprintf(stderr, "cannot read %s\n", argv[2]);
      return 2;
    }
    const int w = ops[i].width;
    if (w > 0 && io.in.size() % w != 0) {
      std::fprintf(stderr, "%s: %zu words is not a whole number of %d-word records\n", argv[1], io.in.size(), w);
      return 2;
    }
    if (w == 0) {
      ops[i].fn(nullptr, io.out);
    } else {
      for (size_t r = 0; r < io.in.size(); r += w) ops[i].fn(&io.in[r], io.out);
    }
    return write_words(argv[3], io.out) ? 0 : 2;
  }
  std::fprintf(stderr, "unknown op %s\n", argv[1]);
  return 2;
}
