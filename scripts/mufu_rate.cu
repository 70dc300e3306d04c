// Special-function unit (MUFU) rate of the tanh / exp2 forms a soft-capped softmax could take:
// values per clock per SM, eight independent chains a thread. Hopper has no packed MUFU
// operation: tanh.approx.f16x2 and ex2.approx.f16x2 issue one MUFU.*.F16 per half (count them:
// cuobjdump -sass), so the packed forms give no more values a clock than the float32 ones.
//   nvcc -arch=sm_90a -O3 scripts/mufu_rate.cu -o /tmp/mufu_rate && /tmp/mufu_rate
// H100 (2026-12-06, docs/results/hopper-sweeps-v15.json): 16.1 values/clk/SM for every form.
#include <cstdio>
#include <cuda_fp16.h>
#define ITERS 2048
#define R 8
__device__ __forceinline__ float tf32(float x){float y; asm volatile("tanh.approx.f32 %0,%1;":"=f"(y):"f"(x)); return y;}
__device__ __forceinline__ unsigned th2(unsigned x){unsigned y; asm volatile("tanh.approx.f16x2 %0,%1;":"=r"(y):"r"(x)); return y;}
__device__ __forceinline__ unsigned tb2(unsigned x){unsigned y; asm volatile("tanh.approx.bf16x2 %0,%1;":"=r"(y):"r"(x)); return y;}
__device__ __forceinline__ float ef32(float x){float y; asm volatile("ex2.approx.ftz.f32 %0,%1;":"=f"(y):"f"(x)); return y;}
__device__ __forceinline__ unsigned eh2(unsigned x){unsigned y; asm volatile("ex2.approx.f16x2 %0,%1;":"=r"(y):"r"(x)); return y;}
__device__ __forceinline__ unsigned pack(float a, float b){unsigned y; asm("cvt.rn.f16x2.f32 %0,%1,%2;":"=r"(y):"f"(b),"f"(a)); return y;}
__device__ __forceinline__ float lo(unsigned x){return __low2float(*reinterpret_cast<__half2*>(&x));}
__device__ __forceinline__ float hi(unsigned x){return __high2float(*reinterpret_cast<__half2*>(&x));}

__global__ void k_tf32(float* o, float s){ float v[R]; for(int r=0;r<R;r++) v[r]=s*(threadIdx.x+r);
  for(int i=0;i<ITERS;i++){ for(int r=0;r<R;r++) v[r]=tf32(v[r]);} float a=0; for(int r=0;r<R;r++) a+=v[r]; o[blockIdx.x*blockDim.x+threadIdx.x]=a;}
__global__ void k_ef32(float* o, float s){ float v[R]; for(int r=0;r<R;r++) v[r]=-s*(threadIdx.x+r);
  for(int i=0;i<ITERS;i++){ for(int r=0;r<R;r++) v[r]=-ef32(v[r]);} float a=0; for(int r=0;r<R;r++) a+=v[r]; o[blockIdx.x*blockDim.x+threadIdx.x]=a;}
__global__ void k_th2(float* o, float s){ unsigned v[R]; for(int r=0;r<R;r++) v[r]=pack(s*threadIdx.x, s*r);
  for(int i=0;i<ITERS;i++){ for(int r=0;r<R;r++) v[r]=th2(v[r]);} float a=0; for(int r=0;r<R;r++) a+=lo(v[r])+hi(v[r]); o[blockIdx.x*blockDim.x+threadIdx.x]=a;}
__global__ void k_tb2(float* o, float s){ unsigned v[R]; for(int r=0;r<R;r++) v[r]=pack(s*threadIdx.x, s*r);
  for(int i=0;i<ITERS;i++){ for(int r=0;r<R;r++) v[r]=tb2(v[r]);} float a=0; for(int r=0;r<R;r++) a+=lo(v[r])+hi(v[r]); o[blockIdx.x*blockDim.x+threadIdx.x]=a;}
__global__ void k_eh2(float* o, float s){ unsigned v[R]; for(int r=0;r<R;r++) v[r]=pack(-s*threadIdx.x, -s*r);
  for(int i=0;i<ITERS;i++){ for(int r=0;r<R;r++) v[r]=eh2(v[r])^0x80008000u;} float a=0; for(int r=0;r<R;r++) a+=lo(v[r])+hi(v[r]); o[blockIdx.x*blockDim.x+threadIdx.x]=a;}
// the realistic pair: two float32 scores -> packed -> tanh -> two float32
__global__ void k_th2cvt(float* o, float s){ float v[2*R]; for(int r=0;r<2*R;r++) v[r]=s*(threadIdx.x+r);
  for(int i=0;i<ITERS;i++){ for(int r=0;r<R;r++){ unsigned t=th2(pack(v[2*r],v[2*r+1])); v[2*r]=lo(t)*0.9f; v[2*r+1]=hi(t)*0.9f;}} float a=0; for(int r=0;r<2*R;r++) a+=v[r]; o[blockIdx.x*blockDim.x+threadIdx.x]=a;}
__global__ void k_tf32b(float* o, float s){ float v[2*R]; for(int r=0;r<2*R;r++) v[r]=s*(threadIdx.x+r);
  for(int i=0;i<ITERS;i++){ for(int r=0;r<2*R;r++) v[r]=tf32(v[r])*0.9f;} float a=0; for(int r=0;r<2*R;r++) a+=v[r]; o[blockIdx.x*blockDim.x+threadIdx.x]=a;}

typedef void(*K)(float*,float);
int main(){ int sms, clk; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0); cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  float* o; int blocks=sms*8, threads=256; cudaMalloc(&o, blocks*threads*4);
  struct {const char* n; K k; double vals;} ks[]={{"tanh.f32",k_tf32,R},{"ex2.f32",k_ef32,R},{"tanh.f16x2",k_th2,2*R},{"tanh.bf16x2",k_tb2,2*R},{"ex2.f16x2",k_eh2,2*R},{"tanh.f16x2+cvt+fmul",k_th2cvt,2*R},{"tanh.f32+fmul",k_tf32b,2*R}};
  cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b);
  for(auto& k: ks){ k.k<<<blocks,threads>>>(o,1e-3f); cudaEventRecord(a); for(int i=0;i<5;i++) k.k<<<blocks,threads>>>(o,1e-3f); cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms,a,b); double v=5.0*blocks*threads*ITERS*k.vals; printf("%-22s %8.1f Gvalues/s  %6.2f values/clk/SM (at %d MHz max)\n", k.n, v/ms/1e6, v/(ms*1e-3)/sms/(clk*1e3), clk/1000);}
  return 0;}
