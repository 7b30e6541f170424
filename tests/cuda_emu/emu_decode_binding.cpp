// torch.ops.attention_ext_emu_decode.decode_fwd: the CUDA decode op's host steps
// (csrc/torch/decode_cuda_steps.h, the same code as the real binding) and kernels
// (csrc/decode/cuda, emu_decode_kernels.cpp) run by the host emulator on CPU tensors. Arguments:
// those of torch.ops.attention_ext.decode_fwd plus `sms`, the SM count the split heuristic sees.
// set_schedule: the warps' interleaving (cuda_emu.h), to shake out missing barriers.
// set_kernels: the kernel selection (decode/cuda/entry.h DecodeCudaKernels).
// set_capturing: the host steps act as under a CUDA-graph capture (no host read of the index
// values; they are clamped instead). Ambient state, as a stream's capture status is on a GPU, and
// the same setter as the softmax emulator's (emulator.capture() sets both).
// Unlike the real binding, out, lse and the split scratch start as NaN (Device::kPoison), so an
// element the kernels fail to write fails the tests.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "decode/cuda/entry.h"
#include "emu_entry.h"  // set_schedule
#include "torch/decode_cuda_steps.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;

bool g_capturing = false;

struct EmuDecodeDevice {
  static constexpr bool kPoison = true;
  static constexpr const char* kWhat = "attention_ext_emu_decode";
  int sms;

  void check_device(const Tensor& q) const {
    TORCH_CHECK(q.device().is_cpu(), "attention_ext_emu_decode: the emulator takes CPU tensors");
    TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble, "attention_ext_emu_decode: the CUDA kernels have no float64 path");
  }
  int guard(const Tensor&) const { return 0; }
  int sm_count() const { return sms; }
  bool capturing() const { return g_capturing; }
  void decode_fwd(const attn::DecodeParams& p, attn::DType dt, int splits, float* part_o, float* part_lse) const {
    attn::cuda_decode_fwd(p, dt, splits, part_o, part_lse, nullptr);
  }
};

std::tuple<Tensor, Tensor> emu_decode_fwd(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                          const OptTensor& seqlens_k, const OptTensor& block_table,
                                          const OptTensor& cache_batch_idx, const OptTensor& leftpad_k,
                                          const OptTensor& alibi_slopes, const OptTensor& sinks, double scale,
                                          double softcap, int64_t window_left, int64_t window_right,
                                          int64_t num_splits, int64_t sms, const OptTensor& k_descale,
                                          const OptTensor& v_descale) {
  // cp.async (the tensor-core kernel) may read only from the caches
  attn_emu::clear_global_ranges();
  for (const Tensor* t : {&k_cache, &v_cache}) {
    if (t->numel() > 0) attn_emu::add_global_range(t->storage().data(), t->storage().nbytes());
  }
  const attn::api::DecodeArgs a{q, k_cache, v_cache, seqlens_k, block_table, cache_batch_idx, leftpad_k,
                                alibi_slopes, sinks, scale, softcap, window_left, window_right, num_splits,
                                k_descale, v_descale};
  return attn::api::decode_cuda_steps(EmuDecodeDevice{int(sms)}, a);
}

// The split count the heuristic picks for (B * H_k) CTAs, the longest sequence and `sms` SMs.
int64_t emu_decode_num_splits(int64_t ctas, int64_t sms, int64_t max_keys, int64_t requested) {
  return attn::decode_num_splits_heuristic(ctas, int(sms), max_keys, requested);
}

void emu_decode_set_schedule(bool warp_serial, bool reverse) { attn_emu::set_schedule(warp_serial, reverse); }

void emu_decode_set_capturing(bool capturing) { g_capturing = capturing; }

// The kernel selection of the real op (decode/cuda/entry.h), on the emulator's copy of dispatch.cu.
// The kernels launched since the last call (which decode kernel a call took).
std::vector<std::string> emu_decode_launches() { return attn_emu::take_launches(); }

// take_launch_stats() since the last call, flattened: 5 counts per launch (emu_entry.h LaunchStats)
std::vector<int64_t> emu_decode_launch_stats() {
  std::vector<int64_t> out;
  for (const auto& st : attn_emu::take_launch_stats()) {
    for (uint64_t f : {st.ctas, st.threads, st.mma, st.barriers, st.cp_async_bytes}) out.push_back(int64_t(f));
  }
  return out;
}

void emu_decode_set_kernels(bool tensor_cores, bool quantized) {
  attn::cuda_decode_set_kernels(attn::DecodeCudaKernels{tensor_cores, quantized});
}

}  // namespace

TORCH_LIBRARY(attention_ext_emu_decode, m) {
  m.def("decode_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? seqlens_k, Tensor? block_table, "
        "Tensor? cache_batch_idx, Tensor? leftpad_k, Tensor? alibi_slopes, Tensor? sinks, float scale, "
        "float softcap, int window_left, int window_right, int num_splits, int sms, Tensor? k_descale=None, "
        "Tensor? v_descale=None) -> "
        "(Tensor, Tensor)",
        &emu_decode_fwd);
  m.def("num_splits(int ctas, int sms, int max_keys, int requested) -> int", &emu_decode_num_splits);
  m.def("set_schedule(bool warp_serial, bool reverse) -> ()", &emu_decode_set_schedule);
  m.def("set_capturing(bool capturing) -> ()", &emu_decode_set_capturing);
  m.def("set_kernels(bool tensor_cores, bool quantized=True) -> ()", &emu_decode_set_kernels);
  m.def("launches() -> str[]", &emu_decode_launches);
  m.def("launch_stats() -> int[]", &emu_decode_launch_stats);
}
