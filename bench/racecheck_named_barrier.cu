// Does compute-sanitizer's racecheck model a named barrier's producers that only arrive
// (bar.arrive) and its consumers that wait (bar.sync)? sweep_core hands X's split operand from its
// query warps to its key warps that way (mamba3_scan_sweep.cu, arrive_x_split); this kernel is the
// same order of accesses in a few lines, so a report here is racecheck's, not the sweep's.
//
// Each step: barrier 0; the producers (warps 0-3) write b (their reads by the consumers were in
// the previous step, before this barrier 0) and everyone writes a; barrier 0; the producers write
// x and arrive at barrier 1 (variant 0) or wait there (variant 1); the consumers (warps 4-7) read
// a, wait at barrier 1, then read x and b.
//
// Not built by CMake (a diagnosis, not a product test). On a GPU machine:
//   nvcc -arch=sm_90a -O2 -lineinfo bench/racecheck_named_barrier.cu -o racecheck_named_barrier
//   compute-sanitizer --tool racecheck ./racecheck_named_barrier 0   # arrive
//   compute-sanitizer --tool racecheck ./racecheck_named_barrier 1   # both wait
// H200, CUDA 13 (2026-11-30): variant 0, 15 WAR "hazards" between the consumers' reads of b and
// the next step's writes (ordered by barrier 0); variant 1, none (bench/RESULTS.md, session 37).
#include <cstdio>
#include <cstdlib>

__global__ void producers_and_consumers(float* out, int variant) {
  __shared__ float a[256], b[256], x[128];
  const int t = static_cast<int>(threadIdx.x);
  float sum = 0.f;
  for (int step = 0; step < 16; ++step) {
    __syncthreads();
    if (t < 128) b[t] = static_cast<float>(step + t);
    a[t] = static_cast<float>(step * t);
    __syncthreads();
    if (t < 128) {
      x[t] = static_cast<float>(step - t);
      if (variant == 0) {
        asm volatile("bar.arrive 1, 256;" ::: "memory");
      } else {
        asm volatile("bar.sync 1, 256;" ::: "memory");
      }
    } else {
      sum += a[(t + 17) % 256];
      asm volatile("bar.sync 1, 256;" ::: "memory");
      sum += x[t - 128] + b[t - 128];
    }
  }
  out[blockIdx.x * 256 + t] = sum;
}

int main(int argc, char** argv) {
  const int variant = argc > 1 ? std::atoi(argv[1]) : 0;
  if (variant != 0 && variant != 1) {
    std::fprintf(stderr, "usage: racecheck_named_barrier [0|1] (0: producers arrive, 1: wait)\n");
    return 2;
  }
  float* out = nullptr;
  if (cudaMalloc(&out, 4 * 256 * sizeof(float)) != cudaSuccess) return 1;
  producers_and_consumers<<<4, 256>>>(out, variant);
  const cudaError_t status = cudaDeviceSynchronize();
  std::printf("variant %d: %s\n", variant, cudaGetErrorString(status));
  cudaFree(out);
  return status == cudaSuccess ? 0 : 1;
}
