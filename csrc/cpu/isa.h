// The CPU kernels are compiled once per ISA level, each with its own flags (setup.py's
// _cpu_levels: base = any x86-64, avx2 = AVX2 + FMA + F16C, avx512 = AVX-512 F/BW/VL/DQ, and
// native = -march=native when ATTENTION_EXT_NATIVE=1), and the dispatcher (cpu/dispatch.h)
// runs the highest level the running CPU supports. A level's translation units get
// -DATTN_CPU_ISA=<level>: every kernel and every csrc/cpu helper it uses then lives in the inline
// namespace attn::cpu::<level>, so the levels' symbols never collide and the linker never merges
// an AVX-512 copy of one of our inline functions or templates into a lower level's code (W
// differs between levels, so such a merge would be wrong even where it does not fault).
// Without ATTN_CPU_ISA (the torch bindings, the dispatcher) the
// same headers declare the families' DispatchStubs, which call the active level's kernels.
#pragma once

#if defined(ATTN_CPU_ISA)
#define ATTN_CPU_ISA_BEGIN inline namespace ATTN_CPU_ISA {
#define ATTN_CPU_ISA_END }
#else
#define ATTN_CPU_ISA_BEGIN
#define ATTN_CPU_ISA_END
#endif

namespace attn {
namespace cpu {

// The level the entry points run now: the highest one built that this CPU supports, unless
// set_isa chose a lower one.
const char* isa();
// Levels built into this library that this CPU runs, lowest first, as "base,avx2"; `all`: every
// level built, runnable or not.
const char* isa_levels(bool all = false);
// Makes `name` the active level (nullptr or "": the default, the highest runnable one). Returns
// nullptr on success, else why not (a level that was not built or that this CPU lacks); the
// active level is then unchanged.
const char* set_isa(const char* name);
// float32 lanes of the active level's SIMD vector.
int simd_width();
// Whether the int8 dot products (cpu/q8dot.h) of the active level may use vpdpbusd, and the
// decode kernel's int16-pair products vpdpwssd, beyond the level's own flags: the variants
// "avx2vnni" (AVX-VNNI, 256 bits: Alder Lake, Zen 5) and "avx512vnni" (AVX512-VNNI without BF16:
// Cascade Lake, Ice Lake) run the avx2 / avx512 code with this set; every other kernel is the
// level's own. (avx512bf16 compiles VNNI in.)
bool int8_vnni();
// Whether the int8 and bf16 products may use AMX tiles (cpu/amx.h): the variant "avx512amx"
// (Sapphire Rapids and later) runs the avx512bf16 code with this set, on CPUs whose OS granted
// the tile state to the process.
bool amx();
// Whether the CPU has AVX512-VBMI's byte permutes (vpermb, vpermi2b). The decode kernel's e4m3
// caches under bf16 queries convert to bf16 by byte tables on them at the avx512bf16 level (in
// inline asm: the level is not compiled with VBMI, which Cooper Lake lacks), and widen to float32
// where it is false.
bool vbmi();
// Bytes of L1 data cache per core (glibc's sysconf, which reads cpuid), 32 KiB where it does not
// say: kernels that keep a working block in L1 size it by this (Zen 4 has 32 KiB, Zen 5 and
// Sapphire Rapids 48 KiB).
int l1d_bytes();

}  // namespace cpu
}  // namespace attn
