// The plan cache (kernels/cuda/gemm_plan_cache.h) through LinearCuda and CausalAttentionCudnn: a
// cold cache builds every GEMM's plan (and cuDNN's attention plans) and writes it; a warm one (a
// fresh process's view of the same file) builds none and gives the same bits; a record tampered
// on disk is found (corrupt: its CRC; stale: cuBLASLt's check, or cuDNN refusing the plan) and
// rebuilt, counted.
#include <gtest/gtest.h>

#ifdef MEGACPP_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/plan_cache.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/gemm_plan_cache.h"
#include "kernels/cuda/linear.h"
#include "tests/support/gpu.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

using cuda::GemmPlanCache;
using cuda::LinearCuda;
using cuda::LinearShape;
using cuda::RowsOut;

// LinearCuda plans six GEMMs: forward into bf16, fp32 and fp32 with the bias epilogue; dx into
// bf16 and fp32; dW.
constexpr uint64_t kGemmsPerLinear = 6;
const LinearShape kShape{96, 64, 80};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&pointer_, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(pointer_, 0, bytes), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(pointer_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(pointer_);
  }
  void upload(const void* host) {
    EXPECT_EQ(cudaMemcpy(pointer_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::string download() const {
    std::string out(bytes_, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), pointer_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  void* pointer_ = nullptr;
  size_t bytes_ = 0;
};

std::vector<uint16_t> random_bf16(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> out(count);
  for (uint16_t& v : out) {
    const float f = normal(rng);
    uint32_t bits = 0;
    std::memcpy(&bits, &f, sizeof(bits));
    v = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// Every output of one forward (fp32 y with bias, bf16 y) and one backward (bf16 dx, dW, db), as
// bytes: equal bytes mean the same algorithms ran.
std::string run_linear(GemmPlanCache* cache) {
  const size_t rows = static_cast<size_t>(kShape.rows), in = static_cast<size_t>(kShape.in),
               out = static_cast<size_t>(kShape.out);
  DeviceBuffer workspace(LinearCuda::workspace_bytes(kShape));
  DeviceBuffer x(rows * in * 2), w(out * in * 2), dy(rows * out * 2), bias(out * 4);
  DeviceBuffer y32(rows * out * 4), y16(rows * out * 2), dx(rows * in * 2), dw(out * in * 4),
      db(out * 4);
  x.upload(random_bf16(rows * in, 1).data());
  w.upload(random_bf16(out * in, 2).data());
  dy.upload(random_bf16(rows * out, 3).data());
  const std::vector<float> host_bias(out, 0.25f);
  bias.upload(host_bias.data());
  const LinearCuda op(kShape, workspace.as<void>(), LinearCuda::workspace_bytes(kShape), cache);
  op.forward(x.as<uint16_t>(), w.as<uint16_t>(), bias.as<float>(),
             RowsOut{nullptr, y32.as<float>()});
  op.forward(x.as<uint16_t>(), w.as<uint16_t>(), nullptr, RowsOut{y16.as<uint16_t>(), nullptr});
  op.backward(x.as<uint16_t>(), w.as<uint16_t>(), dy.as<uint16_t>(),
              RowsOut{dx.as<uint16_t>(), nullptr}, dw.as<float>(), db.as<float>(), false);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return y32.download() + y16.download() + dx.download() + dw.download() + db.download();
}

class GemmPlanCacheTest : public ::testing::Test {
 protected:
  void SetUp() override { MEGACPP_REQUIRE_GPU(); }
  testing::TempDir dir_;
};

TEST_F(GemmPlanCacheTest, ColdCacheBuildsAndWritesWarmCacheHitsWithTheSameBits) {
  std::string cold_bits, warm_bits;
  std::filesystem::path file;
  {
    GemmPlanCache cold(dir_.path(), 0);
    EXPECT_TRUE(cold.problems().empty());
    EXPECT_NE(cold.scope().find("cublaslt-"), std::string::npos) << cold.scope();
    EXPECT_NE(cold.scope().find("/sm_"), std::string::npos) << cold.scope();
    cold_bits = run_linear(&cold);
    const PlanLedger ledger = cold.ledger();
    EXPECT_EQ(ledger.builds, kGemmsPerLinear);
    EXPECT_EQ(ledger.hits, 0u);
    EXPECT_EQ(ledger.stale, 0u);
    EXPECT_NE(ledger.last_build.find("rows=96, in=64, out=80"), std::string::npos)
        << ledger.last_build;
    cold.flush();
    file = cold.file();
    ASSERT_TRUE(std::filesystem::exists(file));
  }
  const PlanCacheContent content = parse_plan_cache(file, testing::read_bytes(file));
  EXPECT_TRUE(content.problems.empty());
  EXPECT_EQ(content.records.size(), kGemmsPerLinear);

  GemmPlanCache warm(dir_.path(), 0);
  warm_bits = run_linear(&warm);
  const PlanLedger ledger = warm.ledger();
  EXPECT_EQ(ledger.builds, 0u);
  EXPECT_EQ(ledger.hits, kGemmsPerLinear);
  EXPECT_EQ(warm_bits, cold_bits) << "a cached plan must run the algorithm the heuristic chose";
  // Without a cache: today's behaviour, the heuristic's choice, the same bits.
  EXPECT_EQ(run_linear(nullptr), cold_bits);
}

TEST_F(GemmPlanCacheTest, CorruptRecordIsDroppedAndRebuilt) {
  std::string cold_bits;
  std::filesystem::path file;
  {
    GemmPlanCache cold(dir_.path(), 0);
    cold_bits = run_linear(&cold);
    cold.flush();
    file = cold.file();
  }
  std::string bytes = testing::read_bytes(file);
  // The last record's value (its last byte before the record's CRC).
  bytes[bytes.size() - 5] = static_cast<char>(bytes[bytes.size() - 5] ^ 0x40);
  testing::write_text(file, bytes);

  GemmPlanCache damaged(dir_.path(), 0);
  ASSERT_EQ(damaged.problems().size(), 1u);
  EXPECT_NE(damaged.problems()[0].find("CRC32 mismatch"), std::string::npos)
      << damaged.problems()[0];
  EXPECT_EQ(run_linear(&damaged), cold_bits);
  PlanLedger ledger = damaged.ledger();
  EXPECT_EQ(ledger.builds, 1u);
  EXPECT_EQ(ledger.hits, kGemmsPerLinear - 1);
  damaged.flush();  // rewritten whole
  EXPECT_TRUE(parse_plan_cache(file, testing::read_bytes(file)).problems.empty());
  GemmPlanCache repaired(dir_.path(), 0);
  EXPECT_EQ(run_linear(&repaired), cold_bits);
  EXPECT_EQ(repaired.ledger().builds, 0u);
}

TEST_F(GemmPlanCacheTest, ARecordWhoseWorkspaceDisagreesIsStaleAndRebuilt) {
  std::string cold_bits;
  std::filesystem::path file;
  std::string scope;
  {
    GemmPlanCache cold(dir_.path(), 0);
    cold_bits = run_linear(&cold);
    cold.flush();
    file = cold.file();
    scope = cold.scope();
  }
  // A record whose CRC is right but whose plan no longer matches what cuBLASLt says of it (as
  // after a library change under the same version string): the workspace it claims differs.
  PlanCacheContent content = parse_plan_cache(file, testing::read_bytes(file));
  ASSERT_FALSE(content.records.empty());
  std::string& value = content.records.begin()->second;
  ASSERT_GE(value.size(), sizeof(uint64_t));
  uint64_t workspace = 0;
  std::memcpy(&workspace, value.data() + value.size() - sizeof(workspace), sizeof(workspace));
  workspace += 256;
  std::memcpy(value.data() + value.size() - sizeof(workspace), &workspace, sizeof(workspace));
  testing::write_text(file, serialize_plan_cache(scope, content.records));

  GemmPlanCache stale(dir_.path(), 0);
  EXPECT_TRUE(stale.problems().empty());
  EXPECT_EQ(run_linear(&stale), cold_bits);
  const PlanLedger ledger = stale.ledger();
  EXPECT_EQ(ledger.stale, 1u);
  EXPECT_EQ(ledger.builds, 1u);
  EXPECT_EQ(ledger.hits, kGemmsPerLinear - 1);
  stale.flush();
  GemmPlanCache again(dir_.path(), 0);
  run_linear(&again);
  EXPECT_EQ(again.ledger().builds, 0u);
  EXPECT_EQ(again.ledger().stale, 0u);
}

// One forward and backward of cuDNN's attention with plans from `cache`: every output as bytes,
// and what the op says of its plans.
std::pair<std::string, std::string> run_attention(GemmPlanCache* cache) {
  const cuda::AttentionShape shape{1, 256, 4, 2, 64, 0.125};
  const size_t q = 256 * 4 * 64, kv = 256 * 2 * 64;
  DeviceBuffer workspace(cuda::CausalAttentionCudnn::workspace_bytes(shape, true));
  DeviceBuffer dq(q * 2), dk(kv * 2), dv(kv * 2), out(q * 2), dout(q * 2), lse(256 * 4 * 4);
  DeviceBuffer qb(q * 2), kb(kv * 2), vb(kv * 2);
  qb.upload(random_bf16(q, 4).data());
  kb.upload(random_bf16(kv, 5).data());
  vb.upload(random_bf16(kv, 6).data());
  dout.upload(random_bf16(q, 7).data());
  const cuda::CausalAttentionCudnn op(shape, 256, 128, true, workspace.as<void>(),
                                      cuda::CausalAttentionCudnn::workspace_bytes(shape, true), 0,
                                      cache);
  op.forward(qb.as<uint16_t>(), kb.as<uint16_t>(), vb.as<uint16_t>(), out.as<uint16_t>(),
             lse.as<float>());
  op.backward(qb.as<uint16_t>(), kb.as<uint16_t>(), vb.as<uint16_t>(), out.as<uint16_t>(),
              dout.as<uint16_t>(), lse.as<float>(), dq.as<uint16_t>(), dk.as<uint16_t>(),
              dv.as<uint16_t>());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {out.download() + lse.download() + dq.download() + dk.download() + dv.download(),
          op.describe()};
}

TEST_F(GemmPlanCacheTest, CudnnAttentionPlansAreStoredLoadedWithTheSameBitsAndRebuiltWhenStale) {
  std::filesystem::path file;
  std::string scope, cold_bits;
  {
    GemmPlanCache cold(dir_.path(), 0);
    EXPECT_NE(cold.scope().find("/cudnn-"), std::string::npos) << cold.scope();
    const auto [bits, plans] = run_attention(&cold);
    cold_bits = bits;
    EXPECT_EQ(plans.find("from the cache"), std::string::npos) << plans;
    EXPECT_EQ(cold.ledger().builds, 2u);  // forward and backward
    EXPECT_NE(cold.ledger().last_build.find("backward plan (cuDNN engine"), std::string::npos)
        << cold.ledger().last_build;
    cold.flush();
    file = cold.file();
    scope = cold.scope();
  }
  {
    GemmPlanCache warm(dir_.path(), 0);
    const auto [bits, plans] = run_attention(&warm);
    EXPECT_EQ(warm.ledger().builds, 0u);
    EXPECT_EQ(warm.ledger().hits, 2u);
    EXPECT_NE(plans.find("(plan from the cache)"), std::string::npos) << plans;
    EXPECT_EQ(bits, cold_bits) << "a loaded plan must run what the heuristic chose";
  }
  // A record whose CRC holds but which cuDNN no longer takes (as after a library change under
  // the same version string): stale, rebuilt and counted.
  PlanCacheContent content = parse_plan_cache(file, testing::read_bytes(file));
  ASSERT_EQ(content.records.size(), 2u);
  for (auto& [key, value] : content.records) {
    EXPECT_NE(key.find("cudnn-"), std::string::npos) << key;
    value = "{\"not\": \"a cuDNN plan\"}";
  }
  testing::write_text(file, serialize_plan_cache(scope, content.records));
  GemmPlanCache stale(dir_.path(), 0);
  const auto [bits, plans] = run_attention(&stale);
  EXPECT_EQ(stale.ledger().stale, 2u);
  EXPECT_EQ(stale.ledger().builds, 2u);
  EXPECT_EQ(bits, cold_bits);
}

}  // namespace
}  // namespace megacpp

#else

TEST(GemmPlanCacheTest, SkippedWithoutCuda) {
  GTEST_SKIP() << "built without CUDA";
}

#endif
