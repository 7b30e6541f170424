// AMX tiles (Sapphire Rapids and later), shared by the int8 (cpu/q8dot.h) and bf16
// (cpu/bf16dot.h) products of the avx512bf16 level's "avx512amx" variant (isa.h's amx(), chosen
// at run time where the CPU has AMX-TILE, -INT8 and -BF16 and the OS granted the tile state).
//
// One configuration for every product: eight tiles of 16 rows x 64 bytes. Tiles 0-3 hold a
// (2, 2) block of (16, 16) float32 / int32 accumulators (32 rows x 32 columns, the B panels'
// width), 4-5 A's two 16-row blocks, 6-7 B's two 16-column halves; each A and B tile is loaded
// once per 64 bytes of k and used twice.
//
// The configuration lives for an AmxScope: a kernel's task opens one (nothing but our code runs
// in the thread until it closes), and a product outside any scope configures and releases the
// tiles itself. Other code in the thread, oneDNN's, loads its own configuration between our
// tasks; a thread holds no AMX state between them. Per product, ldtilecfg + tilerelease cost
// about 14% of a (48, 128, 128) bf16 product on a Sapphire Rapids-class core.
#pragma once

#include <cstdint>

#include "cpu/isa.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 18))
#include <immintrin.h>
#define ATTN_AMX 1
#define ATTN_AMX_FN __attribute__((target("amx-tile,amx-int8,amx-bf16")))

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// ldtilecfg's 64-byte operand (palette 1)
struct alignas(64) AmxTileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

ATTN_AMX_FN inline void amx_configure() {
  AmxTileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // ldtilecfg in asm with the whole struct as its operand: GCC 12's _tile_loadconfig does not tell
  // the optimizer that it reads all 64 bytes, and the rows / colsb stores were dropped as dead
  // (the tiles then stayed unconfigured: SIGILL at the first tile instruction)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// The accumulator tiles of a (16 MB, 16 NB) block, MB and NB 1 or 2: tile 2 i + j holds rows
// [16 i, 16 i + 16) and 4-byte columns [16 j, 16 j + 16) of a matrix whose rows are `stride` bytes
// apart (tile numbers are immediates: hence one helper per operation).
template <int MB, int NB>
ATTN_AMX_FN inline void amx_acc_zero() {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (MB == 2) _tile_zero(2);
  if constexpr (MB == 2 && NB == 2) _tile_zero(3);
}
template <int MB, int NB>
ATTN_AMX_FN inline void amx_acc_load(const void* base, int64_t stride) {
  const char* p = static_cast<const char*>(base);
  _tile_loadd(0, p, stride);
  if constexpr (NB == 2) _tile_loadd(1, p + 64, stride);
  if constexpr (MB == 2) _tile_loadd(2, p + 16 * stride, stride);
  if constexpr (MB == 2 && NB == 2) _tile_loadd(3, p + 16 * stride + 64, stride);
}
template <int MB, int NB>
ATTN_AMX_FN inline void amx_acc_store(void* base, int64_t stride) {
  char* p = static_cast<char*>(base);
  _tile_stored(0, p, stride);
  if constexpr (NB == 2) _tile_stored(1, p + 64, stride);
  if constexpr (MB == 2) _tile_stored(2, p + 16 * stride, stride);
  if constexpr (MB == 2 && NB == 2) _tile_stored(3, p + 16 * stride + 64, stride);
}

// open AmxScopes in this thread
inline thread_local int amx_scope_depth = 0;

// The tiles configured from construction to destruction where the "avx512amx" variant runs; a
// no-op elsewhere.
struct AmxScope {
  const bool on;
  ATTN_AMX_FN AmxScope() : on(amx()) {
    if (on && amx_scope_depth++ == 0) amx_configure();
  }
  ATTN_AMX_FN ~AmxScope() {
    if (on && --amx_scope_depth == 0) _tile_release();
  }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

// A product's own configuration where no AmxScope is open
struct AmxCall {
  const bool own = amx_scope_depth == 0;
  ATTN_AMX_FN AmxCall() {
    if (own) amx_configure();
  }
  ATTN_AMX_FN ~AmxCall() {
    if (own) _tile_release();
  }
  AmxCall(const AmxCall&) = delete;
  AmxCall& operator=(const AmxCall&) = delete;
};

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
#else
namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN
struct AmxScope {};
ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
#endif
