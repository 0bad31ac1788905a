// fabric::ep::AllToAll in a build without CUDA: creation reports that CUDA is absent (after the
// configuration checks, which need no GPU).
#include "fabric/ep.h"

namespace fabric::ep {

namespace {

Status no_cuda() {
  return Status(ErrorCode::kUnsupported,
                "fabric-lib was built without CUDA (FABRIC_WITH_CUDA=OFF): no MoE all-to-all");
}

}  // namespace

class AllToAll::Impl {
 public:
  AllToAllConfig config;
  Layout layout;
};

Result<std::unique_ptr<AllToAll>> AllToAll::create(const AllToAllConfig& config) {
  if (Status s = validate(config); !s) return s;
  return no_cuda();
}

AllToAll::AllToAll(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AllToAll::~AllToAll() = default;
const AllToAllConfig& AllToAll::config() const {
  return impl_->config;
}
const Layout& AllToAll::layout() const {
  return impl_->layout;
}
Bytes AllToAll::handle() const {
  return {};
}
Status AllToAll::connect(const std::vector<Bytes>&) {
  return no_cuda();
}
Status AllToAll::dispatch_send(const DispatchSendArgs&, void*) {
  return no_cuda();
}
Status AllToAll::dispatch_recv(const DispatchRecvArgs&, void*) {
  return no_cuda();
}
Status AllToAll::combine_send(const CombineSendArgs&, void*) {
  return no_cuda();
}
Status AllToAll::combine_recv(const CombineRecvArgs&, void*) {
  return no_cuda();
}
Status AllToAll::check() const {
  return no_cuda();
}
ProxyStats AllToAll::proxy_stats() const {
  return {};
}
std::string AllToAll::proxy_memory() const {
  return "none";
}

}  // namespace fabric::ep
