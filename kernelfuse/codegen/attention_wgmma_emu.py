"""The CPU emulation (KF_EMULATION) of the bf16 wgmma products that kernelfuse.codegen.attention_wgmma's kernel and
its warp-specialized form (attention_wgmma_ws) issue: kf_wg's descriptors carry the hardware's fields (desc_fields:
layout type, leading and stride byte offsets) beside the tile's host address, and each thread computes its own
accumulator fragment, reading the swizzled tiles through the hardware's addressing as the PTX ISA defines it for each
swizzle mode (the canonical K-major and MN-major layouts, then address bits 4.. XORed with bits 7..) and A's register
fragments gathered from its quad. The products are done when they return (their asynchrony is not emulated), so the
pins and waits are nothing. attention_wgmma's prelude places this text in namespace kf_wg, in its emulation branch.
"""

WGA_EMULATION = r"""
// The emulation's descriptor: the hardware's fields (desc_fields, decoded below as the tensor cores decode them) and
// the host address in place of the 18-bit shared one.
struct desc_t {
  uint64_t fields;
  const char* start;
};
template <int SW> inline desc_t desc_b16(const void* tile, int offset, int leading) {
  return {desc_fields<SW>(leading), (const char*)tile + offset};
}
// element (k, mn) of the operand at descriptor d, as the tensor cores address it (PTX ISA, "Shared Memory Matrix
// Layout": the canonical layouts, rows of sw = 128, 64 or 32 bytes by the layout type): K-major rows (the M or N
// index) sw bytes apart in groups of 8 the stride byte offset apart, k along the row; MN-major: k's rows sw bytes
// apart in groups of 8 the stride byte offset apart, sw / 2 mn a row, atoms of sw / 2 columns the leading byte
// offset apart; then the swizzle on the address, Swizzle<log2(sw / 16), 4, 3>: bits 4.. ^= bits 7.. (the tiles
// start on the pattern's boundary: base offset 0). Layout type 0 (no swizzle) is not one this kernel sets.
inline float b16_at(const desc_t& d, int k, int mn, bool mn_major) {
  const uintptr_t leading = (d.fields >> 16 & 0x3FFF) << 4, stride = (d.fields >> 32 & 0x3FFF) << 4;
  const int sw = 256 >> (d.fields >> 62), aw = sw / 2;
  uintptr_t a = (uintptr_t)d.start;
  if (mn_major)
    a += (mn / aw) * leading + (k / 8) * stride + (k % 8) * sw + (mn % aw) * 2;
  else
    a += (mn / 8) * stride + (mn % 8) * sw + k * 2;
  a ^= ((a >> 7) & (sw / 16 - 1)) << 4;
  return __uint_as_float((unsigned)*reinterpret_cast<const unsigned short*>(a) << 16);
}
// d (this thread's m64nN fragment: rows row and row + 8, columns 8j + 2t and + 1) += A's two rows' 16 k times B
template <int N> inline void mma_b16_fragment(float (&d)[N / 2], const float (&rows)[2][16], const desc_t& b,
                                              bool trans_b) {
  const int t = threadIdx.x % 4;
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * j + 2 * t + (e & 1);
      float v = d[4 * j + e];
      for (int k = 0; k < 16; ++k) v = fmaf(rows[e >> 1][k], b16_at(b, k, c, trans_b), v);
      d[4 * j + e] = v;
    }
}
inline int fragment_row() { return threadIdx.x % 128 / 32 * 16 + threadIdx.x % 32 / 4; }
template <int NN> inline void mma_bf16_ss(float (&d)[NN], const desc_t& a, const desc_t& b, int accumulate) {
  if (!accumulate)
    for (float& v : d) v = 0.0f;
  float rows[2][16];
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 16; ++k) rows[h][k] = b16_at(a, k, fragment_row() + 8 * h, false);
  mma_b16_fragment<2 * NN>(d, rows, b, false);
}
// A from registers: a[0] (row, k 2t..+1), a[1] (row + 8, the same), a[2] (row, k 2t + 8..+9), a[3] (row + 8, the
// same), low half the lower k; the thread gathers its rows' 16 k from its quad
static unsigned emu_words[1024][4];
template <int NN> inline void mma_bf16_rs(float (&d)[NN], const unsigned (&a)[4], const desc_t& b) {
  for (int i = 0; i < 4; ++i) emu_words[threadIdx.x][i] = a[i];
  __syncwarp();
  const int quad = threadIdx.x / 4 * 4;
  float rows[2][16];
  for (int t = 0; t < 4; ++t)
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 2; ++e) {
        rows[h][2 * t + e] = kf_bf16_float((unsigned short)(emu_words[quad + t][h] >> (16 * e)));
        rows[h][2 * t + 8 + e] = kf_bf16_float((unsigned short)(emu_words[quad + t][2 + h] >> (16 * e)));
      }
  __syncwarp();
  mma_b16_fragment<2 * NN>(d, rows, b, true);
}
template <int N> inline void pin(float (&)[N]) {}
template <int N> inline void pin(unsigned (&)[N][4]) {}
inline float ex2(float x) { return exp2f(x); }
"""
