// Dynamic task scheduling on ATen's intra-op pool (OpenMP when built with -fopenmp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "kernels.h"

namespace attn {
namespace cpu {

// Runs make_worker()(task) for task in [0, n) on the intra-op pool, handing tasks out
// dynamically: tasks of one causal head differ in cost by up to S / kBlockM times, so a
// static split would leave threads idle. Callers number tasks most expensive first.
template <typename MakeWorker>
void parallel_tasks(int64_t n, int num_threads, const MakeWorker& make_worker) {
  if (n <= 0) return;
  int64_t workers = num_threads > 0 ? num_threads : at::get_num_threads();
  workers = std::max<int64_t>(1, std::min<int64_t>(workers, n));
  std::atomic<int64_t> next{0};
  // one chunk per worker; each worker then pulls tasks until none are left
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      auto worker = make_worker();  // per-thread scratch lives in the worker
      for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) worker(t);
    }
  });
}

}  // namespace cpu
}  // namespace attn
