// What the fastest plain loop of an exact Adam step costs on one core: the element math of
// peak's fused step (same flags as the AVX-512 CPU level: no FP contraction, correctly rounded
// sqrt and division) written as one straight C loop, with no launcher, chunking or dispatch. It
// is the floor the issue-16 targets are judged against (benchmarks/README.md, "What an exact
// step can reach on this core"): if this loop cannot reach a target, no launcher can.
//
//   gcc -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off -march=x86-64-v4
//       -mtune=generic -mprefer-vector-width=512 -o /tmp/adam_loop_floor
//       benchmarks/adam_loop_floor.c -lm && /tmp/adam_loop_floor      (one command line)
//
// Three layouts, each in cache (65,536 elements) and from memory (16M), best of 20 rounds:
//   fp32 (torch's):    param, grad, exp_avg, exp_avg_sq fp32          28 B per element
//   fp32 masters:      bf16 grad in, bf16 weight out, fp32 master/m/v  28 B (+2 B read for ownership)
//   remainder + bf16:  bf16 grad, bf16 weight + 16-bit remainder, bf16 moments rounded to
//                      nearest even                                    18 B
// and, in torch's layout and in cache, three ways to take 1 / (sqrt(v) * c + eps): the exact
// sqrt and division; a Newton reciprocal from an integer first guess (four steps: fp32-accurate,
// and the same bits on every backend, FMAs being exact-rounded everywhere); AVX-512's vrcp14ps
// and one Newton step (its bits are not specified across CPU vendors, nor available on the
// grid or CUDA).
// Not peak's code (the kernels live in csrc/core): a measurement of the arithmetic's floor.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline float bits_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t float_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static inline uint16_t round_bf16(float x) {
  const uint32_t b = float_bits(x);
  const uint32_t r = (b + (((b >> 16) & 1u) + 0x7fffu)) >> 16;
  return (b & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)r;
}
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct { float grad_factor, decay, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size; } Hyper;

// What every layout computes: the new moments and the denominator sqrt(v) * c + eps.
static inline float adam_moments(Hyper h, float gr, float m0, float v0, float* mm, float* vv) {
  *mm = fmaf(h.one_minus_beta1, gr - m0, m0);
  *vv = fmaf(h.one_minus_beta2, gr * gr, h.beta2 * v0);
  return sqrtf(*vv) * h.inv_bc2_sqrt + h.eps;
}

__attribute__((noinline)) static void step_fp32(int n, float* w, const float* g, float* m, float* v, Hyper h) {
#pragma GCC ivdep
  for (int i = 0; i < n; i++) {
    const float gr = g[i] * h.grad_factor;
    float mm, vv;
    const float d = adam_moments(h, gr, m[i], v[i], &mm, &vv);
    w[i] = w[i] * h.decay - h.step_size * (mm / d);
    m[i] = mm;
    v[i] = vv;
  }
}

// Denominator variants (torch's layout): 0 exact, 1 Newton reciprocal, 2 vrcp14ps + Newton.
__attribute__((noinline)) static void step_fp32_newton(int n, float* w, const float* g, float* m,
                                                       float* v, Hyper h) {
#pragma GCC ivdep
  for (int i = 0; i < n; i++) {
    const float gr = g[i] * h.grad_factor;
    float mm, vv;
    const float d = adam_moments(h, gr, m[i], v[i], &mm, &vv);
    float r = bits_float(0x7EF311C3u - float_bits(d));
    for (int k = 0; k < 4; k++) r = r * fmaf(-d, r, 2.0f);
    w[i] = w[i] * h.decay - h.step_size * (mm * r);
    m[i] = mm;
    v[i] = vv;
  }
}

__attribute__((noinline)) static void step_fp32_rcp14(int n, float* w, const float* g, float* m,
                                                      float* v, Hyper h) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 G = _mm512_mul_ps(_mm512_loadu_ps(g + i), _mm512_set1_ps(h.grad_factor));
    const __m512 M = _mm512_loadu_ps(m + i), V = _mm512_loadu_ps(v + i);
    const __m512 mm = _mm512_fmadd_ps(_mm512_set1_ps(h.one_minus_beta1), _mm512_sub_ps(G, M), M);
    const __m512 vv = _mm512_fmadd_ps(_mm512_set1_ps(h.one_minus_beta2), _mm512_mul_ps(G, G),
                                      _mm512_mul_ps(_mm512_set1_ps(h.beta2), V));
    const __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vv), _mm512_set1_ps(h.inv_bc2_sqrt)),
                                   _mm512_set1_ps(h.eps));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    const __m512 W = _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_set1_ps(h.decay));
    _mm512_storeu_ps(w + i, _mm512_sub_ps(W, _mm512_mul_ps(_mm512_set1_ps(h.step_size),
                                                           _mm512_mul_ps(mm, r))));
    _mm512_storeu_ps(m + i, mm);
    _mm512_storeu_ps(v + i, vv);
  }
#endif
  step_fp32(n - i, w + i, g + i, m + i, v + i, h);
}

__attribute__((noinline)) static void step_masters(int n, uint16_t* p, const uint16_t* g, float* master,
                                                   float* m, float* v, Hyper h) {
#pragma GCC ivdep
  for (int i = 0; i < n; i++) {
    const float gr = bits_float((uint32_t)g[i] << 16) * h.grad_factor;
    float mm, vv;
    const float d = adam_moments(h, gr, m[i], v[i], &mm, &vv);
    const float w = master[i] * h.decay - h.step_size * (mm / d);
    master[i] = w;
    m[i] = mm;
    v[i] = vv;
    p[i] = round_bf16(w);
  }
}

__attribute__((noinline)) static void step_lean(int n, uint16_t* p, uint16_t* rem, const uint16_t* g,
                                                uint16_t* m, uint16_t* v, Hyper h) {
#pragma GCC ivdep
  for (int i = 0; i < n; i++) {
    const uint32_t low = rem[i];
    const float w0 = bits_float(((((uint32_t)p[i]) - (low >> 15)) << 16) | low);
    const float gr = bits_float((uint32_t)g[i] << 16) * h.grad_factor;
    const float m0 = bits_float((uint32_t)m[i] << 16), v0 = bits_float((uint32_t)v[i] << 16);
    float mm, vv;
    const float d = adam_moments(h, gr, m0, v0, &mm, &vv);
    const float w = w0 * h.decay - h.step_size * (mm / d);
    m[i] = round_bf16(mm);
    v[i] = round_bf16(vv);
    const uint32_t b = float_bits(w);
    p[i] = (uint16_t)((b >> 16) + ((b & 0xffffu) >> 15));  // ties away, as the remainder needs
    rem[i] = (uint16_t)b;
  }
}

static void* buffer(size_t bytes) { return aligned_alloc(4096, (bytes + 4095) / 4096 * 4096); }

static double time_layout(int layout, int n) {
  uint16_t *p = buffer(n * 2), *g = buffer(n * 2), *rem = buffer(n * 2), *m16 = buffer(n * 2), *v16 = buffer(n * 2);
  float *w = buffer(n * 4), *g32 = buffer(n * 4), *m = buffer(n * 4), *v = buffer(n * 4);
  for (int i = 0; i < n; i++) {
    const float gi = (i % 97 - 48) * 1e-3f, wi = 0.01f * (i % 31), vi = 1e-6f * (1 + i % 13);
    g32[i] = gi; g[i] = float_bits(gi) >> 16; w[i] = wi; p[i] = float_bits(wi) >> 16; rem[i] = 0;
    m[i] = 0; v[i] = vi; m16[i] = 0; v16[i] = float_bits(vi) >> 16;
  }
  const Hyper h = {1.0f, 0.99999f, 0.1f, 0.999f, 0.001f, 1.0f, 1e-8f, 1e-4f};
  int calls = 6553600 / n;
  if (calls < 1) calls = 1;
  double best = 1e30;
  for (int round = 0; round < 20; round++) {
    const double t0 = now();
    for (int c = 0; c < calls; c++) {
      if (layout == 0) step_fp32(n, w, g32, m, v, h);
      else if (layout == 1) step_masters(n, p, g, w, m, v, h);
      else if (layout == 2) step_lean(n, p, rem, g, m16, v16, h);
      else if (layout == 3) step_fp32_newton(n, w, g32, m, v, h);
      else step_fp32_rcp14(n, w, g32, m, v, h);
    }
    const double t = (now() - t0) / calls / n * 1e9;
    if (t < best) best = t;
  }
  free(p); free(g); free(rem); free(m16); free(v16); free(w); free(g32); free(m); free(v);
  return best;
}

// The lean loop on the caller's buffers, for benchmarks/bench_optimizer_bounds.py, which builds
// this file as a shared library (-DPLAIN_LOOP_LIBRARY -shared -fPIC, the flags above) and times
// it interleaved with peak's step in one process.
void plain_lean_step(int n, uint16_t* p, uint16_t* rem, const uint16_t* g, uint16_t* m,
                     uint16_t* v) {
  const Hyper h = {1.0f / 1024.0f, 1.0f - 1e-4f * 0.01f, 0.1f, 0.999f, 0.001f, 1.0f, 1e-8f, 1e-4f};
  step_lean(n, p, rem, g, m, v, h);
}

#ifndef PLAIN_LOOP_LIBRARY
int main(void) {
  const char* names[] = {"fp32 (torch's layout)", "fp32 masters, bf16 model", "remainder + bf16 (RNE)"};
  printf("%-28s %16s %16s\n", "plain C loop", "in cache ns/el", "memory ns/el");
  for (int layout = 0; layout < 3; layout++) {
    const double cached = time_layout(layout, 65536), memory = time_layout(layout, 16000000);
    printf("%-28s %16.3f %16.3f\n", names[layout], cached, memory);
  }
  printf("\ntorch's layout, 1 / (sqrt(v) * c + eps) taken as        in cache ns/el\n");
  const char* variants[] = {"exact sqrt and division", "Newton reciprocal (deterministic)",
                            "vrcp14ps + one Newton step"};
  for (int k = 0; k < 3; k++) {
    printf("%-52s %12.3f\n", variants[k], time_layout(k == 0 ? 0 : k + 2, 65536));
  }
  return 0;
}
#endif
