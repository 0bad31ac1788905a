// fabric-bench: the engine's benchmark. One command on one machine: this process is the
// client; it starts its peers (itself again, /proc/self/exe --server, see peer.h) and measures
//
//   --op single    single writes with an immediate, 1 KiB to 64 MiB (--sizes)
//   --op paged     paged writes, 1 to 64 KiB pages (--page-sizes) x 100 and 10000 pages
//                  (--pages), random page indices, stride = page + 128 B, one immediate a page
//   --op imm       imm-only writes: round-trip latency and one-way message rate
//   --op scatter   one source to --peers N peers
//   --op barrier   imm-only write to N peers, each answering; latency until all answers
//   --op read      single reads of the peer's memory, the sizes of --op single, then 4 KiB
//                  reads one at a time (round trips: the request to the owner, the data back)
//   --op paged-read  paged reads, the page shapes of --op paged
//   --op read-rtt  the 4 KiB read round trips alone
//   --op all       single, paged, imm, scatter and barrier (the default; reads are named:
//                  --op all,read,paged-read, as make bench runs it)
//
// Each row runs --warmup untimed passes, then --iters timed passes (see ops.h), each followed
// by the row's baselines (baselines.h): ours, raw, UCX, ours, raw, UCX, ... and reports
// medians, since this machine's speed drifts. Every pass is verified, untimed.
//
// Output: the tables on stdout (report.h), progress on stderr; --json, --markdown, --plot.
// Exit status: 0 when every pass completed and verified, 1 otherwise, 2 on bad usage.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "baselines.h"
#include "fabric/discovery.h"
#include "fabric/fabric.h"
#include "harness.h"
#include "ops.h"
#include "peer.h"
#include "report.h"

#ifndef FABRIC_BENCH_PLOT_SCRIPT
#define FABRIC_BENCH_PLOT_SCRIPT ""
#endif

namespace {

using namespace fabric;
using namespace fabric::bench;

// The largest write or page the benchmark takes.
constexpr uint64_t kMaxSize = 1 * kGiB;
constexpr uint64_t kMaxPage = 64 * kMiB;
// The client's source buffer: at least this, and twice the largest write.
constexpr uint64_t kMinSourceBytes = 128 * kMiB;
// Raw baseline of a paged row: one write (paged read: read) per page, this many in flight, at
// most this many.
constexpr uint64_t kRawPagedWindow = 256;
constexpr uint64_t kRawMaxWrites = 100'000;
// UCX runs move about this fraction of a pass (UCX put over tcp runs at a few hundred MB/s).
constexpr uint64_t kUcxPassFraction = 16;
// iperf3 runs this long, once per timed pass of the largest single write.
constexpr int kIperfSeconds = 1;
constexpr const char* kPython = "/usr/bin/python3";

struct Options {
  std::string provider = "tcp";
  std::string mode = "worker";    // worker, callbacks or progress (--mode)
  std::vector<std::string> nics;  // empty: lo for tcp, shm for shm, else the first NIC
  uint32_t nic_copies = 1;        // --nics N: the group's first NIC N times
  bool provider_given = false;
  bool nics_given = false;
  std::vector<std::string> ops;
  std::vector<std::string> sizes;
  std::vector<std::string> page_sizes;
  std::vector<uint64_t> pages;
  uint64_t window = 32;
  uint32_t iters = 5;
  uint32_t warmup = 1;
  uint32_t peers = 2;
  uint64_t pass_mib = 0;
  bool quick = false;
  std::vector<std::string> baselines;  // empty: every one available (--quick: raw)
  std::string peer_prefix;             // run the peers through this command (e.g. ip netns exec NS)
  std::string json;
  std::string markdown;
  std::string plot;
  uint64_t seed = 1;
  bool server = false;
};

// The engine configuration of every process: the environment (apply_env_overrides) first,
// then what the command line names; unpinned workers, as the processes share the cores.
Result<Config> engine_config(const Options& o) {
  Config c;
  c.provider = o.provider;
  c.groups = {GroupConfig{}};
  c.groups[0].cpu = GroupConfig::kCpuNone;
  if (Status s = c.apply_env_overrides(); !s) return s;
  c.callbacks_on_worker = o.mode == "callbacks";
  c.groups[0].caller_progress = o.mode == "progress";
  if (o.provider_given) c.provider = o.provider;
  if (o.nics_given) {
    c.groups[0].nics = o.nics;
  } else if (std::getenv("FABRIC_NICS") == nullptr) {
    c.groups[0].nics = fabric::default_nics(c.provider);
  }
  if (o.nic_copies > 1 && !c.groups[0].nics.empty()) {
    const std::string first = c.groups[0].nics[0];
    c.groups[0].nics.assign(o.nic_copies, first);
  }
  return c;
}

void log_to_stderr() {
  // A peer's stdout is its protocol; every log line goes to stderr, in every process.
  spdlog::set_default_logger(spdlog::stderr_color_mt("fabric-bench"));
  spdlog::cfg::load_env_levels();
}

Result<std::vector<uint64_t>> parse_sizes(const std::vector<std::string>& texts, uint64_t most,
                                          const char* what) {
  std::vector<uint64_t> out;
  for (const std::string& t : texts) {
    auto v = parse_size(t);
    if (!v) return v.status();
    if (*v == 0 || *v > most) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("{} '{}': must be 1 B to {}", what, t, human_bytes(most)));
    }
    out.push_back(*v);
  }
  return out;
}

std::vector<uint64_t> powers_of_two(uint64_t from, uint64_t to) {
  std::vector<uint64_t> v;
  for (uint64_t s = from; s <= to; s *= 2) v.push_back(s);
  return v;
}

// The rows the options ask for, in the order they run.
Result<std::vector<Row>> make_rows(const Options& o) {
  // "all" stands for the write operations, where it is named (--op all,read: those, then the
  // single reads); an operation named twice runs once.
  std::vector<std::string> ops;
  for (const std::string& op : o.ops.empty() ? std::vector<std::string>{"all"} : o.ops) {
    const std::vector<std::string> these =
        op == "all" ? std::vector<std::string>{"single", "paged", "imm", "scatter", "barrier"}
                    : std::vector<std::string>{op};
    for (const std::string& t : these) {
      if (std::find(ops.begin(), ops.end(), t) == ops.end()) ops.push_back(t);
    }
  }
  std::vector<uint64_t> sizes = o.quick
                                    ? std::vector<uint64_t>{4 * kKiB, 64 * kKiB, kMiB, 16 * kMiB}
                                    : powers_of_two(kKiB, 64 * kMiB);
  std::vector<uint64_t> scatter_sizes =
      o.quick ? std::vector<uint64_t>{64 * kKiB, kMiB}
              : std::vector<uint64_t>{4 * kKiB, 64 * kKiB, kMiB, 16 * kMiB};
  if (!o.sizes.empty()) {
    auto s = parse_sizes(o.sizes, kMaxSize, "--sizes");
    if (!s) return s.status();
    sizes = scatter_sizes = *s;
  }
  std::vector<uint64_t> page_sizes =
      o.quick ? std::vector<uint64_t>{4 * kKiB, 64 * kKiB}
              : std::vector<uint64_t>{kKiB, 4 * kKiB, 8 * kKiB, 16 * kKiB, 32 * kKiB, 64 * kKiB};
  if (!o.page_sizes.empty()) {
    auto s = parse_sizes(o.page_sizes, kMaxPage, "--page-sizes");
    if (!s) return s.status();
    page_sizes = *s;
  }
  std::vector<uint64_t> pages = o.pages.empty() ? std::vector<uint64_t>{100, 10000} : o.pages;

  std::vector<Row> rows;
  auto paged_rows = [&](Op kind) {
    for (uint64_t n : pages) {
      for (uint64_t p : page_sizes) {
        // --quick: 10000-page transfers of 4 KiB pages only, to stay short.
        if (o.quick && o.page_sizes.empty() && n > 100 && p > 4 * kKiB) continue;
        rows.push_back(Row{kind, 0, p, n, 1});
      }
    }
  };
  bool read_rtt = false;  // the round-trip row, once
  for (const std::string& op : ops) {
    if (op == "single") {
      for (uint64_t s : sizes) rows.push_back(Row{Op::kSingle, s, 0, 0, 1});
    } else if (op == "paged") {
      paged_rows(Op::kPaged);
    } else if (op == "read" || op == "read-rtt") {
      if (op == "read") {
        for (uint64_t s : sizes) rows.push_back(Row{Op::kRead, s, 0, 0, 1});
      }
      if (!read_rtt) rows.push_back(Row{Op::kReadRtt, kReadRttBytes, 0, 0, 1});
      read_rtt = true;
    } else if (op == "paged-read") {
      paged_rows(Op::kPagedRead);
    } else if (op == "imm") {
      rows.push_back(Row{Op::kImm, 0, 0, 0, 1});
    } else if (op == "scatter") {
      for (uint64_t s : scatter_sizes) rows.push_back(Row{Op::kScatter, s, 0, 0, o.peers});
    } else if (op == "barrier") {
      rows.push_back(Row{Op::kBarrier, 0, 0, 0, o.peers});
    } else {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("--op '{}': expected single, paged, imm, scatter, barrier, read, "
                                "paged-read, read-rtt or all",
                                op));
    }
  }
  return rows;
}

Budget make_budget(const Options& o) {
  Budget b;
  if (o.quick) {
    b.pass_bytes = 32 * kMiB;
    b.max_transfers = 1'000;
    b.max_pages = 10'000;
    b.rounds = 100;
    b.messages = 2'000;
  }
  if (o.pass_mib != 0) b.pass_bytes = o.pass_mib * kMiB;
  b.window = o.window;
  return b;
}

// Which baselines run: the requested (or default) ones that this machine has.
struct BaselinePlan {
  bool raw = false;
  bool ucx = false;
  bool iperf3 = false;
  std::vector<std::string> notes;
};

BaselinePlan plan_baselines(const Options& o, const BaselineTools& tools) {
  BaselinePlan p;
  std::vector<std::string> want = o.baselines;
  const bool explicit_list = !want.empty();
  if (!explicit_list) {
    want = o.quick ? std::vector<std::string>{"raw"}
                   : std::vector<std::string>{"raw", "ucx", "iperf3"};
  }
  for (const std::string& name : want) {
    if (name == "none") continue;
    const std::string why = tools.missing(name);
    if (!why.empty()) {
      p.notes.push_back(fmt::format("baseline {} skipped: {}", name, why));
      continue;
    }
    if (name == "raw") p.raw = true;
    if (name == "ucx") p.ucx = true;
    if (name == "iperf3") p.iperf3 = true;
  }
  if (o.quick && !explicit_list) {
    p.notes.push_back("--quick: baselines ucx and iperf3 not run (--baseline raw,ucx,iperf3)");
  }
  return p;
}

// Runs the baselines of one row, once; appends each figure to the row's runs.
void run_row_baselines(const RowReport& r, const BaselinePlan& bp, const BaselineTools& tools,
                       RawRunner& raw, const Budget& b,
                       std::map<std::string, std::vector<BaselineFigure>>& out) {
  const Row& row = r.row;
  const uint64_t ucx_iters = [&] {
    const uint64_t size = row.op == Op::kPaged ? row.page_bytes : std::max<uint64_t>(row.bytes, 1);
    return std::clamp<uint64_t>(b.pass_bytes / kUcxPassFraction / size, 2, b.max_transfers);
  }();
  switch (row.op) {
    case Op::kSingle:
      if (bp.raw) {
        out[kRaw].push_back(raw.bw(row.bytes, r.plan.transfers, r.plan.window, r.plan.bytes));
      }
      if (bp.ucx) {
        out[kUcxPut].push_back(run_ucx(tools, "ucp_put_bw", row.bytes, ucx_iters));
        out[kUcxTag].push_back(run_ucx(tools, "tag_bw", row.bytes, ucx_iters));
      }
      break;
    case Op::kPaged:
      if (bp.raw) {
        const uint64_t writes = std::min(r.plan.wrs, kRawMaxWrites);
        out[kRaw].push_back(raw.bw(row.page_bytes, writes, std::min(writes, kRawPagedWindow),
                                   writes * row.page_bytes));
      }
      if (bp.ucx) out[kUcxPut].push_back(run_ucx(tools, "ucp_put_bw", row.page_bytes, ucx_iters));
      break;
    case Op::kImm:
      if (bp.raw) {
        BaselineFigure lat = raw.lat(0, b.rounds);
        BaselineFigure rate = raw.bw(0, b.messages, b.window, 0);
        if (lat.ok()) {
          rate.p50_us = lat.p50_us;
          rate.p99_us = lat.p99_us;
        } else if (rate.ok()) {
          rate.error = lat.error;
        }
        out[kRaw].push_back(rate);
      }
      if (bp.ucx) {
        BaselineFigure lat = run_ucx(tools, "tag_lat", 8, b.rounds);
        BaselineFigure rate = run_ucx(tools, "tag_bw", 8, b.messages);
        if (lat.ok()) {
          rate.p50_us = lat.p50_us;
        } else if (rate.ok()) {
          rate.error = lat.error;
        }
        rate.gbps = std::nan("");
        out[kUcxTag].push_back(rate);
      }
      break;
    case Op::kRead:
      if (bp.raw) {
        out[kRaw].push_back(raw.read_bw(row.bytes, r.plan.transfers, r.plan.window, r.plan.bytes));
      }
      break;
    case Op::kPagedRead:
      if (bp.raw) {
        const uint64_t reads = std::min(r.plan.wrs, kRawMaxWrites);
        out[kRaw].push_back(raw.read_bw(row.page_bytes, reads, std::min(reads, kRawPagedWindow),
                                        reads * row.page_bytes));
      }
      break;
    case Op::kReadRtt:
      if (bp.raw) out[kRaw].push_back(raw.read_lat(row.bytes, b.rounds));
      break;
    case Op::kScatter:
    case Op::kBarrier:
      break;  // no baseline does these
  }
}

std::string short_figures(const RowReport& r) {
  const Summary s = summarize(r);
  std::string text = std::isnan(s.gbps) ? fmt::format("ours {:.3f} Mops", s.mops)
                                        : fmt::format("ours {:.2f} Gbps", s.gbps);
  for (const auto& [name, runs] : r.baselines) {
    const Summary b = summarize(runs);
    if (!std::isnan(b.gbps)) {
      text += fmt::format(", {} {:.2f}", name, b.gbps);
    } else if (!std::isnan(b.mops)) {
      text += fmt::format(", {} {:.3f} Mops", name, b.mops);
    }
  }
  return text;
}

std::string now_text() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&t));
  return buf;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.close();
  if (!f) {
    fmt::print(stderr, "fabric-bench: cannot write {}\n", path);
    return false;
  }
  return true;
}

std::string plot_script() {
  std::string s = FABRIC_BENCH_PLOT_SCRIPT;
  if (!s.empty() && access(s.c_str(), R_OK) == 0) return s;
  s = self_dir() + "/plot_results.py";
  return access(s.c_str(), R_OK) == 0 ? s : "";
}

// Draws `png` from the JSON text with bench/plot_results.py.
bool plot(const std::string& json_path, const std::string& json_text, const std::string& png) {
  const std::string script = plot_script();
  if (script.empty()) {
    fmt::print(stderr, "fabric-bench: --plot: bench/plot_results.py not found\n");
    return false;
  }
  std::string path = json_path;
  char tmp[] = "/tmp/fabric-bench-XXXXXX";
  if (path.empty()) {
    int fd = mkstemp(tmp);
    if (fd < 0) return false;
    close(fd);
    path = tmp;
    if (!write_file(path, json_text)) return false;
  }
  ProgramResult r = run_program({kPython, script, path, png}, milliseconds(120'000));
  if (json_path.empty()) unlink(path.c_str());
  if (r.exit_code != 0) {
    fmt::print(stderr, "fabric-bench: --plot: {} {}: {}\n{}", kPython, script, r.summary(), r.err);
    return false;
  }
  return true;
}

int run_client(const Options& o, const std::string& command) {
  auto rows_or = make_rows(o);
  if (!rows_or) {
    fmt::print(stderr, "fabric-bench: {}\n", rows_or.status().message());
    return 2;
  }
  const std::vector<Row> rows = *rows_or;
  const Budget budget = make_budget(o);
  const uint32_t iters = o.iters;
  const uint32_t warmup = o.warmup;
  auto config = engine_config(o);
  if (!config) {
    fmt::print(stderr, "fabric-bench: {}\n", config.status().to_string());
    return 2;
  }

  uint64_t largest = 0;
  for (const Row& r : rows) largest = std::max({largest, r.bytes, r.page_bytes + kPageGap});
  PageBuffer src_bytes(std::max(kMinSourceBytes, 2 * largest));  // outlives the engine
  if (src_bytes.data() == nullptr) {
    fmt::print(stderr, "fabric-bench: cannot allocate the source buffer\n");
    return 1;
  }
  fill_pattern(src_bytes.data(), src_bytes.size(), o.seed);
  auto created = TransferEngine::create(*config);
  if (!created) {
    fmt::print(stderr, "fabric-bench: cannot create a TransferEngine on provider '{}': {}\n",
               config->provider, created.status().to_string());
    return 1;
  }
  TransferEngine& engine = **created;
  auto src = engine.register_memory(src_bytes.data(), src_bytes.size());
  if (!src) {
    fmt::print(stderr, "fabric-bench: registering the source: {}\n", src.status().to_string());
    return 1;
  }
  std::vector<std::string> peer_args = {"fabric-bench",   "--server", "--provider",
                                        config->provider, "--mode",   o.mode};
  if (!config->groups[0].nics.empty()) {
    peer_args.push_back("--nic");
    peer_args.push_back(fmt::format("{}", fmt::join(config->groups[0].nics, ",")));
  }
  std::string peer_path = "/proc/self/exe";
  if (!o.peer_prefix.empty()) {
    // PREFIX... /path/to/fabric-bench --server ...: /proc/self/exe would name the prefix's
    // program once it runs, so the peer is named by its real path.
    std::vector<std::string> prefix;
    std::istringstream words(o.peer_prefix);
    for (std::string w; words >> w;) prefix.push_back(w);
    peer_path = prefix[0].find('/') == std::string::npos ? find_program(prefix[0]) : prefix[0];
    if (peer_path.empty() || self_path().empty()) {
      fmt::print(stderr, "fabric-bench: --peer-prefix: '{}' not found in PATH\n", prefix[0]);
      return 2;
    }
    peer_args[0] = self_path();
    peer_args.insert(peer_args.begin(), prefix.begin(), prefix.end());
  }
  const Address client_address = engine.address();
  Session session(
      engine, *src, src_bytes,
      [&] { return PeerClient::start(peer_path, peer_args, client_address); }, o.seed);
  session.set_caller_driven(config->groups[0].caller_progress);
  if (Status s = session.ensure_peers(1); !s) {
    fmt::print(stderr, "fabric-bench: the peer did not start: {}\n", s.to_string());
    return 1;
  }
  if (Status s = session.warm_up(); !s) {
    fmt::print(stderr, "fabric-bench: warm-up immediate failed: {}\n", s.to_string());
    return 1;
  }

  const GroupInfo& info = engine.group_info();
  const BaselineTools tools =
      BaselineTools::find(config->provider, info.nics.empty() ? std::string("lo") : info.nics[0]);
  BaselinePlan bp = plan_baselines(o, tools);
  RawRunner raw(tools);
  RunInfo run;
  run.provider = info.provider;
  run.host = host_name();
  run.nics = fmt::format("{}", fmt::join(info.nics, ","));
  run.command = command;
  run.date = now_text();
  // The machine as fabric-info describes it (fabric/discovery.h), and where our NICs sit.
  const fabric::MachineInfo machine = fabric::discover();
  run.cpus = static_cast<unsigned>(machine.allowed_cpus.size());
  run.machine_json = fabric::to_json(machine);
  for (const std::string& nic : info.nics) {
    for (const fabric::NicInfo& n : machine.nics) {
      if (n.name != nic) continue;
      run.notes.push_back(fmt::format("NIC {}: PCI {}, NUMA node {}", nic,
                                      n.pci.empty() ? "-" : n.pci,
                                      n.numa_node < 0 ? "-" : std::to_string(n.numa_node)));
    }
  }
  run.budget = budget;
  run.iters = iters;
  run.warmup = warmup;
  run.quick = o.quick;
  run.notes = bp.notes;
  if (bp.raw && info.nics.size() > 1) {
    run.notes.push_back(
        fmt::format("raw uses one endpoint on {}; ours uses {}", tools.nic, info.nics.size()));
  }
  fmt::print("fabric-bench: provider {}, NIC(s) {}, delivery_complete {}\n", info.provider,
             run.nics, info.delivery_complete ? "yes" : "no");
  fmt::print("  client pid {} address {}; peer pid {} address {}\n", getpid(),
             client_address.short_name(), session.peer(0).pid(),
             session.peer(0).address().short_name());
  fmt::print("  {} rows, {} timed pass(es) each{}; baselines: {}\n", rows.size(), iters,
             o.quick ? " (--quick)" : "", [&] {
               std::vector<std::string> on;
               if (bp.raw) on.push_back("raw");
               if (bp.ucx) on.push_back("ucx");
               if (bp.iperf3) on.push_back("iperf3");
               return on.empty() ? std::string("none") : fmt::format("{}", fmt::join(on, ","));
             }());
  std::fflush(stdout);

  uint64_t largest_single = 0;
  for (const Row& r : rows) {
    if (r.op == Op::kSingle) largest_single = std::max(largest_single, r.bytes);
  }
  Progress progress;
  std::vector<RowReport> reports;
  bool failed = false;
  const auto start = Clock::now();
  for (size_t n = 0; n < rows.size() && !failed; ++n) {
    RowReport rep;
    rep.row = rows[n];
    rep.plan = plan_for(rep.row, budget);
    const std::string head = fmt::format("[{}/{}] {}", n + 1, rows.size(), rep.row.label());
    progress.note(head);
    const auto row_start = Clock::now();
    if (rep.row.peers > session.num_peers()) {
      if (Status s = session.ensure_peers(rep.row.peers); !s) {
        rep.error = s.to_string();
      } else if (Status w = session.warm_up(); !w) {
        rep.error = w.to_string();
      }
    }
    for (uint32_t k = 0; k < warmup && rep.error.empty(); ++k) {
      progress.update(fmt::format("{}: warm-up {}/{}", head, k + 1, warmup));
      auto p = session.run(rep.row, budget, 1000 + k);
      if (!p) rep.error = p.status().to_string();
    }
    for (uint32_t k = 0; k < iters && rep.error.empty(); ++k) {
      progress.update(fmt::format("{}: pass {}/{} ours", head, k + 1, iters));
      auto p = session.run(rep.row, budget, k);
      if (!p) {
        rep.error = p.status().to_string();
        break;
      }
      rep.passes.push_back(std::move(*p));
      progress.update(
          fmt::format("{}: pass {}/{} baselines ({})", head, k + 1, iters, short_figures(rep)));
      run_row_baselines(rep, bp, tools, raw, budget, rep.baselines);
      if (bp.iperf3 && rep.row.op == Op::kSingle && rep.row.bytes == largest_single) {
        run.iperf3.push_back(run_iperf3(tools, kIperfSeconds));
      }
    }
    if (!rep.error.empty()) {
      failed = true;  // the fabric or a peer is broken: stop here
      progress.clear();
      fmt::print(stderr, "fabric-bench: {}: {}\n", rep.row.label(), rep.error);
    } else {
      progress.note(
          fmt::format("{}: {} ({:.1f} s)", head, short_figures(rep), seconds_since(row_start)));
    }
    reports.push_back(std::move(rep));
  }
  progress.clear();
  if (failed && reports.size() < rows.size()) {
    run.notes.push_back(
        fmt::format("{} row(s) not run after the failure", rows.size() - reports.size()));
  }

  bool ok = !failed;
  if (Status s = session.quit_peers(); !s) {
    fmt::print(stderr, "fabric-bench: {}\n", s.to_string());
    ok = false;
  }
  engine.close();
  fmt::print("{}", render_tables(run, reports, false));
  fmt::print(
      "\n{} in {:.0f} s\n",
      ok ? "all passes completed and verified" : "FAILED: some pass did not complete or verify",
      seconds_since(start));
  std::fflush(stdout);

  const std::string json = render_json(run, reports);
  if (!o.json.empty() && !write_file(o.json, json)) ok = false;
  if (!o.markdown.empty() && !write_file(o.markdown, render_tables(run, reports, true))) ok = false;
  if (!o.plot.empty() && !plot(o.json, json, o.plot)) ok = false;
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-bench: the engine's benchmark, with its own peer processes"};
  app.add_option("--op", o.ops,
                 "single, paged, imm, scatter, barrier, read (single reads and 4 KiB read round "
                 "trips), paged-read, read-rtt or all (comma-separated; all: the writes, imm, "
                 "scatter and barrier)")
      ->delimiter(',');
  app.add_option("--provider", o.provider, "libfabric provider: tcp, shm, efa, verbs, auto")
      ->capture_default_str();
  app.add_option("--nic", o.nics,
                 "NIC(s) of the device group, comma-separated (default: lo for tcp, shm for "
                 "shm, else the provider's first)")
      ->delimiter(',');
  app.add_option("--mode", o.mode,
                 "worker: a worker thread per group, callbacks on the callback thread; "
                 "callbacks: callbacks run on the worker (Config::callbacks_on_worker); progress: "
                 "no worker thread, the submitting thread drives the group with progress() "
                 "(GroupConfig::caller_progress). Peers run in the same mode (progress: a "
                 "thread of theirs drives)")
      ->check(CLI::IsMember({"worker", "callbacks", "progress"}))
      ->capture_default_str();
  app.add_option("--nics", o.nic_copies, "use the first NIC N times (multi-rail on one NIC)")
      ->check(CLI::Range(1, 16));
  app.add_option("--sizes", o.sizes, "single, read (and scatter) sizes, e.g. 4KiB,1MiB")
      ->delimiter(',');
  app.add_option("--page-sizes", o.page_sizes,
                 "paged, paged-read: page sizes (default 1,4,8,16,32,64 KiB)")
      ->delimiter(',');
  app.add_option("--pages", o.pages, "paged, paged-read: pages per transfer (default 100,10000)")
      ->delimiter(',')
      ->check(CLI::Range(uint64_t{1}, uint64_t{100'000}));
  app.add_option("--window", o.window, "transfers in flight")
      ->check(CLI::Range(uint64_t{1}, uint64_t{4096}))
      ->capture_default_str();
  app.add_option("--iters", o.iters, "timed passes per row (--quick: 1)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed passes per row first (--quick: 0)")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  app.add_option("--peers", o.peers,
                 "peer processes of scatter and barrier (63: the EP64 shape, one rank to the "
                 "63 others)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--pass-mib", o.pass_mib, "payload per pass in MiB (default 256, --quick 32)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 16));
  app.add_flag("--quick", o.quick, "a run of a few seconds: fewer sizes, one pass, raw only");
  app.add_option("--baseline", o.baselines,
                 "raw, ucx, iperf3 or none, comma-separated (default: all available; --quick: "
                 "raw)")
      ->delimiter(',')
      ->check(CLI::IsMember({"raw", "ucx", "iperf3", "none"}));
  app.add_option("--peer-prefix", o.peer_prefix,
                 "start every peer through this command, e.g. \"ip netns exec lab-b\" (the peer "
                 "in another network namespace)");
  app.add_option("--json", o.json, "write the results as JSON");
  app.add_option("--markdown", o.markdown, "write the tables as Markdown");
  app.add_option("--plot", o.plot, "draw Gbps against size into this PNG (python3-matplotlib)");
  app.add_option("--seed", o.seed, "seed of the data pattern and the page choice")
      ->capture_default_str();
  app.add_flag("--server", o.server, "internal: run as a peer of a client")->group("");
  bool machine_only = false;
  app.add_flag("--machine", machine_only,
               "print the machine as the results' \"machine\" key records it (fabric-info "
               "--json --no-engine) and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is not an error
  }
  if (machine_only) {
    std::printf("%s\n", fabric::to_json(fabric::discover()).c_str());
    return 0;
  }
  o.provider_given = app.count("--provider") > 0;
  o.nics_given = app.count("--nic") > 0;
  if (o.quick && app.count("--iters") == 0) o.iters = 1;
  if (o.quick && app.count("--warmup") == 0) o.warmup = 0;

  log_to_stderr();
  if (o.server) {
    auto config = engine_config(o);
    if (!config) {
      std::printf("error %s\n", config.status().to_string().c_str());
      return 1;
    }
    return run_peer(*config);
  }
  // A peer that dies makes writes to its pipe fail with EPIPE instead of killing us.
  signal(SIGPIPE, SIG_IGN);
  std::string command = "fabric-bench";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return run_client(o, command);
}
