// EtcdRegistry: etcd v3 through its JSON gateway (/v3/...) over libcurl. Keys and values are
// base64 in that API; 64-bit integers travel as JSON strings.
//
// Threads: the caller's (join, leave, members: one request each), the keep-alive thread
// (refreshes the lease every TTL/3; re-grants it and re-publishes this registry's members
// when etcd no longer knows it), and the watch thread (re-read, diff, stream; again after any
// break).
#include <curl/curl.h>
#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/log.h"
#include "fabric/kv/registry.h"

namespace fabric::kv {

Status check_member_name(const std::string& name);  // registry.cc

namespace {

using json = nlohmann::json;

std::string base64(const std::string& in) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s : {18, 12, 6, 0}) out += k[(v >> s) & 63];
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    out += k[(v >> 18) & 63];
    out += k[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    for (int s : {18, 12, 6}) out += k[(v >> s) & 63];
    out += '=';
  }
  return out;
}

std::string unbase64(const std::string& in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    int v = val(c);
    if (v < 0) continue;  // padding
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

// The end of the key range holding every key that starts with prefix.
std::string prefix_end(std::string p) {
  while (!p.empty() && static_cast<uint8_t>(p.back()) == 0xff) p.pop_back();
  if (!p.empty()) p.back() = static_cast<char>(p.back() + 1);
  return p;
}

size_t append(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

int64_t as_int(const json& j) {
  if (j.is_string()) return std::stoll(j.get<std::string>());
  if (j.is_number_integer()) return j.get<int64_t>();
  return 0;
}

struct CurlGlobal {
  CurlGlobal() { curl_global_init(CURL_GLOBAL_DEFAULT); }
};

}  // namespace

class EtcdRegistry::Impl {
 public:
  explicit Impl(EtcdOptions o) : options_(std::move(o)) { static CurlGlobal once; }

  ~Impl() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (keepalive_.joinable()) keepalive_.join();
    if (watcher_.joinable()) watcher_.join();
    if (lease_ != 0) post("/v3/lease/revoke", {{"ID", std::to_string(lease_)}}).status().ignore();
  }

  // One request: POST path with body; the parsed answer, or an error naming what failed.
  Result<json> post(const std::string& path, const json& body) {
    CURL* h = curl_easy_init();
    if (!h) return Status(ErrorCode::kInternal, "curl_easy_init failed");
    std::string url = options_.endpoint + path, payload = body.dump(), out;
    curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, payload.c_str());
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, append);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &out);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.request_timeout.count()));
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    CURLcode rc = curl_easy_perform(h);
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(headers);
    curl_easy_cleanup(h);
    if (rc == CURLE_OPERATION_TIMEDOUT) {
      return Status(ErrorCode::kTimeout, fmt::format("etcd {}: no answer within {} ms", url,
                                                     options_.request_timeout.count()));
    }
    if (rc != CURLE_OK) {
      return Status(ErrorCode::kPeerUnreachable,
                    fmt::format("etcd {}: {}", url, curl_easy_strerror(rc)));
    }
    json j = json::parse(out, nullptr, false);
    if (code != 200 || j.is_discarded()) {
      return Status(ErrorCode::kFabric, fmt::format("etcd {}: HTTP {}: {}", url, code, out));
    }
    return j;
  }

  Status grant() {
    auto r = post("/v3/lease/grant", {{"TTL", std::to_string(options_.lease_ttl.count())}});
    if (!r) return r.status();
    int64_t id = as_int((*r)["ID"]);
    if (id == 0) return Status(ErrorCode::kFabric, "etcd granted no lease: " + r->dump());
    std::lock_guard lock(mu_);
    lease_ = id;
    return Status::ok();
  }

  Status put(const Member& m, int64_t lease) {
    auto r = post("/v3/kv/put", {{"key", base64(options_.prefix + m.name)},
                                 {"value", base64(m.encode())},
                                 {"lease", std::to_string(lease)}});
    return r.status();
  }

  Status start() {
    if (Status st = grant(); !st) return st;
    keepalive_ = std::thread([this] { keepalive_loop(); });
    return Status::ok();
  }

  void keepalive_loop() {
    const auto period = std::chrono::milliseconds(options_.lease_ttl) / 3;
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, period, [&] { return stop_; })) {
      const int64_t lease = lease_;
      lock.unlock();
      auto r = post("/v3/lease/keepalive", {{"ID", std::to_string(lease)}});
      bool expired = false;
      if (r) {
        const json& res = r->contains("result") ? (*r)["result"] : *r;
        expired = !res.contains("TTL") || as_int(res["TTL"]) <= 0;
      }
      if (expired) {
        // etcd forgot the lease (it expired while etcd or this process was away): take a new
        // one and publish this registry's members again.
        fabric::detail::log().info("etcd registry: lease {} expired; re-granting", lease);
        if (grant()) {
          std::map<std::string, Member> owned;
          int64_t now_lease;
          {
            std::lock_guard l2(mu_);
            owned = owned_;
            now_lease = lease_;
          }
          for (auto& [name, m] : owned) put(m, now_lease).ignore();
        }
      }
      lock.lock();
    }
  }

  Status join(const Member& m) {
    if (Status st = check_member_name(m.name); !st) return st;
    int64_t lease;
    {
      std::lock_guard lock(mu_);
      lease = lease_;
    }
    if (Status st = put(m, lease); !st) return st;
    std::lock_guard lock(mu_);
    owned_[m.name] = m;
    return Status::ok();
  }

  Status leave(const std::string& name) {
    {
      std::lock_guard lock(mu_);
      if (!owned_.erase(name)) {
        return Status(ErrorCode::kNotFound, "member '" + name + "' was not joined here");
      }
    }
    return post("/v3/kv/deleterange", {{"key", base64(options_.prefix + name)}}).status();
  }

  // Every member and the revision they were read at.
  Result<std::pair<std::map<std::string, Member>, int64_t>> range() {
    auto r = post("/v3/kv/range", {{"key", base64(options_.prefix)},
                                   {"range_end", base64(prefix_end(options_.prefix))}});
    if (!r) return r.status();
    std::map<std::string, Member> out;
    if (r->contains("kvs")) {
      for (auto& kv : (*r)["kvs"]) {
        auto m = Member::decode(unbase64(kv.value("value", "")));
        if (m) out[m->name] = *m;
      }
    }
    int64_t rev = as_int((*r)["header"]["revision"]);
    return std::make_pair(std::move(out), rev);
  }

  Result<std::vector<Member>> members() {
    auto r = range();
    if (!r) return r.status();
    std::vector<Member> out;
    for (auto& [name, m] : r->first) out.push_back(m);
    return out;
  }

  Status watch(WatchFn fn) {
    std::lock_guard lock(mu_);
    if (watcher_.joinable()) return Status(ErrorCode::kAlreadyExists, "this registry watches");
    fn_ = std::move(fn);
    watcher_ = std::thread([this] { watch_loop(); });
    return Status::ok();
  }

  bool stopping() {
    std::lock_guard lock(mu_);
    return stop_;
  }

  void watch_loop() {
    std::map<std::string, Member> known;
    bool first = true;
    while (!stopping()) {
      auto snap = range();
      if (snap) {
        // Report the difference between what watchers know and what etcd holds now.
        for (auto it = known.begin(); it != known.end();) {
          if (!snap->first.count(it->first)) {
            fn_(false, it->second);
            it = known.erase(it);
          } else {
            ++it;
          }
        }
        for (auto& [name, m] : snap->first) {
          auto k = known.find(name);
          if (k == known.end() || !(k->second == m)) {
            known[name] = m;
            fn_(true, m);
          }
        }
        if (!first) ++resyncs_;
        first = false;
        stream(snap->second + 1, known);
      }
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, options_.retry_interval, [&] { return stop_; });
    }
  }

  // Streams watch events from `revision` until the stream breaks or the registry stops.
  void stream(int64_t revision, std::map<std::string, Member>& known) {
    json req = {{"create_request",
                 {{"key", base64(options_.prefix)},
                  {"range_end", base64(prefix_end(options_.prefix))},
                  {"start_revision", std::to_string(revision)}}}};
    std::string url = options_.endpoint + "/v3/watch", payload = req.dump();
    struct Sink {
      std::string buffer;
      bool broken = false;
      std::function<void(const json&)> on_response;
    } sink;
    sink.on_response = [&](const json& j) {
      const json& res = j.contains("result") ? j["result"] : j;
      if (res.value("canceled", false) || j.contains("error")) {
        sink.broken = true;
        return;
      }
      if (!res.contains("events")) return;
      for (auto& ev : res["events"]) {
        std::string key = unbase64(ev["kv"].value("key", ""));
        if (key.rfind(options_.prefix, 0) != 0) continue;
        std::string name = key.substr(options_.prefix.size());
        if (ev.value("type", "PUT") == "DELETE") {
          auto k = known.find(name);
          if (k != known.end()) {
            Member gone = k->second;
            known.erase(k);
            fn_(false, gone);
          }
        } else if (auto m = Member::decode(unbase64(ev["kv"].value("value", "")))) {
          known[m->name] = *m;
          fn_(true, *m);
        }
      }
    };
    auto write = +[](char* data, size_t size, size_t n, void* p) -> size_t {
      auto* s = static_cast<Sink*>(p);
      s->buffer.append(data, size * n);
      for (size_t nl; (nl = s->buffer.find('\n')) != std::string::npos;) {
        std::string line = s->buffer.substr(0, nl);
        s->buffer.erase(0, nl + 1);
        json j = json::parse(line, nullptr, false);
        if (!j.is_discarded()) s->on_response(j);
      }
      // A response without a newline at the end of a chunk stays buffered until the next one.
      json j = json::parse(s->buffer, nullptr, false);
      if (!s->buffer.empty() && !j.is_discarded()) {
        s->buffer.clear();
        s->on_response(j);
      }
      return size * n;
    };
    CURL* h = curl_easy_init();
    CURLM* multi = curl_multi_init();
    curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, payload.c_str());
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(options_.request_timeout.count()));
    // A silent stream is probed by TCP keep-alive so a vanished etcd is noticed.
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 1L);
    curl_multi_add_handle(multi, h);
    int running = 1;
    while (running && !sink.broken && !stopping()) {
      if (curl_multi_perform(multi, &running) != CURLM_OK) break;
      if (running) curl_multi_poll(multi, nullptr, 0, 100, nullptr);
    }
    curl_multi_remove_handle(multi, h);
    curl_multi_cleanup(multi);
    curl_slist_free_all(headers);
    curl_easy_cleanup(h);
  }

  uint64_t resyncs() const { return resyncs_.load(); }

 private:
  const EtcdOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  int64_t lease_ = 0;
  std::map<std::string, Member> owned_;
  WatchFn fn_;
  std::atomic<uint64_t> resyncs_{0};
  std::thread keepalive_;
  std::thread watcher_;
};

Result<std::unique_ptr<EtcdRegistry>> EtcdRegistry::connect(const EtcdOptions& options) {
  if (options.endpoint.empty()) return Status(ErrorCode::kInvalidArgument, "etcd endpoint empty");
  if (options.prefix.empty()) return Status(ErrorCode::kInvalidArgument, "etcd prefix empty");
  if (options.lease_ttl.count() < 1) {
    return Status(ErrorCode::kInvalidArgument, "etcd lease_ttl must be at least 1 s");
  }
  auto impl = std::make_unique<Impl>(options);
  if (Status st = impl->start(); !st) return st;
  return std::unique_ptr<EtcdRegistry>(new EtcdRegistry(std::move(impl)));
}

EtcdRegistry::EtcdRegistry(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdRegistry::~EtcdRegistry() = default;
Status EtcdRegistry::join(const Member& member) {
  return impl_->join(member);
}
Status EtcdRegistry::leave(const std::string& name) {
  return impl_->leave(name);
}
Result<std::vector<Member>> EtcdRegistry::members() {
  return impl_->members();
}
Status EtcdRegistry::watch(WatchFn fn) {
  return impl_->watch(std::move(fn));
}
uint64_t EtcdRegistry::resyncs() const {
  return impl_->resyncs();
}

}  // namespace fabric::kv
