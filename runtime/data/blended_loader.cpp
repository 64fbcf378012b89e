#include "runtime/data/blended_loader.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "base/error.h"

namespace megacpp::data {

BlendedLoader::BlendedLoader(std::vector<BlendComponent> components, int seqlen) {
  if (components.empty()) {
    fail(ErrorKind::kInvalidArgument, "data blend: no datasets to draw from");
  }
  double total = 0;
  for (const BlendComponent& c : components) {
    if (!c.dataset) fail(ErrorKind::kInvalidArgument, "data blend: a dataset is null");
    if (!(std::isfinite(c.weight) && c.weight > 0)) {
      fail(ErrorKind::kInvalidArgument, "{}: blend weight {} must be positive and finite",
           c.dataset->index_path().string(), c.weight);
    }
    total += c.weight;
  }
  for (BlendComponent& c : components) {
    weights_.push_back(c.weight / total);
    loaders_.emplace_back(std::move(c.dataset), seqlen);
  }
  windows_.assign(loaders_.size(), 0);
}

std::size_t BlendedLoader::choose() const {
  const double n = std::max(static_cast<double>(drawn_), 1.0);
  std::size_t best = 0;
  double best_error = weights_[0] * n - static_cast<double>(windows_[0]);
  for (std::size_t d = 1; d < weights_.size(); ++d) {
    const double error = weights_[d] * n - static_cast<double>(windows_[d]);
    if (error > best_error) {
      best = d;
      best_error = error;
    }
  }
  return best;
}

void BlendedLoader::next_batch(int batch, std::int32_t* tokens) {
  if (batch < 0) fail(ErrorKind::kInvalidArgument, "data blend: batch {} is negative", batch);
  const auto window = static_cast<std::size_t>(loaders_.front().seqlen()) + 1;
  for (int b = 0; b < batch; ++b) {
    const std::size_t d = choose();
    loaders_[d].next_batch(1, tokens + static_cast<std::size_t>(b) * window);
    ++windows_[d];
    ++drawn_;
  }
}

std::vector<BlendedLoader::Cursor> BlendedLoader::cursors() const {
  std::vector<Cursor> out;
  for (std::size_t d = 0; d < loaders_.size(); ++d) {
    out.push_back({loaders_[d].position(), windows_[d]});
  }
  return out;
}

void BlendedLoader::restore(std::span<const Cursor> cursors) {
  if (cursors.size() != loaders_.size()) {
    fail(ErrorKind::kInvalidArgument, "data blend: {} saved positions for {} datasets",
         cursors.size(), loaders_.size());
  }
  for (std::size_t d = 0; d < loaders_.size(); ++d) loaders_[d].seek(cursors[d].position);
  for (std::size_t d = 0; d < loaders_.size(); ++d) windows_[d] = cursors[d].windows;
  drawn_ = std::accumulate(windows_.begin(), windows_.end(), std::uint64_t{0});
}

}  // namespace megacpp::data
