// Receipt store speed of record (issue 3's note quotes these):
//  1. write throughput of step receipts through BatchedWriter (one transaction per batch,
//     synchronous=FULL, on the disk holding --dir), min/median/max over --repeats fresh stores;
//     for contrast, the same receipts committed one transaction each;
//  2. latency of listing the last 1,000 step receipts of one job, newest first, from a store
//     holding 1,000,000 step receipts over 100 jobs: p50/p99 over --queries random jobs, on a
//     read-only connection; then again while a BatchedWriter keeps appending to the same store.
//
// Usage: receipt_store_bench [--dir DIR] [--write-receipts N] [--repeats R] [--queries Q]
//                            [--jobs J] [--steps-per-job S]
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "receipts/batched_writer.h"
#include "receipts/store.h"

namespace {

namespace fs = std::filesystem;
namespace rc = megacpp::receipts;
using Clock = std::chrono::steady_clock;

struct Config {
  fs::path dir;
  int64_t write_receipts = 200000;
  int repeats = 5;
  int queries = 2000;
  int jobs = 100;
  int64_t steps_per_job = 10000;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  const double position = p * static_cast<double>(values.size() - 1);
  const auto below = static_cast<size_t>(position);
  const size_t above = std::min(below + 1, values.size() - 1);
  return values[below] + (position - static_cast<double>(below)) * (values[above] - values[below]);
}

rc::StepReceipt step_receipt(const std::string& job, int64_t step, const std::string& now) {
  rc::StepReceipt receipt;
  receipt.job_id = job;
  receipt.step = step;
  receipt.attempt = 1;
  receipt.loss = 6.0 / (1.0 + 0.001 * static_cast<double>(step));
  receipt.grad_norm = 0.8;
  receipt.lr = 3e-4;
  receipt.tokens = 16384;
  receipt.step_ms = 250.0 + static_cast<double>(step % 13);
  receipt.tokens_per_s = 16384.0 / (receipt.step_ms / 1000.0);
  receipt.flops_per_s = 4.2e14;
  receipt.recorded_at = now;
  return receipt;
}

std::string job_name(int index) {
  return fmt::format("job-20261122-{:04d}", index);
}

// A store with a boot and `jobs` jobs, nothing else.
int64_t prepare(rc::Store& store, int jobs) {
  rc::BootReceipt boot;
  boot.version = "bench";
  boot.status = "serving";
  boot.devices = nlohmann::json::array();
  boot.environment = nlohmann::json::object();
  const int64_t boot_id = store.insert_boot(boot);
  store.transaction([&] {
    for (int j = 0; j < jobs; ++j) {
      rc::JobRecord job;
      job.job_id = job_name(j);
      job.boot_id = boot_id;
      job.state = "running";
      job.spec = {{"model", "tiny"}, {"steps", 10000}};
      store.upsert_job(job);
    }
  });
  return boot_id;
}

void remove_store(const fs::path& db) {
  for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(db.string() + suffix);
}

void bench_write_throughput(const Config& config) {
  const std::string now = rc::utc_now();
  constexpr int kJobs = 4;  // a few jobs training at once, their receipts interleaved
  std::vector<double> rates;
  int64_t batches = 0;
  for (int r = 0; r < config.repeats; ++r) {
    const fs::path db = config.dir / fmt::format("write-{}.db", r);
    remove_store(db);
    rc::Store store(db, rc::OpenMode::kReadWrite);
    prepare(store, kJobs);
    rc::BatchedWriter writer(store);  // default options: 100 ms or 1,000 records per batch
    const auto start = Clock::now();
    for (int64_t i = 0; i < config.write_receipts; ++i) {
      writer.enqueue(step_receipt(job_name(static_cast<int>(i % kJobs)), i / kJobs, now));
    }
    writer.flush();
    const double elapsed = seconds_since(start);
    rates.push_back(static_cast<double>(config.write_receipts) / elapsed);
    batches = writer.stats().batches;
    remove_store(db);
  }
  std::printf(
      "write throughput, BatchedWriter (100 ms / 1000 records per batch, synchronous=FULL), "
      "%lld receipts x %d runs:\n  min %.0f  median %.0f  max %.0f  step receipts/s  "
      "(%lld transactions in the last run)\n",
      static_cast<long long>(config.write_receipts), config.repeats,
      *std::min_element(rates.begin(), rates.end()), percentile(rates, 0.5),
      *std::max_element(rates.begin(), rates.end()), static_cast<long long>(batches));

  // The same receipts, one transaction (one fsync) each.
  const fs::path db = config.dir / "write-single.db";
  remove_store(db);
  rc::Store store(db, rc::OpenMode::kReadWrite);
  prepare(store, 1);
  constexpr int kSingle = 500;
  std::vector<double> latencies_ms;
  const auto start = Clock::now();
  for (int i = 0; i < kSingle; ++i) {
    const auto one = Clock::now();
    store.write_steps(std::vector<rc::StepReceipt>{step_receipt(job_name(0), i, now)});
    latencies_ms.push_back(seconds_since(one) * 1000.0);
  }
  const double elapsed = seconds_since(start);
  std::printf(
      "unbatched, one transaction per receipt, %d receipts:\n  %.0f step receipts/s, "
      "commit p50 %.3f ms  p99 %.3f ms\n",
      kSingle, kSingle / elapsed, percentile(latencies_ms, 0.5), percentile(latencies_ms, 0.99));
  remove_store(db);
}

void build_large_store(const Config& config, const fs::path& db) {
  const std::string now = rc::utc_now();
  const auto start = Clock::now();
  rc::Store store(db, rc::OpenMode::kReadWrite);
  prepare(store, config.jobs);
  // Jobs advance together, 100 steps at a time, as concurrent jobs' receipts would arrive;
  // 100,000 receipts per transaction (the "fast path": fewer fsyncs than the daemon's batches).
  constexpr int64_t kChunk = 100;
  const int64_t rounds = config.steps_per_job / kChunk;
  std::vector<rc::StepReceipt> chunk;
  int64_t written = 0;
  const int64_t rounds_per_transaction = std::max<int64_t>(1, 100000 / (config.jobs * kChunk));
  for (int64_t round = 0; round < rounds;) {
    store.transaction([&] {
      for (int64_t in_txn = 0; in_txn < rounds_per_transaction && round < rounds;
           ++in_txn, ++round) {
        for (int j = 0; j < config.jobs; ++j) {
          chunk.clear();
          for (int64_t s = round * kChunk; s < (round + 1) * kChunk; ++s) {
            chunk.push_back(step_receipt(job_name(j), s, now));
          }
          store.write_steps(chunk);
          written += kChunk;
        }
      }
    });
  }
  std::printf(
      "built %lld step receipts over %d jobs in %.1f s (%.0f receipts/s, large "
      "transactions)\n",
      static_cast<long long>(written), config.jobs, seconds_since(start),
      static_cast<double>(written) / seconds_since(start));
}

struct LatencyResult {
  double p50_ms, p99_ms, max_ms, mean_ms;
};

LatencyResult list_latency(const fs::path& db, const Config& config, uint64_t seed) {
  rc::Store reader(db, rc::OpenMode::kReadOnly);
  std::mt19937_64 rng(seed);
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(config.queries));
  for (int q = -20; q < config.queries; ++q) {  // the first 20 warm the cache and are not counted
    const std::string job = job_name(static_cast<int>(rng() % static_cast<uint64_t>(config.jobs)));
    const auto start = Clock::now();
    const auto steps = reader.steps(job, std::nullopt, 1000, /*newest_first=*/true);
    const double elapsed = seconds_since(start) * 1000.0;
    if (steps.size() != 1000) {
      std::fprintf(stderr, "expected 1000 receipts of %s, got %zu\n", job.c_str(), steps.size());
      std::exit(1);
    }
    if (q >= 0) ms.push_back(elapsed);
  }
  double sum = 0;
  for (double v : ms) sum += v;
  return {percentile(ms, 0.5), percentile(ms, 0.99), *std::max_element(ms.begin(), ms.end()),
          sum / static_cast<double>(ms.size())};
}

void bench_list_latency(const Config& config) {
  const fs::path db = config.dir / "large.db";
  remove_store(db);
  build_large_store(config, db);
  {
    rc::Store reader(db, rc::OpenMode::kReadOnly);
    const auto start = Clock::now();
    const rc::StoreCounts counts = reader.counts();
    std::printf("store: %lld step receipts, %.1f MiB (+ %.1f MiB WAL); counts() took %.1f ms\n",
                static_cast<long long>(counts.steps),
                static_cast<double>(counts.database_bytes) / (1 << 20),
                static_cast<double>(counts.wal_bytes) / (1 << 20), seconds_since(start) * 1000.0);
  }
  const LatencyResult idle = list_latency(db, config, 1);
  std::printf(
      "list last 1000 step receipts of a job (newest first), %d queries, idle store:\n"
      "  p50 %.2f ms  p99 %.2f ms  max %.2f ms  mean %.2f ms\n",
      config.queries, idle.p50_ms, idle.p99_ms, idle.max_ms, idle.mean_ms);

  // Again while the daemon's writer appends receipts of ten running jobs at ~2,000 per second.
  std::atomic<bool> running{true};
  int64_t appended = 0;
  std::thread writer_thread([&] {
    rc::Store store(db, rc::OpenMode::kReadWrite);
    rc::BatchedWriter writer(store);
    const std::string now = rc::utc_now();
    int64_t step = config.steps_per_job;
    while (running.load()) {
      for (int j = 0; j < 10; ++j) writer.enqueue(step_receipt(job_name(j), step, now));
      appended += 10;
      ++step;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    writer.flush();
  });
  const LatencyResult busy = list_latency(db, config, 2);
  running = false;
  writer_thread.join();
  std::printf(
      "same, while a BatchedWriter appends (%lld receipts written meanwhile):\n"
      "  p50 %.2f ms  p99 %.2f ms  max %.2f ms  mean %.2f ms\n",
      static_cast<long long>(appended), busy.p50_ms, busy.p99_ms, busy.max_ms, busy.mean_ms);
  remove_store(db);
}

}  // namespace

int main(int argc, char** argv) {
  Config config;
  config.dir = fs::temp_directory_path() / fmt::format("megacpp-receipt-bench-{}", ::getpid());
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--dir") {
      config.dir = value;
    } else if (flag == "--write-receipts") {
      config.write_receipts = std::atoll(value);
    } else if (flag == "--repeats") {
      config.repeats = std::atoi(value);
    } else if (flag == "--queries") {
      config.queries = std::atoi(value);
    } else if (flag == "--jobs") {
      config.jobs = std::atoi(value);
    } else if (flag == "--steps-per-job") {
      config.steps_per_job = std::atoll(value);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (config.write_receipts < 1 || config.repeats < 1 || config.queries < 1 || config.jobs < 10 ||
      config.steps_per_job < 1000) {
    std::fprintf(stderr,
                 "need --write-receipts >= 1, --repeats >= 1, --queries >= 1, --jobs >= 10, "
                 "--steps-per-job >= 1000\n");
    return 2;
  }
  fs::create_directories(config.dir);
  std::printf("receipt store bench: SQLite WAL, synchronous=FULL, files in %s\n",
              config.dir.string().c_str());
  try {
    bench_write_throughput(config);
    bench_list_latency(config);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    fs::remove_all(config.dir);
    return 1;
  }
  fs::remove_all(config.dir);
  return 0;
}
