// Unit tests of the CUDA emulator (csrc/cuda/emu), run by tests/test_cuda_emulated.py:
//   - mma.cuh's ldmatrix / mma.sync path, with the SmemTile addressing the kernels use, computes
//     the products the kernels expect (Q K^T with lane_a / lane_b, P V with lane_bt);
//   - what the emulator must refuse: a barrier or collective that cannot complete, a warp whose
//     lanes reach different collectives, shared memory past the launch's size;
//   - a read of another warp's cp.async data without a barrier sees the NaN fill.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda/mma.cuh"

using namespace attn::tc;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what.c_str());
    ++failures;
  }
}
void expect_error(const std::function<void()>& fn, const std::string& needle, const std::string& what) {
  try {
    fn();
    expect(false, what + ": no error");
  } catch (const std::runtime_error& e) {
    expect(std::string(e.what()).find(needle) != std::string::npos, what + ": got '" + e.what() + "'");
  }
}

using Tile = SmemTile<16, 64>;  // (16, 64) bf16: rows of 128 bytes, the 8-chunk swizzle

// A (16 x 16), Bn (16 n-rows x 16 k), Bk (16 k-rows x 16 n), row-major fp32 values exact in bf16.
struct Mats {
  float a[16][16], bn[16][16], bk[16][16];
};

// C1 = A Bn^T (the S = Q K^T read: lane_a, lane_b) and C2 = A Bk (the P V read: lane_bt),
// both (16, 16) as two n-tiles.
__global__ void matmul_kernel(const __nv_bfloat16* a, const __nv_bfloat16* bn, const __nv_bfloat16* bk,
                              float* c1, float* c2) {
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sA = smem_u32(smem), sBn = sA + Tile::kBytes, sBk = sBn + Tile::kBytes;
  const int lane = threadIdx.x;
  load_tile_async<16, 64, 32>(sA, a, 16, 16, 16, lane);
  load_tile_async<16, 64, 32>(sBn, bn, 16, 16, 16, lane);
  load_tile_async<16, 64, 32>(sBk, bk, 16, 16, 16, lane);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t fa[4], fb[4], fbt[4];
  ldmatrix_x4(fa, sA + Tile::lane_a(0, lane));
  ldmatrix_x4(fb, sBn + Tile::lane_b(0, lane));
  ldmatrix_x4_trans(fbt, sBk + Tile::lane_bt(0, lane));
  float acc1[8] = {}, acc2[8] = {};
  mma_n16<__nv_bfloat16>(acc1, fa, fb);
  mma_n16<__nv_bfloat16>(acc2, fa, fbt);
  const int g = lane >> 2, c = lane & 3;
  for (int nt = 0; nt < 2; ++nt)
    for (int e = 0; e < 4; ++e) {
      const int i = g + (e >> 1) * 8, j = nt * 8 + 2 * c + (e & 1);
      c1[i * 16 + j] = acc1[4 * nt + e];
      c2[i * 16 + j] = acc2[4 * nt + e];
    }
}

void test_matmul() {
  Mats m;
  std::vector<__nv_bfloat16> a(256), bn(256), bk(256);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      // small integers: exact in bf16 and in any summation order
      m.a[i][j] = float((i * 7 + j * 3) % 11 - 5);
      m.bn[i][j] = float((i * 5 + j * 13) % 9 - 4);
      m.bk[i][j] = float((i * 3 + j * 11) % 7 - 3);
      a[i * 16 + j] = __float2bfloat16_rn(m.a[i][j]);
      bn[i * 16 + j] = __float2bfloat16_rn(m.bn[i][j]);
      bk[i * 16 + j] = __float2bfloat16_rn(m.bk[i][j]);
    }
  std::vector<float> c1(256, NAN), c2(256, NAN);
  attn_emu::clear_global_ranges();
  for (auto* v : {&a, &bn, &bk}) attn_emu::add_global_range(v->data(), v->size() * 2);
  attn_emu::launch(matmul_kernel, dim3(1), dim3(32), 3 * Tile::kBytes, nullptr)(a.data(), bn.data(), bk.data(),
                                                                               c1.data(), c2.data());
  int bad = 0;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float r1 = 0.f, r2 = 0.f;
      for (int k = 0; k < 16; ++k) {
        r1 += m.a[i][k] * m.bn[j][k];
        r2 += m.a[i][k] * m.bk[k][j];
      }
      bad += c1[i * 16 + j] != r1;
      bad += c2[i * 16 + j] != r2;
    }
  expect(bad == 0, "ldmatrix + mma products (" + std::to_string(bad) + " wrong elements)");
}

__global__ void deadlock_kernel() {
  if (threadIdx.x >= 32) {
    __syncthreads();  // warp 1 at the barrier ...
  } else if (threadIdx.x != 0) {
    __shfl_xor_sync(0xffffffffu, 1.f, 1);  // ... warp 0 in a shuffle that lane 0 left
  }
}

__global__ void diverge_kernel() {
  ATTN_EXTERN_SMEM(smem);
  uint32_t r[4];
  if (threadIdx.x < 16) {
    __shfl_xor_sync(0xffffffffu, 1.f, 1);
  } else {
    ldmatrix_x4(r, smem_u32(smem));
  }
}

__global__ void oob_kernel() {
  ATTN_EXTERN_SMEM(smem);
  st_shared_b32(smem_u32(smem) + 1024, 1u);  // the launch has 1024 bytes
}

// Warp 1 loads a row with cp.async; warp 0 reads it with no barrier in between.
__global__ void race_kernel(const float* src, float* out, bool barrier) {
  ATTN_EXTERN_SMEM(smem);
  const uint32_t s = smem_u32(smem);
  if (threadIdx.x == 32) {
    cp_async16(s, src, true);
    cp_async_commit();
    cp_async_wait<0>();
  }
  if (barrier) __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<uint4*>(out) = ld_shared_v4(s);
}

void test_refusals() {
  expect_error([] { attn_emu::launch(deadlock_kernel, dim3(1), dim3(64), 0, nullptr)(); }, "deadlock", "deadlock");
  expect_error([] { attn_emu::launch(diverge_kernel, dim3(1), dim3(32), 1024, nullptr)(); }, "diverged",
               "divergent collectives");
  expect_error([] { attn_emu::launch(oob_kernel, dim3(1), dim3(32), 1024, nullptr)(); }, "past the 1024 bytes",
               "shared memory bounds");
  expect_error([] { attn_emu::launch(oob_kernel, dim3(1), dim3(32), 64 * 1024, nullptr)(); },
               "MaxDynamicSharedMemorySize", "large shared memory without the attribute");
}

void test_race() {
  alignas(16) float src[4] = {1.f, 2.f, 3.f, 4.f};
  alignas(16) float out[4];
  attn_emu::clear_global_ranges();
  attn_emu::add_global_range(src, sizeof(src));
  for (bool barrier : {false, true}) {
    attn_emu::launch(race_kernel, dim3(1), dim3(64), 64, nullptr)(src, out, barrier);
    const bool seen = out[0] == 1.f && out[3] == 4.f;
    expect(barrier ? seen : std::isnan(out[0]), barrier ? "data after the barrier" : "NaN without the barrier");
  }
}

}  // namespace

int main() {
  // the default interleaving (test_race expects warp 0 to read before warp 1 copies)
  attn_emu::set_schedule(/*warp_serial=*/true, /*reverse=*/false);
  attn_emu::set_arch(90);
  test_matmul();
  test_refusals();
  test_race();
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
