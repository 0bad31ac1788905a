// The programs fabric-bench compares the engine with, each run as a separate process with a
// deadline, its output parsed into one BaselineFigure:
//   raw     fabric-bench-raw (bench/raw_baseline.cc): the same provider through bare libfabric,
//           fi_writedata for the write rows and fi_read for the read rows
//   ucx     ucx_perftest (Debian ucx-utils): ucp_put_bw, tag_bw, tag_lat over UCX_TLS=tcp on lo,
//           or posix,cma for shm
//   iperf3  one TCP stream, the kernel's loopback ceiling
// ucx_perftest's server listens on every address and iperf3's client picks its own, so both
// run inside a fresh network namespace (unshare --net) whose only interface is its loopback:
// nothing they open is reachable from outside, and nothing they run clashes with this host's
// ports.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "harness.h"

namespace fabric::bench {

struct BaselineFigure {
  double gbps = std::nan("");
  double mops = std::nan("");
  double p50_us = std::nan("");  // round trip
  double p99_us = std::nan("");
  double post_us = std::nan("");
  double cpu_s_per_gib = std::nan("");  // both processes
  std::string error;                    // empty when the program ran and its output parsed
  bool ok() const { return error.empty(); }
};

// Where the programs are and what they run over. A path left empty: that baseline is absent.
struct BaselineTools {
  std::string provider;  // as the engine was configured: tcp, shm, ...
  std::string nic;       // the engine's first NIC
  std::string raw;       // fabric-bench-raw
  std::string ucx_perftest;
  std::string iperf3;
  std::string unshare;  // for the network namespace of ucx and iperf3
  std::string ip;

  // Finds the programs: fabric-bench-raw next to this executable, the others in PATH.
  static BaselineTools find(const std::string& provider, const std::string& nic);
  // The UCX transports standing for `provider`'s medium, or "" when there is none.
  std::string ucx_tls() const;
  // Why a baseline cannot run here, or "" when it can.
  std::string missing(std::string_view name) const;
};

// fabric-bench-raw --commands, one process pair for the whole run (libfabric's start-up takes
// most of a second here), restarted after a failure.
class RawRunner {
 public:
  explicit RawRunner(const BaselineTools& tools) : tools_(tools) {}
  ~RawRunner();
  // `count` writes of `size` bytes with an immediate, `window` in flight, cycling through
  // buffers of `span` bytes (the engine's pass footprint, so that both miss the caches alike).
  BaselineFigure bw(uint64_t size, uint64_t count, uint64_t window, uint64_t span);
  // `rounds` ping-pong round trips of `size`-byte writes with an immediate.
  BaselineFigure lat(uint64_t size, uint64_t rounds);
  // As bw, with `count` fi_read of `size` bytes (at least 1) from the other process's buffer.
  BaselineFigure read_bw(uint64_t size, uint64_t count, uint64_t window, uint64_t span);
  // `rounds` reads of `size` bytes one at a time: each read's completion is its round trip.
  BaselineFigure read_lat(uint64_t size, uint64_t rounds);

 private:
  Result<std::string> request(const std::string& line);
  // One `bw` or `rd` measurement, its line tagged `tag`; one `lat` or `rdlat`.
  BaselineFigure throughput(const char* verb, const char* tag, uint64_t size, uint64_t count,
                            uint64_t window, uint64_t span);
  BaselineFigure round_trips(const char* verb, const char* tag, uint64_t size, uint64_t rounds);

  const BaselineTools& tools_;
  std::unique_ptr<ChildProcess> process_;
};
// ucx_perftest TEST (ucp_put_bw, tag_bw, tag_lat) with `size` bytes, `iters` iterations.
BaselineFigure run_ucx(const BaselineTools& t, std::string_view test, uint64_t size,
                       uint64_t iters);
// iperf3: one TCP stream over loopback for `seconds`.
BaselineFigure run_iperf3(const BaselineTools& t, int seconds);

}  // namespace fabric::bench
