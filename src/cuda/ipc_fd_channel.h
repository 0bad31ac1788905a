// The engine's Unix socket for passing file descriptors between processes of one host
// (SCM_RIGHTS): how a writer hands the owner of a destination the POSIX file descriptor of a
// cuMemCreate (VMM) allocation it exported for the CUDA IPC path (docs/cuda-ipc.md). Not
// pidfd_getfd, which needs ptrace rights most deployments lack.
//
// One server per process, in the abstract namespace (it vanishes with the process, nothing to
// clean up), named after the process's Origin: a peer that knows the writer's address knows
// where to ask. It answers only processes of its own user (SO_PEERCRED).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::cuda {

// The socket name of the process an origin describes (without the abstract namespace's leading
// zero byte).
std::string fd_socket_name(const Origin& process);

class FdServer {
 public:
  // What the server answers for an id: a file descriptor it sends and then closes, or an error
  // whose message the asking process gets. Runs on the server's thread.
  using Lookup = std::function<Result<int>(uint64_t id)>;

  // Binds `name` and starts the serving thread. Errors: kFabric (the name is taken, or the
  // socket cannot be made).
  static Result<std::unique_ptr<FdServer>> start(const std::string& name, Lookup lookup);
  ~FdServer();  // stops the thread and closes the socket
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

 private:
  FdServer(int listen_fd, int stop_fd, Lookup lookup);
  void serve();
  void answer(int conn);

  const int listen_fd_;
  const int stop_fd_;  // an eventfd: written by the destructor
  Lookup lookup_;
  std::thread thread_;
};

// Asks the server `name` for the descriptor of `id`; returns a new descriptor owned by the
// caller. Blocking, for at most `timeout`. Errors: kRemoteAccess (no such server, the server
// refused, or it does not know the id: its message says why), kTimeout.
Result<int> fetch_fd(const std::string& name, uint64_t id, std::chrono::milliseconds timeout);

}  // namespace fabric::cuda
