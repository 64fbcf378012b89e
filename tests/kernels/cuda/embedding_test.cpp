// The CUDA token embedding (kernels/cuda/embedding.h) against the CPU oracle
// (kernels/cpu/embedding.h in double) on the same fp32 table and gradients: an entry of the oracle
// harness, plus the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/embedding.h"
#include "kernels/cuda/embedding.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::EmbeddingCuda;
using megacpp::cuda::EmbeddingShape;
using oracle::DType;
using oracle::Role;

// How a case draws its tokens.
enum class Tokens {
  kUniform,  // every token of the vocabulary equally likely
  kSkewed,   // Zipf-like over a small vocabulary: long runs of the same token (byte-level text)
  kSame,     // one token on every row: a single segment of all rows
};

struct Embedding {
  static constexpr const char* kName = "EmbeddingCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    EmbeddingShape shape;
    int vocab_size;  // tokens are drawn below this; rows from here to shape.vocab are padding
    Tokens tokens;
    bool accumulate;  // backward adds into a held table gradient (the tied lm_head's)
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    std::vector<Case> out;
    const auto add = [&](int rows, int dim, int vocab_size, int padded, Tokens tokens,
                         bool accumulate) {
      std::ostringstream name;
      name << "rows" << rows << "_D" << dim << "_V" << vocab_size << "_Vp" << padded
           << (tokens == Tokens::kSkewed ? "_skewed"
               : tokens == Tokens::kSame ? "_same"
                                         : "")
           << (accumulate ? "_accumulate" : "");
      out.push_back(
          {name.str(), EmbeddingShape{rows, dim, padded}, vocab_size, tokens, accumulate, {}});
    };
    // GPT-2's vocabulary padded to 8 at bench-350m's width; one micro-batch of 4 × 2048.
    add(4 * 2048, 1024, 50257, 50264, Tokens::kUniform, false);
    add(4 * 2048, 1024, 50257, 50264, Tokens::kUniform, true);
    // The byte tokenizer's 257 tokens (padded to 264): hundreds of rows per token.
    add(4 * 2048, 768, 257, 264, Tokens::kSkewed, false);
    // Odd widths: a partial column slice, dim below one warp.
    add(77, 70, 13, 16, Tokens::kUniform, true);
    add(33, 5, 9, 16, Tokens::kSkewed, false);
    add(500, 96, 40, 40, Tokens::kSame, true);
    return out;
  }

  static void declare(const Case& c, oracle::Problem& p) {
    const EmbeddingShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_int_distribution<int> uniform(0, c.vocab_size - 1);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    // Token ids as fp32 (exact below 2^24): the harness has no integer tensors; gpu() converts.
    p.input("tokens", DType::kF32, static_cast<size_t>(s.rows), [&] {
      switch (c.tokens) {
        case Tokens::kUniform:
          return static_cast<double>(uniform(rng));
        case Tokens::kSkewed:  // P(token ≥ k) = 1/(k+1)²: token 0 takes 3/4 of the rows
          return std::floor(std::min(1.0 / std::sqrt(unit(rng)) - 1.0, c.vocab_size - 1.0));
        case Tokens::kSame:
          return static_cast<double>(c.vocab_size / 2);
      }
      return 0.0;
    });
    const size_t table = static_cast<size_t>(s.vocab) * s.dim;
    const size_t rows = static_cast<size_t>(s.rows) * s.dim;
    p.input("table", DType::kF32, table, [&] { return 0.02 * normal(rng); });
    p.input("dout", DType::kF32, rows, [&] { return normal(rng); });
    // What the table's gradient holds before an accumulating backward (e.g. the tied lm_head's).
    p.input("dtable_in", DType::kF32, c.accumulate ? table : 0, [&] { return normal(rng); });
    p.output("out", DType::kF32, rows, Role::kOutput);
    p.output("dtable", DType::kF32, table, Role::kGradient);
    // The padded rows no token reaches must come out exactly as they went in (0 or dtable_in).
    p.sections("dtable", 1, {{"dtable", 0, 1, /*exact_zeros=*/true}});
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const EmbeddingShape& s = c.shape;
    std::vector<int32_t> tokens(static_cast<size_t>(s.rows));
    for (size_t r = 0; r < tokens.size(); ++r) tokens[r] = static_cast<int32_t>(p.in("tokens")[r]);
    megacpp::cpu::embedding_forward<double>(s.rows, s.dim, tokens.data(), p.in("table"),
                                            p.out("out"));
    double* dtable = p.out("dtable");
    if (c.accumulate) {
      const double* held = p.in("dtable_in");
      std::copy(held, held + static_cast<size_t>(s.vocab) * s.dim, dtable);
    }
    megacpp::cpu::embedding_backward<double>(s.rows, s.dim, tokens.data(), p.in("dout"), dtable);
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    const EmbeddingShape s = c.shape;
    // The int32 token ids, from the fp32 ones the harness uploaded.
    std::vector<float> as_float(static_cast<size_t>(s.rows));
    MEGACPP_CUDA_CHECK(cudaMemcpy(as_float.data(), t.f32("tokens"), as_float.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost));
    std::vector<int32_t> ids(as_float.begin(), as_float.end());
    const auto tokens = std::make_shared<oracle::DeviceBuffer>(ids.size() * sizeof(int32_t));
    tokens->upload(ids.data());
    const auto workspace =
        std::make_shared<oracle::DeviceBuffer>(EmbeddingCuda::workspace_bytes(s));
    const auto op = std::make_shared<EmbeddingCuda>(s, workspace->get(), workspace->bytes());
    const int32_t* ids_device = static_cast<const int32_t*>(tokens->get());
    const float* table = t.f32("table");
    const float* dout = t.f32("dout");
    const float* held = t.f32("dtable_in");
    float* out = t.f32("out");
    float* dtable = t.f32("dtable");
    const size_t table_bytes = static_cast<size_t>(s.vocab) * s.dim * sizeof(float);
    const bool accumulate = c.accumulate;
    oracle::Gpu g;
    g.passes.push_back({"forward", [=] {
                          op->forward(ids_device, table, out);
                        }});
    if (accumulate) {
      g.passes.push_back({"hold", [=] {
                            MEGACPP_CUDA_CHECK(
                                cudaMemcpy(dtable, held, table_bytes, cudaMemcpyDeviceToDevice));
                          }});
    }
    // workspace and tokens stay alive with the closure.
    g.passes.push_back({"backward", [=] {
                          (void)workspace;
                          (void)tokens;
                          op->backward(ids_device, dout, dtable, accumulate);
                        }});
    return g;
  }
};

// Out-of-range tokens cannot be refused on the device: forward makes their rows NaN (the loss
// shows it) and backward leaves the table alone for them.
TEST(EmbeddingCudaTokens, OutOfRangeTokensPoisonForwardAndSkipBackward) {
  MEGACPP_REQUIRE_GPU();
  const EmbeddingShape s{4, 3, 5};
  const std::vector<int32_t> ids{1, 5, -1, 1};
  std::vector<float> table(15), dout(12, 1.f);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i);
  oracle::DeviceBuffer d_ids(ids.size() * 4), d_table(table.size() * 4), d_out(12 * 4),
      d_dout(12 * 4), d_dtable(table.size() * 4), work(EmbeddingCuda::workspace_bytes(s));
  d_ids.upload(ids.data());
  d_table.upload(table.data());
  d_dout.upload(dout.data());
  EmbeddingCuda op(s, work.get(), work.bytes());
  op.forward(static_cast<int32_t*>(d_ids.get()), static_cast<float*>(d_table.get()),
             static_cast<float*>(d_out.get()));
  op.backward(static_cast<int32_t*>(d_ids.get()), static_cast<float*>(d_dout.get()),
              static_cast<float*>(d_dtable.get()), false);
  MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out(12), dtable(15);
  MEGACPP_CUDA_CHECK(cudaMemcpy(out.data(), d_out.get(), 48, cudaMemcpyDeviceToHost));
  MEGACPP_CUDA_CHECK(cudaMemcpy(dtable.data(), d_dtable.get(), 60, cudaMemcpyDeviceToHost));
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(out[static_cast<size_t>(c)], table[static_cast<size_t>(3 + c)]);
    EXPECT_TRUE(std::isnan(out[static_cast<size_t>(3 + c)]));
    EXPECT_TRUE(std::isnan(out[static_cast<size_t>(6 + c)]));
  }
  for (int v = 0; v < 5; ++v) {
    for (int c = 0; c < 3; ++c) {
      EXPECT_EQ(dtable[static_cast<size_t>(v * 3 + c)], v == 1 ? 2.f : 0.f) << v << "," << c;
    }
  }
}

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(EmbeddingCudaShapes, RefusesBadShapesAndShortWorkspace) {
  const auto refused = [](EmbeddingShape s, const std::string& field) {
    oracle::expect_error([&] { EmbeddingCuda op(s, nullptr, 0); },
                         megacpp::ErrorKind::kInvalidArgument, field, "a bad " + field);
  };
  refused({0, 4, 8}, "rows=0");
  refused({4, -1, 8}, "dim=-1");
  refused({4, 4, 0}, "vocab=0");
  refused({4, 4, 1 << 30}, "vocab=1073741824");
}

TEST(EmbeddingCudaShapes, BackwardRefusesAShortWorkspace) {
  MEGACPP_REQUIRE_GPU();
  const EmbeddingShape s{8, 4, 16};
  oracle::DeviceBuffer buffer(256);
  EmbeddingCuda op(s, buffer.get(), 16);
  oracle::expect_error(
      [&] {
        op.backward(static_cast<int32_t*>(buffer.get()), static_cast<float*>(buffer.get()),
                    static_cast<float*>(buffer.get()), false);
      },
      megacpp::ErrorKind::kInvalidArgument, "workspace_bytes", "a 16-byte workspace");
}

}  // namespace

MEGACPP_ORACLE_ENTRY(Embedding);

#else

MEGACPP_ORACLE_NO_CUDA(EmbeddingCuda);

#endif
