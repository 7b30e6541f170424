// torch.ops.attention_ext_emu_delta: the delta rule's CUDA host steps
// (csrc/torch/linear_delta_cuda_steps.h, the same code as the real binding) and kernel
// (csrc/linear/cuda/delta_kernel.cuh, emu_delta_kernels.cpp) run by the host emulator on CPU
// tensors. delta_fwd / delta_step take the arguments of torch.ops.attention_ext.delta_fwd /
// delta_step. set_schedule: the warps' interleaving (cuda_emu.h), to shake out missing barriers.
// Unlike the real binding, out and the final state start as NaN (Device::kPoison), so an element
// the kernel fails to write fails the tests.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "emu_entry.h"  // set_schedule, launch stats
#include "linear/cuda/entry.h"
#include "torch/linear_delta_cuda_steps.h"

namespace {

using at::Tensor;

struct EmuDeltaDevice {
  static constexpr bool kPoison = true;
  static constexpr const char* kWhat = "attention_ext_emu_delta";

  void check_device(const Tensor& q) const {
    TORCH_CHECK(q.device().is_cpu(), "attention_ext_emu_delta: the emulator takes CPU tensors");
    TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble, "attention_ext_emu_delta: the CUDA kernels have no float64 path");
  }
  int guard(const Tensor&) const { return 0; }
  void delta_fwd(const attn::DeltaParamsT<float>& p, const attn::DeltaCudaKernels& k, const Tensor& scratch,
                 std::initializer_list<Tensor> reads) const {
    attn_emu::clear_global_ranges();
    for (const Tensor& t : reads) {
      if (t.numel() > 0) attn_emu::add_global_range(t.storage().data(), t.storage().nbytes());
    }
    if (scratch.defined()) attn_emu::add_global_range(scratch.data_ptr(), scratch.nbytes());
    attn::cuda_delta_fwd(p, k, scratch.defined() ? scratch.data_ptr() : nullptr, nullptr);
  }
  void delta_bwd(const attn::DeltaBwdParamsT<float>& p, const Tensor& scratch,
                 std::initializer_list<Tensor> reads) const {
    attn_emu::clear_global_ranges();
    for (const Tensor& t : reads) {
      if (t.numel() > 0) attn_emu::add_global_range(t.storage().data(), t.storage().nbytes());
    }
    attn_emu::add_global_range(scratch.data_ptr(), scratch.nbytes());
    attn::cuda_delta_bwd(p, scratch.data_ptr(), nullptr);
  }
};

std::tuple<Tensor, Tensor, Tensor> emu_delta_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS, bool checkpoints) {
  return attn::api::delta_cuda_fwd_steps(EmuDeltaDevice{}, q, k, v, beta, ATTN_DELTA_MAKE_OPTIONS(), checkpoints);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> emu_delta_bwd(
    const Tensor& dout, const std::optional<Tensor>& dfinal_state, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS, const std::optional<Tensor>& checkpoints) {
  return attn::api::delta_cuda_bwd_steps(EmuDeltaDevice{}, dout, dfinal_state, q, k, v, beta, ATTN_DELTA_MAKE_OPTIONS(),
                                         checkpoints);
}

Tensor emu_delta_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, Tensor state,
                      const std::optional<Tensor>& gate, double scale, bool qk_l2norm) {
  return attn::api::delta_cuda_step_steps(EmuDeltaDevice{}, q, k, v, beta, state, gate, scale, qk_l2norm);
}

void emu_delta_set_schedule(bool warp_serial, bool reverse) { attn_emu::set_schedule(warp_serial, reverse); }

// The kernel selection (entry.h DeltaCudaKernels) of the emulated module, as the real
// delta_set_cuda_kernels op sets it; returns the previous one.
int64_t emu_delta_set_chunked(int64_t chunked) {
  const int old = attn::cuda_delta_kernels().chunked;
  attn::cuda_delta_set_kernels(attn::DeltaCudaKernels{int(chunked)});
  return old;
}

std::vector<std::string> emu_delta_launches() { return attn_emu::take_launches(); }

// take_launch_stats() since the last call, flattened: 5 counts per launch (emu_entry.h LaunchStats)
std::vector<int64_t> emu_delta_launch_stats() {
  std::vector<int64_t> out;
  for (const auto& st : attn_emu::take_launch_stats()) {
    for (uint64_t f : {st.ctas, st.threads, st.mma, st.barriers, st.cp_async_bytes}) out.push_back(int64_t(f));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(attention_ext_emu_delta, m) {
  m.def("delta_fwd(Tensor q, Tensor k, Tensor v, Tensor beta" ATTN_DELTA_OPTIONS_SCHEMA
        ", bool checkpoints=False) -> (Tensor, Tensor, Tensor)",
        &emu_delta_fwd);
  m.def("delta_bwd(Tensor dout, Tensor? dfinal_state, Tensor q, Tensor k, Tensor v, Tensor beta" ATTN_DELTA_OPTIONS_SCHEMA
        ", Tensor? checkpoints=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        &emu_delta_bwd);
  m.def("delta_step(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor(a!) state, Tensor? gate, float scale, "
        "bool qk_l2norm) -> Tensor",
        &emu_delta_step);
  m.def("set_schedule(bool warp_serial, bool reverse) -> ()", &emu_delta_set_schedule);
  m.def("set_chunked(int chunked) -> int", &emu_delta_set_chunked);
  m.def("launches() -> str[]", &emu_delta_launches);
  m.def("launch_stats() -> int[]", &emu_delta_launch_stats);
}
