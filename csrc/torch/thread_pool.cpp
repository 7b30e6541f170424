// csrc/cpu/parallel.h's pool, bound to ATen's intra-op thread pool.
#include <ATen/Parallel.h>

#include "cpu/parallel.h"

namespace attn {
namespace cpu {

int pool_threads() { return at::get_num_threads(); }

void pool_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) { body(i0, i1); });
}

}  // namespace cpu
}  // namespace attn
