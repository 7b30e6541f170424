// The attention_ext op library: every op's schema, the developer kernel selection, and the
// Python module attention_ext._C (what was compiled, for `python -m attention_ext info`). Each
// family x device registers its kernels in its own binding file (softmax_cpu.cpp,
// softmax_cuda.cpp, linear_cpu.cpp).
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cpu/isa.h"            // the ISA levels, simd_width
#include "cpu/memory.h"         // BlockCache
#include "peak/cpu/entry.h"     // peak_loop
#if defined(ATTN_WITH_CUDA)
#include "decode/cuda/entry.h"   // cuda_decode_set_kernels
#include "linear/cuda/entry.h"   // cuda_linear_set_kernels
#include "softmax/cuda/entry.h"  // cuda_set_kernels
#endif
#include "torch/decode_binding.h"   // ATTN_DECODE_SCHEMA
#include "torch/linear_binding.h"   // ATTN_LINEAR_OPTIONS_SCHEMA
#include "torch/linear_delta_binding.h"    // ATTN_DELTA_OPTIONS_SCHEMA
#include "torch/softmax_binding.h"  // ATTN_SOFTMAX_OPTIONS_SCHEMA

namespace {

// The developer-only selection of experimental CUDA kernels (attn::CudaKernels); without the
// CUDA kernels it only checks its arguments.
void set_cuda_kernels(int64_t hopper_fwd, int64_t hopper_bwd, int64_t tune_fwd, int64_t tune_bwd, bool force_simt) {
  TORCH_CHECK_VALUE(hopper_fwd >= 0 && hopper_fwd <= 2, "attention_ext.set_cuda_kernels: hopper_fwd must be 0, 1 or 2, got ",
                    hopper_fwd);
  TORCH_CHECK_VALUE(hopper_bwd >= 0 && hopper_bwd <= 2, "attention_ext.set_cuda_kernels: hopper_bwd must be 0, 1 or 2, got ",
                    hopper_bwd);
  TORCH_CHECK_VALUE(tune_fwd >= 0 && tune_bwd >= 0, "attention_ext.set_cuda_kernels: tune_fwd and tune_bwd must be >= 0, got ",
                    tune_fwd, ", ", tune_bwd);
#if defined(ATTN_WITH_CUDA)
  attn::cuda_set_kernels(attn::CudaKernels{int(hopper_fwd), int(hopper_bwd), int(tune_fwd), int(tune_bwd), force_simt});
#endif
}

// The linear family's CUDA forward schedule (attn::LinearCudaKernels); without the CUDA kernels
// it only checks its arguments.
void linear_set_cuda_kernels(bool chunk_parallel, int64_t segment_chunks, bool chunk_states) {
  TORCH_CHECK_VALUE(segment_chunks >= 0 && segment_chunks <= (int64_t(1) << 24),
                    "attention_ext.linear.set_cuda_kernels: segment_chunks must be in [0, 2^24] (0 = fill the device), got ",
                    segment_chunks);
#if defined(ATTN_WITH_CUDA)
  attn::cuda_linear_set_kernels(attn::LinearCudaKernels{chunk_parallel, int(segment_chunks), chunk_states});
#else
  (void)chunk_parallel;
  (void)chunk_states;
#endif
}

// attention_ext.linear.set_cuda_kernels(delta_chunked=): the delta rule's CUDA forward schedule
// (attn::DeltaCudaKernels: -1 auto, 0 the recurrent kernel, 1 the chunk kernels where they fit).
void delta_set_cuda_kernels(int64_t chunked) {
  TORCH_CHECK_VALUE(chunked >= -1 && chunked <= 1,
                    "attention_ext.linear.set_cuda_kernels: delta_chunked must be None, True or False (-1, 1 or 0), got ",
                    chunked);
#if defined(ATTN_WITH_CUDA)
  attn::cuda_delta_set_kernels(attn::DeltaCudaKernels{int(chunked)});
#endif
}

// attention_ext.decode.set_cuda_kernels: the CUDA decode kernel selection (decode/cuda/entry.h).
void decode_set_cuda_kernels(bool tensor_cores, bool quantized) {
#if defined(ATTN_WITH_CUDA)
  attn::cuda_decode_set_kernels(attn::DecodeCudaKernels{tensor_cores, quantized});
#else
  (void)tensor_cores;
  (void)quantized;
#endif
}

// Frees the CPU output blocks kept for reuse (csrc/torch/alloc.h); returns their bytes.
int64_t empty_cpu_cache() { return int64_t(attn::cpu::BlockCache::release()); }

// The CPU kernels' ISA levels (csrc/cpu/isa.h), for attention_ext._ext: plain Python functions,
// not ops, as the choice is process-wide like torch.set_num_threads.
PyObject* py_cpu_isa(PyObject*, PyObject*) { return PyUnicode_FromString(attn::cpu::isa()); }
// delta_params.h delta_chunk_takes for attention_ext._ext.delta_chunked: (chunked, dtype name, K,
// V, gate per key, plain, S, backward) -> bool
PyObject* py_delta_chunk_takes(PyObject*, PyObject* args) {
  int chunked = 0, k = 0, v = 0, per_key = 0, plain = 0, backward = 0;
  long long s = 0;
  const char* dt = nullptr;
  if (!PyArg_ParseTuple(args, "isiippLp", &chunked, &dt, &k, &v, &per_key, &plain, &s, &backward)) return nullptr;
  const std::string name(dt);
  const attn::DType d = name == "bfloat16" ? attn::DType::kBF16
                        : name == "float16" ? attn::DType::kF16
                        : name == "float32" ? attn::DType::kF32
                                            : attn::DType::kF64;
  return PyBool_FromLong(attn::delta_chunk_takes(chunked, d, k, v, per_key != 0, plain != 0, s, backward != 0));
}
PyObject* py_cpu_isas(PyObject*, PyObject* all) {
  return PyUnicode_FromString(attn::cpu::isa_levels(PyObject_IsTrue(all) == 1));
}
PyObject* py_set_cpu_isa(PyObject*, PyObject* name) {
  const char* s = name == Py_None ? nullptr : PyUnicode_AsUTF8(name);
  if (name != Py_None && s == nullptr) return nullptr;  // not a str: TypeError set
  if (const char* why = attn::cpu::set_isa(s)) {
    PyErr_Format(PyExc_ValueError, "CPU ISA level '%s': %s (this build: %s; this CPU runs: %s)", s, why,
                 attn::cpu::isa_levels(true), attn::cpu::isa_levels(false));
    return nullptr;
  }
  return PyUnicode_FromString(attn::cpu::isa());
}
PyObject* py_simd_width(PyObject*, PyObject*) { return PyLong_FromLong(attn::cpu::simd_width()); }

// Iterations of one thread's peak loop (csrc/peak/cpu/entry.h) that take about 1 ms, measured
// once per ISA level and kind: short enough that a burst often finds its cores free on a shared
// machine, long enough that the pool's wake-up and the clock read are noise beside it.
int64_t peak_burst_iters(int kind, double seconds_per_burst) {
  using Clock = std::chrono::steady_clock;
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, int64_t> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(std::string(attn::cpu::isa()), kind);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int64_t iters = 256;
  for (;;) {
    const auto t0 = Clock::now();
    attn::cpu::peak_loop_stub(kind, iters);
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    if (t >= seconds_per_burst / 4) {
      iters = std::max<int64_t>(1, int64_t(double(iters) * seconds_per_burst / t));
      break;
    }
    iters *= 2;
  }
  known[key] = iters;
  return iters;
}

// FLOP/s of `threads` pool threads running a peak loop at once: the best of the bursts that fit
// in `seconds` (at least one), the one least disturbed by other processes. 0 where the active
// ISA level has no such instruction. A plain function, not an op, like the ISA choice it
// measures: bench.flop_ceiling reads the kernels' rate against it.
double cpu_peak_flops(int kind, int64_t threads, double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  const double per_round = attn::cpu::peak_loop_stub(kind, 1);  // FLOPs of one round
  if (per_round == 0.0) return 0.0;
  const int64_t iters = peak_burst_iters(kind, 1e-3);
  const double flops = per_round * double(iters) * double(threads);
  double best = 0.0;
  const auto start = Clock::now();
  do {
    const auto t0 = Clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) attn::cpu::peak_loop_stub(kind, iters);
    });
    best = std::max(best, flops / since(t0));
  } while (since(start) < seconds);
  return best;
}

PyObject* py_cpu_peak_flops(PyObject*, PyObject* args) {
  const char* kind_name = nullptr;
  long long threads = 0;
  double seconds = 0.0;
  if (!PyArg_ParseTuple(args, "sLd", &kind_name, &threads, &seconds)) return nullptr;
  int kind;
  if (std::strcmp(kind_name, "fp32_fma") == 0) {
    kind = attn::cpu::kPeakFp32Fma;
  } else if (std::strcmp(kind_name, "bf16_dot") == 0) {
    kind = attn::cpu::kPeakBf16Dot;
  } else if (std::strcmp(kind_name, "int8_dot") == 0) {
    kind = attn::cpu::kPeakInt8Dot;
  } else if (std::strcmp(kind_name, "int8_amx") == 0) {
    kind = attn::cpu::kPeakInt8Amx;
  } else if (std::strcmp(kind_name, "bf16_amx") == 0) {
    kind = attn::cpu::kPeakBf16Amx;
  } else {
    PyErr_Format(PyExc_ValueError,
                 "cpu_peak_flops: kind must be 'fp32_fma', 'bf16_dot', 'int8_dot', 'int8_amx' or 'bf16_amx', got '%s'",
                 kind_name);
    return nullptr;
  }
  const int pool = at::get_num_threads();
  if (threads == 0) threads = pool;
  if (threads < 1 || threads > pool) {
    PyErr_Format(PyExc_ValueError,
                 "cpu_peak_flops: threads must be 1..%d (torch's thread count; 0 for all of them), got %lld: "
                 "call torch.set_num_threads(%lld) first to measure more",
                 pool, threads, threads);
    return nullptr;
  }
  if (!(seconds > 0.0 && seconds <= 60.0)) {
    PyErr_Format(PyExc_ValueError, "cpu_peak_flops: seconds must be in (0, 60], got %g", seconds);
    return nullptr;
  }
  double flops;
  Py_BEGIN_ALLOW_THREADS
  flops = cpu_peak_flops(kind, threads, seconds);
  Py_END_ALLOW_THREADS
  return PyFloat_FromDouble(flops);
}


// attention_ext::softmax_fwd_plain called from Python without the op's generic argument conversion
// (torch.ops converts each argument to an IValue against the schema, a visible part of a small
// call: benchmarks/results/2026-11-29-figures-from-comments.md). Positional arguments, the
// schema's order; plain tensors only, no torch function mode (else TypeError: the Python caller
// takes torch.ops' path, which handles them). The call goes through the dispatcher as any op
// call does (autograd, profiler, dispatch modes), without the GIL, as torch's own bindings.
PyObject* py_fwd_plain(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 std::optional<double>, int64_t, int64_t, bool, c10::string_view,
                                                 int64_t, bool, const std::optional<at::Tensor>&);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("attention_ext::softmax_fwd_plain", "").typed<Sig>();
  if (nargs != 10 && nargs != 11) {
    PyErr_Format(PyExc_TypeError, "softmax_fwd_plain: 10 or 11 positional arguments, got %zd", nargs);
    return nullptr;
  }
  const bool has_bias = nargs == 11 && args[10] != Py_None;
  if (!THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) || !THPVariable_CheckExact(args[2]) ||
      (has_bias && !THPVariable_CheckExact(args[10])) || at::impl::torch_function_mode_enabled()) {
    PyErr_SetString(PyExc_TypeError, "softmax_fwd_plain: q, k, v and bias must be plain tensors, with no torch function mode");
    return nullptr;
  }
  std::optional<double> scale;
  if (args[3] != Py_None) {
    scale = PyFloat_AsDouble(args[3]);
    if (*scale == -1.0 && PyErr_Occurred()) return nullptr;
  }
  int64_t ints[3];
  for (int i = 0; i < 3; ++i) {
    ints[i] = PyLong_AsLongLong(args[i == 2 ? 8 : 4 + i]);
    if (ints[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  // each conversion checked before the next: a call made with an exception pending would replace
  // it with a SystemError
  const int bottom_right = PyObject_IsTrue(args[6]);
  if (bottom_right < 0) return nullptr;
  const int deterministic = PyObject_IsTrue(args[9]);
  if (deterministic < 0) return nullptr;
  Py_ssize_t layout_len = 0;
  const char* layout = PyUnicode_AsUTF8AndSize(args[7], &layout_len);
  if (layout == nullptr) return nullptr;
  const at::Tensor &q = THPVariable_Unpack(args[0]), &k = THPVariable_Unpack(args[1]), &v = THPVariable_Unpack(args[2]);
  const std::optional<at::Tensor> bias = has_bias ? std::optional<at::Tensor>(THPVariable_Unpack(args[10])) : std::nullopt;
  std::tuple<at::Tensor, at::Tensor> res;
  {
    // released for the call and taken back when it ends or throws (HANDLE_TH_ERRORS needs it)
    struct NoGil {
      PyThreadState* state = PyEval_SaveThread();
      ~NoGil() { PyEval_RestoreThread(state); }
    } no_gil;
    res = op.call(q, k, v, scale, ints[0], ints[1], bottom_right != 0, c10::string_view(layout, size_t(layout_len)),
                  ints[2], deterministic != 0, bias);
  }
  PyObject* out = THPVariable_Wrap(std::move(std::get<0>(res)));
  PyObject* lse = THPVariable_Wrap(std::move(std::get<1>(res)));
  if (out == nullptr || lse == nullptr) {
    Py_XDECREF(out);
    Py_XDECREF(lse);
    return nullptr;
  }
  PyObject* pair = PyTuple_Pack(2, out, lse);
  Py_DECREF(out);
  Py_DECREF(lse);
  return pair;
  END_HANDLE_TH_ERRORS
}

#if defined(ATTN_SANITIZE)
// Test-only canaries of the sanitized build (ATTENTION_EXT_SANITIZE=1, tests/sanitizers): each
// commits one defect the sanitizers must report, so a clean run proves they were live. Called
// from a subprocess, which ASan / UBSan (halt_on_error=1) end with the report.

// Reads one float past a 4-float heap buffer: ASan's heap-buffer-overflow. UBSan is off in this
// function, or its object-size check would report the read first.
__attribute__((no_sanitize("undefined"))) PyObject* canary_heap_overflow(PyObject*, PyObject*) {
  float* buf = new float[4]();
  volatile float* p = buf;  // volatile: the read stays in at -O1
  const int n = 4;
  float past = p[n];
  delete[] buf;
  return PyFloat_FromDouble(past);
}

// 1 << s in int: UBSan's shift-exponent check for s >= 32. (Not a signed overflow: Python's
// CFLAGS, which setuptools adds, carry -fwrapv, which defines it.) The exponent comes from Python
// so the compiler cannot fold it.
PyObject* canary_shift_overflow(PyObject*, PyObject* arg) {
  const int s = int(PyLong_AsLong(arg));
  const int y = 1 << s;
  return PyLong_FromLong(y);
}

#endif

PyMethodDef module_methods[] = {
    {"cpu_isa", py_cpu_isa, METH_NOARGS, "the CPU kernels' active ISA level"},
    {"delta_chunk_takes", py_delta_chunk_takes, METH_VARARGS,
     "whether the CUDA delta chunk kernels take a call: (chunked, dtype name, K, V, per_key, plain, S)"},
    {"cpu_isas", py_cpu_isas, METH_O, "the levels built and runnable here (all=True: built), comma-separated"},
    {"set_cpu_isa", py_set_cpu_isa, METH_O, "make a level active (None: the highest runnable); ValueError if not"},
    {"simd_width", py_simd_width, METH_NOARGS, "float32 lanes of the active level's SIMD vector"},
    {"softmax_fwd_plain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_fwd_plain)), METH_FASTCALL,
     "softmax_fwd_plain(q, k, v, scale, window_left, window_right, bottom_right, layout, num_splits, deterministic[, bias]): "
     "torch.ops.attention_ext.softmax_fwd_plain for plain tensors, without torch.ops' argument conversion"},
    {"cpu_peak_flops", py_cpu_peak_flops, METH_VARARGS,
     "cpu_peak_flops(kind, threads, seconds): FLOP/s of threads (0: torch's count) running the active level's "
     "'fp32_fma', 'bf16_dot' or 'int8_dot' loop, the best 1 ms burst of `seconds` (one at least); 0.0 where the level "
     "lacks the instruction"},
#if defined(ATTN_SANITIZE)
    {"_canary_heap_overflow", canary_heap_overflow, METH_NOARGS, "sanitized build only: a heap over-read"},
    {"_canary_shift_overflow", canary_shift_overflow, METH_O, "sanitized build only: 1 << s in int32"},
#endif
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C",
                          "attention_ext compiled kernels (ops live in torch.ops.attention_ext)", -1, module_methods};

}  // namespace

TORCH_LIBRARY(attention_ext, m) {
  // softmax family
  m.def("softmax_fwd(Tensor q, Tensor k, Tensor v" ATTN_SOFTMAX_OPTIONS_SCHEMA
        ", int num_splits=1, bool deterministic=False) -> (Tensor, Tensor)");
  m.def("softmax_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse" ATTN_SOFTMAX_OPTIONS_SCHEMA
        ", bool bias_grad, bool deterministic, Tensor? dlse=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // fwd with no tensor option, for small calls (softmax_plain.cpp): a composite of fwd
  m.def("softmax_fwd_plain(Tensor q, Tensor k, Tensor v, float? scale=None, int window_left=-1, int window_right=-1, "
        "bool bottom_right=False, str layout=\"bhsd\", int num_splits=0, bool deterministic=False, "
        "Tensor? bias=None) -> (Tensor, Tensor)");
  m.def("dropout_mask(int b, int h, int sq, int sk, float p, int seed, int offset, Device? device=None) -> Tensor");
  // the functional API's forward: softmax_fwd, or the decode kernel for few-row CPU calls with
  // nothing to differentiate (softmax_route.cpp); softmax_fwd_route says which, and why
  m.def("softmax_fwd_routed(Tensor q, Tensor k, Tensor v" ATTN_SOFTMAX_OPTIONS_SCHEMA
        ", int num_splits=1, bool deterministic=False) -> (Tensor, Tensor)");
  // the forward with a quantized Q.K^T (SageAttention's method; inference: no backward):
  // qk_quant "int8" (CPU: csrc/cpu/q8dot.h)
  m.def("softmax_fwd_quant(Tensor q, Tensor k, Tensor v" ATTN_SOFTMAX_OPTIONS_SCHEMA
        ", str qk_quant=\"int8\") -> (Tensor, Tensor)");
  m.def("softmax_fwd_route(Tensor q, Tensor k, Tensor v" ATTN_SOFTMAX_OPTIONS_SCHEMA ") -> str");
  // sparse family: block-sparse attention is fwd / bwd with block_layout; top-k's threshold pass
  // (common/block_sparse.h) takes the same options (top-k's own left unset) and returns the
  // (B, H, Sq) thresholds and cut keys that fwd / bwd then take as topk_thr / topk_jcut
  m.def("topk_threshold(Tensor q, Tensor k" ATTN_SOFTMAX_OPTIONS_SCHEMA ", int k_top) -> (Tensor, Tensor)");
  // Linformer: k and v projected along the sequence, then fwd (softmax_linformer.cpp, a composite)
  m.def("linformer_attention(Tensor q, Tensor k, Tensor v, Tensor proj_k, Tensor? proj_v=None, float? scale=None) "
        "-> Tensor");
  // Reformer's shared-QK LSH attention: hash, sort, chunked fwd with a mask, rounds merged by LSE
  // (sparse_lsh.cpp, composites); lsh_buckets is its hash alone, (B, H, n_hashes, S) int64
  m.def("lsh_buckets(Tensor qk, Tensor? rotations, int n_buckets) -> Tensor");
  m.def("lsh_attention(Tensor qk, Tensor v, Tensor? rotations, int n_buckets, int n_hashes, int chunk_size, "
        "bool causal=False) -> (Tensor, Tensor)");
  // linear family
  // keep_residual: also return out's rounding residual (linear_binding.h), which linear_bwd then
  // reads (an empty tensor where keep_residual_for does not hold)
  m.def("linear_fwd(Tensor q, Tensor k, Tensor v" ATTN_LINEAR_OPTIONS_SCHEMA
        ", bool keep_residual=False) -> (Tensor, Tensor, Tensor, Tensor)");
  // linear_fwd's input rules alone, on any device (the Python reference fallback's check)
  m.def("linear_check(Tensor q, Tensor k, Tensor v" ATTN_LINEAR_OPTIONS_SCHEMA ") -> ()");
  m.def("linear_bwd(Tensor dout, Tensor? dfinal_state, Tensor q, Tensor k, Tensor v, Tensor out, Tensor den"
        ATTN_LINEAR_OPTIONS_SCHEMA ", Tensor? out_residual=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // the recurrent step: mutates state (and normalizer) in place, so a decode step reads and
  // writes the state once; functionalization (torch.compile) sees the (a!) / (b!) annotations
  m.def("linear_step(Tensor q, Tensor k, Tensor v, Tensor(a!) state, Tensor(b!)? normalizer, Tensor? decay, "
        "int feature_map, float eps, float scale) -> Tensor");
  // the delta rule (DeltaNet, Gated DeltaNet, KDA), in the linear family: linear_delta_binding.h
  // checkpoints: the forward also returns the states its backward would recompute (CPU kernels;
  // an empty tensor when False), which delta_bwd then reads instead of a forward pass of its own
  m.def("delta_fwd(Tensor q, Tensor k, Tensor v, Tensor beta" ATTN_DELTA_OPTIONS_SCHEMA
        ", bool checkpoints=False) -> (Tensor, Tensor, Tensor)");
  m.def("delta_bwd(Tensor dout, Tensor? dfinal_state, Tensor q, Tensor k, Tensor v, Tensor beta"
        ATTN_DELTA_OPTIONS_SCHEMA ", Tensor? checkpoints=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("delta_check(Tensor q, Tensor k, Tensor v, Tensor beta" ATTN_DELTA_OPTIONS_SCHEMA ") -> ()");
  // decode: T tokens advance the state in place (one read and one write of it per step)
  m.def("delta_step(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor(a!) state, Tensor? gate, float scale, "
        "bool qk_l2norm) -> Tensor");
  // decode family: attention of a few query rows over a (paged) KV cache, forward only
  m.def(ATTN_DECODE_SCHEMA);
  m.def("decode_check" ATTN_DECODE_ARGS_SCHEMA " -> ()");
  // the CPU output blocks kept for reuse (csrc/torch/alloc.h), like torch.cuda.empty_cache()
  m.def("empty_cpu_cache() -> int", &empty_cpu_cache);
  // developer-only
  m.def("set_cuda_kernels(int hopper_fwd, int hopper_bwd, int tune_fwd, int tune_bwd, bool force_simt) -> ()",
        &set_cuda_kernels);
  m.def("linear_set_cuda_kernels(bool chunk_parallel, int segment_chunks, bool chunk_states) -> ()", &linear_set_cuda_kernels);
  m.def("decode_set_cuda_kernels(bool tensor_cores, bool quantized=False) -> ()", &decode_set_cuda_kernels);
  m.def("delta_set_cuda_kernels(int chunked) -> ()", &delta_set_cuda_kernels);
}

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* mod = PyModule_Create(&module_def);
  if (mod == nullptr) return nullptr;
  PyModule_AddIntConstant(mod, "decode_max_q", attn::api::kDecodeMaxQ);
#if defined(ATTN_WITH_CUDA)
  PyModule_AddIntConstant(mod, "with_cuda", 1);
  PyModule_AddStringConstant(mod, "cuda_archs", ATTN_CUDA_ARCHS);
#else
  PyModule_AddIntConstant(mod, "with_cuda", 0);
  PyModule_AddStringConstant(mod, "cuda_archs", "");
#endif
#if defined(ATTN_SANITIZE)
  PyModule_AddIntConstant(mod, "sanitize", 1);  // ASan + UBSan (ATTENTION_EXT_SANITIZE=1)
#else
  PyModule_AddIntConstant(mod, "sanitize", 0);
#endif
#if defined(_OPENMP)
  PyModule_AddIntConstant(mod, "openmp", 1);
#else
  PyModule_AddIntConstant(mod, "openmp", 0);
#endif
  return mod;
}
