#pragma once
// Finite-difference gradient checking for the double-precision oracle tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace megacpp::testing {

inline std::vector<double> random_vector(size_t n, std::mt19937_64& rng, double lo = -1,
                                         double hi = 1) {
  std::vector<double> v(n);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Checks analytic[i] against the central difference of `loss` with respect to
// values[i], for every index when values.size() <= max_checked, otherwise for a
// random sample of max_checked indices. `loss` must read `values` afresh.
inline void expect_gradient_matches(const std::string& what, std::vector<double>& values,
                                    const std::vector<double>& analytic,
                                    const std::function<double()>& loss, std::mt19937_64& rng,
                                    size_t max_checked = 24, double eps = 1e-6,
                                    double rel_tol = 1e-6, double abs_floor = 1e-3) {
  ASSERT_EQ(values.size(), analytic.size()) << what;
  std::vector<size_t> indices(values.size());
  for (size_t i = 0; i < indices.size(); ++i) indices[i] = i;
  if (indices.size() > max_checked) {
    std::shuffle(indices.begin(), indices.end(), rng);
    indices.resize(max_checked);
  }
  double scale = abs_floor;
  for (double g : analytic) scale = std::max(scale, std::abs(g));
  for (size_t i : indices) {
    const double saved = values[i];
    values[i] = saved + eps;
    const double plus = loss();
    values[i] = saved - eps;
    const double minus = loss();
    values[i] = saved;
    const double numeric = (plus - minus) / (2 * eps);
    EXPECT_NEAR(analytic[i], numeric, rel_tol * std::max(std::abs(numeric), scale))
        << what << "[" << i << "]";
  }
}

}  // namespace megacpp::testing
