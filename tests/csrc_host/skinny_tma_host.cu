// Host harness of csrc/dsv3_fused_a_gemm_tma.cu (see
// tests/test_skinny_tma_model.py), compiled with the kernel's FA_* defines
// (FA_SMEM_BYTES from the Python launcher: the kernel's static_assert checks
// it); the kernel itself goes to PTX only.  Every op returns the kernel's own
// index functions (namespace fat) over the records it is given.
#include "dsv3_fused_a_gemm_tma.cu"

#include "harness.h"

using namespace fat;

#define OP1(name, expr) \
  static void op_##name(const word* in, std::vector<word>& out) { out.push_back((word)(expr)); }

static void op_work(const word* in, std::vector<word>& out) {  // (tile0, step, rank) -> Work, x range
  const Work wk = make_work((int)in[0], (int)in[1], (int)in[2]);
  const int v[] = {wk.tile0, wk.step, wk.ntile, wk.c_begin, wk.cpt, wk.total, wk.x_k0(), wk.x_len()};
  out.insert(out.end(), v, v + 8);
}

static void op_sequence(const word* in, std::vector<word>& out) {  // (tile0, step, rank, g) -> tile, chunk
  const Work wk = make_work((int)in[0], (int)in[1], (int)in[2]);
  out.push_back((word)wk.tile((int)in[3]));
  out.push_back((word)wk.chunk((int)in[3]));
}

OP1(tile_rows, tile_rows((int)in[0]))
OP1(chunk_len, chunk_len((int)in[0]))
OP1(stage_w, stage_w((int)in[0]))
OP1(lane_w, lane_w((int)in[0], (int)in[1]))
OP1(lane_x, lane_x((int)in[0], (int)in[1]))
OP1(read_w, read_w((int)in[0]))
OP1(read_x, read_x((int)in[0], (int)in[1]))
OP1(row_w, row_w((int)in[0], (int)in[1]))
OP1(row_x, row_x((int)in[0]))
OP1(unit_off, unit_off((int)in[0]))
OP1(warp_tg, warp_tg((int)in[0]))
OP1(warp_kg, warp_kg((int)in[0]))
OP1(subtile, subtile((int)in[0], (int)in[1]))
OP1(unit_of, unit_of((int)in[0], (int)in[1]))
OP1(acc_row, acc_row((int)in[0], (int)in[1]))
OP1(acc_mm, acc_mm((int)in[0], (int)in[1]))
OP1(elem, elem((int)in[0], (int)in[1]))
OP1(elem_mm, elem_mm((int)in[0]))
OP1(elem_r, elem_r((int)in[0]))
OP1(owner_of, owner_of((int)in[0]))
OP1(inbox_base, inbox_base((int)in[0]))
OP1(inbox_index, inbox_index((int)in[0]))

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "consts") == 0) {
    PRINT_CONST(N);
    PRINT_CONST(K);
    PRINT_CONST(ROWS);
    PRINT_CONST(NT);
    PRINT_CONST(SPLIT);
    PRINT_CONST(CHUNK);
    PRINT_CONST(STAGES);
    PRINT_CONST(CW);
    PRINT_CONST(MB);
    PRINT_CONST(MF);
    PRINT_CONST(XRES);
    PRINT_CONST(TG);
    PRINT_CONST(WT);
    PRINT_CONST(KW);
    PRINT_CONST(TILES);
    PRINT_CONST(CHUNKS);
    PRINT_CONST(UNITS);
    PRINT_CONST(UPW);
    PRINT_CONST(EVEN_UNITS);
    PRINT_CONST(PITCH);
    PRINT_CONST(XPITCH);
    PRINT_CONST(STAGE_W);
    PRINT_CONST(STAGE_BYTES);
    PRINT_CONST(RING_BYTES);
    PRINT_CONST(XRES_BYTES);
    PRINT_CONST(TILE);
    PRINT_CONST(PER);
    PRINT_CONST(RED_BYTES);
    PRINT_CONST(INBOX_BYTES);
    PRINT_CONST(BAR_OFF);
    PRINT_CONST(SMEM);
    return 0;
  }
  static const Op ops[] = {
      {"work", 3, op_work},         {"sequence", 4, op_sequence}, {"tile_rows", 1, op_tile_rows},
      {"chunk_len", 1, op_chunk_len}, {"stage_w", 1, op_stage_w},   {"lane_w", 2, op_lane_w},
      {"lane_x", 2, op_lane_x},     {"read_w", 1, op_read_w},     {"read_x", 2, op_read_x},
      {"row_w", 2, op_row_w},       {"row_x", 1, op_row_x},       {"unit_off", 1, op_unit_off},
      {"warp_tg", 1, op_warp_tg},   {"warp_kg", 1, op_warp_kg},   {"subtile", 2, op_subtile},
      {"unit_of", 2, op_unit_of},   {"acc_row", 2, op_acc_row},   {"acc_mm", 2, op_acc_mm},
      {"elem", 2, op_elem},         {"elem_mm", 1, op_elem_mm},   {"elem_r", 1, op_elem_r},
      {"owner_of", 1, op_owner_of}, {"inbox_base", 1, op_inbox_base}, {"inbox_index", 1, op_inbox_index},
  };
  return run_harness(argc, argv, ops, sizeof(ops) / sizeof(ops[0]));
}
