// FileRegistry: membership among the processes of one machine through one file per member.
//
// File format: Member::encode() lines followed by the owner's lines (Member::decode skips keys
// it does not know):
//   owner=PID:START:INSTANCE   the process (its start time in clock ticks since boot, so that
//                              a reused pid is not mistaken for the owner) and the registry
//   host=BOOT_ID               /proc/sys/kernel/random/boot_id of the owner's machine
//   lease_ms=TTL
// The file's mtime is the lease: the keep-alive thread touches it every TTL/3.
//
// Threads: the caller's (join, leave, members), the keep-alive thread, and the watch thread
// (started by watch()). mu_ guards the owned members; the watch thread's view is its own.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "fabric/kv/registry.h"

namespace fabric::kv {

Status check_member_name(const std::string& name);  // registry.cc

namespace {

using namespace std::chrono_literals;

constexpr size_t kMaxName = 200;
constexpr const char* kTempPrefix = ".tmp.";

std::string errno_text(int err) {
  return std::strerror(err);
}

std::string read_small_file(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

const std::string& boot_id() {
  static const std::string id = read_small_file("/proc/sys/kernel/random/boot_id");
  return id;
}

// From /proc/PID/stat: the state (field 3) and the start time in clock ticks after boot
// (field 22); empty when the process does not exist.
struct ProcStat {
  std::string state;
  std::string start;
};
ProcStat proc_stat(pid_t pid) {
  std::string stat = read_small_file("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 > stat.size()) return {};
  std::istringstream in(stat.substr(close + 2));
  ProcStat out;
  in >> out.state;
  std::string field;
  for (int i = 4; i <= 22 && (in >> field); ++i) {
  }
  out.start = field;
  return out;
}

// Whether the process that wrote owner "PID:START:..." on this host is gone for sure: no such
// pid, a zombie (killed, not yet reaped by its parent), or another process with that pid.
bool owner_dead(const std::string& owner) {
  pid_t pid = 0;
  std::string start;
  {
    auto c1 = owner.find(':');
    if (c1 == std::string::npos) return false;
    auto c2 = owner.find(':', c1 + 1);
    try {
      pid = static_cast<pid_t>(std::stol(owner.substr(0, c1)));
    } catch (const std::exception&) {
      return false;
    }
    start = owner.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
  }
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  ProcStat now = proc_stat(pid);
  if (now.state == "Z" || now.state == "X") return true;
  return !now.start.empty() && !start.empty() && now.start != start;
}

// One member file as read.
struct Entry {
  Member member;
  std::string owner;
  bool alive = false;
  bool owner_gone = false;  // on this host, its process is dead: the file may be removed
  ino_t inode = 0;
};

std::string field(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, key.size() + 1, key + "=") == 0) return line.substr(key.size() + 1);
  }
  return {};
}

// Reads directory/name; false when it vanished or is not a member file.
bool read_entry(int dirfd, const std::string& name, Entry& out) {
  int fd = openat(dirfd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  struct stat st {};
  std::string text;
  bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  char buf[4096];
  for (ssize_t n; ok && (n = read(fd, buf, sizeof buf)) > 0;) text.append(buf, size_t(n));
  close(fd);
  if (!ok) return false;
  auto m = Member::decode(text);
  if (!m || m->name != name) return false;
  out.member = std::move(*m);
  out.owner = field(text, "owner");
  out.inode = st.st_ino;
  uint64_t lease_ms = 0;
  try {
    lease_ms = std::stoull(field(text, "lease_ms"));
  } catch (const std::exception&) {
    return false;
  }
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  const int64_t age_ms = (int64_t(now.tv_sec) - int64_t(st.st_mtim.tv_sec)) * 1000 +
                         (int64_t(now.tv_nsec) - int64_t(st.st_mtim.tv_nsec)) / 1000000;
  out.owner_gone = !boot_id().empty() && field(text, "host") == boot_id() && owner_dead(out.owner);
  out.alive = age_ms <= int64_t(lease_ms) && !out.owner_gone;
  return true;
}

}  // namespace

class FileRegistry::Impl {
 public:
  Impl(FileOptions options, int dirfd) : options_(std::move(options)), dirfd_(dirfd) {
    static std::atomic<uint64_t> instances{0};
    owner_ = std::to_string(getpid()) + ":" + proc_stat(getpid()).start + ":" +
             std::to_string(instances.fetch_add(1));
    keeper_ = std::thread([this] { keep_alive(); });
  }

  ~Impl() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (keeper_.joinable()) keeper_.join();
    if (stop_fd_ >= 0) {
      uint64_t one = 1;
      (void)!write(stop_fd_, &one, sizeof one);
    }
    if (watcher_.joinable()) watcher_.join();
    for (auto& [name, m] : owned_) remove_if_mine(name);
    if (inotify_fd_ >= 0) close(inotify_fd_);
    if (stop_fd_ >= 0) close(stop_fd_);
    close(dirfd_);
  }

  const std::string& directory() const { return options_.directory; }

  Status join(const Member& m) {
    if (Status st = check_member_name(m.name); !st) return st;
    if (m.name[0] == '.' || m.name.size() > kMaxName) {
      return Status(ErrorCode::kInvalidArgument,
                    "member name '" + m.name + "' starts with '.' or is longer than " +
                        std::to_string(kMaxName) + " bytes (FileRegistry)");
    }
    std::lock_guard lock(mu_);
    if (Status st = write_file(m); !st) return st;
    owned_[m.name] = m;
    return Status::ok();
  }

  Status leave(const std::string& name) {
    std::lock_guard lock(mu_);
    if (!owned_.erase(name)) {
      return Status(ErrorCode::kNotFound, "member '" + name + "' was not joined here");
    }
    remove_if_mine(name);
    return Status::ok();
  }

  Result<std::vector<Member>> members() {
    auto now = scan();
    if (!now) return now.status();
    std::vector<Member> out;
    for (auto& [name, m] : *now) out.push_back(std::move(m));
    return out;
  }

  Status watch(WatchFn fn) {
    {
      std::lock_guard lock(mu_);
      if (watching_) return Status(ErrorCode::kAlreadyExists, "this registry already watches");
      watching_ = true;
    }
    stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stop_fd_ < 0) {
      return Status(ErrorCode::kInternal, "FileRegistry: eventfd: " + errno_text(errno));
    }
    // Without inotify (limits reached) the watch still works by polling.
    inotify_fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (inotify_fd_ >= 0 && inotify_add_watch(inotify_fd_, options_.directory.c_str(),
                                              IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM |
                                                  IN_CLOSE_WRITE) < 0) {
      close(inotify_fd_);
      inotify_fd_ = -1;
    }
    auto first = scan();
    if (!first) return first.status();
    view_ = std::move(*first);
    for (auto& [name, m] : view_) fn(true, m);
    watcher_ = std::thread([this, fn = std::move(fn)] { watch_loop(fn); });
    return Status::ok();
  }

 private:
  std::string temp_name(const std::string& name) {
    return kTempPrefix + name + "." + std::to_string(getpid()) + "." + std::to_string(++temps_);
  }

  // Holding mu_.
  Status write_file(const Member& m) {
    std::string text = m.encode() + "owner=" + owner_ + "\nhost=" + boot_id() +
                       "\nlease_ms=" + std::to_string(options_.lease_ttl.count()) + "\n";
    std::string tmp = temp_name(m.name);
    int fd = openat(dirfd_, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return io_error("create " + tmp, errno);
    size_t done = 0;
    while (done < text.size()) {
      ssize_t n = write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        int err = n < 0 ? errno : EIO;
        close(fd);
        unlinkat(dirfd_, tmp.c_str(), 0);
        return io_error("write " + tmp, err);
      }
      done += size_t(n);
    }
    close(fd);
    if (renameat(dirfd_, tmp.c_str(), dirfd_, m.name.c_str()) != 0) {
      int err = errno;
      unlinkat(dirfd_, tmp.c_str(), 0);
      return io_error("rename " + tmp + " to " + m.name, err);
    }
    return Status::ok();
  }

  Status io_error(const std::string& what, int err) const {
    return Status(ErrorCode::kInternal,
                  "FileRegistry " + options_.directory + ": " + what + ": " + errno_text(err));
  }

  // Removes directory/name if this registry wrote it (another may have replaced it).
  void remove_if_mine(const std::string& name) {
    Entry e;
    if (read_entry(dirfd_, name, e) && e.owner == owner_) unlinkat(dirfd_, name.c_str(), 0);
  }

  // Every present member, by name; removes files whose owner is dead.
  Result<std::map<std::string, Member>> scan() {
    int fd = openat(dirfd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR* dir = fd < 0 ? nullptr : fdopendir(fd);
    if (dir == nullptr) {
      int err = errno;
      if (fd >= 0) close(fd);
      return io_error("read the directory", err);
    }
    std::map<std::string, Member> out;
    while (struct dirent* d = readdir(dir)) {
      std::string name = d->d_name;
      if (name.empty() || name[0] == '.') continue;  // ., .., temporary files
      Entry e;
      if (!read_entry(dirfd_, name, e)) continue;
      if (e.alive) {
        out[name] = std::move(e.member);
      } else if (e.owner_gone) {
        // Only if it is still the same file: a new owner may have renamed its own into place.
        // (A window remains between this check and the unlink; that owner's keep-alive then
        // writes its file again within TTL/3.)
        struct stat st {};
        if (fstatat(dirfd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_ino == e.inode) {
          unlinkat(dirfd_, name.c_str(), 0);
        }
      }
    }
    closedir(dir);
    return out;
  }

  // Touches each owned member's file every TTL/3; re-writes one that disappeared, forgets one
  // that another registry replaced.
  void keep_alive() {
    std::unique_lock lock(mu_);
    const auto period = std::max<std::chrono::milliseconds>(options_.lease_ttl / 3, 1ms);
    while (!cv_.wait_for(lock, period, [&] { return stopping_; })) {
      for (auto it = owned_.begin(); it != owned_.end();) {
        Entry e;
        if (!read_entry(dirfd_, it->first, e)) {
          write_file(it->second).ignore();  // retried at the next period if this failed
        } else if (e.owner != owner_) {
          it = owned_.erase(it);
          continue;
        } else {
          utimensat(dirfd_, it->first.c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
        }
        ++it;
      }
    }
  }

  void watch_loop(const WatchFn& fn) {
    for (;;) {
      struct pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {inotify_fd_, POLLIN, 0}};
      int n = poll(fds, inotify_fd_ >= 0 ? 2 : 1, int(options_.poll_interval.count()));
      if (n > 0 && (fds[0].revents & POLLIN)) return;
      if (n > 0 && inotify_fd_ >= 0 && (fds[1].revents & POLLIN)) {
        char buf[4096];
        while (read(inotify_fd_, buf, sizeof buf) > 0) {
        }
      }
      auto now = scan();
      if (!now) continue;  // the directory went away: report nothing, try again
      for (auto& [name, m] : view_) {
        if (!now->count(name)) fn(false, m);
      }
      for (auto& [name, m] : *now) {
        auto it = view_.find(name);
        if (it == view_.end() || !(it->second == m)) fn(true, m);
      }
      view_ = std::move(*now);
    }
  }

  const FileOptions options_;
  const int dirfd_;
  std::string owner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool watching_ = false;
  uint64_t temps_ = 0;
  std::map<std::string, Member> owned_;
  // The watch thread's.
  int stop_fd_ = -1;
  int inotify_fd_ = -1;
  std::map<std::string, Member> view_;
  std::thread keeper_;
  std::thread watcher_;
};

Result<std::unique_ptr<FileRegistry>> FileRegistry::open(const FileOptions& options) {
  const std::string& dir = options.directory;
  if (dir.empty()) {
    return Status(ErrorCode::kInvalidArgument, "FileOptions.directory is empty");
  }
  if (options.lease_ttl <= 0ms || options.poll_interval <= 0ms) {
    return Status(ErrorCode::kInvalidArgument,
                  "FileOptions.lease_ttl and poll_interval must be positive");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return Status(ErrorCode::kInvalidArgument,
                  "FileRegistry: cannot create directory '" + dir + "': " + ec.message());
  }
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "FileRegistry: '" + dir + "' is not a usable directory: " + errno_text(errno));
  }
  if (faccessat(fd, ".", W_OK | X_OK, 0) != 0) {
    int err = errno;
    close(fd);
    return Status(ErrorCode::kInvalidArgument,
                  "FileRegistry: directory '" + dir + "' is not writable: " + errno_text(err));
  }
  return std::unique_ptr<FileRegistry>(new FileRegistry(std::make_unique<Impl>(options, fd)));
}

FileRegistry::FileRegistry(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FileRegistry::~FileRegistry() = default;
Status FileRegistry::join(const Member& member) {
  return impl_->join(member);
}
Status FileRegistry::leave(const std::string& name) {
  return impl_->leave(name);
}
Result<std::vector<Member>> FileRegistry::members() {
  return impl_->members();
}
Status FileRegistry::watch(WatchFn fn) {
  return impl_->watch(std::move(fn));
}
const std::string& FileRegistry::directory() const {
  return impl_->directory();
}

}  // namespace fabric::kv
