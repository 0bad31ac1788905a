#include "kv/wire.h"

#include <fmt/format.h>

#include "common/codec.h"

namespace fabric::kv::wire {

namespace {

void put_bytes(detail::ByteWriter& w, std::span<const std::byte> b) {
  w.u32(static_cast<uint32_t>(b.size()));
  w.bytes(b);
}

}  // namespace

Bytes encode(const Message& m) {
  detail::ByteWriter w;
  w.u32(kMagic);
  w.u8(static_cast<uint8_t>(m.type));
  w.u64(m.request);
  w.u32(m.decode_rank);
  w.u32(m.prefill_rank);
  switch (m.type) {
    case Type::kPull: {
      const KvLayout& l = m.layout;
      w.u32(m.imm);
      w.u32(m.prefill_tp);
      for (uint32_t v : {l.num_layers, l.num_pages, l.tokens_per_page, l.num_kv_heads, l.head_bytes,
                         uint32_t{l.split_kv}, l.tp_size, l.tp_rank}) {
        w.u32(v);
      }
      w.u64(l.base_offset);
      w.u64(l.layer_stride);
      w.u64(l.page_stride);
      w.u32(static_cast<uint32_t>(m.pages.size()));
      for (uint32_t p : m.pages) w.u32(p);
      put_bytes(w, m.memory);
      break;
    }
    case Type::kCancel:
    case Type::kPing:
      put_bytes(w, m.sender);
      break;
    case Type::kFinished:
      w.u32(m.code);
      put_bytes(w, std::as_bytes(std::span(m.text.data(), m.text.size())));
      break;
  }
  return w.take();
}

Result<Message> decode(std::span<const std::byte> bytes) {
  detail::ByteReader r(bytes);
  auto bad = [](const char* field) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("KV message truncated or malformed at {}", field));
  };
  uint32_t magic = 0;
  uint8_t type = 0;
  Message m;
  if (!r.u32(magic) || magic != kMagic) return bad("magic");
  if (!r.u8(type) || type < 1 || type > 4) return bad("type");
  m.type = static_cast<Type>(type);
  if (!r.u64(m.request) || !r.u32(m.decode_rank) || !r.u32(m.prefill_rank)) return bad("header");
  auto get_bytes = [&](Bytes& out) {
    uint32_t n = 0;
    return r.u32(n) && r.bytes(n, out);
  };
  switch (m.type) {
    case Type::kPull: {
      KvLayout& l = m.layout;
      uint32_t split = 0;
      if (!r.u32(m.imm) || !r.u32(m.prefill_tp) || !r.u32(l.num_layers) || !r.u32(l.num_pages) ||
          !r.u32(l.tokens_per_page) || !r.u32(l.num_kv_heads) || !r.u32(l.head_bytes) ||
          !r.u32(split) || !r.u32(l.tp_size) || !r.u32(l.tp_rank) || !r.u64(l.base_offset) ||
          !r.u64(l.layer_stride) || !r.u64(l.page_stride)) {
        return bad("layout");
      }
      l.split_kv = split != 0;
      uint32_t n = 0;
      if (!r.u32(n) || n > r.remaining() / 4) return bad("pages");
      m.pages.resize(n);
      for (auto& p : m.pages) r.u32(p);
      if (!get_bytes(m.memory)) return bad("memory");
      break;
    }
    case Type::kCancel:
    case Type::kPing:
      if (!get_bytes(m.sender)) return bad("sender");
      break;
    case Type::kFinished: {
      Bytes text;
      if (!r.u32(m.code) || !get_bytes(text)) return bad("status");
      m.text.assign(reinterpret_cast<const char*>(text.data()), text.size());
      break;
    }
  }
  return m;
}

}  // namespace fabric::kv::wire
