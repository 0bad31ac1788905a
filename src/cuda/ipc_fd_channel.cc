// FdServer and fetch_fd: file descriptors over an abstract Unix socket (SCM_RIGHTS).
#include "cuda/ipc_fd_channel.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"

namespace fabric::cuda {

namespace {

// A request is the 8-byte id; a reply is u8 status (0: a descriptor rides along), u16 message
// length, the message.
constexpr size_t kMaxMessage = 512;

sockaddr_un address_of(const std::string& name, socklen_t& len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] = 0: the abstract namespace
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

Status sys_error(ErrorCode code, std::string_view what) {
  return Status(code, fmt::format("{}: {}", what, std::strerror(errno)));
}

bool wait_for(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  return poll(&p, 1, timeout_ms) == 1 && (p.revents & events) != 0;
}

}  // namespace

std::string fd_socket_name(const Origin& o) {
  return fmt::format("fabric-ipc.{}.{}.{}", o.pidns, o.pid, o.start_time);
}

Result<std::unique_ptr<FdServer>> FdServer::start(const std::string& name, Lookup lookup) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return sys_error(ErrorCode::kFabric, "socket(AF_UNIX)");
  socklen_t len = 0;
  sockaddr_un a = address_of(name, len);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd, 64) != 0) {
    Status s = sys_error(ErrorCode::kFabric, fmt::format("binding the fd socket '{}'", name));
    close(fd);
    return s;
  }
  int stop = eventfd(0, EFD_CLOEXEC);
  if (stop < 0) {
    Status s = sys_error(ErrorCode::kFabric, "eventfd");
    close(fd);
    return s;
  }
  return std::unique_ptr<FdServer>(new FdServer(fd, stop, std::move(lookup)));
}

FdServer::FdServer(int listen_fd, int stop_fd, Lookup lookup)
    : listen_fd_(listen_fd), stop_fd_(stop_fd), lookup_(std::move(lookup)) {
  thread_ = std::thread([this] { serve(); });
}

FdServer::~FdServer() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(stop_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(stop_fd_);
}

void FdServer::serve() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    answer(conn);
    close(conn);
  }
}

void FdServer::answer(int conn) {
  ucred peer{};
  socklen_t plen = sizeof(peer);
  auto reply = [conn](uint8_t status, const std::string& text, int fd) {
    std::string body(3, '\0');
    const auto n = static_cast<uint16_t>(std::min(text.size(), kMaxMessage));
    body[0] = static_cast<char>(status);
    std::memcpy(body.data() + 1, &n, sizeof(n));
    body.append(text, 0, n);
    iovec iov{body.data(), body.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    [[maybe_unused]] ssize_t sent = sendmsg(conn, &msg, MSG_NOSIGNAL);
  };
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &plen) != 0 || peer.uid != getuid()) {
    reply(1, "refused: the asking process belongs to another user", -1);
    return;
  }
  uint64_t id = 0;
  size_t got = 0;
  while (got < sizeof(id)) {
    if (!wait_for(conn, POLLIN, 1000)) return;  // a silent client: drop it
    ssize_t n = read(conn, reinterpret_cast<char*>(&id) + got, sizeof(id) - got);
    if (n <= 0) return;
    got += static_cast<size_t>(n);
  }
  auto fd = lookup_(id);
  if (!fd) {
    reply(1, fd.status().message(), -1);
    return;
  }
  reply(0, "", *fd);
  close(*fd);
}

Result<int> fetch_fd(const std::string& name, uint64_t id, std::chrono::milliseconds timeout) {
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return sys_error(ErrorCode::kRemoteAccess, "socket(AF_UNIX)");
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{s};
  socklen_t len = 0;
  sockaddr_un a = address_of(name, len);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    return sys_error(ErrorCode::kRemoteAccess,
                     fmt::format("connecting to the writer's fd socket '{}' (is the writer "
                                 "process gone?)",
                                 name));
  }
  if (write(s, &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) {
    return sys_error(ErrorCode::kRemoteAccess, "sending the fd request");
  }
  if (!wait_for(s, POLLIN, static_cast<int>(timeout.count()))) {
    return Status(ErrorCode::kTimeout, fmt::format("no answer from the fd socket '{}' within {} ms",
                                                   name, timeout.count()));
  }
  char body[3 + kMaxMessage];
  iovec iov{body, sizeof(body)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if (n < 3) {
    if (fd >= 0) close(fd);
    return Status(ErrorCode::kRemoteAccess,
                  fmt::format("the fd socket '{}' closed without an answer", name));
  }
  uint16_t text_len = 0;
  std::memcpy(&text_len, body + 1, sizeof(text_len));
  const std::string text(body + 3, std::min<size_t>(text_len, static_cast<size_t>(n) - 3));
  if (body[0] != 0 || fd < 0) {
    if (fd >= 0) close(fd);
    return Status(ErrorCode::kRemoteAccess,
                  fmt::format("the writer refused descriptor {:#x}: {}", id, text));
  }
  return fd;
}

}  // namespace fabric::cuda
