// A real etcd for the tests: Debian's etcd-server on 127.0.0.1, free ports, a temporary data
// directory; stopped (and restarted on the same ports and data) on demand.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "fabric/kv/registry.h"

extern char** environ;

namespace fabric::kv::testing {

inline const char* etcd_binary() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return nullptr;
}

// A port nobody listens on now (the kernel's choice for an ephemeral bind).
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

class EtcdServer {
 public:
  EtcdServer() {
    char tmpl[] = "/tmp/fabric-kv-etcd-XXXXXX";
    if (mkdtemp(tmpl)) dir_ = tmpl;
    client_port_ = free_port();
    peer_port_ = free_port();
  }
  ~EtcdServer() {
    stop();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(client_port_); }

  // Starts etcd and waits (10 s at most) until it answers. False when it did not.
  bool start() {
    const std::string client = endpoint();
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    std::vector<std::string> args = {etcd_binary(),
                                     "--name=test",
                                     "--data-dir=" + dir_ + "/data",
                                     "--listen-client-urls=" + client,
                                     "--advertise-client-urls=" + client,
                                     "--listen-peer-urls=" + peer,
                                     "--initial-advertise-peer-urls=" + peer,
                                     "--initial-cluster=test=" + peer,
                                     "--log-outputs=" + dir_ + "/etcd.log",
                                     "--logger=zap"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, (dir_ + "/stderr.log").c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    int rc = posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid_ = -1;
      return false;
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until) {
      EtcdOptions o;
      o.endpoint = client;
      o.lease_ttl = std::chrono::seconds(1);
      o.request_timeout = std::chrono::milliseconds(500);
      if (EtcdRegistry::connect(o)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  // SIGTERM, then SIGKILL after 5 s; reaps it.
  void stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    int status = 0;
    for (int i = 0; i < 100 && waitpid(pid_, &status, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (waitpid(pid_, &status, WNOHANG) == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
    pid_ = -1;
  }

 private:
  std::string dir_;
  int client_port_ = -1;
  int peer_port_ = -1;
  pid_t pid_ = -1;
};

}  // namespace fabric::kv::testing
