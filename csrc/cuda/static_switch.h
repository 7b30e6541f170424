// Run-time head dim -> compile-time head-dim bucket, for every launcher switch.
//
// Head dims that are not a bucket run in the next bucket up (64, 128, 256): the kernels
// zero-fill and predicate the columns past d. A developer build can compile buckets out
// (-DATTN_CUDA_SKIP_HDIM64 / 128 / 256, setup.py's ATTENTION_EXT_CUDA_SKIP); a switch never
// instantiates a launcher for a bucket that was left out, so its instantiation file may be absent.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

namespace attn {

constexpr int bucket_for_head_dim(int d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }

constexpr bool hdim_compiled(int bucket) {
  switch (bucket) {
#if !defined(ATTN_CUDA_SKIP_HDIM64)
    case 64: return true;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM128)
    case 128: return true;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM256)
    case 256: return true;
#endif
    default: return false;
  }
}

namespace detail {
template <int kB, typename F>
bool hdim_case(int bucket, F& f) {
  if constexpr (hdim_compiled(kB)) {
    if (bucket == kB) {
      f(std::integral_constant<int, kB>{});
      return true;
    }
  }
  return false;
}
}  // namespace detail

// Calls f(std::integral_constant<int, kD>{}) with kD the bucket of head dim d, if kD is one of
// kBuckets and compiled in; else throws naming `what`. The callers' predicates (use_tensor_cores,
// use_hopper_fwd ...) never send a bucket that is not there, so the throw is a guard.
template <int... kBuckets, typename F>
void hdim_switch(int d, const char* what, F&& f) {
  const int bucket = bucket_for_head_dim(d);
  if (!(detail::hdim_case<kBuckets>(bucket, f) || ...)) {
    throw std::runtime_error(std::string(what) + ": no kernel for head-dim bucket " + std::to_string(bucket) +
                             " in this build");
  }
}

}  // namespace attn
