// Host harness of csrc/nvfp4_mid.cu (see tests/test_csrc_host.py), compiled
// with the kernel's P_* defines; the kernel itself goes to PTX only.
#include "nvfp4_mid.cu"

#include "harness.h"

using namespace mid;

static void op_slot_offset(const word* in, std::vector<word>& out) {  // (r, t4, q) -> byte offset
  out.push_back(slot_offset((int)in[0], (int)in[1], (int)in[2]));
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "consts") == 0) {
    PRINT_CONST(MB);
    PRINT_CONST(ROW_SMEM);
    PRINT_CONST(U);
    PRINT_CONST(STAGE_BYTES);
    return 0;
  }
  static const Op ops[] = {{"slot_offset", 3, op_slot_offset}};
  return run_harness(argc, argv, ops, 1);
}
