// fabric_lib._EpAllToAll: fabric::ep::AllToAll on raw device addresses and stream handles
// (ints). fabric_lib.ep.AllToAll wraps it for torch tensors and exchanges the handles over
// torch.distributed; this module never imports torch.
//
// Launchers return once their kernels are enqueued (they never wait for the GPU); creation,
// connect() and close() block, with the GIL released.
#include <string>

#include "bindings.h"
#include "fabric/ep.h"

namespace fabric::python {

namespace {

using ep::AllToAll;

// A device address or a stream handle, an int from 0 to 2^64 - 1 (InvalidArgument naming `what`
// otherwise, e.g. "dispatch_send: tokens").
template <typename T>
T* ptr(const IntArg& address, const char* what) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(u64(address, what)));
}

void* stream_ptr(const IntArg& stream, const char* what) {
  return ptr<void>(stream, what);
}

// An int field of the configuration, from `min` to INT_MAX.
int int_arg(const IntArg& arg, const char* what, int min) {
  return static_cast<int>(signed_value(arg, what, min, std::numeric_limits<int>::max()));
}

ep::TokenDtype dtype_of(const std::string& name) {
  if (name == "bf16") return ep::TokenDtype::kBf16;
  if (name == "fp8_e4m3") return ep::TokenDtype::kFp8E4m3;
  throw StatusError{
      Status(ErrorCode::kInvalidArgument, "dtype '" + name + "' is neither 'bf16' nor 'fp8_e4m3'")};
}

class PyAllToAll {
 public:
  explicit PyAllToAll(std::unique_ptr<AllToAll> a) : impl_(std::move(a)) {}
  ~PyAllToAll() { close(); }

  void close() {
    if (!impl_) return;
    py::gil_scoped_release release;
    impl_.reset();
  }
  AllToAll& get() const {
    if (!impl_) throw StatusError{Status(ErrorCode::kClosed, "the all-to-all is closed")};
    return *impl_;
  }

 private:
  std::unique_ptr<AllToAll> impl_;
};

}  // namespace

void bind_ep(py::module_& m) {
  py::class_<PyAllToAll>(
      m, "_EpAllToAll",
      "fabric::ep::AllToAll on device addresses and stream handles (ints): one rank's side of "
      "an MoE dispatch/combine between GPUs (NVLink within a node, a host proxy and RDMA "
      "writes between nodes). Use fabric_lib.ep.AllToAll, which "
      "takes torch tensors and exchanges the handles over torch.distributed.")
      .def(py::init([](const IntArg& rank, const IntArg& world_size, const IntArg& num_experts,
                       const IntArg& hidden, const IntArg& top_k, const IntArg& max_tokens_per_rank,
                       const std::string& dtype, const IntArg& gpus_per_node, py::handle timeout,
                       const IntArg& cuda_device, const std::string& provider,
                       const std::vector<std::string>& nics, const std::string& proxy_memory) {
             ep::AllToAllConfig c;
             c.rank = int_arg(rank, "_EpAllToAll: rank", 0);
             c.world_size = int_arg(world_size, "_EpAllToAll: world_size", 0);
             c.num_experts = u32(num_experts, "_EpAllToAll: num_experts");
             c.hidden = u32(hidden, "_EpAllToAll: hidden");
             c.top_k = u32(top_k, "_EpAllToAll: top_k");
             c.max_tokens_per_rank = u32(max_tokens_per_rank, "_EpAllToAll: max_tokens_per_rank");
             c.dtype = dtype_of(dtype);
             c.gpus_per_node = int_arg(gpus_per_node, "_EpAllToAll: gpus_per_node", 0);
             c.timeout = to_duration<std::chrono::milliseconds>(timeout, "timeout");
             c.cuda_device = int_arg(cuda_device, "_EpAllToAll: cuda_device", -1);
             c.provider = provider;
             c.nics = nics;
             c.proxy_memory = proxy_memory;
             py::gil_scoped_release release;
             return std::make_unique<PyAllToAll>(check(AllToAll::create(c)));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("num_experts"), py::arg("hidden"),
           py::arg("top_k"), py::arg("max_tokens_per_rank"), py::arg("dtype") = "bf16",
           py::arg("gpus_per_node") = 0, py::arg("timeout") = 10.0, py::arg("cuda_device") = -1,
           py::arg("provider") = "auto", py::arg("nics") = std::vector<std::string>{},
           py::arg("proxy_memory") = "auto",
           "Allocates and zeroes this rank's buffer on its GPU (cuda_device, or the current "
           "one when -1) and exports it. dtype: 'bf16' or 'fp8_e4m3'; timeout: how long a "
           "kernel (or the proxy) waits for a peer (seconds or a timedelta). gpus_per_node: "
           "ranks of one node (0: all of them); ranks of other nodes are reached through a "
           "proxy thread and a TransferEngine of `provider` ('auto', 'tcp', 'shm', 'verbs') on "
           "`nics` (empty: the provider's first), its areas in `proxy_memory` ('auto', 'host', "
           "'gpu': GPUDirect RDMA only). Raises InvalidArgument naming a bad field (a negative "
           "integer among them; cuda_device -1 is the one negative value), "
           "Unsupported without CUDA or a GPU, or for an absent provider.")
      .def(
          "handle",
          [](const PyAllToAll& a) {
            const Bytes h = a.get().handle();
            return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
          },
          "This rank's export (bytes): pass it to every other rank.")
      .def(
          "connect",
          [](PyAllToAll& a, const std::vector<py::bytes>& handles) {
            std::vector<Bytes> hs;
            for (const py::bytes& h : handles) {
              std::string s = h;
              const auto* b = reinterpret_cast<const std::byte*>(s.data());
              hs.emplace_back(b, b + s.size());
            }
            py::gil_scoped_release release;
            check(a.get().connect(hs));
          },
          py::arg("handles"),
          "Maps the buffer of every peer of this node and starts the proxy towards the others; "
          "handles: every rank's handle() in rank order, this rank's included. Raises "
          "InvalidArgument (a peer configured differently, names the field), RemoteAccess (CUDA "
          "could not map a peer), AlreadyExists.")
      .def(
          "dispatch_send",
          [](PyAllToAll& a, const IntArg& tokens, const IntArg& scales, const IntArg& topk_idx,
             const IntArg& topk_weights, const IntArg& num_tokens, const IntArg& stream) {
            ep::DispatchSendArgs args{ptr<const void>(tokens, "dispatch_send: tokens"),
                                      ptr<const float>(scales, "dispatch_send: scales"),
                                      ptr<const int64_t>(topk_idx, "dispatch_send: topk_idx"),
                                      ptr<const float>(topk_weights, "dispatch_send: topk_weights"),
                                      u32(num_tokens, "dispatch_send: num_tokens")};
            void* s = stream_ptr(stream, "dispatch_send: stream");
            check(a.get().dispatch_send(args, s));
          },
          py::arg("tokens"), py::arg("scales"), py::arg("topk_idx"), py::arg("topk_weights"),
          py::arg("num_tokens"), py::arg("stream"),
          "Enqueues the send half of a dispatch on `stream` (a cudaStream_t as an int). "
          "Addresses are ints, 0 for none: tokens [num_tokens, hidden], scales (fp8) "
          "[num_tokens, hidden / 128] fp32, topk_idx [num_tokens, top_k] int64, topk_weights "
          "[num_tokens, top_k] fp32 or 0.")
      .def(
          "dispatch_recv",
          [](PyAllToAll& a, const IntArg& out_tokens, const IntArg& out_scales,
             const IntArg& out_weights, const IntArg& out_source, const IntArg& expert_counts,
             const IntArg& expert_offsets, const IntArg& stream) {
            ep::DispatchRecvArgs args{
                ptr<void>(out_tokens, "dispatch_recv: out_tokens"),
                ptr<float>(out_scales, "dispatch_recv: out_scales"),
                ptr<float>(out_weights, "dispatch_recv: out_weights"),
                ptr<int32_t>(out_source, "dispatch_recv: out_source"),
                ptr<int32_t>(expert_counts, "dispatch_recv: expert_counts"),
                ptr<int32_t>(expert_offsets, "dispatch_recv: expert_offsets")};
            void* s = stream_ptr(stream, "dispatch_recv: stream");
            check(a.get().dispatch_recv(args, s));
          },
          py::arg("out_tokens"), py::arg("out_scales"), py::arg("out_weights"),
          py::arg("out_source"), py::arg("expert_counts"), py::arg("expert_offsets"),
          py::arg("stream"),
          "Enqueues the receive half of a dispatch: waits on the GPU for every rank's tokens, "
          "then writes them in the flat layout (local expert e's rows from expert_offsets[e], "
          "expert_counts[e] of them). Addresses are ints, 0 for none.")
      .def(
          "combine_send",
          [](PyAllToAll& a, const IntArg& expert_out, const IntArg& stream) {
            ep::CombineSendArgs args{ptr<const void>(expert_out, "combine_send: expert_out")};
            void* s = stream_ptr(stream, "combine_send: stream");
            check(a.get().combine_send(args, s));
          },
          py::arg("expert_out"), py::arg("stream"),
          "Enqueues the send half of a combine: row i of expert_out ([max_recv_rows, hidden] "
          "bf16) goes back to where dispatch_recv's row i came from.")
      .def(
          "combine_recv",
          [](PyAllToAll& a, const IntArg& topk_idx, const IntArg& topk_weights,
             const IntArg& num_tokens, const IntArg& out, const IntArg& stream) {
            ep::CombineRecvArgs args{ptr<const int64_t>(topk_idx, "combine_recv: topk_idx"),
                                     ptr<const float>(topk_weights, "combine_recv: topk_weights"),
                                     u32(num_tokens, "combine_recv: num_tokens"),
                                     ptr<void>(out, "combine_recv: out")};
            void* s = stream_ptr(stream, "combine_recv: stream");
            check(a.get().combine_recv(args, s));
          },
          py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_tokens"), py::arg("out"),
          py::arg("stream"),
          "Enqueues the receive half of a combine: waits on the GPU for every rank's outputs, "
          "then out[t] = sum over k of topk_weights[t, k] x output (fp32, rounded to bf16).")
      .def(
          "check", [](const PyAllToAll& a) { check(a.get().check()); },
          "Raises the first failure a kernel or the proxy recorded (Timeout, PeerUnreachable, "
          "InvalidArgument); never blocks. "
          "Call it after synchronising with the stream.")
      .def(
          "proxy_stats",
          [](const PyAllToAll& a) {
            const ep::ProxyStats st = a.get().proxy_stats();
            py::dict out;
            const char* kinds[2] = {"dispatch", "combine"};
            for (int k = 0; k < 2; ++k) {
              py::dict d;
              d["rounds_sent"] = st.rounds_sent[k];
              d["writes_sent"] = st.writes_sent[k];
              d["bytes_sent"] = st.bytes_sent[k];
              d["post_ns"] = st.post_ns[k];
              d["complete_ns"] = st.complete_ns[k];
              d["rounds_received"] = st.rounds_received[k];
              d["receive_ns"] = st.receive_ns[k];
              out[kinds[k]] = d;
            }
            out["passes"] = st.passes;
            out["naps"] = st.naps;
            return out;
          },
          "The inter-node proxy's counters since creation, summed over the peers of other nodes: "
          "per kind ('dispatch', 'combine') rounds_sent, writes_sent, bytes_sent, post_ns (ready "
          "word seen to writes posted), complete_ns (posted to the last write completed), "
          "rounds_received, receive_ns (counts seen to the flag raised); passes and naps of its "
          "loop. All zero without peers on other nodes.")
      .def_property_readonly(
          "proxy_memory", [](const PyAllToAll& a) { return a.get().proxy_memory(); },
          "Where the proxy's areas are: 'none' (no peers on other nodes), 'host' or 'gpu' (GPU "
          "memory its engine reaches itself).")
      .def("close", &PyAllToAll::close,
           "Unmaps the peers' buffers and frees this rank's (blocks while the GPU finishes). "
           "Stop every rank first (a barrier).")
      .def_property_readonly(
          "rank", [](const PyAllToAll& a) { return a.get().config().rank; }, "This rank.")
      .def_property_readonly(
          "world_size", [](const PyAllToAll& a) { return a.get().config().world_size; },
          "Ranks of the all-to-all.")
      .def_property_readonly(
          "num_experts", [](const PyAllToAll& a) { return a.get().config().num_experts; },
          "Experts over all ranks.")
      .def_property_readonly(
          "num_local_experts",
          [](const PyAllToAll& a) { return a.get().layout().num_local_experts; },
          "Experts of each rank: rank r holds [r * n, (r + 1) * n).")
      .def_property_readonly(
          "hidden", [](const PyAllToAll& a) { return a.get().config().hidden; },
          "Elements of a token.")
      .def_property_readonly(
          "top_k", [](const PyAllToAll& a) { return a.get().config().top_k; }, "Experts per token.")
      .def_property_readonly(
          "max_tokens_per_rank",
          [](const PyAllToAll& a) { return a.get().config().max_tokens_per_rank; },
          "The most tokens one dispatch of a rank carries.")
      .def_property_readonly(
          "scale_columns", [](const PyAllToAll& a) { return a.get().layout().scale_columns; },
          "fp32 scales per fp8 token (hidden / 128; 0 for bf16).")
      .def_property_readonly(
          "max_recv_rows", [](const PyAllToAll& a) { return a.get().layout().max_recv_rows; },
          "Rows of dispatch_recv's output and combine_send's input.")
      .def_property_readonly(
          "buffer_bytes", [](const PyAllToAll& a) { return a.get().layout().buffer_bytes; },
          "Bytes of this rank's exported buffer.");
}

}  // namespace fabric::python
