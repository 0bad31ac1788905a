// The engine's Prometheus metrics from inside a NIXL process: a minimal HTTP endpoint serving
// TransferEngine::stats() in Prometheus' text format (version 0.0.4), with the names and labels
// of the Python exporter (python/fabric_lib/metrics.py, docs/metrics.md). A scrape reads
// stats() once; nothing is counted between scrapes.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "fabric/engine.h"

namespace fabric::nixl_backend {

// The text of one scrape: every metric of the table in docs/metrics.md for `engine`, labelled
// engine="<name>".
std::string prometheus_text(const TransferEngine& engine, const std::string& name);

class MetricsServer {
 public:
  // Listens on 0.0.0.0:port (0: a free port, see port()) and answers every GET with the
  // metrics, on a thread of its own. Errors: kFabric (the port cannot be bound).
  static Result<std::unique_ptr<MetricsServer>> start(const TransferEngine& engine,
                                                      std::string name, int port);
  // Stops the thread and closes the socket.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsServer(const TransferEngine& engine, std::string name, int fd, int port);
  void serve();

  const TransferEngine& engine_;
  const std::string name_;
  const int fd_;
  const int port_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace fabric::nixl_backend
