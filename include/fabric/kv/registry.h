// Membership: who serves prefill and decode, and at which engine address. Members join and
// leave while traffic flows; watchers learn of both.
//
// Three registries:
//   LocalRegistry  in-process, no server: for one process hosting several ranks, and tests.
//   FileRegistry   the processes of one machine, no server: one file per member in a shared
//                  directory (/dev/shm by default), kept alive by its owner; a member whose
//                  owning process died disappears at the next scan, one that stopped
//                  refreshing (a hung process, another host) when its lease runs out.
//   EtcdRegistry   etcd v3 (its JSON gateway, over libcurl): each registry holds one lease and
//                  keeps it alive; members are keys under a prefix attached to that lease, so a
//                  member whose process dies disappears once the lease TTL runs out. A watch
//                  stream reports joins and leaves; when etcd restarts or the stream breaks, the
//                  registry re-reads the prefix, reports the difference, re-grants its lease if
//                  etcd forgot it, re-publishes its own members and watches again.
//
// Threads: join, leave and members block for one round trip (bounded by the request timeout).
// Watch callbacks run on the registry's own thread, one at a time, never under a lock that
// join/leave/members take: they may call them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fabric/status.h"

namespace fabric::kv {

struct Member {
  std::string name;      // unique in the registry: the key under the prefix
  std::string role;      // "prefill", "decode", "router", ...
  std::string instance;  // the TP group it belongs to
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  std::string address;  // its engine's Address, hex (Address::to_hex)
  std::string data;     // free-form (no newline)

  // "key=value" lines; decode names the first malformed line.
  std::string encode() const;
  static Result<Member> decode(const std::string& text);
  friend bool operator==(const Member&, const Member&) = default;
};

class Registry {
 public:
  // joined: a member appeared or changed (true) or disappeared (false).
  using WatchFn = std::function<void(bool joined, const Member& member)>;

  virtual ~Registry() = default;
  // Publishes (or replaces) a member owned by this registry. Errors: kInvalidArgument (an
  // empty name, or one with '/' or a newline), kPeerUnreachable (etcd down), kTimeout.
  virtual Status join(const Member& member) = 0;
  // Withdraws a member this registry published. Errors: kNotFound, kPeerUnreachable.
  virtual Status leave(const std::string& name) = 0;
  // Every member now, by name.
  virtual Result<std::vector<Member>> members() = 0;
  // Starts reporting changes after the current members (which `fn` first gets as joins).
  // Once per registry: kAlreadyExists on a second call.
  virtual Status watch(WatchFn fn) = 0;
};

// The in-process registry: every LocalRegistry made from the same Shared sees the same
// members; a member leaves when its registry is destroyed.
class LocalRegistry : public Registry {
 public:
  struct Shared;
  static std::shared_ptr<Shared> make_shared_state();
  explicit LocalRegistry(std::shared_ptr<Shared> shared);
  ~LocalRegistry() override;
  Status join(const Member& member) override;
  Status leave(const std::string& name) override;
  Result<std::vector<Member>> members() override;
  Status watch(WatchFn fn) override;

 private:
  std::shared_ptr<Shared> shared_;
  uint64_t id_;
};

struct FileOptions {
  // The directory shared by the processes (created, with its parents, if missing).
  std::string directory = "/dev/shm/fabric-kv";
  // A member whose file was not refreshed for this long is gone (its owner refreshes it every
  // lease_ttl / 3). Readers use the TTL written in the file by its owner.
  std::chrono::milliseconds lease_ttl{3000};
  // The watch re-reads the directory at least this often (inotify wakes it sooner on joins and
  // leaves); a crashed owner is noticed within this interval.
  std::chrono::milliseconds poll_interval{100};
};

// Membership among the processes of one machine through files, with no server.
//
// Each member is one file, directory/NAME, holding Member::encode() plus its owner (pid, the
// process's start time, the host's boot id) and its lease TTL, written to a temporary name and
// renamed into place, so readers never see half a file. The owner's keep-alive thread touches
// the file every lease_ttl / 3 (and re-writes it if someone removed it). A reader counts a
// member as present while its file is fresher than its TTL and, on this host, its owning
// process is still alive; a file whose owner is verifiably dead is removed by the reader that
// notices. members() reads the directory; watch() runs a thread woken by inotify and by a
// poll_interval timer, which reports the difference from its last view as joins and leaves.
//
// Threads: join, leave and members do a few file operations on the caller's thread. Watch
// callbacks run on the registry's watch thread, one at a time, with no lock held.
class FileRegistry : public Registry {
 public:
  // Creates the directory if needed. Errors: kInvalidArgument naming the directory when it is
  // empty, cannot be created, is not a directory or is not writable; kInvalidArgument for a
  // zero lease_ttl or poll_interval.
  static Result<std::unique_ptr<FileRegistry>> open(const FileOptions& options);
  // Removes this registry's members' files and stops its threads.
  ~FileRegistry() override;
  // Errors: kInvalidArgument (a name that is empty, starts with '.', is longer than 200 bytes,
  // or holds '/' or a newline), kInternal with the system's reason when the file cannot be
  // written.
  Status join(const Member& member) override;
  Status leave(const std::string& name) override;
  Result<std::vector<Member>> members() override;
  Status watch(WatchFn fn) override;
  const std::string& directory() const;

  class Impl;

 private:
  explicit FileRegistry(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct EtcdOptions {
  std::string endpoint = "http://127.0.0.1:2379";  // the etcd client URL
  std::string prefix = "/fabric/kv/members/";
  std::chrono::seconds lease_ttl{3};  // a dead member disappears after at most this long
  std::chrono::milliseconds request_timeout{2000};
  // After the watch stream breaks, how long to wait before re-reading and watching again.
  std::chrono::milliseconds retry_interval{200};
};

class EtcdRegistry : public Registry {
 public:
  // Grants the lease and starts its keep-alive. Errors: kInvalidArgument (empty prefix or
  // endpoint), kPeerUnreachable (no etcd answers there).
  static Result<std::unique_ptr<EtcdRegistry>> connect(const EtcdOptions& options);
  // Withdraws this registry's members (revokes the lease) when etcd is reachable, stops the
  // threads.
  ~EtcdRegistry() override;
  Status join(const Member& member) override;
  Status leave(const std::string& name) override;
  Result<std::vector<Member>> members() override;
  Status watch(WatchFn fn) override;
  // How many times the watch stream was re-established after a break (etcd restarts).
  uint64_t resyncs() const;

  class Impl;

 private:
  explicit EtcdRegistry(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fabric::kv
