#include "transport/open_domain.h"

#include "transport/libfabric/lf_domain.h"
#include "transport/shm/shm_domain.h"
#ifdef FABRIC_WITH_VERBS
#include "transport/verbs/verbs_domain.h"
#endif

namespace fabric::transport {

bool verbs_built() {
#ifdef FABRIC_WITH_VERBS
  return true;
#else
  return false;
#endif
}

Result<std::unique_ptr<Domain>> open_domain(const TransportOptions& options,
                                            const std::string& nic) {
  const bool gpu_direct = options.gpu_direct;
  if (options.provider == kVerbsProvider) {
#ifdef FABRIC_WITH_VERBS
    auto d = VerbsDomain::open(nic, options.verbs, gpu_direct);
    if (!d) return d.status();
    return std::unique_ptr<Domain>(std::move(*d));
#else
    (void)gpu_direct;
    return Status(ErrorCode::kUnsupported,
                  "the verbs backend is not in this build (libibverbs-dev was not found when it "
                  "was configured)");
#endif
  }
  if (options.provider == kShmFabricProvider) {
    auto d = ShmDomain::open(nic, ShmDomain::kDefaultRingBytes, options.shm_copy_threads);
    if (!d) return d.status();
    return std::unique_ptr<Domain>(std::move(*d));
  }
  // libfabric's shm provider stays reachable under its own name (the raw baseline's).
  const std::string provider =
      options.provider == kOfiShmProvider ? std::string("shm") : options.provider;
  auto d = LfDomain::open(provider, nic, gpu_direct);
  if (!d) return d.status();
  return std::unique_ptr<Domain>(std::move(*d));
}

}  // namespace fabric::transport
