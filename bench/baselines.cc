#include "baselines.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

namespace fabric::bench {

namespace {

constexpr milliseconds kBaselineTimeout{60'000};
// ucx_perftest prints bandwidth in MB/s of 2^20 bytes.
constexpr double kUcxMB = 1024.0 * 1024.0;
// The ports inside the private network namespace (nothing else listens there).
constexpr int kUcxPort = 13337;
constexpr int kIperfPort = 5201;

// Brings up the namespace's loopback, starts the server in the background ($SERVER_CMD),
// waits until its port listens, runs the client ($CLIENT_CMD) and waits for the server.
// Positional parameters: $1 ip, $2 port; the commands come as environment variables so that
// no quoting is needed.
constexpr const char* kNamespaceScript = R"(
"$1" link set lo up || exit 97
eval "$SERVER_CMD" >/dev/null 2>&1 &
server=$!
hexport=$(printf '%04X' "$2")
i=0
until grep -q ":$hexport 00000000:0000 0A" /proc/net/tcp; do
  i=$((i + 1))
  if [ $i -gt 500 ]; then kill $server; echo "the server did not listen" >&2; exit 98; fi
  sleep 0.01
done
eval "$CLIENT_CMD"
rc=$?
wait $server
exit $rc
)";

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string failure(const std::string& what, const ProgramResult& r) {
  std::string err = r.err;
  while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
  if (auto nl = err.rfind('\n'); nl != std::string::npos) err = err.substr(nl + 1);
  return fmt::format("{}: {}{}{}", what, r.summary(), err.empty() ? "" : ": ", err.substr(0, 160));
}

ProgramResult run_in_namespace(const BaselineTools& t, int port, const std::string& server,
                               const std::string& client, std::vector<std::string> env) {
  env.push_back("SERVER_CMD=" + server);
  env.push_back("CLIENT_CMD=" + client);
  return run_program({t.unshare, "--net", "--", "/bin/sh", "-c", kNamespaceScript, "fabric-bench",
                      t.ip, std::to_string(port)},
                     kBaselineTimeout, env);
}

}  // namespace

BaselineTools BaselineTools::find(const std::string& provider, const std::string& nic) {
  BaselineTools t;
  t.provider = provider;
  t.nic = nic;
  const std::string raw = self_dir() + "/fabric-bench-raw";
  if (access(raw.c_str(), X_OK) == 0) t.raw = raw;
  t.ucx_perftest = find_program("ucx_perftest");
  t.iperf3 = find_program("iperf3");
  t.unshare = find_program("unshare");
  t.ip = find_program("ip");
  return t;
}

std::string BaselineTools::ucx_tls() const {
  if (provider == "tcp") return "tcp";
  if (provider == "shm") return "posix,cma";
  return "";
}

std::string BaselineTools::missing(std::string_view name) const {
  if (name == "raw") return raw.empty() ? "fabric-bench-raw is not next to fabric-bench" : "";
  const bool ns = !unshare.empty() && !ip.empty() && geteuid() == 0;
  if (name == "ucx") {
    if (ucx_perftest.empty()) return "ucx_perftest not installed (Debian ucx-utils; make bench)";
    if (ucx_tls().empty()) return fmt::format("no UCX transport stands for provider {}", provider);
    if (!ns) return "needs root, unshare and ip for a private loopback namespace";
    return "";
  }
  if (name == "iperf3") {
    if (iperf3.empty()) return "iperf3 not installed (make bench)";
    if (provider != "tcp") return "the TCP ceiling is for provider tcp only";
    if (!ns) return "needs root, unshare and ip for a private loopback namespace";
    return "";
  }
  return "unknown baseline";
}

RawRunner::~RawRunner() {
  if (process_) process_->send("quit").ignore();
}

Result<std::string> RawRunner::request(const std::string& line) {
  if (!process_) {
    auto p = ChildProcess::spawn(tools_.raw, {"fabric-bench-raw", "--provider", tools_.provider,
                                              "--nic", tools_.nic, "--commands"});
    if (!p) return p.status();
    process_ = std::move(*p);
  }
  auto r = process_->request(line, kBaselineTimeout);
  if (!r) process_.reset();  // dead or stuck: a fresh pair next time
  return r;
}

BaselineFigure RawRunner::bw(uint64_t size, uint64_t count, uint64_t window, uint64_t span) {
  return throughput("bw", "raw", size, count, window, span);
}

BaselineFigure RawRunner::read_bw(uint64_t size, uint64_t count, uint64_t window, uint64_t span) {
  return throughput("rd", "rawread", size, count, window, span);
}

BaselineFigure RawRunner::lat(uint64_t size, uint64_t rounds) {
  return round_trips("lat", "rawlat", size, rounds);
}

BaselineFigure RawRunner::read_lat(uint64_t size, uint64_t rounds) {
  return round_trips("rdlat", "rawreadlat", size, rounds);
}

BaselineFigure RawRunner::throughput(const char* verb, const char* tag, uint64_t size,
                                     uint64_t count, uint64_t window, uint64_t span) {
  BaselineFigure f;
  constexpr uint64_t kWarmup = 16;
  auto r = request(
      fmt::format("{} {} {} {} {} {}", verb, size, count, window, std::min(count, kWarmup), span));
  char got[16] = {}, prov[64] = {};
  unsigned long long s = 0, n = 0;
  double seconds = 0, gbps = 0, post = 0, cpu = 0;
  if (!r) {
    f.error = "fabric-bench-raw: " + r.status().message();
  } else if (std::sscanf(r->c_str(), "%15s %63s %llu %llu %lf %lf %lf %lf", got, prov, &s, &n,
                         &seconds, &gbps, &post, &cpu) != 8 ||
             std::string_view(got) != tag || seconds <= 0) {
    f.error = "fabric-bench-raw: " + *r;
  } else {
    if (size > 0) f.gbps = gbps;
    f.mops = static_cast<double>(n) / seconds / 1e6;
    f.post_us = post;
    if (size > 0) f.cpu_s_per_gib = cpu / (static_cast<double>(size * n) / kGiB);
  }
  return f;
}

BaselineFigure RawRunner::round_trips(const char* verb, const char* tag, uint64_t size,
                                      uint64_t rounds) {
  BaselineFigure f;
  auto r = request(fmt::format("{} {} {} 20", verb, size, rounds));
  char got[16] = {}, prov[64] = {};
  unsigned long long s = 0, n = 0;
  double p50 = 0, p99 = 0;
  if (!r) {
    f.error = "fabric-bench-raw: " + r.status().message();
  } else if (std::sscanf(r->c_str(), "%15s %63s %llu %llu %lf %lf", got, prov, &s, &n, &p50,
                         &p99) != 6 ||
             std::string_view(got) != tag) {
    f.error = "fabric-bench-raw: " + *r;
  } else {
    f.p50_us = p50;
    f.p99_us = p99;
  }
  return f;
}

BaselineFigure run_ucx(const BaselineTools& t, std::string_view test, uint64_t size,
                       uint64_t iters) {
  BaselineFigure f;
  if (std::string why = t.missing("ucx"); !why.empty()) {
    f.error = why;
    return f;
  }
  const uint64_t warmup = std::clamp<uint64_t>(iters / 10, 1, 100);
  const std::string exe = quoted(t.ucx_perftest);
  const std::string server = fmt::format("{} -p {}", exe, kUcxPort);
  const std::string client = fmt::format("{} 127.0.0.1 -p {} -t {} -s {} -n {} -w {} -v", exe,
                                         kUcxPort, test, size, iters, warmup);
  std::vector<std::string> env = {"UCX_TLS=" + t.ucx_tls(), "UCX_WARN_UNUSED_ENV_VARS=n"};
  if (t.provider == "tcp") env.push_back("UCX_NET_DEVICES=lo");
  ProgramResult r = run_in_namespace(t, kUcxPort, server, client, env);
  // The last line that starts with a number is the final result:
  // iterations,p50_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
  std::istringstream lines(r.out);
  std::string line, last;
  while (std::getline(lines, line)) {
    const size_t at = line.find_first_not_of(' ');
    if (at != std::string::npos && std::isdigit(static_cast<unsigned char>(line[at]))) last = line;
  }
  double v[8] = {};
  if (r.exit_code != 0 || std::sscanf(last.c_str(), " %lf,%lf,%lf,%lf,%lf,%lf,%lf,%lf", &v[0],
                                      &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) != 8) {
    f.error = failure(fmt::format("ucx_perftest {}", test), r);
    return f;
  }
  if (test.ends_with("_lat")) {
    // A ping-pong test reports half the round trip.
    f.p50_us = 2 * v[1];
    f.mops = v[7] / 1e6;
  } else {
    f.gbps = v[5] * kUcxMB * 8 / 1e9;
    f.mops = v[7] / 1e6;
  }
  return f;
}

BaselineFigure run_iperf3(const BaselineTools& t, int seconds) {
  BaselineFigure f;
  if (std::string why = t.missing("iperf3"); !why.empty()) {
    f.error = why;
    return f;
  }
  const std::string exe = quoted(t.iperf3);
  const std::string server = fmt::format("{} -s -B 127.0.0.1 -p {} -1", exe, kIperfPort);
  const std::string client =
      fmt::format("{} -c 127.0.0.1 -B 127.0.0.1 -p {} -t {} -J", exe, kIperfPort, seconds);
  ProgramResult r = run_in_namespace(t, kIperfPort, server, client, {});
  const size_t sum = r.out.find("\"sum_received\"");
  const size_t bps = sum == std::string::npos ? sum : r.out.find("\"bits_per_second\":", sum);
  double bits = 0;
  if (r.exit_code != 0 || bps == std::string::npos ||
      std::sscanf(r.out.c_str() + bps, "\"bits_per_second\": %lf", &bits) != 1) {
    f.error = failure("iperf3", r);
    return f;
  }
  f.gbps = bits / 1e9;
  return f;
}

}  // namespace fabric::bench
