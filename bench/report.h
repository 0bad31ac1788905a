// What fabric-bench prints and writes: the medians of every row, ours and the baselines', as
// a human table (stdout), a Markdown table (--markdown) and JSON (--json); and the plot
// (--plot), drawn by bench/plot_results.py from the JSON.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "baselines.h"
#include "ops.h"

namespace fabric::bench {

// Baseline names, as they appear in the JSON.
inline constexpr const char* kRaw = "raw";
inline constexpr const char* kUcxPut = "ucx_put_bw";
inline constexpr const char* kUcxTag = "ucx_tag_bw";
inline constexpr const char* kIperf = "iperf3";

// One row: its passes and the baseline runs interleaved with them.
struct RowReport {
  Row row;
  Plan plan;
  std::vector<PassResult> passes;  // the timed passes, each verified
  std::string error;               // the first failure; the row has no figures then
  std::map<std::string, std::vector<BaselineFigure>> baselines;
};

// Medians over the passes (latency percentiles over every transfer of every pass).
struct Summary {
  double gbps = std::nan("");
  double mops = std::nan("");
  double p50_us = std::nan("");
  double p99_us = std::nan("");
  double post_us = std::nan("");
  double wakeups_per_op = std::nan("");  // ours only: the client engine's worker
  double sleeps_per_op = std::nan("");
  double syscalls_per_op = std::nan("");  // ours only: the client process, every thread
  double switches_per_op = std::nan("");
  double cpu_s_per_gib = std::nan("");
  size_t runs = 0;
  std::string error;  // the last error of a baseline that never ran
};
Summary summarize(const RowReport& r);
Summary summarize(const std::vector<BaselineFigure>& runs);

struct RunInfo {
  std::string provider;  // as the engine reports it, e.g. "tcp;ofi_rxm"
  std::string host;
  std::string nics;
  std::string command;
  std::string date;
  unsigned cpus = 0;         // the CPUs this process may run on
  std::string machine_json;  // fabric::to_json(fabric::discover())
  Budget budget;
  uint32_t iters = 0;
  uint32_t warmup = 0;
  bool quick = false;
  std::vector<BaselineFigure> iperf3;  // the TCP ceiling, runs
  std::vector<std::string> notes;      // baselines skipped and why
};

// The tables, as aligned text (markdown = false) or Markdown.
std::string render_tables(const RunInfo& info, const std::vector<RowReport>& rows, bool markdown);
std::string render_json(const RunInfo& info, const std::vector<RowReport>& rows);

}  // namespace fabric::bench
