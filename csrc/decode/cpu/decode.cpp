// Decode attention on the CPU: a few query rows against a long KV cache, bound by the bandwidth
// of reading K and V once.
//
// One task = (batch b, key split), every head. The rows of kv head hk are the G = H / H_k query
// heads of its GQA group times the Sq query rows, packed as G * Sq rows, so each K / V element
// is loaded once per group and feeds G * Sq FMAs. Keys go by in chunks of kChunk (fewer where
// the kv rows are wide: kChunkBytes), and inside a chunk key by key, each key's kv heads in order
// (one sequential stream through a (B, S, H_k, D) cache or a page of one; walking one kv head's
// rows, H_k * D apart, maps them onto a few L1 sets and misses the TLB every few rows; float32
// MHA at D >= 128 on AVX2 walks 8 at a time per kv head, where that measured faster: dot_keys):
//   scores  S (H * Sq, chunk) = Q K_chunk^T, each K row converted to T in registers;
//   policy  the shared online softmax's TileSoftmax (cpu/online_softmax.h) per row, one per head;
//   PV      O (H * Sq, D) += P V_chunk kv head by kv head, each V row converted in registers,
//           O in registers per (4 rows x 2 vectors) block; the scores pass prefetched V.
// O accumulates kFlushChunks * kChunk keys at a time and each such block joins the row's running
// output by compensated addition (simd.h's kahan_add; l per chunk, in TileSoftmax::online_update), so a
// split of tens of millions of keys keeps float32 accuracy. Splits give many cores work at batch 1 (their
// count follows the problem, not the threads: decode_num_splits); their (O_s, lse_s) merge exactly through
// common/split_merge.h, where the sinks join. Addresses come from common/decode_params.h's KvRows,
// so contiguous and paged caches (and cache_batch_idx / leftpad) share this code.
// Quantized caches (int8, fp8 e4m3) are element types like the 16-bit ones, widened in registers
// (a byte per element read: half a bf16 cache's bytes; int8 under 16-bit queries on AVX2 /
// AVX-512 in int32 products instead: kInts); their descales never touch an element: a
// key's k scale multiplies its score (per (batch, kv head): folded into the q rows once, except
// under bf16 queries, whose q stays bf16 data: kDots), and a key's v scale its probability before
// P V (per (batch, kv head): the output row at the end), after the softmax's sum has taken the
// probabilities.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/fp8.h"
#include "common/split_merge.h"
#include "cpu/bf16dot.h"
#include "cpu/isa.h"
#include "cpu/pack.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "decode/cpu/entry.h"
#include "cpu/online_softmax.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

namespace {

// Keys per chunk: a multiple of every vector width. One kv head's K / V rows of a chunk (32 x
// 128 x 4 B = 16 KB in fp32) fit L1; the whole chunk's (x H_k) fit L2, where the scores pass
// prefetches them.
constexpr int kChunkKeys = 32;
// Query rows per register block of the two products.
constexpr int kRowBlock = 4;
// One chunk's K rows of every kv head, at most (keys per chunk halve down to a vector's lanes
// until they fit): the scores pass prefetches the chunk's V and the next chunk's K into L2, so
// three such blocks share it. At H_k * D = 4096 float32 (MHA, H 32, D 128) 32 keys of K are
// 512 KB, all a 512 KB L2 holds before the V and next K beside them; shorter chunks measured
// faster there (benchmarks/results/2026-11-28-decode-cpu-zen3.md).
constexpr int64_t kChunkBytes = 128 * 1024;
// Chunks whose P V accumulate plainly in O before O joins the running output (os, oc): the
// compensated addition's pass over O every 256 keys (512 for 8-bit caches' chunks), instead of
// every chunk, keeps its cost small.
constexpr int kFlushChunks = 8;

// Cache element types: E is the storage, loaded as one vec<T> converted in registers.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
struct I8 {  // int8
  int8_t x;
};
struct F8 {  // fp8 e4m3 (float8_e4m3fn: no infinities, S.1111.111 NaN)
  uint8_t bits;
};

template <typename E>
constexpr bool kByte = std::is_same_v<E, I8> || std::is_same_v<E, F8>;

// e4m3 elements are read at 2^-8 of their value: the byte's 7 magnitude bits shifted into a
// binary16 (exponent bias 15 against e4m3's 7; e4m3 subnormals land on binary16 subnormals) are
// that value exactly, so a shift and a mask make a half that vcvtph2ps (F16C) widens, five
// operations per vector with the NaN check where common/fp8.h's float32 form takes nine. The 2^8
// (kUnit) joins the descales where they are read: every e4m3 cache has them. S.1111.111 (NaN)
// would read as 1.875 and is set to NaN.
template <typename E>
constexpr float kUnit = std::is_same_v<E, F8> ? 256.0f : 1.0f;
inline float f8_to_f32(uint8_t b) { return e4m3_to_float(b) * 0x1p-8f; }  // common/fp8.h, x 2^-8

template <typename T, typename E>
inline vec<T> load_cvt(const E* p) {
  if constexpr (std::is_same_v<E, T>) {
    return vload(p);
  } else if constexpr (std::is_same_v<E, Bf16>) {
    // bf16 is the top half of a float32: widen the 16-bit lanes and shift
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
    typedef uint16_t h16 __attribute__((vector_size(W * 2)));
    h16 h;
    std::memcpy(&h, p, sizeof(h));
    const vi x = __builtin_convertvector(h, vi) << 16;
    vf f;
    std::memcpy(&f, &x, sizeof(f));
    return f;
#endif
  } else if constexpr (std::is_same_v<E, I8>) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    vf f;
    for (int u = 0; u < W; ++u) f[u] = float(p[u].x);
    return f;
#endif
  } else if constexpr (std::is_same_v<E, F8>) {  // x 2^-8 (kUnit)
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i h =
        _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(0xbf80)));
    const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    return (vf)_mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)  // AVX-512 without BW / VL: below
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(int16_t(0xbf80)));
    const __m256i nan =
        _mm256_cvtepi8_epi32(_mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f)));
    return (vf)_mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                                _mm256_castsi256_ps(nan));
#else
    vf f;
    for (int u = 0; u < W; ++u) f[u] = f8_to_f32(p[u].bits);
    return f;
#endif
  } else {
    static_assert(std::is_same_v<E, F16>);
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    vf f;
    for (int u = 0; u < W; ++u) f[u] = f16_to_f32(p[u].bits);
    return f;
#endif
  }
}
// bf16 caches on CPUs with AVX512-BF16: both products run on vdpbf16ps (bf16dot.h), 32 bf16
// per instruction, read as they are stored (no widening) and half the multiply-add
// instructions, which bound this kernel (not the memory: the widening kernel read its bf16
// cache well under one core's streaming rate; figures:
// benchmarks/results/2026-11-29-figures-from-comments.md). Scores: q and K are bf16 data (the
// op's inputs share one dtype), so the products are exact and only the float32 summation
// order differs. P V: P is rounded to bf16 (as the softmax family's bf16 forward does, see
// bf16dot.h), and V's rows go in pairs of keys: unpacking two rows' 16-bit words interleaves
// (v_j[c], v_j+1[c]) into one 32-bit lane, so one instruction adds p_j v_j[c] + p_j+1 v_j+1[c]
// for 16 columns. Within 128-bit lanes, so a full 32-column block of O is kept in that order
// (dots_col) and put back once per task.
// e4m3 caches under bf16 queries (kQb: q is bf16 data) take the same products where the CPU has
// VBMI and not AMX (run()): their elements convert to bf16 in registers exactly (4 significant
// bits; bf16x32), four byte-table operations per 32, where load_pair's widening of 32 to float32
// takes ten and then an FMA per element per row where vdpbf16ps takes half of one (int8 caches
// take kInts below where the level has it, else the same bf16 products). Under float32 / fp16 queries they
// widen to float32 (q would not be bf16 data, and P would be rounded past the float32 rule).
// int8 caches under 16-bit queries (kQb: bf16 or fp16 q) on AVX2 / AVX-512: both products in
// int32 on pairs of int16 (vpdpwssd where the level or its variant has VNNI, else vpmaddwd +
// vpaddd), where the bf16 form spends five conversions per 32 elements of K and of V: a cache row widens by one
// vpmovsxbw per 32 elements, and a pair of V rows interleaves by one byte unpack each half.
//   Q K^T: each q row is q16 x 2^e, e the row's max exponent - 14 (|q16| <= 32752): a bf16 row
//     is exact where its elements are within 2^7 of its largest (an fp16 row within 2^4), and
//     smaller elements round by at most 2^-15 of the largest, far below q's own rounding. The
//     int32 sums are exact (|sum| <= d 32752 128 < 2^31 for d <= kI16MaxD).
//   P V: each chunk's P row is p16 x 2^e the same way, rounded by at most 2^-15 of its largest
//     probability (bf16's P rounds each by 2^-9 of itself); the chunk's int32 sums join O in
//     float32, times the row's scale.
// Non-finite rows (q, or P from a NaN score / descale) get a NaN scale, so they show as NaN.
// kI16Cols: the columns of one int16 vector (0: no such path at this level)
// I16Ops: the level's vectors for P V, I int16 pairs / int32 lanes, Bytes kI16Cols cache bytes;
// pairs_lo / pairs_hi widen two rows' bytes into (v0[c], v1[c]) pairs (the two halves of a byte
// unpack: i16_col's order), add_scaled(o, acc, s) is o += s acc in float32 over acc's lanes.
// dpwssd<kVnni>(acc, a, b): acc + the int16 pair products of a and b. kVnni: the level's VNNI
// variant runs (isa.h's int8_vnni: "avx512vnni", AVX512-VNNI without BF16, Cascade Lake and Ice
// Lake; "avx2vnni", AVX-VNNI, Alder Lake and later) where the level's flags lack it: one
// vpdpwssd in inline asm, since an intrinsic under a target attribute could not be inlined into
// this level's code. avx512bf16 compiles VNNI in.
#if defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kI16Cols = 32;
#if defined(__AVX512VNNI__)
constexpr bool kVnniVariant = false;
#else
constexpr bool kVnniVariant = true;
#endif
template <bool kVnni>
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  if constexpr (kVnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
  }
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
struct I16Ops {
  using I = __m512i;
  using Bytes = __m256i;
  static I zero() { return _mm512_setzero_si512(); }
  static Bytes bytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static Bytes no_bytes() { return _mm256_setzero_si256(); }
  static I pairs_lo(Bytes v0, Bytes v1) { return _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(v0, v1)); }
  static I pairs_hi(Bytes v0, Bytes v1) { return _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(v0, v1)); }
  static I bcast(int32_t w) { return _mm512_set1_epi32(w); }
  static void add_scaled(float* o, I acc, float s) {
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(s), _mm512_loadu_ps(o)));
  }
};
#elif defined(__AVX2__)
constexpr int kI16Cols = 16;
constexpr bool kVnniVariant = true;
template <bool kVnni>
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
  if constexpr (kVnni) {  // AVX-VNNI's encoding ({vex}), not AVX512-VNNI's
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
  }
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
struct I16Ops {
  using I = __m256i;
  using Bytes = __m128i;
  static I zero() { return _mm256_setzero_si256(); }
  static Bytes bytes(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static Bytes no_bytes() { return _mm_setzero_si128(); }
  static I pairs_lo(Bytes v0, Bytes v1) { return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v0, v1)); }
  static I pairs_hi(Bytes v0, Bytes v1) { return _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(v0, v1)); }
  static I bcast(int32_t w) { return _mm256_set1_epi32(w); }
  static void add_scaled(float* o, I acc, float s) {
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(s), _mm256_loadu_ps(o)));
  }
};
#else
constexpr int kI16Cols = 0;
constexpr bool kVnniVariant = false;
#endif
constexpr bool kI16Level = kI16Cols > 0;
constexpr int kI16MaxD = 256;
template <typename T, typename E, bool kQb>
constexpr bool kInts = kI16Level && kQb && std::is_same_v<T, float> && std::is_same_v<E, I8>;
// 2^(e - 14) for amax of exponent e (|x| / scale < 2^15 for |x| <= amax), at least 2^-126 so
// that 1 / scale stays finite (rows below 2^-112 keep fewer bits: far below any sum they join);
// 0 for amax 0, NaN for NaN / inf
// (once per row and chunk: from the exponent bits, not libm's ilogb / ldexp calls)
inline float i16_pow2(float amax) {
  if (!std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  if (!(amax > 0.f)) return 0.f;
  uint32_t bits;
  std::memcpy(&bits, &amax, 4);
  const int e = std::max(int(bits >> 23) - 127 - 14, -126);  // a subnormal amax: the floor
  const uint32_t out = uint32_t(e + 127) << 23;
  float r;
  std::memcpy(&r, &out, 4);
  return r;
}

template <typename T, typename E, bool kQb = false>
constexpr bool kDots = kBf16Dot && std::is_same_v<T, float> &&
                       (std::is_same_v<E, Bf16> || (kQb && kByte<E>)) && !kInts<T, E, kQb>;

#if defined(__AVX512BF16__)
// e4m3 magnitude m (7 bits) as bf16 bits at 2^-8 of its value (kUnit), split into bytes: a normal
// m (exponent field >= 1) is the bf16 with exponent e + 112 and its 3 mantissa bits on top of
// bf16's 7, a subnormal m (m < 8) is m x 2^-17, m = 127 (S.1111.111) NaN. dup: the byte index of
// each output byte that doubles 32 bytes into 32 words.
struct F8Bf16Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t dup[64];
};
constexpr F8Bf16Tables make_f8_bf16_tables() {
  F8Bf16Tables t{};
  constexpr uint16_t kSubnormal[8] = {0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860};
  for (int m = 0; m < 128; ++m) {
    const uint16_t h = m == 127 ? 0x7fc0 : m < 8 ? kSubnormal[m] : uint16_t((m << 4) + (112 << 7));
    t.lo[m] = uint8_t(h & 0xff);
    t.hi[m] = uint8_t(h >> 8);
  }
  for (int j = 0; j < 64; ++j) t.dup[j] = uint8_t(j / 2);
  return t;
}
inline constexpr F8Bf16Tables kF8Bf16 = make_f8_bf16_tables();
// AVX512-VBMI's byte permutes in inline asm (the level's flags lack VBMI, and an intrinsic under
// a target attribute could not be inlined into this level's code): permb(idx, src) = src's bytes
// at idx (6 bits); permi2b(idx, k, t0, t1) = the bytes of (t0, t1) at idx (7 bits) where k is
// set, idx's own bytes elsewhere.
inline __m512i permb(__m512i idx, __m512i src) {
  __m512i r;
  asm("vpermb %2, %1, %0" : "=v"(r) : "v"(idx), "v"(src));
  return r;
}
inline __m512i permi2b(__m512i idx, __mmask64 k, __m512i t0, __m512i t1) {
  asm("vpermi2b %3, %2, %0%{%1%}" : "+v"(idx) : "Yk"(k), "v"(t0), "v"(t1));
  return idx;
}
#endif
#if defined(__AVX512BF16__)
// 32 elements of a cache row at p as bf16 (zeros past the first n < 32 when kTail, nothing read
// there; n <= 32): bf16 as stored, int8 and e4m3 (x 2^-8, kUnit) converted
template <typename E, bool kTail = false>
inline __m512i bf16x32(const E* p, int n = 32) {
  const __mmask32 mask = kTail && n < 32 ? (__mmask32(1) << n) - 1 : ~__mmask32(0);
  if constexpr (std::is_same_v<E, Bf16>) {
    return kTail ? _mm512_maskz_loadu_epi16(mask, p) : _mm512_loadu_si512(p);
  } else {
    static_assert(kByte<E>);
    const __m256i b =
        kTail ? _mm256_maskz_loadu_epi8(mask, p) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<E, I8>) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
      return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    } else {
      // e4m3 bits to bf16 bits by byte tables (run() takes this path only where isa.h's vbmi()
      // holds): each byte doubled into a word, then the word's high byte looked up in kF8Bf16.hi
      // and its low byte in .lo by the byte's 7 magnitude bits (vpermi2b: 128 entries in two
      // registers), the sign ORed in. Four operations per 32 elements, where the integer form
      // (shift, add, a table for the 8 subnormals, a NaN compare and blend) took ten, and a
      // table entry is exact for every byte, subnormals and NaN included.
      const __m512i dup = permb(_mm512_load_si512(kF8Bf16.dup), _mm512_castsi256_si512(b));
      const __m512i hi = permi2b(dup, __mmask64(0xAAAAAAAAAAAAAAAAull), _mm512_load_si512(kF8Bf16.hi),
                                 _mm512_load_si512(kF8Bf16.hi + 64));
      const __m512i x = permi2b(hi, __mmask64(0x5555555555555555ull), _mm512_load_si512(kF8Bf16.lo),
                                _mm512_load_si512(kF8Bf16.lo + 64));
      return _mm512_ternarylogic_epi32(x, dup, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // x | (dup & sign)
    }
  }
}
#endif
// Stored position of column c (< 32) of a full 32-column block in the kDots order: the
// unpacked low words (columns 8g + 0..3 of each 8) fill the first 16 lanes, the high words
// (8g + 4..7) the next 16.
inline int dots_col(int c) {
  const int g = c / 8, h = c % 8;
  return h < 4 ? 4 * g + h : 16 + 4 * g + (h - 4);
}

// Stored position of column c (< 32) of a full 32-column block in the kInts order on AVX-512: a
// byte unpack of two V rows pairs columns 0-7 and 16-23 in its low half, 8-15 and 24-31 in its
// high half (on AVX2, 16 columns per block, it pairs 0-7 and 8-15: column order).
inline int i16_col(int c) { return c / 8 == 1 ? c + 8 : c / 8 == 2 ? c - 8 : c; }

// Whether a bf16 cache row loads as even / odd lanes: 2L elements in one vector load are 32-bit
// lanes (element 2u in the low half, 2u + 1 in the high half), so a mask keeps the odd elements
// as float32 and a shift makes the even ones: two operations per 2L elements, where widening
// L elements at a time takes four. The q rows and the O accumulators are kept in the same
// permuted column order (each 2L block: its even columns, then its odd ones), so the products
// need no shuffle; O goes back to column order once, at the end of a task.
template <typename T, typename E>
constexpr bool kEvenOdd =
#if defined(__AVX2__) || defined(__AVX512F__)
    std::is_same_v<E, Bf16> && std::is_same_v<T, float> && !kDots<T, E>;
#else
    false;
#endif

// v0, v1 = the 2L elements at p, converted to T: in order, or (kEvenOdd) even and odd lanes
template <typename T, typename E>
inline void load_pair(const E* p, vec<T>* v0, vec<T>* v1) {
  if constexpr (kEvenOdd<T, E>) {
#if defined(__AVX512F__)
    const __m512i x = _mm512_loadu_si512(p);
    *v1 = (vf)_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u)));
    *v0 = (vf)_mm512_slli_epi32(x, 16);
#elif defined(__AVX2__)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *v1 = (vf)_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u)));
    *v0 = (vf)_mm256_slli_epi32(x, 16);
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  } else if constexpr (std::is_same_v<E, F8> && std::is_same_v<T, float>) {
    // 32 elements through one byte-to-word widening, shift and mask (load_cvt's binary16 route),
    // the NaN test one compare for all 32 and the NaN lanes set only where there is one: ten
    // operations where two load_cvt take sixteen
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i h =
        _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16(int16_t(0xbf80)));
    *v0 = (vf)_mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *v1 = (vf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    const __mmask32 nan = _mm256_cmpeq_epi8_mask(_mm256_or_si256(b, _mm256_set1_epi8(char(0x80))),
                                                 _mm256_set1_epi8(char(0xff)));  // S.1111.111
    if (__builtin_expect(nan != 0, 0)) {
      const __m512 qnan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
      *v0 = (vf)_mm512_mask_mov_ps((__m512)*v0, __mmask16(nan), qnan);
      *v1 = (vf)_mm512_mask_mov_ps((__m512)*v1, __mmask16(nan >> 16), qnan);
    }
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
  } else if constexpr (std::is_same_v<E, F8> && std::is_same_v<T, float>) {  // as above, 16 elements
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i h =
        _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(0xbf80)));
    *v0 = (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *v1 = (vf)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    const __m128i nan = _mm_cmpeq_epi8(_mm_or_si128(b, _mm_set1_epi8(char(0x80))), _mm_set1_epi8(char(0xff)));
    if (__builtin_expect(_mm_movemask_epi8(nan) != 0, 0)) {
      const __m256 qnan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
      *v0 = (vf)_mm256_blendv_ps((__m256)*v0, qnan, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan)));
      *v1 = (vf)_mm256_blendv_ps((__m256)*v1, qnan, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(nan, 8))));
    }
#endif
  } else {
    *v0 = load_cvt<T>(p);
    *v1 = load_cvt<T>(p + kLanes<T>);
  }
}
// Column c of a row in the kEvenOdd order (d a multiple of 2L), and back
inline int even_odd_col(int c, int L) {
  const int blk = c / (2 * L) * (2 * L), u = c - blk;
  return blk + (u % 2) * L + u / 2;
}

template <typename T, typename E>
inline T to_t(E e) {
  if constexpr (std::is_same_v<E, T>) return e;
  else if constexpr (std::is_same_v<E, Bf16>) return bf16_to_f32(e.bits);
  else if constexpr (std::is_same_v<E, I8>) return T(e.x);
  else if constexpr (std::is_same_v<E, F8>) return f8_to_f32(e.bits);
  else return f16_to_f32(e.bits);
}

template <typename T, typename E, bool kQb = false>
struct DecodeWorker {
  static constexpr bool kDot = kDots<T, E, kQb>;
  // Keys per chunk: twice kChunkKeys for 8-bit caches (the same bytes per kv head as a 16-bit
  // chunk), which halves the softmax's fixed work per row and key.
  static constexpr int kChunk = kByte<E> ? 2 * kChunkKeys : kChunkKeys;
  using V = vec<T>;
  static constexpr int L = kLanes<T>;
  const DecodeParamsT<T>& p;
  DType dt;
  int group, rows_g, rows, splits, d, dp;
  T *part_o, *part_lse;  // split partials (B, H, Sq, splits[, dp]); nullptr when unsplit
  std::vector<T> mem;
  T *q, *qp, *o, *s, *m, *l, *row;
  std::vector<uint16_t> qh;  // kDots: the q rows as bf16, packed per register block as qp
  int dq;                    // qh's row length: d rounded up to 32 (one vdpbf16ps operand)
  std::vector<uint16_t> ph;  // kDots: the chunk's P rows rounded to bf16 (rows, kChunk)
  static constexpr bool kInt = kInts<T, E, kQb>;
  const bool vnni = kInt && int8_vnni();  // kInts: the products on vpdpwssd beyond the level's flags
  // f(std::bool_constant<kV>): kInts' products with kV = vnni where the level can take it (dpwssd)
  template <typename F>
  decltype(auto) on_products(F&& f) const {
    if constexpr (kVnniVariant) {
      if (vnni) return f(std::true_type{});
    }
    return f(std::false_type{});
  }
  std::vector<int16_t> qi;    // kInts: the q rows' q16, packed per register block in kI16Cols columns
  std::vector<int16_t> q16;   // kInts / kDots: one q row converted (dp), before pack_q deals it out
  std::vector<int> scol;      // stored_col(c) for c < dp (c itself past d): once per worker
  std::vector<int16_t> pi;    // kInts: the chunk's P rows' p16 (rows, kChunk)
  std::vector<float> qsc, psc;  // kInts: each row's q scale, and its P scale in this chunk
  std::vector<int32_t> si;    // kInts: the chunk's integer scores, key-major per register block
  T *os, *oc, *lc;  // the running output, its compensation, and l's (o: the block being summed)
  int chunk;  // keys per chunk (kChunk, or fewer where one chunk's K rows pass kChunkBytes)
  const E* kp[kChunk];  // the chunk's K / V rows of kv head 0 (head hk: + hk * head stride)
  const E* vp[kChunk];
  const E* kp_next[kChunk];  // the next chunk's
  const E* vp_next[kChunk];
  // quantized caches: the descales' row (times H_k) of the chunk's keys, and the next chunk's
  static constexpr bool kQuant = std::is_same_v<E, I8> || std::is_same_v<E, F8>;
  int64_t sr[kChunk], sr_next[kChunk];
  // per-key descales of the chunk (x kUnit), (H_k, kChunk): contiguous per kv head; kDot takes its
  // (batch, kv head) descales the same way (q stays bf16 data), filled once per task
  std::vector<T> kscl, vscl;
  std::vector<int> row_lo, row_hi;  // the keys query row i sees: [row_lo[i], row_hi[i])
  std::vector<PolicyT<T>> pols;  // one per query head
  std::vector<TileSoftmax<T>> tss;

  DecodeWorker(const DecodeParamsT<T>& p_, DType dt_, int splits_, T* po, T* pl)
      : p(p_), dt(dt_), group(p_.h / p_.h_k), rows_g(group * p_.sq), rows(p_.h * p_.sq), splits(splits_),
        d(p_.d), dp(round_up(p_.d, L)), part_o(po), part_lse(pl) {
    dq = round_up(d, 32);
    if constexpr (kDot) {
      qh.assign((size_t(rows) + kRowBlock) * dq, 0);
      ph.assign((size_t(rows) + kRowBlock) * kChunk, 0);
    }
    if constexpr (kInt || kDot) q16.assign(dp, 0);
    scol.resize(dp);
    for (int c = 0; c < dp; ++c) scol[c] = c < d ? stored_col(c) : c;
    if constexpr (kInt) {
      qi.assign((size_t(rows) + kRowBlock) * dq, 0);
      pi.assign((size_t(rows) + kRowBlock) * kChunk, 0);
      qsc.assign(size_t(rows) + kRowBlock, 0.f);
      psc.assign(size_t(rows) + kRowBlock, 0.f);
      si.assign((size_t(rows) + kRowBlock) * kChunk, 0);
    }
    const size_t rp = size_t(rows) + kRowBlock;
    mem.assign(rp * dp * 5 + rp * kChunk + rp * 3 + dp, T(0));
    q = mem.data();
    qp = q + rp * dp;
    o = qp + rp * dp;
    s = o + rp * dp;
    m = s + rp * kChunk;
    l = m + rp;
    row = l + rp;
    os = row + dp;
    oc = os + rp * dp;
    lc = oc + rp * dp;
    if (key_scaled()) {
      kscl.resize(size_t(p.h_k) * kChunk);
      vscl.resize(size_t(p.h_k) * kChunk);
    }
    chunk = kChunk;
    const int64_t k_row_bytes = int64_t(p.h_k) * d * int64_t(sizeof(E));
    while (chunk > L && chunk * k_row_bytes > kChunkBytes) chunk /= 2;
    row_lo.resize(p.sq);
    row_hi.resize(p.sq);
    pols.reserve(p.h);  // TileSoftmax keeps a reference: no reallocation
    tss.reserve(p.h);
  }

  // Descales per key (kscl, vscl): per (token, kv head), or under kDots / kInts, whose q rows stay
  // unscaled data; else a (batch, kv head) scale folds into q and the output row
  bool key_scaled() const { return kQuant && (p.descale_per_token || kDot || kInt); }

  // S rows [r0, r0 + RR) x key jj = q_r . k_r (raw); two accumulators per row break the add
  // chain. kShared: one K row k for every row (the heads of a GQA group); otherwise row x reads
  // k + x * kstride (MHA at q_len 1: one row per kv head, so a block spans RR heads, and their
  // horizontal sums share one reduction, which costs as much as the products at D = 64). The
  // block's q rows are packed (qp): vector c / L of row x at (c / L * RR + x) * L, so one
  // pointer walks all RR rows (with RR row pointers GCC ran out of registers and reloaded them
  // from the stack every step).
  template <int RR, bool kShared>
  void dot(int r0, int jj, const E* k, int64_t kstride) {
    if constexpr (kDot) {
      dot_bf16<RR, kShared>(r0, jj, k, kstride);
      return;
    }
    if constexpr (kInt) {  // the common head dims with their loop unrolled
      return on_products([&](auto v) {
        constexpr bool kV = decltype(v)::value;
        if (d == 128) return dot_i16<RR, kShared, 4, kV>(r0, jj, k, kstride);
        if (d == 64) return dot_i16<RR, kShared, 2, kV>(r0, jj, k, kstride);
        return dot_i16<RR, kShared, 0, kV>(r0, jj, k, kstride);
      });
    }
    const int d2 = d / (2 * L) * (2 * L), dv = d / L * L;
    const T* qb = qp + size_t(r0) * dp;
    V a0[RR], a1[RR];
#pragma GCC unroll 4
    for (int x = 0; x < RR; ++x) a0[x] = a1[x] = V{};
    int c = 0;
    for (; c < d2; c += 2 * L, qb += 2 * RR * L) {
      if constexpr (kShared) {
        V k0, k1;
        load_pair<T>(k + c, &k0, &k1);
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) {
          a0[x] += vload(qb + x * L) * k0;
          a1[x] += vload(qb + (RR + x) * L) * k1;
        }
      } else {
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) {
          V k0, k1;
          load_pair<T>(k + x * kstride + c, &k0, &k1);
          a0[x] += vload(qb + x * L) * k0;
          a1[x] += vload(qb + (RR + x) * L) * k1;
        }
      }
    }
    for (; c < dv; c += L, qb += RR * L) {
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) a0[x] += vload(qb + x * L) * load_cvt<T>(k + (kShared ? 0 : x * kstride) + c);
    }
    T* sj = s + size_t(r0) * kChunk + jj;
    if (d == dv) {
      V r[RR];
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) r[x] = a0[x] + a1[x];
      if (store_sums4<RR>(r, sj)) return;
    }
#pragma GCC unroll 4
    for (int x = 0; x < RR; ++x) {
      T sum = hsum_tree(a0[x] + a1[x]);
      const E* kx = k + (kShared ? 0 : x * kstride);
      for (int cc = dv; cc < d; ++cc) sum += qb[x * L + (cc - dv)] * to_t<T>(kx[cc]);
      sj[x * kChunk] = sum;
    }
  }
  // sj[x * kChunk] <- the lane sum of r[x] for a block of four float rows through simd.h's
  // shared reduction; false (nothing written) for other blocks, which sum row by row
  template <int RR>
  static bool store_sums4(const V* r, T* sj) {
    if constexpr (RR == 4 && std::is_same_v<V, vf>) {
      float sums[4];
      if (hsum4(r, sums)) {
        for (int x = 0; x < 4; ++x) sj[x * kChunk] = sums[x];
        return true;
      }
    }
    (void)r, (void)sj;
    return false;
  }
  // dot() on vdpbf16ps (kDots): the same blocks, 32 elements per step; qh's vector c / 32 of
  // row x at (c / 32 * RR + x) * 32. A row's last partial step loads K under a mask (zeros past
  // d, nothing read there), against qh's zero padding.
  template <int RR, bool kShared>
  void dot_bf16(int r0, int jj, const E* k, int64_t kstride) {
#if defined(__AVX512BF16__)
    const uint16_t* qb = qh.data() + size_t(r0) * dq;
    auto krow = [&](int x) { return k + (kShared ? 0 : x * kstride); };
    __m512 a0[RR], a1[RR];
#pragma GCC unroll 4
    for (int x = 0; x < RR; ++x) a0[x] = a1[x] = _mm512_setzero_ps();
    int c = 0;
    for (; c + 64 <= d; c += 64, qb += 2 * RR * 32) {
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
        const E* kx = krow(x) + c;
        a0[x] = _mm512_dpbf16_ps(a0[x], (__m512bh)_mm512_loadu_si512(qb + x * 32), (__m512bh)bf16x32(kx));
        a1[x] = _mm512_dpbf16_ps(a1[x], (__m512bh)_mm512_loadu_si512(qb + (RR + x) * 32), (__m512bh)bf16x32(kx + 32));
      }
    }
    for (; c < d; c += 32, qb += RR * 32) {
      const int nc = std::min(d - c, 32);
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
        a0[x] = _mm512_dpbf16_ps(a0[x], (__m512bh)_mm512_loadu_si512(qb + x * 32),
                                 (__m512bh)bf16x32<E, true>(krow(x) + c, nc));
      }
    }
    T* sj = s + size_t(r0) * kChunk + jj;
    V r[RR];
#pragma GCC unroll 4
    for (int x = 0; x < RR; ++x) r[x] = (V)_mm512_add_ps(a0[x], a1[x]);
    if (store_sums4<RR>(r, sj)) return;
#pragma GCC unroll 4
    for (int x = 0; x < RR; ++x) sj[x * kChunk] = hsum_tree(r[x]);
#else
    (void)r0, (void)jj, (void)k, (void)kstride;
#endif
  }
  // dot() in int32 (kInts): si's block r0 holds key jj's RR sums at jj * RR (scores_from_ints
  // scales them). NC: d / 32 where d is a multiple of 32 known at compile time, else 0.
  template <int RR, bool kShared, int NC, bool kV>
  void dot_i16(int r0, int jj, const E* k, int64_t kstride) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const int16_t* qb = qi.data() + size_t(r0) * dq;
    auto krow = [&](int x) { return reinterpret_cast<const int8_t*>(k + (kShared ? 0 : x * kstride)); };
    __m512i a[RR];
#pragma GCC unroll 4
    for (int x = 0; x < RR; ++x) a[x] = _mm512_setzero_si512();
    const int dd = NC > 0 ? NC * 32 : d;
#pragma GCC unroll 8
    for (int c = 0; c < dd; c += 32, qb += RR * 32) {
      const __mmask32 mask = NC > 0 || dd - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (dd - c)) - 1;
      if constexpr (kShared) {
        const __m512i kv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, krow(0) + c));
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) a[x] = dpwssd<kV>(a[x], kv, _mm512_loadu_si512(qb + x * 32));
      } else {
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) {
          const __m512i kv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, krow(x) + c));
          a[x] = dpwssd<kV>(a[x], kv, _mm512_loadu_si512(qb + x * 32));
        }
      }
    }
    int32_t* sj = si.data() + size_t(r0) * kChunk + jj * RR;
    if constexpr (RR == 4) {  // simd.h's hsum4 tree on int32
      const __m512i u01 =
          _mm512_add_epi32(_mm512_shuffle_i32x4(a[0], a[1], 0x44), _mm512_shuffle_i32x4(a[0], a[1], 0xEE));
      const __m512i u23 =
          _mm512_add_epi32(_mm512_shuffle_i32x4(a[2], a[3], 0x44), _mm512_shuffle_i32x4(a[2], a[3], 0xEE));
      __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(u01, u23, 0x88), _mm512_shuffle_i32x4(u01, u23, 0xDD));
      w = _mm512_add_epi32(w, _mm512_shuffle_epi32(w, _MM_PERM_BADC));
      w = _mm512_add_epi32(w, _mm512_shuffle_epi32(w, _MM_PERM_CDAB));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sj),
                       _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0,
                                                                                         0, 0, 0, 0, 0, 0, 0), w)));
    } else {
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) sj[x] = _mm512_reduce_add_epi32(a[x]);
    }
#elif defined(__AVX2__)
    const int16_t* qb = qi.data() + size_t(r0) * dq;
    auto krow = [&](int x) { return reinterpret_cast<const int8_t*>(k + (kShared ? 0 : x * kstride)); };
    const int dd = NC > 0 ? NC * 32 : d;
    auto kload = [&](const int8_t* kc, int c) {  // 16 int8 as int16; zeros past dd, not read
      if (NC > 0 || dd - c >= 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kc)));
      alignas(16) int8_t t[16] = {};
      std::memcpy(t, kc, size_t(dd - c));
      return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
    };
    __m256i a[RR];
#pragma GCC unroll 4
    for (int x = 0; x < RR; ++x) a[x] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < dd; c += 16, qb += RR * 16) {
      if constexpr (kShared) {
        const __m256i kv = kload(krow(0) + c, c);
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) {
          a[x] = dpwssd<kV>(a[x], kv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + x * 16)));
        }
      } else {
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) {
          a[x] = dpwssd<kV>(a[x], kload(krow(x) + c, c),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + x * 16)));
        }
      }
    }
    int32_t* sj = si.data() + size_t(r0) * kChunk + jj * RR;
    if constexpr (RR == 4) {  // lanes (r0 r1 r2 r3) in each half, then the halves added
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sj),
                       _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    } else {
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
        alignas(32) int32_t t[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), a[x]);
        sj[x] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
      }
    }
#else
    (void)r0, (void)jj, (void)k, (void)kstride;
#endif
  }
  // kInts: S rows <- the chunk's integer sums times the rows' q scales, row-major
  void scores_from_ints(int n) {
    for_dot_blocks([&](int r0, auto rr) {
      constexpr int RR = decltype(rr)::value;
      const int32_t* src = si.data() + size_t(r0) * kChunk;
#if defined(__AVX512F__)
      if constexpr (RR == 4) {  // four keys x four rows per vector: rows to quarters, then stored
        const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m512 sc = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                                _mm512_castps128_ps512(_mm_loadu_ps(qsc.data() + r0)));
        T* s0 = s + size_t(r0) * kChunk;
        for (int jj = 0; jj < n; jj += 4) {  // past n: S's padding, which scores() overwrites
          const __m512i sums = _mm512_permutexvar_epi32(idx, _mm512_loadu_si512(src + jj * 4));
          const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), sc);
          _mm_storeu_ps(s0 + jj, _mm512_castps512_ps128(x));
          _mm_storeu_ps(s0 + kChunk + jj, _mm512_extractf32x4_ps(x, 1));
          _mm_storeu_ps(s0 + 2 * kChunk + jj, _mm512_extractf32x4_ps(x, 2));
          _mm_storeu_ps(s0 + 3 * kChunk + jj, _mm512_extractf32x4_ps(x, 3));
        }
        return;
      }
#endif
      for (int x = 0; x < RR; ++x) {
        T* srow = s + size_t(r0 + x) * kChunk;
        const float sc = qsc[r0 + x];
        for (int jj = 0; jj < n; ++jj) srow[jj] = float(src[jj * RR + x]) * sc;
      }
    });
  }
  // Row r's softmax over the chunk's keys [j0, j0 + n) (nn: n rounded up to a vector): its
  // descales, the policy's scores and masks, the online update, and the products' P (bf16 /
  // int16); returns the row's new max (operator() rescales its output)
  T softmax_row(int r, int i, int j0, int n, int nn, const TileSoftmax<T>& ts, T* srow) {
    const bool key_scales = key_scaled();
    std::fill(srow + n, srow + nn, T(0));
    if (key_scales) {  // each key's k scale
      const T* ks = kscl.data() + size_t(r / rows_g) * kChunk;
      for (int jj = 0; jj < n; ++jj) srow[jj] *= ks[jj];
    }
    ts.scores(srow, i, j0, n == nn && ts.tile_full(i, i + 1, j0, nn), nn);
    if (nn > n) mask_outside(srow, j0, nn, j0, j0 + n);
    const T m_new = ts.online_update(srow, m[r], &l[r], &lc[r], nn);
    if (key_scales) {  // each key's v scale on its probability, the softmax's sum taken: only
      // on the keys the row sees, whose others keep P = 0 whatever their scale (NaN included)
      const T* vs = vscl.data() + size_t(r / rows_g) * kChunk;
      const int lo = std::clamp(row_lo[i] - j0, 0, n), hi = std::clamp(row_hi[i] - j0, lo, n);
      for (int jj = lo; jj < hi; ++jj) srow[jj] *= vs[jj];
    }
    if constexpr (kDot) rows_to_bf16(srow, 0, ph.data() + size_t(r) * kChunk, 0, 1, nn);
    if constexpr (kInt) p_to_i16(srow, nn, pi.data() + size_t(r) * kChunk, &psc[r]);
    return m_new;
  }
  // kInts: nv vectors ld(0) .. ld(nv - 1) of floats (a chunk's P row, or a q row) -> their int16
  // values and their scale (x = x16 x scale, i16_pow2 of the row's max |x|); ld reads a row in
  // memory (p_to_i16) or the fused softmax's registers (softmax_row_int)
  template <typename Load>
  static void to_i16(Load ld, int nv, int16_t* dst, float* scale) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m512 mx = _mm512_setzero_ps();  // max |P| (a negative v descale makes P < 0); NaN apart
    __mmask16 bad = 0;
    for (int u = 0; u < nv; ++u) {
      const __m512 x = __m512(ld(u));
      mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
      bad |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    }
    const float sc = bad ? std::numeric_limits<float>::quiet_NaN() : i16_pow2(_mm512_reduce_max_ps(mx));
    *scale = sc;
    const __m512 inv = _mm512_set1_ps(sc > 0.f ? 1.f / sc : 0.f);  // a power of two: exact
    for (int u = 0; u < nv; ++u) {
      const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(__m512(ld(u)), inv));  // to nearest even
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + u * 16), _mm512_cvtsepi32_epi16(x));
    }
#elif defined(__AVX2__)
    __m256 mx = _mm256_setzero_ps();
    int bad = 0;
    for (int u = 0; u < nv; ++u) {
      const __m256 x = __m256(ld(u));
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), x));  // |x|
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, mx);
    const float sc = bad ? std::numeric_limits<float>::quiet_NaN() : i16_pow2(*std::max_element(t, t + 8));
    *scale = sc;
    const __m256 inv = _mm256_set1_ps(sc > 0.f ? 1.f / sc : 0.f);
    for (int u = 0; u < nv; ++u) {
      const __m256i x = _mm256_cvtps_epi32(_mm256_mul_ps(__m256(ld(u)), inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + u * 8),
                       _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
    }
#else
    (void)ld, (void)nv, (void)dst, (void)scale;
#endif
  }
  // to_i16 of a row of n floats in memory (n a multiple of the vector width)
  static void p_to_i16(const float* src, int n, int16_t* dst, float* scale) {
    to_i16([&](int u) { return vload(src + u * L); }, n / L, dst, scale);
  }
  // kInts, a chunk whose keys every row sees, with plain scores (fuse_softmax): row r's k scales,
  // online update, v scales and int16 P in one pass through registers, where the general path
  // (softmax_row) makes five passes through the row in memory; measured faster
  // (benchmarks/results/2026-12-03-decode-int8-fused-softmax-zen5.md). Returns
  // the row's new max, or NaN with nothing changed where the row holds a NaN or no finite
  // score: the general path handles those (its NaN policy stays in one place).
  T softmax_row_int(int r, const TileSoftmax<T>& ts, int nn) {
    constexpr int NV = kChunk / L;
    const int nv = nn / L;
    T* srow = s + size_t(r) * kChunk;
    const T* ks = kscl.data() + size_t(r / rows_g) * kChunk;
    const T* vs = vscl.data() + size_t(r / rows_g) * kChunk;
    V x[NV];
    V mx = vbcast(-std::numeric_limits<T>::infinity());
    uint32_t bad = 0;
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) {
      if (u >= nv) break;
      x[u] = vload(srow + u * L) * vload(ks + u * L);
      bad |= lane_bits(x[u] != x[u]);
      mx = vmax(mx, x[u]);
    }
    const T m_old = m[r];
    const T m_new = ts.new_max(m_old, mx);
    if (bad || !std::isfinite(m_new)) return std::numeric_limits<T>::quiet_NaN();
    // the columns past pv_i16's whole blocks take P from S in float32 (pv_cols)
    const bool p_tail = d % std::max(kI16Cols, 1) != 0;
    V sum = V{};
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) {
      if (u >= nv) break;
      const V e = vexp2_nonpos(ts.exp2_arg(x[u], m_new));
      sum += e;
      x[u] = e * vload(vs + u * L);
      if (p_tail) vstore(srow + u * L, x[u]);
    }
    ts.add_sum(m_old, m_new, &l[r], &lc[r], hsum_tree(sum));
    to_i16([&](int u) { return x[u]; }, nv, pi.data() + size_t(r) * kChunk, &psc[r]);
    return m_new;
  }
  // Column c of a q / O row as stored: kEvenOdd permutes each full 2L block, kDots each full
  // 32-column block of O (its q goes to qh in column order); the rest stays
  static constexpr bool kPermuted = kEvenOdd<T, E> || kDot || kInt;
  int stored_col(int c) const {
    if constexpr (kDot) return c < d / 32 * 32 ? c / 32 * 32 + dots_col(c % 32) : c;
    if constexpr (kInt) return kI16Cols == 32 && c < d / 32 * 32 ? c / 32 * 32 + i16_col(c % 32) : c;
    return kEvenOdd<T, E> && c < d / (2 * L) * (2 * L) ? even_odd_col(c, L) : c;
  }
  // dst[c] = src[stored_col(c)] over a row (dp). Every permuted order moves columns only within
  // full 32-column blocks on AVX-512 (kEvenOdd's 2L, kDots', kInts'), so two vpermt2ps per
  // block do it there; elsewhere the table scol. (Element by element through stored_col's
  // branches it was a visible part of a split's time: 2026-12-02-decode-task-fixed-costs-zen5.md.)
  void unpermute(const T* __restrict__ src, T* __restrict__ dst) const {
    int c = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (d >= 32) {
        alignas(64) int32_t lo[16], hi[16];
        for (int j = 0; j < 16; ++j) lo[j] = scol[j], hi[j] = scol[16 + j];
        const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
        for (; c + 32 <= d; c += 32) {
          const __m512 a = _mm512_loadu_ps(src + c), b = _mm512_loadu_ps(src + c + 16);
          _mm512_storeu_ps(dst + c, _mm512_permutex2var_ps(a, ilo, b));
          _mm512_storeu_ps(dst + c + 16, _mm512_permutex2var_ps(a, ihi, b));
        }
      }
    }
#endif
    for (; c < dp; ++c) dst[c] = src[scol[c]];
  }
  // qp <- the q rows (q, column order) packed per register block, in stored column order
  void pack_q() {
    for_dot_blocks([&](int r0, auto rr) {
      constexpr int RR = decltype(rr)::value;
      // kInts / kDots: each row converted whole (vectorized) into q16, then dealt out in B-column
      // pieces (B: one int16 vector's columns, or one vdpbf16ps operand's 32); the padding past d
      // in each row's last piece keeps qi's / qh's zeros
      if constexpr (kInt) {
        constexpr int B = std::max(kI16Cols, 1);
        int16_t* dst = qi.data() + size_t(r0) * dq;
        for (int x = 0; x < RR; ++x) {
          // the whole padded row: its zeros past d change neither the scale nor the ints
          p_to_i16(q + size_t(r0 + x) * dp, dp, q16.data(), &qsc[r0 + x]);
          for (int c = 0; c < d; c += B) {
            std::copy_n(q16.data() + c, std::min(B, d - c), dst + (c / B * RR + x) * B);
          }
        }
        return;
      }
      if constexpr (kDot) {  // q is bf16 data: the conversion back is exact
        uint16_t* dst = qh.data() + size_t(r0) * dq;
        for (int x = 0; x < RR; ++x) {
          rows_to_bf16(q + size_t(r0 + x) * dp, 0, reinterpret_cast<uint16_t*>(q16.data()), 0, 1, dp);
          for (int c = 0; c < d; c += 32) {
            std::copy_n(reinterpret_cast<const uint16_t*>(q16.data()) + c, std::min(32, d - c),
                        dst + (c / 32 * RR + x) * 32);
          }
        }
        return;
      }
      T* dst = qp + size_t(r0) * dp;
      for (int x = 0; x < RR; ++x) {
        for (int c = 0; c < dp; ++c) {
          const int sc = scol[c];
          dst[(sc / L * RR + x) * L + sc % L] = q[size_t(r0 + x) * dp + c];
        }
      }
    });
  }
  // One row per kv head (MHA at q_len 1): the scores' register blocks span kv heads, and their
  // horizontal sums share one reduction. That measured faster for converted caches and for
  // float32 on AVX2; float32 on AVX-512 measured faster per head, so it keeps one head per block
  // there (benchmarks/results/2026-11-29-figures-from-comments.md).
  static constexpr bool kHeadBlocksF32 =
#if defined(__AVX2__) && !defined(__AVX512F__)
      true;
#else
      false;
#endif
  bool head_blocks() const { return rows_g == 1 && (!std::is_same_v<E, T> || kHeadBlocksF32); }
  // One row per kv head, float32 cache, on AVX2 (head_blocks, 8-lane vectors): at d >= 128 the
  // scores go 8 keys at a time per row, one accumulator per key, reduced together (simd.h's
  // hsum8) into one vector of S. Each K row is still loaded once; q's vectors are loaded once
  // per 8 keys instead of once per key, and the reduction costs about one instruction per score
  // against two in the per-key blocks (hsum4 over 4 kv heads). That measured faster for float32
  // at D 128, the cache cold or warm; at D 64 faster warm but slower cold, and bf16 caches lost
  // at H 8 D 128 (benchmarks/results/2026-11-28-decode-cpu-zen3.md): those stay on the per-key
  // blocks.
  static constexpr bool kKeyBlocks = kHeadBlocksF32 && std::is_same_v<T, float> && std::is_same_v<E, T>;
  bool key_blocks() const { return kKeyBlocks && head_blocks() && d >= 128 && d % (2 * L) == 0; }
  // S row r (kv head r) x keys [jb, jb + 8) of the chunk, raw. Keys past nk (the chunk's end)
  // read key jb's row again, and their sums land in S past n, which the softmax never reads
  // (scores() zero-fills [n, nn) first). Every key's sum follows the same order wherever its
  // block starts, so splits and chunk edges do not change a score.
  void dot_keys(int r, int jb, int nk) {
    if constexpr (kKeyBlocks) {
      // row r's q in qp: block r0 of RR rows (row_blocks over the kv heads), vector c / L of
      // row x at (c / L * RR + x) * L
      const int r0 = r / kRowBlock * kRowBlock, rr = std::min(kRowBlock, p.h_k - r0);
      const T* qb = qp + size_t(r0) * dp + (r - r0) * L;
      const int qs = rr * L;
      const E* kr[8];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) kr[u] = kp[jb + (u < nk ? u : 0)] + int64_t(r) * p.k_head_stride;
      V acc[8];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) acc[u] = V{};
      for (int c = 0; c < d; c += 2 * L, qb += 2 * qs) {
        const V q0 = vload(qb), q1 = vload(qb + qs);
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) {
          V k0, k1;
          load_pair<T>(kr[u] + c, &k0, &k1);
          acc[u] += q0 * k0;
          acc[u] += q1 * k1;
        }
      }
      V sums;
      if (hsum8(acc, &sums)) vstore(s + size_t(r) * kChunk + jb, sums);  // always on AVX2
    } else {
      (void)r, (void)jb, (void)nk;
    }
  }
  // f(r0, RR) over the register blocks of the scores: a GQA group's rows, or kv heads side by
  // side (head_blocks)
  template <typename F>
  void for_dot_blocks(F&& f) const {
    if (head_blocks()) {
      row_blocks(0, p.h_k, f);
    } else {
      for (int hk = 0; hk < p.h_k; ++hk) row_blocks(hk * rows_g, (hk + 1) * rows_g, f);
    }
  }
  // O rows [r0, r0 + RR), columns [c, c + NV * L) += P V over keys [j_lo, j_hi): NV / 2 pairs
  // of vectors (load_pair's order), O in registers
  template <int RR, int NV>
  void pv_cols(int r0, int c, int64_t voff, int j_lo, int j_hi) {
    static_assert(NV % 2 == 0 && RR * NV <= 8, "the accumulators leave registers for V and P");
    V a[RR][NV];
#pragma GCC unroll 8
    for (int x = 0; x < RR; ++x) {
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) a[x][u] = vload(o + (r0 + x) * dp + c + u * L);
    }
    // one pointer into P, its rows at constant offsets (x * kChunk): with (r0 + x) * kChunk + jj
    // indexing GCC kept an address register and an lea per row
    const T* pj = s + size_t(r0) * kChunk + j_lo;
    for (int jj = j_lo; jj < j_hi; ++jj, ++pj) {
      V v[NV];
#pragma GCC unroll 4
      for (int u = 0; u < NV; u += 2) load_pair<T>(vp[jj] + voff + c + u * L, &v[u], &v[u + 1]);
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
        const V pr = vbcast_mem(pj + x * kChunk);
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) a[x][u] += pr * v[u];
      }
    }
#pragma GCC unroll 8
    for (int x = 0; x < RR; ++x) {
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) vstore(o + (r0 + x) * dp + c + u * L, a[x][u]);
    }
  }
  // O rows [r0, r0 + RR) += P (RR, n) @ V rows of the chunk (kv head at offset voff), O in
  // registers, the chunk's keys inner. A pass covers NV = 8 / RR vectors of columns (2 for a
  // 4-row block): every key adds into each of the block's RR x NV accumulators, so they are its
  // independent FMA chains, and 8 chains cover the FMA latency on two ports. With two vectors
  // per pass a one-row block (MHA: one row per kv head) had two chains; the gain measured small
  // (benchmarks/results/2026-11-27-decode-cpu-zen3.md), same bits.
  // Keys [j_lo, j_hi) of the chunk only (an edge chunk, one row at a time: the keys outside
  // the row's window add nothing, not even 0 x a NaN value).
  template <int RR>
  void pv(int r0, int n, int64_t voff, int j_lo = 0, int j_hi = -1) {
    if (j_hi < 0) j_hi = n;
    const int dv = d / L * L;
    int c = 0;
    if constexpr (kDot) c = pv_bf16<RR>(r0, voff, j_lo, j_hi);  // the full 32-column blocks
    if constexpr (kInt) {
      c = on_products([&](auto v) { return pv_i16<RR, decltype(v)::value>(r0, voff, j_lo, j_hi); });
    }
    constexpr int NV = RR == 1 ? 8 : RR == 2 ? 4 : 2;
    if constexpr (NV >= 8) {
      for (; c + 8 * L <= dv; c += 8 * L) pv_cols<RR, 8>(r0, c, voff, j_lo, j_hi);
    }
    if constexpr (NV >= 4) {  // and what a one-row block leaves past 8 vectors (D 64 on AVX-512)
      for (; c + 4 * L <= dv; c += 4 * L) pv_cols<RR, 4>(r0, c, voff, j_lo, j_hi);
    }
    for (; c + 2 * L <= dv; c += 2 * L) pv_cols<RR, 2>(r0, c, voff, j_lo, j_hi);
    for (; c < dv; c += L) {
      V a[RR];
      for (int x = 0; x < RR; ++x) a[x] = vload(o + (r0 + x) * dp + c);
      for (int jj = j_lo; jj < j_hi; ++jj) {
        const V v0 = load_cvt<T>(vp[jj] + voff + c);
        for (int x = 0; x < RR; ++x) a[x] += vbcast_mem(s + (r0 + x) * kChunk + jj) * v0;
      }
      for (int x = 0; x < RR; ++x) vstore(o + (r0 + x) * dp + c, a[x]);
    }
    for (; c < d; ++c) {
      for (int jj = j_lo; jj < j_hi; ++jj) {
        const T vc = to_t<T>(vp[jj][voff + c]);
        for (int x = 0; x < RR; ++x) o[(r0 + x) * dp + c] += s[(r0 + x) * kChunk + jj] * vc;
      }
    }
  }
  // pv() on vdpbf16ps (kDots) over the full 32-column blocks of O (in dots_col order); returns
  // the columns done. Keys go in pairs from an even index: P's pair (p_j, p_j+1) is one 32-bit
  // word of ph, and the two V rows' words interleave by unpacking; a key outside [j_lo, j_hi)
  // in a pair (an odd first or last key; its p is 0, masked) pairs with a zero row, never read.
  template <int RR>
  int pv_bf16(int r0, int64_t voff, int j_lo, int j_hi) {
#if defined(__AVX512BF16__)
    const int d32 = d / 32 * 32;
    if (j_lo >= j_hi) return d32;  // no key of this chunk for these rows
    for (int c = 0; c < d32; c += 32) {
      __m512 lo[RR], hi[RR];
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
        lo[x] = _mm512_loadu_ps(o + (r0 + x) * dp + c);
        hi[x] = _mm512_loadu_ps(o + (r0 + x) * dp + c + 16);
      }
      const uint16_t* pj = ph.data() + size_t(r0) * kChunk;
      auto step = [&](__m512i v0, __m512i v1, const uint16_t* pw) {
        const __m512bh blo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        const __m512bh bhi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) {
          int32_t w;
          std::memcpy(&w, pw + x * kChunk, 4);
          const __m512bh a = (__m512bh)_mm512_set1_epi32(w);
          lo[x] = _mm512_dpbf16_ps(lo[x], a, blo);
          hi[x] = _mm512_dpbf16_ps(hi[x], a, bhi);
        }
      };
      int jj = j_lo & ~1;
      if (jj < j_lo && j_lo < j_hi) {
        step(_mm512_setzero_si512(), bf16x32(vp[j_lo] + voff + c), pj + jj);
        jj += 2;
      }
      for (; jj + 1 < j_hi; jj += 2) step(bf16x32(vp[jj] + voff + c), bf16x32(vp[jj + 1] + voff + c), pj + jj);
      if (jj < j_hi) step(bf16x32(vp[jj] + voff + c), _mm512_setzero_si512(), pj + jj);
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
        _mm512_storeu_ps(o + (r0 + x) * dp + c, lo[x]);
        _mm512_storeu_ps(o + (r0 + x) * dp + c + 16, hi[x]);
      }
    }
    return d32;
#else
    (void)r0, (void)voff, (void)j_lo, (void)j_hi;
    return 0;
#endif
  }
  // pv() in int32 (kInts) over the full 32-column blocks of O (in i16_col order); returns the
  // columns done. Keys in pairs from an even index as pv_bf16: P's pair (p_j, p_j+1) is one
  // 32-bit word of pi, the two V rows' bytes interleave by unpacking (then widen to int16); a key
  // outside [j_lo, j_hi) in a pair pairs with a zero row, never read.
  template <int RR, bool kV>
  int pv_i16(int r0, int64_t voff, int j_lo, int j_hi) {
    constexpr int B = std::max(kI16Cols, 1), NB = kI16Cols == 32 ? 2 : 1;
    const int db = d / B * B;
    if (j_lo >= j_hi) return db;  // no key of this chunk for these rows
    int c = 0;
    for (; c + NB * B <= db; c += NB * B) pv_i16_cols<RR, NB, kV>(r0, voff, c, j_lo, j_hi);
    if (c < db) pv_i16_cols<RR, 1, kV>(r0, voff, c, j_lo, j_hi);
    return db;
  }
  // pv_i16 over NB blocks of kI16Cols columns from column c: NB = 2 (AVX-512) shares each P
  // pair's broadcast and the key loop between two blocks (2 NB RR accumulators: 16 of the 32 zmm
  // at four rows; AVX2's 16 ymm take one block)
  template <int RR, int NB, bool kV>
  void pv_i16_cols(int r0, int64_t voff, int c, int j_lo, int j_hi) {
#if defined(__AVX2__)  // I16Ops: AVX2 or AVX-512 (every level with AVX-512 has BW and VL)
    {
      using I = I16Ops::I;
      const int16_t* pj = pi.data() + size_t(r0) * kChunk;
      I acc[RR][2 * NB];
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
#pragma GCC unroll 4
        for (int u = 0; u < 2 * NB; ++u) acc[x][u] = I16Ops::zero();
      }
      auto vrow = [&](int j, int u) { return I16Ops::bytes(vp[j] + voff + c + kI16Cols * u); };
      // keys j, j + 1 (v0 / v1 zero for a key outside [j_lo, j_hi), whose rows are not read)
      auto step = [&](int j, bool first, bool second) {
        I b[2 * NB];
#pragma GCC unroll 2
        for (int u = 0; u < NB; ++u) {
          const auto v0 = first ? vrow(j, u) : I16Ops::no_bytes();
          const auto v1 = second ? vrow(j + 1, u) : I16Ops::no_bytes();
          b[2 * u] = I16Ops::pairs_lo(v0, v1);
          b[2 * u + 1] = I16Ops::pairs_hi(v0, v1);
        }
#pragma GCC unroll 4
        for (int x = 0; x < RR; ++x) {
          int32_t w;
          std::memcpy(&w, pj + x * kChunk + j, 4);
          const I a = I16Ops::bcast(w);
#pragma GCC unroll 4
          for (int u = 0; u < 2 * NB; ++u) acc[x][u] = dpwssd<kV>(acc[x][u], a, b[u]);
        }
      };
      int jj = j_lo & ~1;
      if (jj < j_lo) {
        step(jj, false, true);
        jj += 2;
      }
      for (; jj + 1 < j_hi; jj += 2) step(jj, true, true);
      if (jj < j_hi) step(jj, true, false);
#pragma GCC unroll 4
      for (int x = 0; x < RR; ++x) {
        float* orow = o + (r0 + x) * dp + c;
#pragma GCC unroll 4
        for (int u = 0; u < 2 * NB; ++u) I16Ops::add_scaled(orow + kI16Cols / 2 * u, acc[x][u], psc[r0 + x]);
      }
    }
#else
    (void)r0, (void)voff, (void)c, (void)j_lo, (void)j_hi;
#endif
  }
  // f(r0, RR) over the rows [r_begin, r_end) in register blocks of up to kRowBlock
  template <typename F>
  static void row_blocks(int r_begin, int r_end, F&& f) {
    for (int r0 = r_begin; r0 < r_end; r0 += kRowBlock) {
      switch (std::min(kRowBlock, r_end - r0)) {
        case 1: f(r0, std::integral_constant<int, 1>{}); break;
        case 2: f(r0, std::integral_constant<int, 2>{}); break;
        case 3: f(r0, std::integral_constant<int, 3>{}); break;
        default: f(r0, std::integral_constant<int, 4>{}); break;
      }
    }
  }

  // One task: batch b, keys of split `split`, every head. Rows r = h * Sq + i; the rows of kv
  // head hk's group are [hk * G * Sq, (hk + 1) * G * Sq).
  void operator()(int64_t task) {
    const int split = int(task % splits), b = int(task / splits);
    const SeqInfo si = decode_seq_info(p, b);
    const KvRows kv(p, b, 0);
    pols.clear();
    tss.clear();
    for (int h = 0; h < p.h; ++h) {
      pols.emplace_back(p, si, b, h);
      tss.emplace_back(p, pols.back(), b * p.h + h);
    }
    // the keys any row sees (windows do not depend on the head), and this split's share of them
    int klo, khi;
    pols[0].key_range(0, p.sq, &klo, &khi);
    klo = std::max(klo, 0);
    khi = std::min(khi, si.len_k);
    for (int i = 0; i < p.sq; ++i) pols[0].key_range(i, i + 1, &row_lo[i], &row_hi[i]);
    // splits on kChunkKeys boundaries, as decode_num_splits counts them, whatever this cache's chunk
    const int per = round_up(std::max((std::max(khi - klo, 0) + splits - 1) / splits, 1), kChunkKeys);
    const int a = std::min(khi, klo + split * per), e = std::min(khi, a + per);

    const bool per_token = kQuant && p.descale_per_token;
    const bool key_scales = key_scaled();
    const E* kbase = static_cast<const E*>(p.k);
    const E* vbase = static_cast<const E*>(p.v);
    const int line_elems = std::max<int>(1, 64 / int(sizeof(E)));
    auto rows_of = [&](int j0, const E** kq, const E** vq, int64_t* sq_) {
      kv.walk(j0, std::min(chunk, e - j0), [&](int jj, int64_t ko, int64_t vo) {
        kq[jj] = kbase + ko;
        vq[jj] = vbase + vo;
      });
      if (per_token) {
        for (int jj = 0; jj < std::min(chunk, e - j0); ++jj) sq_[jj] = kv.scale_row(j0 + jj) * p.h_k;
      }
    };
    // The first chunk's K rows, which no scores pass prefetched, are asked for before the task's
    // set-up (q rows, O's zeros), which then runs while they arrive
    if (a < e) {
      rows_of(a, kp, vp, sr);
      for (int jj = 0; jj < std::min(chunk, e - a); ++jj) {
        for (int hk = 0; hk < p.h_k; ++hk) {
          const E* k = kp[jj] + hk * p.k_head_stride;
          for (int c = 0; c < d; c += line_elems) __builtin_prefetch(k + c, 0, 2);
        }
      }
    }
    if (kQuant && !per_token && (kDot || kInt)) {
      for (int hk = 0; hk < p.h_k; ++hk) {
        std::fill_n(kscl.data() + size_t(hk) * kChunk, kChunk, p.k_descale[int64_t(b) * p.h_k + hk] * kUnit<E>);
        std::fill_n(vscl.data() + size_t(hk) * kChunk, kChunk, p.v_descale[int64_t(b) * p.h_k + hk] * kUnit<E>);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int h = r / p.sq, i = r % p.sq;
      const char* src = elem(p.q, dt, int64_t(b) * p.q_batch_stride + int64_t(h) * p.q_head_stride +
                                          int64_t(i) * p.q_row_stride);
      load_row(dt, src, q + size_t(r) * dp, d, dp);
      if (kQuant && !key_scales) {  // a (batch, kv head) k scale: q . (k s) = (q s) . k
        const T ks = p.k_descale[int64_t(b) * p.h_k + r / rows_g] * kUnit<E>;
        for (int c = 0; c < d; ++c) q[size_t(r) * dp + c] *= ks;
      }
    }
    pack_q();
    std::fill(o, o + size_t(rows) * dp, T(0));
    std::fill(os, os + size_t(rows) * dp, T(0));
    std::fill(oc, oc + size_t(rows) * dp, T(0));
    std::fill(m, m + rows, -std::numeric_limits<T>::infinity());
    std::fill(l, l + rows, T(0));
    std::fill(lc, lc + rows, T(0));
    // o's block joins the running output os (compensation oc), and o starts the next block
    auto flush = [&] {
      kahan_add(os, oc, o, rows * dp);
      std::fill(o, o + size_t(rows) * dp, T(0));
    };

    for (int j0 = a; j0 < e; j0 += chunk) {
      const int n = std::min(chunk, e - j0), nn = round_up(n, L);
      if (j0 > a) {
        std::copy(kp_next, kp_next + n, kp);
        std::copy(vp_next, vp_next + n, vp);
        if (per_token) std::copy(sr_next, sr_next + n, sr);
      }
      const int n_next = j0 + chunk < e ? std::min(chunk, e - j0 - chunk) : 0;
      if (n_next > 0) rows_of(j0 + chunk, kp_next, vp_next, sr_next);
      // scores: key by key, every kv head of the key (one sequential stream through the cache);
      // on the way, the key's V rows are prefetched for the PV pass and the next chunk's K rows
      // for the next scores pass (the hardware prefetchers alone left the FMAs waiting on K).
      // Into L2 (prefetcht1), not L1: a chunk of every kv head (64-128 KB at H_k 8, D 128)
      // outgrows a 32 KB L1, so L1 prefetches evicted rows not yet read. L2 hints measured
      // faster; prefetching the next chunk's V (one chunk ahead instead of the same chunk) lost
      // again (benchmarks/results/2026-11-29-figures-from-comments.md).
      const bool kb = key_blocks();
      for (int jj = 0; jj < n; ++jj) {
        if (kb) {  // row r = kv head r, 8 keys at a time
          if (jj % 8 == 0) {
            for (int r = 0; r < p.h_k; ++r) dot_keys(r, jj, std::min(8, n - jj));
          }
        } else if (head_blocks()) {  // row r = kv head r
          row_blocks(0, p.h_k, [&](int r0, auto rr) {
            dot<decltype(rr)::value, false>(r0, jj, kp[jj] + r0 * p.k_head_stride, p.k_head_stride);
          });
        }
        for (int hk = 0; hk < p.h_k; ++hk) {
          const E* k = kp[jj] + hk * p.k_head_stride;
          if (!head_blocks()) {
            row_blocks(hk * rows_g, (hk + 1) * rows_g,
                       [&](int r0, auto rr) { dot<decltype(rr)::value, true>(r0, jj, k, 0); });
          }
          const E* v = vp[jj] + hk * p.v_head_stride;
          for (int c = 0; c < d; c += line_elems) __builtin_prefetch(v + c, 0, 2);
          if (jj < n_next) {
            const E* kn = kp_next[jj] + hk * p.k_head_stride;
            for (int c = 0; c < d; c += line_elems) __builtin_prefetch(kn + c, 0, 2);
          }
        }
      }
      if constexpr (kInt) scores_from_ints(n);
      // the chunk's descales, gathered once per kv head (their rows share them): where the
      // chunk's keys are consecutive rows of the descales (a contiguous cache, or a chunk inside
      // a page), their (n, H_k) block transposed in registers
      bool scales_block = std::is_same_v<T, float> && per_token;
      for (int jj = 1; jj < n && scales_block; ++jj) scales_block = sr[jj] == sr[jj - 1] + p.h_k;
      if (scales_block) {
        if constexpr (std::is_same_v<T, float>) {
          transpose(p.k_descale + sr[0], n, p.h_k, p.h_k, kscl.data(), kChunk);
          transpose(p.v_descale + sr[0], n, p.h_k, p.h_k, vscl.data(), kChunk);
          if constexpr (kUnit<E> != 1.0f) {
            for (T* x : {kscl.data(), vscl.data()}) {
              for (size_t c = 0; c < size_t(p.h_k) * kChunk; c += L) vstore(x + c, vload(x + c) * T(kUnit<E>));
            }
          }
        }
      } else if (per_token) {
        for (int jj = 0; jj < n; ++jj) {
          const float* ks = p.k_descale + sr[jj];
          const float* vs = p.v_descale + sr[jj];
          for (int hk = 0; hk < p.h_k; ++hk) {
            kscl[size_t(hk) * kChunk + jj] = ks[hk] * kUnit<E>;
            vscl[size_t(hk) * kChunk + jj] = vs[hk] * kUnit<E>;
          }
        }
      }
      // kInts: softmax_row_int where every row sees every key of a whole chunk with plain scores
      bool fuse_softmax = false;
      if constexpr (kInt) {
        fuse_softmax = n == nn;
        for (int i = 0; i < p.sq && fuse_softmax; ++i) fuse_softmax = row_lo[i] <= j0 && row_hi[i] >= j0 + n;
        for (int h = 0; h < p.h && fuse_softmax; ++h) {
          fuse_softmax = tss[h].plain && pols[h].topk_thr == nullptr && tss[h].tile_full(0, p.sq, j0, nn);
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int i = r % p.sq;
        const TileSoftmax<T>& ts = tss[r / p.sq];
        T* srow = s + r * kChunk;
        T m_new = std::numeric_limits<T>::quiet_NaN();
        if constexpr (kInt) {
          if (fuse_softmax) m_new = softmax_row_int(r, ts, nn);
        }
        if (std::isnan(m_new)) {  // the general path
          m_new = softmax_row(r, i, j0, n, nn, ts, srow);
        }
        if (m_new != m[r]) {  // rescale the row's output by e^{m - m'} (0 before anything was seen)
          const T alpha = std::isinf(m[r]) ? T(0) : std::exp(m[r] - m_new);
          for (T* x : {o, os, oc}) {
            T* xrow = x + size_t(r) * dp;
            for (int c = 0; c < dp; c += L) vstore(xrow + c, vload(xrow + c) * alpha);
          }
          m[r] = m_new;
        }
      }
      // PV kv head by kv head: the chunk's V rows are in cache by now, and O stays in registers
      // across the chunk's keys
      // An edge chunk, where some query row's window (causal / window with several query rows)
      // hides keys the others see, runs row by row over each row's own keys: in one product
      // a hidden key would still cost 0 x its value, so a NaN / inf value there would reach rows
      // that never read it (the NaN policy, README). At most a few chunks per task.
      bool edge = false;
      for (int i = 0; i < p.sq; ++i) edge |= row_lo[i] > j0 || row_hi[i] < j0 + n;
      for (int hk = 0; hk < p.h_k; ++hk) {
        if (!edge) {
          row_blocks(hk * rows_g, (hk + 1) * rows_g,
                     [&](int r0, auto rr) { pv<decltype(rr)::value>(r0, n, hk * p.v_head_stride); });
          continue;
        }
        for (int r = hk * rows_g; r < (hk + 1) * rows_g; ++r) {
          const int i = r % p.sq;
          pv<1>(r, n, hk * p.v_head_stride, std::clamp(row_lo[i] - j0, 0, n), std::clamp(row_hi[i] - j0, 0, n));
        }
      }
      if ((j0 - a + chunk) % (kFlushChunks * kChunk) == 0) flush();
    }
    flush();

    for (int r = 0; r < rows; ++r) {
      const int h = r / p.sq, i = r % p.sq;
      const int64_t row_id = (int64_t(b) * p.h + h) * p.sq + i;
      T* orow = o + size_t(r) * dp;  // o is free after the last flush: the row's output os - oc
      const T* osrow = os + size_t(r) * dp;
      const T* ocrow = oc + size_t(r) * dp;
      for (int c = 0; c < dp; c += L) vstore(orow + c, vload(osrow + c) - vload(ocrow + c));
      if (kQuant && !key_scales) {  // a (batch, kv head) v scale
        const V vs = vbcast(T(p.v_descale[int64_t(b) * p.h_k + r / rows_g] * kUnit<E>));
        for (int c = 0; c < dp; c += L) vstore(orow + c, vload(orow + c) * vs);
      }
      if constexpr (kPermuted) {  // back to column order
        unpermute(orow, row);
        std::copy(row, row + dp, orow);
      }
      if (part_o != nullptr) {  // a partial: normalized by its own sum, no sink (the merge adds it)
        const T inv = finish_row(m[r], l[r] - lc[r], false, T(0), T(1), &part_lse[row_id * splits + split]);
        T* dst = part_o + (row_id * splits + split) * dp;
        for (int c = 0; c < dp; c += L) vstore(dst + c, vload(orow + c) * inv);
        continue;
      }
      const bool has_sink = p.sinks != nullptr;
      const T inv = finish_row(m[r], l[r] - lc[r], has_sink, has_sink ? p.sinks[h] : T(0), T(1),
                               &p.lse[int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + i]);
      for (int c = 0; c < dp; c += L) vstore(row + c, vload(orow + c) * inv);
      store_row(dt, row, elem(p.o, dt, int64_t(b) * p.o_batch_stride + int64_t(h) * p.o_head_stride +
                                           int64_t(i) * p.o_row_stride), d);
    }
  }
};

// out, lse of every (b, h, i) row from its splits' partials (split_merge.h), sinks included
template <typename T>
void merge_splits(const DecodeParamsT<T>& p, DType dt, int splits, const T* part_o, const T* part_lse) {
  const int dp = round_up(p.d, kLanes<T>);
  const int64_t n_rows = int64_t(p.b) * p.h * p.sq;
  pool_for(n_rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<T> row(dp);
    for (int64_t rid = r0; rid < r1; ++rid) {
      const int i = int(rid % p.sq), h = int((rid / p.sq) % p.h), b = int(rid / (int64_t(p.sq) * p.h));
      const T* ls = part_lse + rid * splits;
      const bool has_sink = p.sinks != nullptr;
      const T lse = merge_split_lse<T>(ls, splits, 1, has_sink, has_sink ? p.sinks[h] : T(0));
      std::fill(row.begin(), row.end(), T(0));
      for (int sp = 0; sp < splits; ++sp) {
        const T w = split_weight(ls[sp], lse);
        if (w == T(0)) continue;
        const T* src = part_o + (rid * splits + sp) * dp;
        for (int c = 0; c < dp; ++c) row[c] += w * src[c];
      }
      store_row(dt, row.data(), elem(p.o, dt, int64_t(b) * p.o_batch_stride + int64_t(h) * p.o_head_stride +
                                                  int64_t(i) * p.o_row_stride), p.d);
      p.lse[int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + i] = lse;
    }
  });
}

template <typename T, typename E>
void run(const DecodeParamsT<T>& p, DType dt) {
  int max_keys = 0;
  for (int b = 0; b < p.b; ++b) max_keys = std::max(max_keys, decode_seq_info(p, b).len_k);
  const int splits = decode_num_splits(p, max_keys);
  const int64_t n_tasks = int64_t(p.b) * splits;
  std::vector<T> part_o, part_lse;
  if (splits > 1) {
    const int64_t n_rows = int64_t(p.b) * p.h * p.sq;
    part_o.resize(size_t(n_rows) * splits * round_up(p.d, kLanes<T>));
    part_lse.resize(size_t(n_rows) * splits);
  }
  T* po = splits > 1 ? part_o.data() : nullptr;
  T* pl = splits > 1 ? part_lse.data() : nullptr;
  if constexpr ((kDots<T, E, true> || kInts<T, E, true>) && kByte<E>) {
    // kInts: bf16 or fp16 q; kDots (P rounded to bf16): bf16 q only. e4m3 takes kDots only on
    // a CPU with VBMI (bf16x32's byte tables) and without AMX (Intel), whose vdpbf16ps runs at
    // half the FMA rate: its widening to float32 reads 1.08-1.13x faster there
    // (benchmarks/results/2026-12-01-decode-e4m3-intel.md).
    const bool q16 = dt == DType::kBF16 || (kInts<T, E, true> && dt == DType::kF16 && p.d <= kI16MaxD);
    const bool f8_widens = kDots<T, E, true> && std::is_same_v<E, F8> && (amx() || !vbmi());
    if (q16 && !f8_widens && (!kInts<T, E, true> || p.d <= kI16MaxD)) {
      parallel_tasks(n_tasks, p.num_threads, [&] { return DecodeWorker<T, E, true>(p, dt, splits, po, pl); });
      if (splits > 1) merge_splits(p, dt, splits, po, pl);
      return;
    }
  }
  parallel_tasks(n_tasks, p.num_threads, [&] { return DecodeWorker<T, E>(p, dt, splits, po, pl); });
  if (splits > 1) merge_splits(p, dt, splits, po, pl);
}

}  // namespace

template <typename T>
int decode_num_splits(const DecodeParamsT<T>& p, int max_keys) {
  const int chunks = std::max(1, (max_keys + kChunkKeys - 1) / kChunkKeys);
  if (p.num_splits > 0) return std::min(p.num_splits, chunks);
  // From the problem alone, never from the thread count: the merge sums the splits' partials in
  // an order fixed by the split count, so a count that followed the threads would change the
  // rounding with them (the forward is bit-identical for any thread count). Up to kTasks tasks
  // (B * splits): 64 give a batch-1 call work for 32 cores at two tasks each (dynamic hand-out
  // evens out ragged lengths), and bound the partials to about (64 + B) * H * Sq rows of d.
  // Each split keeps >= kSplitKeys keys (at H_k 8, D 128; below), so a task's fixed cost (its q rows, the partial it
  // writes and the merge reads, the unprefetched first chunk) stays small against its keys:
  // shorter splits cost measurably more than one split, while 1024-key splits measured within
  // the noise of the thread-count rule from batch 1 to 4 and 4k to 64k keys
  // (benchmarks/results/2026-11-29-figures-from-comments.md). A 4k cache at batch 1 gets 4
  // splits, 16k 16, 64k and longer 64; batch 4 at 16k 16; batch >= 64 none.
  // The keys per split count K / V elements, not keys: a split holds the elements of 1024 keys at
  // H_k 8, D 128 (2M), so wider kv rows take fewer keys, down to 256. At MHA H 32 D 128 and 1024
  // keys, 1024-key splits left batch 1 one task (one core busy); 256-key splits (4 tasks) ran
  // faster on 2 cores (benchmarks/results/2026-11-28-decode-cpu-zen3.md).
  constexpr int64_t kTasks = 64, kSplitKeys = 1024, kSplitKeysMin = 256, kSplitElems = kSplitKeys * 2 * 8 * 128;
  const int64_t want = (kTasks + p.b - 1) / p.b;
  const int64_t row = 2 * int64_t(p.h_k) * p.d;  // K and V elements per key
  const int64_t split_keys = std::clamp<int64_t>(kSplitElems / std::max<int64_t>(row, 1), kSplitKeysMin, kSplitKeys);
  return int(std::max<int64_t>(1, std::min<int64_t>(want, max_keys / split_keys)));
}
template int decode_num_splits<float>(const DecodeParamsT<float>&, int);
template int decode_num_splits<double>(const DecodeParamsT<double>&, int);

template <typename T>
void decode_fwd(const DecodeParamsT<T>& p, DType dt) {
  if constexpr (std::is_same_v<T, double>) {
    run<double, double>(p, dt);
  } else {
    if (p.kv_quant == kKvInt8) return run<float, I8>(p, dt);
    if (p.kv_quant == kKvFp8) return run<float, F8>(p, dt);
    switch (dt) {
      case DType::kBF16: run<float, Bf16>(p, dt); break;
      case DType::kF16: run<float, F16>(p, dt); break;
      default: run<float, float>(p, dt); break;
    }
  }
}
template void decode_fwd<float>(const DecodeParamsT<float>&, DType);
template void decode_fwd<double>(const DecodeParamsT<double>&, DType);
ATTN_CPU_REGISTER(decode_fwd_stub<float>, &decode_fwd<float>);
ATTN_CPU_REGISTER(decode_fwd_stub<double>, &decode_fwd<double>);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
