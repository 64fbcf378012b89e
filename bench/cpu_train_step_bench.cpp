// CPU speed of record (benchmarks, not tests):
//  - BM_Sgemm: OpenBLAS sgemm through kernels/cpu/gemm.h on this machine's
//    threads: the ceiling the training step's FLOP rate is compared with.
//  - BM_TrainStep: one forward+backward+AdamW step of a model preset, reported as
//    tokens/s and model FLOP/s (Model::step_flops).
//  - BM_Scan: the chunked Mamba-3 scan alone, forward+backward.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/mamba3_scan_chunked.h"
#include "runtime/model/model.h"
#include "runtime/optimizer/adamw.h"

namespace {

void BM_Sgemm(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1)),
            k = static_cast<int>(state.range(2));
  std::vector<float> a(static_cast<size_t>(m) * k, 0.5f), b(static_cast<size_t>(n) * k, 0.25f),
      c(static_cast<size_t>(m) * n);
  for (auto _ : state) {
    megacpp::cpu::gemm<float>(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(),
                              n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * m * n * k, benchmark::Counter::kIsIterationInvariantRate);
}
// The square ceiling, and the shapes of the tiny preset's largest products.
BENCHMARK(BM_Sgemm)
    ->Args({1024, 1024, 1024})
    ->Args({2048, 1056, 192})
    ->Args({2048, 192, 384})
    ->Args({2048, 768, 192})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_TrainStep(benchmark::State& state) {
  const int batch = 8, seqlen = 256;
  megacpp::Model<float> model(megacpp::model_preset("tiny"));
  model.init_parameters(1);
  model.plan(batch, seqlen);
  megacpp::AdamW<float> optimizer(model.parameters(), {});
  std::mt19937_64 rng(1);
  std::vector<int32_t> tokens(static_cast<size_t>(batch) * (seqlen + 1));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 257);
  for (auto _ : state) {
    model.parameters().zero_grad();
    benchmark::DoNotOptimize(model.forward_backward(tokens.data(), 1.0));
    optimizer.step(1e-3);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(batch * seqlen, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["FLOP/s"] = benchmark::Counter(model.step_flops(batch, seqlen),
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TrainStep)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(5.0);

void BM_Scan(benchmark::State& state) {
  megacpp::ops::ScanShape s;
  s.batch = 8;
  s.seqlen = 256;
  s.heads = 8;
  s.groups = 1;
  s.state = 32;
  s.headdim = 48;
  s.rank = 4;
  s.chunk = 16;
  s.angles = 8;
  const size_t tok = static_cast<size_t>(s.batch) * s.seqlen;
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<float> u(-1, 1);
  auto fill = [&](size_t n, float scale, float offset) {
    std::vector<float> v(n);
    for (auto& x : v) x = offset + scale * u(rng);
    return v;
  };
  const size_t bc = static_cast<size_t>(s.rank) * s.groups * s.state,
               hp = static_cast<size_t>(s.heads) * s.headdim;
  auto q = fill(tok * bc, 1, 0), k = fill(tok * bc, 1, 0), v = fill(tok * hp, 1, 0),
       z = fill(tok * hp, 1, 0);
  auto dt = fill(tok * s.heads, 0.05f, 0.1f), adt = fill(tok * s.heads, 0.05f, -0.1f),
       trap = fill(tok * s.heads, 1, 0);
  auto ang = fill(tok * s.angles, 1, 0);
  const size_t hrn = static_cast<size_t>(s.heads) * s.rank * s.state,
               hrp = static_cast<size_t>(s.heads) * s.rank * s.headdim;
  auto qb = fill(hrn, 0.1f, 1), kb = fill(hrn, 0.1f, 1), mx = fill(hrp, 0.1f, 0.25f),
       mz = fill(hrp, 0.1f, 1), mo = fill(hrp, 0.1f, 0.25f),
       d = fill(static_cast<size_t>(s.heads), 0.1f, 1);
  megacpp::ops::ScanInputs<float> in{q.data(),  k.data(),    v.data(),   z.data(),  adt.data(),
                                     dt.data(), trap.data(), ang.data(), qb.data(), kb.data(),
                                     mx.data(), mz.data(),   mo.data(),  d.data()};
  std::vector<float> y(tok * hp), dy = fill(tok * hp, 1, 0);
  auto gq = q, gk = k, gv = v, gz = z, gadt = adt, gdt = dt, gtrap = trap, gang = ang, gqb = qb,
       gkb = kb, gmx = mx, gmz = mz, gmo = mo, gd = d;
  megacpp::ops::ScanGrads<float> g{gq.data(),  gk.data(),    gv.data(),   gz.data(),  gadt.data(),
                                   gdt.data(), gtrap.data(), gang.data(), gqb.data(), gkb.data(),
                                   gmx.data(), gmz.data(),   gmo.data(),  gd.data()};
  megacpp::cpu::Mamba3ScanChunked<float> scan(s);
  for (auto _ : state) {
    scan.forward(in, y.data());
    scan.backward(in, dy.data(), g);
    benchmark::DoNotOptimize(gq.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(tok), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Scan)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

}  // namespace

BENCHMARK_MAIN();
