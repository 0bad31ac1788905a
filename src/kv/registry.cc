// Member's text form and the in-process LocalRegistry.
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <sstream>

#include "fabric/kv/registry.h"

namespace fabric::kv {

std::string Member::encode() const {
  return fmt::format("name={}\nrole={}\ninstance={}\ntp_size={}\ntp_rank={}\naddress={}\ndata={}\n",
                     name, role, instance, tp_size, tp_rank, address, data);
}

Result<Member> Member::decode(const std::string& text) {
  Member m;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto eq = line.find('=');
    if (eq == std::string::npos) {
      return Status(ErrorCode::kInvalidArgument, "member line without '=': " + line);
    }
    std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    try {
      if (key == "name")
        m.name = value;
      else if (key == "role")
        m.role = value;
      else if (key == "instance")
        m.instance = value;
      else if (key == "tp_size")
        m.tp_size = static_cast<uint32_t>(std::stoul(value));
      else if (key == "tp_rank")
        m.tp_rank = static_cast<uint32_t>(std::stoul(value));
      else if (key == "address")
        m.address = value;
      else if (key == "data")
        m.data = value;
      // Unknown keys are skipped: newer writers may add some.
    } catch (const std::exception&) {
      return Status(ErrorCode::kInvalidArgument, "member field " + key + " is not a number");
    }
  }
  if (m.name.empty()) return Status(ErrorCode::kInvalidArgument, "member without a name");
  return m;
}

Status check_member_name(const std::string& name) {
  if (name.empty() || name.find_first_of("/\n") != std::string::npos) {
    return Status(ErrorCode::kInvalidArgument,
                  "member name '" + name + "' is empty or holds '/' or a newline");
  }
  return Status::ok();
}

struct LocalRegistry::Shared {
  std::mutex mu;
  uint64_t next_id = 1;
  std::map<std::string, std::pair<uint64_t, Member>> members;  // name -> (owner, member)
  std::map<uint64_t, WatchFn> watchers;
  // Runs the watchers outside the lock (they may call back in).
  void notify(bool joined, const Member& m, std::unique_lock<std::mutex>& lock) {
    std::vector<WatchFn> fns;
    for (auto& [id, fn] : watchers) fns.push_back(fn);
    lock.unlock();
    for (auto& fn : fns) fn(joined, m);
  }
};

std::shared_ptr<LocalRegistry::Shared> LocalRegistry::make_shared_state() {
  return std::make_shared<Shared>();
}

LocalRegistry::LocalRegistry(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {
  std::lock_guard lock(shared_->mu);
  id_ = shared_->next_id++;
}

LocalRegistry::~LocalRegistry() {
  std::vector<Member> gone;
  {
    std::lock_guard lock(shared_->mu);
    shared_->watchers.erase(id_);
    for (auto it = shared_->members.begin(); it != shared_->members.end();) {
      if (it->second.first == id_) {
        gone.push_back(it->second.second);
        it = shared_->members.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& m : gone) {
    std::unique_lock lock(shared_->mu);
    shared_->notify(false, m, lock);
  }
}

Status LocalRegistry::join(const Member& member) {
  if (Status st = check_member_name(member.name); !st) return st;
  std::unique_lock lock(shared_->mu);
  shared_->members[member.name] = {id_, member};
  shared_->notify(true, member, lock);
  return Status::ok();
}

Status LocalRegistry::leave(const std::string& name) {
  std::unique_lock lock(shared_->mu);
  auto it = shared_->members.find(name);
  if (it == shared_->members.end() || it->second.first != id_) {
    return Status(ErrorCode::kNotFound, "member '" + name + "' was not joined here");
  }
  Member m = it->second.second;
  shared_->members.erase(it);
  shared_->notify(false, m, lock);
  return Status::ok();
}

Result<std::vector<Member>> LocalRegistry::members() {
  std::lock_guard lock(shared_->mu);
  std::vector<Member> out;
  for (auto& [name, m] : shared_->members) out.push_back(m.second);
  return out;
}

Status LocalRegistry::watch(WatchFn fn) {
  std::vector<Member> now;
  {
    std::lock_guard lock(shared_->mu);
    if (shared_->watchers.count(id_)) {
      return Status(ErrorCode::kAlreadyExists, "this registry already watches");
    }
    shared_->watchers[id_] = fn;
    for (auto& [name, m] : shared_->members) now.push_back(m.second);
  }
  for (auto& m : now) fn(true, m);
  return Status::ok();
}

}  // namespace fabric::kv
