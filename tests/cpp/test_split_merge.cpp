// Plain C++ checks of the split-KV merge (common/split_merge.h) that the CUDA combine kernel
// runs: rows of random logits, cut into splits (empty ones, fully masked ones, more splits than
// keys), each split reduced to (lse_s, O_s) as the split kernel does in float, then merged and
// compared against a direct float64 softmax over all keys, with and without a sink logit.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "common/split_merge.h"

#include "check.h"

constexpr double kNegInf = -INFINITY;

// One case: keys 0..n-1 with logits s (-inf = masked) and d-dim values v, cut into nsplit
// ranges of ceil(n / nsplit) keys (the kernel's cut; the last ones may be empty).
template <typename Acc>
void run_case(const std::vector<double>& s, const std::vector<double>& v, int d, int nsplit,
              bool has_sink, double sink, double tol, const char* what) {
  const int n = int(s.size());
  // float64 reference: softmax over keys and the sink
  double mx = has_sink ? sink : kNegInf;
  for (double x : s) mx = std::fmax(mx, x);
  std::vector<double> ref_o(d, 0.0);
  double ref_lse = kNegInf;
  if (mx != kNegInf) {
    double sum = has_sink ? std::exp(sink - mx) : 0.0;
    for (double x : s) sum += x == kNegInf ? 0.0 : std::exp(x - mx);
    ref_lse = mx + std::log(sum);
    for (int j = 0; j < n; ++j)
      if (s[j] != kNegInf)
        for (int c = 0; c < d; ++c) ref_o[c] += std::exp(s[j] - ref_lse) * v[j * d + c];
  }

  // the partials, in Acc, laid out (split, d) and (split)
  const int per = nsplit > 0 ? (n + nsplit - 1) / nsplit : 0;
  std::vector<Acc> lse(nsplit), o(size_t(nsplit) * d, Acc(0));
  for (int sp = 0; sp < nsplit; ++sp) {
    const int j0 = sp * per, j1 = std::min(n, j0 + per);
    Acc m = Acc(-INFINITY);
    for (int j = j0; j < j1; ++j) m = std::fmax(m, Acc(s[j]));
    if (m == Acc(-INFINITY)) {  // empty or fully masked: what the kernel writes
      lse[sp] = Acc(-INFINITY);
      continue;
    }
    Acc l = 0;
    for (int j = j0; j < j1; ++j)
      if (s[j] != kNegInf) l += attn::exp_acc(Acc(s[j]) - m);
    lse[sp] = m + attn::log_acc(l);
    for (int j = j0; j < j1; ++j)
      if (s[j] != kNegInf)
        for (int c = 0; c < d; ++c) o[sp * d + c] += attn::exp_acc(Acc(s[j]) - m) / l * Acc(v[j * d + c]);
  }

  // the merge, as the combine kernel does it
  const Acc got_lse = attn::merge_split_lse<Acc>(lse.data(), nsplit, 1, has_sink, Acc(sink));
  std::vector<Acc> got_o(d, Acc(0));
  for (int sp = 0; sp < nsplit; ++sp) {
    const Acc w = attn::split_weight<Acc>(lse[sp], got_lse);
    CHECK(!std::isnan(w), "%s: NaN weight of split %d", what, sp);
    for (int c = 0; c < d; ++c) got_o[c] += w * o[sp * d + c];
  }

  if (ref_lse == kNegInf) {
    CHECK(double(got_lse) == kNegInf, "%s: lse %g, want -inf", what, double(got_lse));
  } else {
    CHECK(std::fabs(double(got_lse) - ref_lse) <= tol * std::fmax(1.0, std::fabs(ref_lse)),
          "%s: lse %.9g, want %.9g", what, double(got_lse), ref_lse);
  }
  for (int c = 0; c < d; ++c) {
    CHECK(!std::isnan(double(got_o[c])) && std::fabs(double(got_o[c]) - ref_o[c]) <= tol,
          "%s: o[%d] %.9g, want %.9g", what, c, double(got_o[c]), ref_o[c]);
  }
}

template <typename Acc>
void run_all(double tol, const char* acc_name) {
  std::mt19937 rng(1234);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  const int d = 5;
  const int lens[] = {0, 1, 2, 7, 64, 129, 1000};
  const int splits[] = {1, 2, 3, 7, 64, 200};
  // masks: 0 none, 1 random 30% masked, 2 the first half masked (whole splits -inf),
  // 3 everything masked (lse = -inf without a sink, = sink with one, O = 0)
  for (int n : lens)
    for (int ns : splits)
      for (int mask = 0; mask < 4; ++mask)
        for (int sink_mode = 0; sink_mode < 3; ++sink_mode) {  // none, finite, -inf
          std::vector<double> s(n), v(size_t(n) * d);
          for (int j = 0; j < n; ++j) {
            s[j] = normal(rng);
            if (mask == 1 && unif(rng) < 0.3) s[j] = kNegInf;
            if (mask == 2 && j < n / 2) s[j] = kNegInf;
            if (mask == 3) s[j] = kNegInf;
          }
          for (double& x : v) x = normal(rng) / 3.0;
          // a sink far above the logits checks that it dominates without overflow
          const double sink = sink_mode == 2 ? kNegInf : (n % 2 ? normal(rng) : 40.0);
          char what[128];
          std::snprintf(what, sizeof(what), "%s n=%d splits=%d mask=%d sink=%d", acc_name, n, ns, mask,
                        sink_mode);
          run_case<Acc>(s, v, d, ns, sink_mode != 0, sink, tol, what);
        }
}

int main() {
  run_all<double>(1e-12, "double");
  run_all<float>(2e-5, "float");
  // large logits: exp() of unshifted values would overflow float
  run_case<float>({80.0, 85.0, kNegInf, 90.0}, {1, 2, 3, 4}, 1, 3, true, 88.0, 2e-5, "float large");
  if (failures == 0) std::printf("split merge: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
