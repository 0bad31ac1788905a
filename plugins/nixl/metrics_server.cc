#include "metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

namespace fabric::nixl_backend {
namespace {

struct Counter {
  const char* name;
  const char* help;
  uint64_t GroupStats::*field;
};

// The Python exporter's table (python/fabric_lib/metrics.py), in its order.
constexpr Counter kGroupCounters[] = {
    {"fabric_transfers_submitted", "One-sided transfers accepted by submit().",
     &GroupStats::transfers_submitted},
    {"fabric_transfers_completed", "Accepted transfers that completed.",
     &GroupStats::transfers_completed},
    {"fabric_transfers_failed", "Accepted transfers that failed.", &GroupStats::transfers_failed},
    {"fabric_bytes_submitted", "Payload bytes of the accepted transfers.",
     &GroupStats::bytes_submitted},
    {"fabric_messages_sent", "Messages accepted by send().", &GroupStats::messages_sent},
    {"fabric_messages_completed", "Sent messages that were delivered.",
     &GroupStats::messages_completed},
    {"fabric_messages_failed", "Sent messages that failed.", &GroupStats::messages_failed},
    {"fabric_messages_received", "Messages received.", &GroupStats::messages_received},
    {"fabric_cuda_ipc_transfers", "Accepted transfers written over the CUDA IPC path.",
     &GroupStats::cuda_ipc_transfers},
    {"fabric_cuda_ipc_bytes", "Payload bytes the CUDA IPC path moved.",
     &GroupStats::cuda_ipc_bytes},
    {"fabric_internal_work_requests", "Work requests of the engine's own messages.",
     &GroupStats::internal_work_requests_posted},
    {"fabric_worker_passes", "Passes of the group's worker loop.", &GroupStats::worker_passes},
    {"fabric_worker_sleeps", "Times the worker blocked with nothing to do.",
     &GroupStats::worker_sleeps},
    {"fabric_worker_wakeups", "Times a submitter woke the worker from a sleep.",
     &GroupStats::worker_wakeups},
};

}  // namespace

std::string prometheus_text(const TransferEngine& engine, const std::string& name) {
  const EngineStats stats = engine.stats();
  std::ostringstream out;
  const std::string label = "engine=\"" + name + "\"";
  for (const Counter& c : kGroupCounters) {
    out << "# HELP " << c.name << "_total " << c.help << "\n# TYPE " << c.name
        << "_total counter\n";
    for (size_t g = 0; g < stats.groups.size(); ++g) {
      out << c.name << "_total{" << label << ",group=\"" << g << "\"} " << stats.groups[g].*c.field
          << "\n";
    }
  }
  out << "# HELP fabric_immediates_received_total Immediates counted by the engine.\n"
      << "# TYPE fabric_immediates_received_total counter\n"
      << "fabric_immediates_received_total{" << label << "} " << stats.immediates_received << "\n";
  out << "# HELP fabric_nic_up 1 while the NIC is up, 0 while it is marked down (failover).\n"
      << "# TYPE fabric_nic_up gauge\n";
  for (size_t g = 0; g < stats.groups.size(); ++g) {
    const auto up = engine.nics_up(static_cast<uint32_t>(g));
    const auto& nics = engine.group_info(static_cast<uint32_t>(g)).nics;
    for (size_t n = 0; n < up.size() && n < nics.size(); ++n) {
      out << "fabric_nic_up{" << label << ",group=\"" << g << "\",nic=\"" << nics[n] << "\"} "
          << (up[n] ? 1 : 0) << "\n";
    }
  }
  out << "# HELP fabric_host_mirror_bytes Pinned host memory of the staging mirrors.\n"
      << "# TYPE fabric_host_mirror_bytes gauge\n";
  for (size_t g = 0; g < stats.groups.size(); ++g) {
    out << "fabric_host_mirror_bytes{" << label << ",group=\"" << g << "\"} "
        << stats.groups[g].host_mirror_bytes << "\n";
  }
  return out.str();
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const TransferEngine& engine,
                                                            std::string name, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(ErrorCode::kFabric, std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    return Status(ErrorCode::kFabric,
                  "metrics_port " + std::to_string(port) + ": " + std::strerror(err));
  }
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(engine, std::move(name), fd, ntohs(addr.sin_port)));
}

MetricsServer::MetricsServer(const TransferEngine& engine, std::string name, int fd, int port)
    : engine_(engine), name_(std::move(name)), fd_(fd), port_(port), thread_([this] { serve(); }) {}

MetricsServer::~MetricsServer() {
  stop_.store(true);
  thread_.join();
  ::close(fd_);
}

// One request per connection: read until the end of the headers (or 100 ms), answer, close.
void MetricsServer::serve() {
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const int conn = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    std::string request;
    char buf[1024];
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
      pollfd c{conn, POLLIN, 0};
      if (::poll(&c, 1, 100) <= 0) break;
      const ssize_t n = ::recv(conn, buf, sizeof(buf), 0);
      if (n <= 0) break;
      request.append(buf, static_cast<size_t>(n));
    }
    const std::string body = prometheus_text(engine_, name_);
    const std::string head =
        "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n";
    const std::string reply = head + body;
    size_t sent = 0;
    while (sent < reply.size()) {
      const ssize_t n = ::send(conn, reply.data() + sent, reply.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    ::close(conn);
  }
}

}  // namespace fabric::nixl_backend
