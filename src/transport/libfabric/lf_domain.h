// The libfabric backend: one RDM endpoint on one libfabric domain (NIC).
//
// The same code serves efa in production and tcp / shm on machines without an RDMA NIC.
// Control path (opening, registration, peers) in lf_domain.cc; hot path (post, poll) in
// lf_datapath.cc.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "transport/domain.h"

namespace fabric::transport {

// Closes a libfabric object when it goes out of scope.
template <typename T>
struct FidCloser {
  void operator()(T* p) const noexcept;
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

// What `fi_info` offers for a provider, for fabric-info and for NIC selection.
struct DomainListing {
  std::string provider;  // "tcp;ofi_rxm"
  std::string fabric;    // "127.0.0.1/32"
  std::string domain;    // "lo"
  bool ipv4 = false;
};
// Every RDM domain the provider offers with the capabilities the engine needs. "auto" resolves
// to efa when present, else tcp. Empty when the provider is absent.
std::vector<DomainListing> list_domains(const std::string& provider);
// The provider "auto" stands for on this machine.
std::string resolve_provider(const std::string& provider);

class LfDomain final : public Domain {
 public:
  // Opens `nic` (a domain name; empty: the first the provider offers; IPv4 preferred).
  // gpu_direct: ask for FI_HMEM where CUDA is present (info().hmem says whether it was given).
  static Result<std::unique_ptr<LfDomain>> open(const std::string& provider, const std::string& nic,
                                                bool gpu_direct = true);
  ~LfDomain() override;

  const DomainInfo& info() const override { return info_; }
  const Bytes& endpoint_name() const override { return name_; }

  Result<std::unique_ptr<MemoryRegistration>> register_memory(void* ptr, uint64_t length,
                                                              bool remote_read) override;
  Result<PeerHandle> resolve_peer(std::span<const std::byte> name) override;
  void forget_peer(PeerHandle peer) override;
  void reset_peer(PeerHandle peer) override;
  void close() override;

  PostResult post_write(const WriteRequest& req) override;
  PostResult post_read(const ReadRequest& req) override;
  PostResult post_send(const SendRequest& req) override;
  PostResult post_recv(const RecvRequest& req) override;
  size_t poll(std::span<Completion> out) override;
  int wait_fd() const override { return wait_fd_; }
  bool ready_to_wait() override;

 private:
  // Provider context storage, for providers that ask for it (FI_CONTEXT / FI_CONTEXT2 mode).
  struct ContextSlot {
    fi_context2 ctx;
    uint64_t wr_id;
  };

  LfDomain() = default;
  void* context_for(uint64_t wr_id);
  uint64_t wr_id_from(void* context);
  void release_context(void* context);
  void read_error(Completion& out);
  // The peer's endpoint name as this domain's address vector takes it, or InvalidArgument when
  // it is not an address of this domain's format: libfabric 1.17's util AV takes an insert's
  // length from the address's own family field and keeps it for every later insert, so one
  // malformed name would cut the domain off from every new peer (and read past the name).
  Result<Bytes> checked_peer_name(std::span<const std::byte> name) const;

  // Members in creation order: destruction runs in reverse (endpoint before its CQ and AV,
  // those before the domain, the domain before the fabric).
  struct InfoFree {
    void operator()(fi_info* p) const noexcept;
  };
  std::unique_ptr<fi_info, InfoFree> fi_;
  FidPtr<fid_fabric> fabric_;
  FidPtr<fid_domain> domain_;
  FidPtr<fid_cq> cq_;
  FidPtr<fid_av> av_;
  FidPtr<fid_ep> ep_;

  DomainInfo info_;
  Bytes name_;
  uint64_t mr_mode_ = 0;
  uint32_t addr_format_ = 0;  // fi_info's addr_format: what a peer's endpoint name must be
  int wait_fd_ = -1;
  bool needs_context_ = false;
  bool hmem_ = false;      // FI_HMEM granted: CUDA memory is registered with FI_HMEM_CUDA
  uint64_t next_key_ = 1;  // for providers without FI_MR_PROV_KEY
  // Endpoint name -> address-vector entry; looked up by string_view, without allocating.
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, PeerHandle, NameHash, std::equal_to<>> peers_;
  // A PeerHandle is an index into addrs_, never reused, so that reset_peer can move a peer to
  // another address-vector entry under the same handle. A forgotten peer's entry is
  // FI_ADDR_UNSPEC, and so is a peer whose reconnection failed: posts towards it fail.
  std::vector<fi_addr_t> addrs_;
  fi_addr_t fi_address(PeerHandle peer) const { return addrs_[peer]; }
  std::vector<std::unique_ptr<ContextSlot>> free_contexts_;
  std::vector<fi_cq_data_entry> cq_buf_;
};

}  // namespace fabric::transport
